"""`disco-ray finetune`'s options of a run's course: the learning-rate schedule, gradient
accumulation and clipping, checkpoints and resuming (`disco_ray.models.schedule`,
`disco_ray.models.train_state`)."""

from __future__ import annotations

import argparse
import math

from disco_ray.graph.errors import UsageError

from .app import positive_int


def _max_norm(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        x = math.nan
    if not (math.isfinite(x) and x > 0):
        raise argparse.ArgumentTypeError(f"want a number > 0, got {text[:40]!r}")
    return x


def _steps(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"want an integer >= 0, got {text[:40]!r}")
    return n


def add_schedule_args(p) -> None:
    p.add_argument(
        "--lr-schedule",
        choices=["constant", "linear", "cosine"],
        default="constant",
        help="the learning rate step by step, as transformers' get_scheduler (default constant)",
    )
    p.add_argument(
        "--warmup-steps", type=_steps, default=0, metavar="W", help="a linear ramp from 0 over W steps first"
    )
    p.add_argument(
        "--grad-accum",
        type=positive_int,
        default=1,
        metavar="K",
        help="micro-batches of --batch rows per step, their gradients summed in the step's graph",
    )
    p.add_argument(
        "--max-grad-norm",
        type=_max_norm,
        metavar="C",
        help="clip the global L2 norm of all LoRA gradients to C (torch's clip_grad_norm_)",
    )
    p.add_argument(
        "--save-every",
        type=positive_int,
        metavar="N",
        help="write a checkpoint OUT/step-N every N steps (adapter, optimizer, data position, RNG)",
    )
    p.add_argument(
        "--resume",
        metavar="OUT/step-N",
        help="continue the checkpoint to step --steps (counted from the run's start)",
    )


def schedule_kwargs(args) -> dict:
    """`LoraTrainer`'s keyword arguments of these options (--max-grad-norm goes in its OptimSpec)."""
    from disco_ray.models.schedule import LrSchedule

    return {
        "lr_schedule": LrSchedule.named(args.lr_schedule, args.warmup_steps),
        "grad_accum": args.grad_accum,
        "total_steps": args.steps,
        "resume": args.resume,
    }


def check_resumed_lora(args, lora) -> None:
    """UsageError naming a LoRA option given with --resume that differs from the checkpoint's."""
    if args.resume is None:
        return
    targets = None if args.lora_targets is None else tuple(x for x in args.lora_targets.split(",") if x)
    for flag, given, have in (
        ("--lora-rank", args.lora_rank, lora.rank),
        ("--lora-alpha", args.lora_alpha, lora.alpha),
        ("--lora-targets", targets and tuple(sorted(targets)), tuple(sorted(lora.targets))),
    ):
        if given is not None and given != have:
            raise UsageError(
                f"--resume {args.resume}: {flag} {given!r} differs from the checkpoint's {have!r}"
            )
