"""The model's graphs by plan key, and what is read off them: the bytes a plan moves, the
capacities a generation needs (`capacity_bounds`)."""

from __future__ import annotations

import math

from disco_ray.graph.memgraph import MemGraph, MKind
from disco_ray.graph.quant import Quant, kv_quant
from planner.capacity import CapacityBounds
from workloads.llm.batch import batch_decode_graph, batch_prefill_graph
from workloads.llm.checkpoint import Checkpoint
from workloads.llm.model import ModelGraph, decode_graph, prefill_graph

STOPS = 4  # stop ids per row of a batch's decode graph: a request's rounded up to a power of two >= this


def model_graph(
    ck: Checkpoint, gpus: int, key: tuple, block: int, dtype: str | None, tile: int
) -> ModelGraph:
    """The graph of a plan key: ("prefill", blocks, logits, cache), ("decode", blocks), or a
    batch's ("batch_prefill" | "batch_decode", rows, cache blocks, micro-batches), a decode step
    that samples on the device with one more: ("batch_decode", ..., stop ids per row)."""
    if key[0] == "prefill":
        _, blocks, logits, cache = key
        mgraph = prefill_graph(
            ck,
            gpus,
            blocks,
            block,
            dtype=dtype,
            logits=logits,
            cache=cache,
            tile=tile,
        )
    elif key[0] == "decode":
        mgraph = decode_graph(ck, gpus, key[1], block, dtype)
    else:  # a batch's: (kind, rows, cache blocks, micro-batches[, stop ids per row])
        _, rows, blocks, micro, *stops = key
        if key[0] == "batch_prefill":
            mgraph = batch_prefill_graph(
                ck,
                gpus,
                rows,
                blocks,
                block,
                dtype=dtype,
                micro=micro,
                tile=tile,
            )
        else:
            mgraph = batch_decode_graph(
                ck, gpus, rows, blocks, block, dtype=dtype, micro=micro, stops=stops[0] if stops else 0
            )
    return mgraph


def capacity_bounds(
    path: str,
    *,
    gpus: int = 1,
    prompt: int,
    new_tokens: int = 0,
    block: int = 64,
    tile: int | None = None,
    dtype: str | None = None,
    batch: int | None = None,
    micro: int = 1,
    stops: int = STOPS,
    quantize: str | None = None,
    quant_group: int = 64,
    kv_cache: str | None = None,
    kv_group: int | None = None,
) -> CapacityBounds:
    """Per GPU, the least capacity that plans every graph a generation of `new_tokens` after a
    prompt of `prompt` tokens uses (`min`: its largest vertex fits), and the capacity with room
    for every tensor of the largest graph at once (`roomy`: nothing offloaded).

    `batch`: the graphs of `run_generate_batch` for that many prompts of at most `prompt` tokens
    (rows rounded up to a power of two, `micro` micro-batches; the fewer rows after compaction
    need no more), instead of the single-sequence ones; its decode steps sample on the device with
    `stops` stop ids per row (`run_generate_batch` rounds a request's up to a power of two >= 4).
    `quantize`, `quant_group`: the graphs of a model run with them (packed weights); `kv_cache`,
    `kv_group` alike (an int8 KV cache)."""
    ck = Checkpoint(path).quantized(Quant.named(quantize, quant_group))
    ck = ck.with_kv_cache(kv_quant(kv_cache, ck.config.head_dim, kv_group))
    blocks = math.ceil(prompt / block)
    tile = tile or 4 * block
    last = prompt + new_tokens - 2  # the position the last decode step feeds
    if batch is not None:
        rows = 1 << (max(1, batch) - 1).bit_length()
        m = min(micro, rows)
        graphs = [batch_prefill_graph(ck, gpus, rows, blocks, block, dtype=dtype, micro=m, tile=tile)]
        end = blocks * block + new_tokens - 2  # the cache index the last step feeds
        graphs += [
            batch_decode_graph(ck, gpus, rows, n, block, dtype=dtype, micro=m, stops=stops)
            for n in range(blocks + 1, end // block + 2)
            if new_tokens > 1
        ]
    else:
        graphs = [prefill_graph(ck, gpus, blocks, block, dtype=dtype, cache=new_tokens > 1, tile=tile)]
        if new_tokens > 1:
            graphs += [
                decode_graph(ck, gpus, n, block, dtype) for n in range(prompt // block + 1, last // block + 2)
            ]
    return CapacityBounds.of(m.taskgraph for m in graphs)


def bytes_moved(mg: MemGraph) -> int:
    """Bytes a plan moves between host and device per run: inputs loaded, reloads and offloads
    (the plan's own count: a resident weight's skipped load still counts, alike for every split)."""
    kinds = (MKind.INPUT, MKind.RELOAD, MKind.OFFLOAD)
    return sum(v.out.nbytes for v in mg.vertices if v.kind in kinds)
