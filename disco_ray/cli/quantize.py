"""`disco-ray quantize MODEL_DIR OUT_DIR --bits 4`: a checkpoint written quantized (packed int8 or
int4 safetensors, docs/FORMATS.md), which `generate` and `finetune` read as stored: every load,
from host memory or from disk, moves the packed bytes and nothing is quantized again."""

from __future__ import annotations

import argparse

from .app import command, positive_int
from .paths import writable_dir


@command(
    "quantize",
    help="write a checkpoint quantized (int8 or int4, group-wise): generate and finetune read it packed",
    description="Writes MODEL_DIR's weights quantized into the new directory OUT_DIR: the decoder "
    "layers' linear weights at --bits, the embedding table and LM head at 8 bits, packed as "
    "docs/QUANTIZATION.md says; the other tensors, the tokenizer's files and config.json (with a "
    "quantization_config) as they are. `generate OUT_DIR --weights disk` then streams the packed "
    "bytes; --quantize may be left out (a conflicting one is refused).",
)
def add_quantize(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir", metavar="MODEL_DIR", help="a Hugging Face checkpoint directory")
    p.add_argument(
        "out_dir", metavar="OUT_DIR", type=writable_dir("OUT_DIR"), help="a new (or empty) directory"
    )
    p.add_argument("--bits", type=int, choices=[8, 4], required=True, help="bits per code: 8 or 4")
    p.add_argument(
        "--group",
        type=positive_int,
        default=64,
        metavar="N",
        help="elements per scale and zero point of a row (default 64)",
    )


def cmd_quantize(args: argparse.Namespace) -> int:
    from disco_ray.graph.sizes import format_size
    from disco_ray.models.quantized import quantize_checkpoint

    st = quantize_checkpoint(args.model_dir, str(args.out_dir), args.bits, args.group)
    print(
        f"{st['out']}: {st['packed']} of {st['tensors']} tensors packed (int{args.bits}, group "
        f"{args.group}), {format_size(st['bytes_in'])} -> {format_size(st['bytes_out'])} in {st['seconds']:.1f} s"
    )
    return 0
