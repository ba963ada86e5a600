"""`disco-ray finetune`: LoRA fine-tuning of a Hugging Face LLaMA checkpoint.

    disco-ray finetune MODEL_DIR --data TOKENS.npy --steps K --lr LR --capacity SIZE --out DIR
        [--init-adapter DIR | --lora-rank R --lora-alpha A --lora-targets q_proj,v_proj,...]
        [--optimizer adamw|sgd] [--weight-decay W] [--batch B] [--gpus G] [--json] ...

TOKENS.npy is an int64 array [batch, seq]; the loss is the mean next-token cross-entropy
(transformers' labels=input_ids); a step is one optimizer step over the file's whole batch, or
over --batch rows of it (cycling). --out receives the adapter in PEFT's layout
(adapter_config.json + adapter_model.safetensors). Prints one loss per step, or with --json one
object with "losses", seconds per step and the plan's statistics.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from disco_ray.graph.errors import UsageError

from .app import (
    add_capacity_args,
    add_tier_args,
    capacity_of,
    closing_after_error,
    command,
    seconds_arg,
    seed_arg,
)
from .paths import writable_dir
from .run import add_model_run_args, model_run_kwargs


@command(
    "finetune",
    help="LoRA fine-tuning of a Hugging Face LLaMA checkpoint",
    description="Train a LoRA adapter of MODEL_DIR on TOKENS.npy for K optimizer steps and write it "
    "to DIR in PEFT's layout.",
)
def add_finetune(p) -> None:
    p.add_argument("model", metavar="MODEL_DIR")
    p.add_argument("--data", required=True, metavar="TOKENS.npy", help="int64 token ids [batch, seq]")
    p.add_argument("--steps", type=int, required=True, metavar="K")
    p.add_argument("--lr", type=float, required=True, metavar="LR")
    p.add_argument(
        "--out", required=True, type=writable_dir("--out"), metavar="DIR", help="where to write the adapter"
    )
    p.add_argument("--init-adapter", metavar="DIR", help="a PEFT adapter to start from")
    p.add_argument("--lora-rank", type=int, default=16, metavar="R")
    p.add_argument("--lora-alpha", type=float, default=32.0, metavar="A")
    p.add_argument(
        "--lora-targets",
        metavar="M,...",
        help="modules to adapt (default: q,k,v,gate,up,down projections: Phi-3's qkv_proj,gate_up_proj,down_proj)",
    )
    p.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    p.add_argument("--weight-decay", type=float, default=0.0, metavar="W")
    p.add_argument("--batch", type=int, metavar="B", help="sequences per step (default: all)")
    p.add_argument("--gpus", type=int, default=1, metavar="G")
    add_capacity_args(p, required=True)
    add_tier_args(p)  # --host-capacity, --disk
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], help="default: the checkpoint's")
    p.add_argument(
        "--block", type=int, metavar="N", help="row tile, in tokens (default: tiles of at most 512, equal)"
    )
    p.add_argument("--seed", type=seed_arg, default=0, help="of a new adapter's initial A")
    p.add_argument(
        "--grad-sum",
        choices=["sum_into", "add", "chain"],
        default="sum_into",
        help="how gradient partials are summed: sum-into kernels (default), one n-ary add, a chain of adds",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--timeout", type=seconds_arg, metavar="S", help="give up a step after S seconds")
    add_model_run_args(p)  # --weights, the engine's and the cluster's options
    p.set_defaults(streams=None)  # the trainer's own default (`default_streams`)


def _tokens(path: str):
    import numpy as np
    import torch

    try:
        arr = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise UsageError(f"--data {path}: not a readable .npy file ({e})") from None
    if not isinstance(arr, np.ndarray) or arr.dtype.kind not in "iu" or arr.ndim != 2:
        what = getattr(arr, "dtype", type(arr).__name__)
        raise UsageError(
            f"--data {path}: want an integer array [batch, seq], got {what} {list(getattr(arr, 'shape', []))}"
        )
    return torch.from_numpy(arr.astype(np.int64))


def cmd_finetune(args) -> int:
    from disco_ray.models.finetune import LoraTrainer, default_streams
    from workloads.llm.train import LoraSpec, OptimSpec

    capacity = capacity_of(args, args.gpus)
    assert capacity is not None  # argparse requires --capacity
    if args.steps < 1:
        raise UsageError(f"--steps must be >= 1, got {args.steps}")
    out = Path(args.out)
    data = _tokens(args.data)
    if args.lora_targets is None:  # the default projections, as the model's family names them
        from workloads.llm.checkpoint import Checkpoint
        from workloads.llm.lora import default_targets

        targets = default_targets(Checkpoint(args.model).config)
    else:
        targets = tuple(x for x in args.lora_targets.split(",") if x)
    spec = LoraSpec(args.lora_rank, args.lora_alpha, targets)
    optim = OptimSpec(args.optimizer, args.lr, weight_decay=args.weight_decay)
    if args.streams is None:
        args.streams = default_streams(args.backend)
    kw = model_run_kwargs(args, args.gpus)
    with closing_after_error(
        LoraTrainer(
            args.model,
            gpus=args.gpus,
            capacity=capacity,
            lora=spec,
            init_adapter=args.init_adapter,
            optim=optim,
            dtype=args.dtype,
            block=args.block,
            seed=args.seed,
            grad_sum=args.grad_sum,
            **kw,
        )
    ) as tr:
        losses = tr.train(data, args.steps, args.batch, args.timeout)
        tr.save_adapter(args.out)
        stats = tr.statistics()
    if args.json:
        print(json.dumps({**stats, "losses": losses, "out": str(out)}))
    else:
        for k, loss in enumerate(losses, 1):
            print(f"step {k}: loss {loss:.6f}")
        per = sorted(stats["step_s"])[len(stats["step_s"]) // 2]
        print(f"wrote {args.out}; {len(losses)} steps, median {per:.3f} s per step", file=sys.stderr)
    return 0
