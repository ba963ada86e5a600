"""Fine-tuning data: rows of token ids from a .npy array or a JSONL file of documents.

    rows = load_tokens("train.jsonl", "ckpt/", seq_len=512)   # int64 [rows, 512]

A `.npy` file is an integer array [rows, seq], used as it is. Any other file is JSONL, one
document a line (blank lines skipped; other fields of a line ignored):

    {"text": "Once upon a time"}     tokenized by the checkpoint's tokenizer.json (the
                                     `tokenizers` library, special tokens added: what
                                     transformers' fast tokenizer gives for `tok(text)`)
    {"ids": [1, 306, 4658]}          token ids as they are

The documents are packed as transformers' `run_clm.py` (`group_texts`) and trl's "wrapped"
packing do: concatenated, each followed by the end-of-sequence token (unless it already ends
with it), cut into rows of `seq_len` tokens; the remainder shorter than a row is dropped.
Attention is not masked at document boundaries (docs/TRAINING.md, "Packing").

Every line is checked before anything runs: a bad one is a UsageError naming FILE:LINE.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from disco_ray.graph.errors import UsageError

MAX_LINE_CHARS = 1 << 26  # one document of 64 MiB: far beyond any row


def load_tokens(
    path: str | Path, model: str | Path, seq_len: int | None = None, flag: str = "--data"
) -> torch.Tensor:
    """The int64 rows [rows, seq] of data file `path` for checkpoint directory `model`.

    Args:
        path: a `.npy` integer array [rows, seq], or a JSONL file of documents (packed).
        model: the checkpoint: its vocabulary bounds the ids; its tokenizer.json tokenizes
            "text" lines; its end-of-sequence id separates documents.
        seq_len: tokens per row (JSONL: required; .npy: its rows' length if given).
        flag: the option that named `path`, to start every message.

    Raises:
        UsageError: a missing or unreadable file, a bad line (FILE:LINE), no end-of-sequence id,
            fewer tokens than one row.
    """
    from workloads.llm.checkpoint import Checkpoint

    path, model = Path(path), Path(model)
    vocab = Checkpoint(str(model)).config.vocab
    if path.suffix == ".npy":
        rows = _npy(path, flag)
        if seq_len is not None and rows.shape[1] != seq_len:
            raise UsageError(f"{flag} {path}: rows of {rows.shape[1]} tokens, but --seq-len {seq_len}")
        bad = rows[(rows < 0) | (rows >= vocab)]
        if bad.numel():
            raise UsageError(
                f"{flag} {path}: token id {int(bad[0])} is outside the vocabulary 0..{vocab - 1}"
            )
        return rows
    if seq_len is None:
        raise UsageError(f"{flag} {path}: a JSONL file is packed into rows: give --seq-len N")
    if type(seq_len) is not int or seq_len < 2:
        raise UsageError(f"--seq-len must be an integer >= 2, got {seq_len!r}")
    tok = _Tokenizer(model)
    docs = read_documents(path, vocab, tok.encode, flag)
    return pack(docs, seq_len, eos_id(model, tok), f"{flag} {path}")


def _npy(path: Path, flag: str) -> torch.Tensor:
    import numpy as np

    try:
        arr = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise UsageError(f"{flag} {path}: not a readable .npy file ({e})") from None
    if not isinstance(arr, np.ndarray) or arr.dtype.kind not in "iu" or arr.ndim != 2:
        what = getattr(arr, "dtype", type(arr).__name__)
        raise UsageError(
            f"{flag} {path}: want an integer array [batch, seq], got {what} {list(getattr(arr, 'shape', []))}"
        )
    return torch.from_numpy(arr.astype(np.int64))


def read_documents(
    path: str | Path, vocab: int, encode: Callable[[str], list[int]], flag: str = "--data"
) -> list[list[int]]:
    """The token ids of each document of JSONL file `path`, each line checked."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot read ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise UsageError(f"{flag} {path}: not UTF-8 text (byte {e.start})") from None
    docs = []
    for number, text in enumerate(lines, 1):
        if text.strip():
            docs.append(parse_document(text, f"{path}:{number}", vocab, encode))
    if not docs:
        raise UsageError(f"{flag} {path}: no documents (an empty file)")
    return docs


def json_object(text: str, where: str, what: str, shape: str) -> dict:
    """One JSONL line as a JSON object; UsageError starting with `where` ("FILE:LINE") otherwise
    (`what` the line is, `shape` the object it should be)."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"{where}: malformed JSON at column {e.colno}: {e.msg}") from None
    except RecursionError:
        raise UsageError(f"{where}: nested too deeply to be a {what}") from None
    if not isinstance(doc, dict):
        raise UsageError(f"{where}: want a JSON object ({shape})")
    return doc


def parse_document(text: str, where: str, vocab: int, encode: Callable[[str], list[int]]) -> list[int]:
    """One JSONL line's token ids; `where` ("FILE:LINE") starts every message."""
    if len(text) > MAX_LINE_CHARS:
        raise UsageError(f"{where}: a line of {len(text)} characters (at most {MAX_LINE_CHARS})")
    doc = json_object(text, where, "document", '{"text": "..."} or {"ids": [...]}')
    if ("ids" in doc) == ("text" in doc):
        raise UsageError(f'{where}: give exactly one of "text" and "ids"')
    if "text" in doc:
        if not isinstance(doc["text"], str):
            raise UsageError(f'{where}: "text" must be a string, got {json.dumps(doc["text"])[:60]}')
        try:
            ids = list(encode(doc["text"]))
        except UsageError as e:  # no tokenizer: named at the first line that needs one
            raise UsageError(f"{where}: {e}") from None
        what = "the tokenized text"
    else:
        ids = doc["ids"]
        if not isinstance(ids, list) or not all(type(i) is int for i in ids):
            raise UsageError(
                f'{where}: "ids" must be a list of integer token ids, got {json.dumps(ids)[:60]}'
            )
        what = '"ids"'
    if not ids:
        raise UsageError(f"{where}: an empty document ({what}: no tokens)")
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:  # a tokenizer bigger than the model's vocabulary, or a wrong id
        raise UsageError(f"{where}: {what}: token id {bad[0]} is outside the vocabulary 0..{vocab - 1}")
    return ids


def pack(docs: list[list[int]], seq_len: int, eos: int, where: str) -> torch.Tensor:
    """`docs` concatenated, each followed by `eos` (unless it ends with it), cut into int64 rows of
    `seq_len`; the last, partial row dropped (transformers' run_clm.py `group_texts`)."""
    flat: list[int] = []
    for d in docs:
        flat.extend(d)
        if d[-1] != eos:
            flat.append(eos)
    rows = len(flat) // seq_len
    if rows == 0:
        raise UsageError(f"{where}: {len(flat)} tokens in all, fewer than one row of --seq-len {seq_len}")
    return torch.tensor(flat[: rows * seq_len], dtype=torch.int64).reshape(rows, seq_len)


class _Tokenizer:
    """The checkpoint's tokenizer.json, loaded on first use (a file of "ids" lines needs none)."""

    def __init__(self, model: Path):
        self.path = model / "tokenizer.json"
        self._tok = None

    def get(self):
        if self._tok is None:
            if not self.path.exists():
                raise UsageError(f'a "text" line needs {self.path}, which is missing (give "ids")')
            from tokenizers import Tokenizer

            try:
                self._tok = Tokenizer.from_file(str(self.path))
            except Exception as e:  # the library's own error types, varying by version
                raise UsageError(f"{self.path}: not a tokenizer file ({e})") from None
        return self._tok

    def encode(self, text: str) -> list[int]:
        return self.get().encode(text).ids  # special tokens added, as transformers' tok(text)

    def token_id(self, token: str) -> int | None:
        return self.get().token_to_id(token) if self.path.exists() else None


def eos_id(model: Path, tok: _Tokenizer) -> int:
    """The end-of-sequence id between packed documents: config.json's `eos_token_id` (the first
    of a list), else tokenizer_config.json's `eos_token` looked up in tokenizer.json."""
    cfg = _json(model / "config.json")
    eos = cfg.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    if type(eos) is int:
        return eos
    token = _json(model / "tokenizer_config.json").get("eos_token")
    if isinstance(token, dict):  # an AddedToken, as older tokenizers save it
        token = token.get("content")
    got = tok.token_id(token) if isinstance(token, str) else None
    if got is None:
        raise UsageError(
            f"{model}: packing documents needs an end-of-sequence id: config.json has no eos_token_id "
            "and tokenizer_config.json no eos_token that tokenizer.json knows"
        )
    return got


def _json(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"{path}: cannot read it as JSON ({e})") from None
    return doc if isinstance(doc, dict) else {}
