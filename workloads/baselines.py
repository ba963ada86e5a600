"""Plain PyTorch baselines with weights in host memory (pinned when CUDA), moved level by level.

- `torch_naive`: before each level, copy its weights to the GPU and wait (copy, then compute).
- `torch_prefetch`: double-buffered; a side stream copies level i+1's weights while level i
  computes (the usual hand-written overlap, as in GPU.md's peer anchors).
- `torch_in_memory`: all weights copied first, only the computation timed (the lower bound).

They run on one device (the computation of a tensor-parallel workload, not its split) and return
the outputs, checked against the workload's reference in tests, with the elapsed seconds: from the
first input copy (activations too start in host memory, pinned when CUDA) to the last level's end;
copying the outputs back is not timed. On the CPU the copies are plain copies and nothing overlaps.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from disco_ray.graph.errors import UsageError

from . import Workload
from .llama import full_weights, layer_spec, llama_layer
from .llm.layer import rope_tables


@dataclass(frozen=True, slots=True)
class BaselineResult:
    name: str
    device: str
    seconds: float
    outputs: dict[str, torch.Tensor]


S = TypeVar("S")  # a baseline's state between levels (the activations, and what they carry)


@dataclass(frozen=True, slots=True)
class _Program(Generic[S]):
    """A workload as levels of host weights and a step run per level."""

    weights: list[dict[str, torch.Tensor]]
    act: torch.Tensor  # the first level's activations, in host memory
    init: Callable[[str, torch.Tensor], S]  # (device, activations there) -> state
    step: Callable[[S, dict[str, torch.Tensor]], S]
    finish: Callable[[S], dict[str, torch.Tensor]]


def _program(w: Workload) -> _Program[Any]:
    if not w.inputs:
        raise UsageError(f"baseline of {w.name}: the workload was built without inputs (materialize=False)")
    ins = w.inputs
    if w.name == "matmul_chain":
        n, gpus = w.params["n"], w.params["gpus"]
        out = w.taskgraph.outputs[0]
        levels = [{"y": torch.cat([ins[f"y{i}_g{j}"] for j in range(gpus)], dim=1)} for i in range(n)]
        # typed by the annotation: _Program[...](...) would set __orig_class__ on a frozen slots class
        chain: _Program[torch.Tensor] = _Program(
            levels,
            ins["x0_g0"],
            lambda dev, x: x,
            lambda x, wt: x @ wt["y"],
            lambda x: {out: x.cpu()},
        )
        return chain
    if w.name == "llama_prefill":
        p = w.params
        tiles = p["seq"] // p["tile"]
        outs = w.meta["outputs"]
        levels = [full_weights(ins, names) for names in w.meta["layer_weights"]]

        def init(dev, h):
            cos, sin = rope_tables(
                layer_spec(p["dim"], p["heads"], p["ffn"]), torch.arange(p["seq"]), h.dtype
            )
            return h, cos.to(dev), sin.to(dev)

        def step(state, wt):
            h, cos, sin = state
            return llama_layer(h, wt, cos, sin, p["heads"]), cos, sin

        def finish(state):
            h = state[0].cpu()
            return {o: h[t * p["tile"] : (t + 1) * p["tile"]] for t, o in enumerate(outs)}

        h0 = torch.cat([ins[f"h0_t{t}"] for t in range(tiles)], dim=0)
        return _Program(levels, h0, init, step, finish)
    raise UsageError(f"no torch baseline for workload {w.name!r} (matmul_chain, llama_prefill)")


def _device(device: str | None) -> str:
    return device or ("cuda" if torch.cuda.is_available() else "cpu")


def _host(prog: _Program[Any], dev: str) -> tuple[list[dict[str, torch.Tensor]], torch.Tensor]:
    """The weights and first activations in host memory, pinned when the device is a GPU."""
    if not dev.startswith("cuda"):
        return prog.weights, prog.act
    pinned = [{k: t.contiguous().pin_memory() for k, t in lv.items()} for lv in prog.weights]
    return pinned, prog.act.contiguous().pin_memory()


def _sync(dev: str) -> None:
    if dev.startswith("cuda"):
        torch.cuda.synchronize(dev)


def _finished(name: str, dev: str, t0: float, prog, state) -> BaselineResult:
    """Waits for the device, stops the clock started at `t0`, and hands back the outputs."""
    _sync(dev)
    seconds = time.perf_counter() - t0
    return BaselineResult(name, dev, seconds, prog.finish(state))


def torch_naive(w: Workload, device: str | None = None) -> BaselineResult:
    """Copies each level's weights to the device, waits, then computes the level."""
    dev = _device(device)
    prog = _program(w)
    host, act = _host(prog, dev)
    _sync(dev)
    t0 = time.perf_counter()
    state = prog.init(dev, act.to(dev))
    for lv in host:
        wt = {k: t.to(dev) for k, t in lv.items()}
        _sync(dev)
        state = prog.step(state, wt)
    return _finished("torch_naive", dev, t0, prog, state)


def torch_prefetch(w: Workload, device: str | None = None) -> BaselineResult:
    """Double-buffered: level i+1's weights are copied on a side stream while level i computes."""
    dev = _device(device)
    prog = _program(w)
    host, act = _host(prog, dev)
    cuda = dev.startswith("cuda")
    bufs = [{k: torch.empty_like(t, device=dev) for k, t in host[0].items()} for _ in range(2)]
    side = torch.cuda.Stream(dev) if cuda else None
    loaded = [torch.cuda.Event() for _ in range(2)] if cuda else []
    freed = [torch.cuda.Event() for _ in range(2)] if cuda else []

    def load(i: int) -> None:
        b = bufs[i % 2]
        if side is not None:  # cuda
            side.wait_event(freed[i % 2])  # the level that last used this buffer has computed
            with torch.cuda.stream(side):
                for k, t in host[i].items():
                    b[k].copy_(t, non_blocking=True)
                loaded[i % 2].record(side)
        else:
            for k, t in host[i].items():
                b[k].copy_(t)

    _sync(dev)
    t0 = time.perf_counter()
    if cuda:
        for e in freed:
            e.record()
    state = prog.init(dev, act.to(dev))
    load(0)
    for i in range(len(host)):
        if i + 1 < len(host):
            load(i + 1)
        if cuda:
            torch.cuda.current_stream(dev).wait_event(loaded[i % 2])
        state = prog.step(state, bufs[i % 2])
        if cuda:
            freed[i % 2].record()
    return _finished("torch_prefetch", dev, t0, prog, state)


def torch_in_memory(w: Workload, device: str | None = None) -> BaselineResult:
    """All weights and inputs on the device beforehand; only the computation is timed."""
    dev = _device(device)
    prog = _program(w)
    on_dev = [{k: t.to(dev) for k, t in lv.items()} for lv in prog.weights]
    act = prog.act.to(dev)
    _sync(dev)
    t0 = time.perf_counter()
    state = prog.init(dev, act)
    for wt in on_dev:
        state = prog.step(state, wt)
    return _finished("torch_in_memory", dev, t0, prog, state)


BASELINES = {"torch_naive": torch_naive, "torch_prefetch": torch_prefetch, "torch_in_memory": torch_in_memory}
