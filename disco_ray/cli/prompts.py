"""`disco-ray generate --prompts`: the JSONL requests in, the JSONL results out.

A pure core (`read_prompts`, `Results`) and one thin shell (`LineSink`, the only code that
writes). Every line of the input is checked before a model is loaded, so bad input is one
`disco-ray: error: FILE:LINE: ...` line, exit 2, with nothing written.

In, one JSON object per line (blank lines are skipped; `index` counts the prompts, from 0):
    {"ids": [1, 306, 4658]}  or  {"text": "Once upon a time"}
    optional: "max_new_tokens": N (>= 1, else --max-new-tokens), "stop_ids": [2, 13]
Out, one JSON object per line, in the order the sequences finish:
    {"index", "ids" (the prompt's), "new_ids", "text" (lines given as text), "finish_reason"}
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from disco_ray.graph.errors import UsageError
from disco_ray.models.textdata import json_object

FIELDS = frozenset({"ids", "text", "max_new_tokens", "stop_ids"})
MAX_LINE_CHARS = 1 << 24  # one prompt line of 16 MiB is far beyond any context length


@dataclass(frozen=True, slots=True)
class Request:
    """One prompt of the JSONL file, checked."""

    index: int  # among the file's prompts, from 0
    line: int  # its line number in the file, from 1 (for messages)
    ids: tuple[int, ...]  # the prompt's token ids (tokenized when given as text)
    max_new_tokens: int
    stop_ids: tuple[int, ...] = ()  # this line's own, beside --stop-ids and the EOS ids (the model's)
    text: bool = False  # given as text: the output gets the decoded new tokens


def _int_list(value: object, what: str, where: str, vocab: int) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(type(i) is int for i in value):
        raise UsageError(f"{where}: {what} must be a list of integer token ids, got {json.dumps(value)[:60]}")
    bad = [i for i in value if not 0 <= i < vocab]
    if bad:
        raise UsageError(f"{where}: {what}: token id {bad[0]} is outside the vocabulary 0..{vocab - 1}")
    return tuple(value)


def parse_line(
    text: str,
    where: str,
    *,
    index: int,
    line: int,
    vocab: int,
    max_new_tokens: int | None,
    encode: Callable[[str], list[int]],
) -> Request:
    """One line's request; `where` ("FILE:LINE") starts every message; `encode` tokenizes text."""
    doc = json_object(text, where, "prompt", '{"ids": [...]} or {"text": "..."}')
    unknown = sorted(set(doc) - FIELDS)
    if unknown:
        raise UsageError(f"{where}: unknown field {unknown[0]!r} (known: {', '.join(sorted(FIELDS))})")
    if ("ids" in doc) == ("text" in doc):
        raise UsageError(f'{where}: give exactly one of "ids" and "text"')
    if "text" in doc:
        if not isinstance(doc["text"], str):
            raise UsageError(f'{where}: "text" must be a string')
        try:
            ids = tuple(encode(doc["text"]))
        except UsageError as e:  # no tokenizer: said once, at the first line that needs it
            raise UsageError(f"{where}: {e}") from None
        if not ids:
            raise UsageError(f"{where}: empty prompt (the text tokenizes to no ids)")
        _int_list(list(ids), "the tokenized text", where, vocab)  # a tokenizer bigger than the model
    else:
        ids = _int_list(doc["ids"], '"ids"', where, vocab)
        if not ids:
            raise UsageError(f"{where}: empty prompt (no ids)")
    n = doc.get("max_new_tokens", max_new_tokens)
    if n is None:
        raise UsageError(f'{where}: no "max_new_tokens" and no --max-new-tokens')
    if type(n) is not int or n < 1:
        raise UsageError(f'{where}: "max_new_tokens" must be an integer >= 1, got {json.dumps(n)[:40]}')
    stops = _int_list(doc.get("stop_ids", []), '"stop_ids"', where, vocab)
    return Request(index, line, ids, n, stops, "text" in doc)


def read_prompts(
    path: str,
    *,
    vocab: int,
    max_new_tokens: int | None,
    encode: Callable[[str], list[int]],
) -> list[Request]:
    """Every request of the JSONL file `path`, checked (UsageError naming FILE:LINE otherwise)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise UsageError(f"--prompts {path}: cannot read ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise UsageError(f"--prompts {path}: not UTF-8 text (byte {e.start})") from None
    out: list[Request] = []
    for number, text in enumerate(lines, 1):
        if not text.strip():
            continue
        where = f"{path}:{number}"
        if len(text) > MAX_LINE_CHARS:
            raise UsageError(f"{where}: a line of {len(text)} characters (at most {MAX_LINE_CHARS})")
        out.append(
            parse_line(
                text,
                where,
                index=len(out),
                line=number,
                vocab=vocab,
                max_new_tokens=max_new_tokens,
                encode=encode,
            )
        )
    if not out:
        raise UsageError(f"--prompts {path}: no prompts (want one JSON object per line)")
    return out


class Results:
    """Which result line each finished sequence of a batch makes: a pure core, fed the model's
    `on_finish` (a line's own `stop_ids` go to the model, which ends the sequence at the first).
    """

    def __init__(self, batch: Sequence[Request], decode: Callable[[list[int]], str] | None = None):
        self.batch = list(batch)
        self.decode = decode
        self.done: list[bool] = [False] * len(self.batch)

    def finish(self, pos: int, new_ids: Sequence[int], reason: str) -> dict | None:
        """The model finished sequence `pos` of the batch with `new_ids` for `reason` ("stop" or
        "length"): its result line, or None if it was reported already."""
        if self.done[pos]:
            return None
        self.done[pos] = True
        req = self.batch[pos]
        ids = [int(t) for t in new_ids]
        doc: dict = {"index": req.index, "ids": list(req.ids), "new_ids": ids}
        if req.text and self.decode is not None:
            doc["text"] = self.decode(ids)
        doc["finish_reason"] = reason
        return doc

    def all_done(self) -> bool:
        return all(self.done)


class LineSink:
    """Where result lines go, each a whole line written at once and flushed.

    To a file: the lines go to `PATH.partial`, renamed to PATH by `commit()` once every
    sequence is done; a run that fails keeps only the `.partial` (whole lines, the sequences
    finished so far) and never leaves a PATH of its own. To stdout (`path` None): flushed per line.
    """

    def __init__(self, path: str | None, stream: IO[str] | None = None):
        self.path = Path(path) if path is not None else None
        self.partial = self.path.with_name(self.path.name + ".partial") if self.path is not None else None
        self.lines = 0
        self._file: IO[str] | None = None
        self._stream = stream

    def __enter__(self) -> LineSink:
        if self.partial is not None:
            self._file = open(self.partial, "w", encoding="utf-8")  # closed by commit or __exit__
        return self

    def write(self, doc: dict) -> None:
        f = self._file if self._file is not None else self._stream
        assert f is not None, "LineSink.write outside its with-block"
        f.write(json.dumps(doc) + "\n")  # one write per line: a reader never sees half of one
        f.flush()
        self.lines += 1

    def commit(self) -> None:
        """Every line is written: the file takes its final name (atomically, on one file system)."""
        if self._file is None:
            return
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = None
        assert self.path is not None and self.partial is not None
        os.replace(self.partial, self.path)

    def __exit__(self, *exc) -> None:
        if self._file is not None:  # not committed: a failed run keeps the .partial, if it has a line
            self._file.close()
            self._file = None
            if not self.lines and self.partial is not None:
                self.partial.unlink(missing_ok=True)
