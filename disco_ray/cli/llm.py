"""What the `generate` command's modes share: the checkpoint's vocabulary and tokenizer, the
sampling options checked, the capacity (and budget file) and the model opened at it."""

from __future__ import annotations

from pathlib import Path

from disco_ray.graph.errors import UsageError

from .app import capacity_of, closing_after_error
from .run import model_run_kwargs


def tokenizer_of(model: str, flag: str = "--prompt"):
    """The checkpoint's tokenizer.json loaded; `flag` names the option that needs it in an error."""
    path = Path(model) / "tokenizer.json"
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise UsageError(f"{flag} needs the tokenizers package (pip install tokenizers)") from None
    if not path.exists():
        raise UsageError(f"{flag} needs {path}, which is missing (give token ids)")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:
        raise UsageError(f"{path}: not a tokenizer file ({e})") from None


_FLAGS = {"temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p", "seed": "--seed"}


def sampling_of(args, vocab: int):
    """The run's `SamplingParams` from the options (checked against the vocabulary): sampling
    when asked (`--do-sample`) or when a sampling option is given without `--greedy`."""
    from disco_ray.models.sampling import SamplingParams

    opts = (("temperature", args.temperature), ("top_k", args.top_k), ("top_p", args.top_p))
    given = {k: v for k, v in opts if v is not None}
    params = SamplingParams(
        do_sample=args.do_sample or (bool(given) and not args.greedy),
        seed=args.seed,
        stop_ids=tuple(args.stop_ids or ()),
        **given,
    )
    try:
        params.validate(vocab)
    except UsageError as e:
        field, _, rest = str(e).partition(" ")
        flag = _FLAGS.get(field)
        raise UsageError(f"{flag} {rest}" if flag else f"--stop-ids: {e}") from None
    return params


def capacity_and_budget(args):
    """The arena bytes per GPU and the budget file to follow (None), checked."""
    capacity = capacity_of(args, args.gpus)
    budget = None
    if args.budget_file:
        from disco_ray.driver.elastic import BudgetFile, device_memory, fit_budget

        budget = BudgetFile(args.budget_file)
        if capacity is None:  # the budget's, clamped to the device's memory (a warning)
            asked = budget.budget.capacity
            if isinstance(asked, list) and len(asked) != args.gpus:
                raise UsageError(f"{budget.name}: gives {len(asked)} sizes for {args.gpus} GPU(s)")
            limit = None if getattr(args, "address", None) else device_memory(args.backend, args.gpus)
            capacity = fit_budget(asked, args.gpus, limit, budget.name, budget.warned)
    if capacity is None:
        raise UsageError("--capacity is required: the arena bytes of each GPU, e.g. 64MiB")
    return capacity, budget


def vocab_of(model: str) -> int:
    """The vocabulary size from the checkpoint's config (its headers only: no weight is read)."""
    from workloads.llm.checkpoint import Checkpoint

    return Checkpoint(model).config.vocab


def check_positions(model: str, lengths: list[tuple[str, int, int]]) -> None:
    """UsageError, before the model loads, naming the first (where, prompt tokens, new tokens) of
    `lengths` beyond the checkpoint's max_position_embeddings."""
    from disco_ray.models.planned import positions_beyond
    from workloads.llm.checkpoint import Checkpoint

    cfg = Checkpoint(model).config
    for where, prompt, new in lengths:
        why = positions_beyond(prompt, new, cfg.max_positions)
        if why is not None:
            raise UsageError(f"{where}: {why}")


def model_stats(args, stats: dict) -> dict:
    """The model's statistics and the run's options that every mode's JSON reports."""
    return {
        "plans": stats["plans"],
        "weight_bytes": stats["weight_bytes"],
        "gpus": args.gpus,
        "engine": args.engine,
        "backend": args.backend,
        "dtype": stats["dtype"],
        "kv_cache": stats["kv_cache"],
        "resizes": stats["resizes"],
        "clamped_plans": stats["clamped_plans"],
        "capacity_choice": stats["capacity_choice"],
    }


def open_model(args, capacity):
    """The `LlamaModel` the options describe, at `capacity` arena bytes per GPU, to open with
    `with` (closed after the error line when the run fails: `app.closing_after_error`)."""
    from disco_ray.models import LlamaModel

    kw = model_run_kwargs(args, args.gpus)
    return closing_after_error(
        LlamaModel(
            args.model,
            gpus=args.gpus,
            capacity=capacity,
            dtype=args.dtype,
            block=args.block,
            tile=args.tile,
            kv_cache=args.kv_cache,
            kv_group=args.kv_group,
            **kw,
        )
    )


def reason_of(seq) -> str:
    """A `SequenceOutput`'s finish reason as the results write it: "stop" or "length"."""
    from disco_ray.models.sampling import FinishReason

    r = seq.finish_reason
    return r.value if isinstance(r, FinishReason) else str(r)
