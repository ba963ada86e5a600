"""`disco-ray finetune`: LoRA fine-tuning of a Hugging Face LLaMA checkpoint.

    disco-ray finetune MODEL_DIR --data FILE --steps K --lr LR --capacity SIZE --out DIR
        [--init-adapter DIR | --lora-rank R --lora-alpha A --lora-targets q_proj,v_proj,...]
        [--optimizer adamw|sgd] [--weight-decay W] [--batch B] [--gpus G] [--json] ...
        [--seq-len N] [--eval-data FILE [--eval-every N] [--eval-batch B]]
        [--lr-schedule constant|linear|cosine --warmup-steps W] [--grad-accum K] [--max-grad-norm C]
        [--save-every N] [--resume OUT/step-N]
    disco-ray finetune MODEL_DIR --steps 0 --eval-data FILE --capacity SIZE [--init-adapter DIR]

FILE is an int64 array [batch, seq] (.npy) or a JSONL of documents packed into rows of --seq-len
(`finetune_eval`, `disco_ray.models.textdata`); the loss is the mean next-token cross-entropy
(transformers' labels=input_ids); a step is one optimizer step over the file's whole batch, or
over --batch rows of it (cycling). --out receives the adapter in PEFT's layout
(adapter_config.json + adapter_model.safetensors). Prints a line per step on stderr as it runs,
then one loss per step (and the evaluations), or with --json one object with "losses", "steps"
(each step's figures), "eval", seconds per step and the plan's statistics. --save-every N writes a
checkpoint OUT/step-N every N steps (`disco_ray.models.train_state`); --resume OUT/step-N
continues it to step --steps (counted from the run's start, as transformers' max_steps).
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
from .finetune_args import add_schedule_args, check_resumed_lora, schedule_kwargs
from .finetune_eval import Progress, add_data_args, check_modes, read_data
from .paths import writable_dir
from .run import add_model_run_args, model_run_kwargs


@command(
    "finetune",
    help="LoRA fine-tuning of a Hugging Face LLaMA checkpoint",
    description="Train a LoRA adapter of MODEL_DIR on FILE (.npy token ids or JSONL documents) for K "
    "optimizer steps and write it to DIR in PEFT's layout; or, with --steps 0, evaluate an adapter.",
)
def add_finetune(p) -> None:
    p.add_argument("model", metavar="MODEL_DIR")
    p.add_argument("--data", metavar="FILE", help="int64 token ids [batch, seq] (.npy), or JSONL documents")
    p.add_argument("--steps", type=int, required=True, metavar="K", help="0: evaluate --eval-data only")
    p.add_argument("--lr", type=float, metavar="LR", help="needed to train")
    p.add_argument("--out", type=writable_dir("--out"), metavar="DIR", help="where to write the adapter")
    add_data_args(p)  # --seq-len, --eval-data, --eval-every, --eval-batch
    p.add_argument("--init-adapter", metavar="DIR", help="a PEFT adapter to start from")
    p.add_argument("--lora-rank", type=int, metavar="R", help="(default 16)")
    p.add_argument("--lora-alpha", type=float, metavar="A", help="(default 32)")
    p.add_argument(
        "--lora-targets",
        metavar="M,...",
        help="modules to adapt (default: q,k,v,gate,up,down projections: Phi-3's qkv_proj,gate_up_proj,down_proj)",
    )
    p.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    p.add_argument("--weight-decay", type=float, default=0.0, metavar="W")
    p.add_argument("--batch", type=int, metavar="B", help="sequences per micro-batch (default: all / K)")
    # --lr-schedule, --warmup-steps, --grad-accum, --max-grad-norm, --save-every, --resume
    add_schedule_args(p)
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
        help="how gradient partials are summed: sum-into kernels (default), one n-ary add (the default "
        "with --save-every or --resume: a fixed order, so a resumed run ends bit for bit as one run), a chain of adds",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--timeout", type=seconds_arg, metavar="S", help="give up a step after S seconds")
    add_model_run_args(p)  # --weights, the engine's and the cluster's options
    p.set_defaults(streams=None)  # the trainer's own default (`default_streams`)
    for action in p._actions:
        if "--streams" in action.option_strings:
            action.help = "compute streams per GPU (default: 1 on the cpu backend, 5 on cuda)"


def cmd_finetune(args) -> int:
    from disco_ray.models.finetune import LoraTrainer
    from disco_ray.models.train_defaults import default_streams
    from workloads.llm.train import LoraSpec, OptimSpec

    capacity = capacity_of(args, args.gpus)
    assert capacity is not None  # argparse requires --capacity
    check_modes(args)
    data, held = read_data(args)
    if args.resume is not None:  # the checkpoint's adapter and LoRA settings
        targets = None
    elif args.lora_targets is None:  # the default projections, as the model's family names them
        from workloads.llm.checkpoint import Checkpoint
        from workloads.llm.lora import default_targets

        targets = default_targets(Checkpoint(args.model).config)
    else:
        targets = tuple(x for x in args.lora_targets.split(",") if x)
    rank = 16 if args.lora_rank is None else args.lora_rank
    alpha = 32.0 if args.lora_alpha is None else args.lora_alpha
    spec = None if targets is None else LoraSpec(rank, alpha, targets)
    lr = OptimSpec().lr if args.lr is None else args.lr  # no --lr: --steps 0, no update
    optim = OptimSpec(args.optimizer, lr, weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm)
    progress = Progress(args, held)
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
            grad_sum=args.grad_sum or ("add" if args.save_every or args.resume else "sum_into"),
            **schedule_kwargs(args),
            **kw,
        )
    ) as tr:
        progress.trainer = tr
        check_resumed_lora(args, tr.lora)
        if tr.steps_done > args.steps:
            raise UsageError(
                f"--resume {args.resume}: the checkpoint is at step {tr.steps_done}, past --steps {args.steps}"
            )
        losses = (
            tr.train(
                data,
                args.steps - tr.steps_done,
                args.batch,
                args.timeout,
                save_every=args.save_every,
                out=args.out,
                on_step=progress.step,
            )
            if data is not None
            else []
        )
        progress.finish()
        if args.out is not None:
            tr.save_adapter(args.out)
        stats = tr.statistics()
    if args.json:
        out = str(Path(args.out)) if args.out is not None else None
        print(json.dumps({**stats, "losses": losses, **progress.json(), "out": out}))
    else:
        for k, loss in enumerate(losses, stats["steps"] - len(losses) + 1):  # a resumed run's steps go on
            print(f"step {k}: loss {loss:.6f}")
        for line in progress.lines():
            print(line)
        if losses:
            per = sorted(stats["step_s"])[len(stats["step_s"]) // 2]
            print(f"wrote {args.out}; {len(losses)} steps, median {per:.3f} s per step", file=sys.stderr)
    return 0
