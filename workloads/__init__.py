"""Workloads: functions that build a TaskGraph, its inputs and an independent torch reference.

`build("matmul_chain", n=8, gpus=2)` calls a registered builder; `params(name)` lists its typed
parameters so a command line can parse `key=value` strings with `build_from_strings`. Builders are
imported on first use, so a workload whose module is missing (not merged yet) fails only when asked.
"""

from __future__ import annotations

import importlib
import inspect
import math
import os
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from disco_ray.graph.errors import DiscoError, UsageError
from disco_ray.graph.taskgraph import TaskGraph


@dataclass(frozen=True, slots=True)
class Workload:
    """A TaskGraph with its inputs and a plain-torch reference computing the same outputs.

    `reference(inputs)` returns {output id: tensor}; it is written independently of the TaskGraph
    (it does not call `disco_ray.graph.reference.evaluate`). `levels` lists, per level (layer), the
    TaskGraph ids that belong to it, for the levelwise ablation; `weights` the weight input ids.
    """

    name: str
    taskgraph: TaskGraph
    inputs: dict[str, torch.Tensor]
    reference: Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]]
    levels: list[list[str]] = field(default_factory=list)
    weights: list[str] = field(default_factory=list)
    params: dict = field(default_factory=dict)  # the builder's arguments, for baselines and reports
    meta: dict = field(default_factory=dict)

    def order(self) -> list[str]:
        """The serial order the builder laid the graph out in (level by level): a planner order."""
        return list(self.taskgraph.vertices)

    def level_of(self) -> dict[str, int]:
        """TaskGraph id -> level index, for the ids that `levels` names."""
        return {v: n for n, ids in enumerate(self.levels) for v in ids}

    def statistics(self) -> dict:
        return {
            "name": self.name,
            "levels": len(self.levels),
            "weights": len(self.weights),
            "weight_bytes": sum(self.taskgraph[w].nbytes for w in self.weights),
            **self.taskgraph.statistics(),
        }


# name -> (module, function); imported lazily
REGISTRY: dict[str, tuple[str, str]] = {
    "matmul_chain": ("workloads.matmul_chain", "matmul_chain"),
    "tp_matmul": ("workloads.tp_matmul", "tp_matmul"),
    "llama_prefill": ("workloads.llama", "llama_prefill"),
    "random_dag": ("workloads", "random_dag_workload"),
}


def names() -> list[str]:
    return sorted(REGISTRY)


def builder(name: str) -> Callable[..., Workload]:
    """The builder function of workload `name`; UsageError names the known ones."""
    if name not in REGISTRY:
        raise UsageError(f"unknown workload {name!r} (one of {', '.join(names())})")
    module, fn = REGISTRY[name]
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        raise UsageError(f"workload {name!r} is not available: {e}") from None
    return getattr(mod, fn)


def params(name: str) -> dict[str, tuple[type, object]]:
    """Parameter name -> (type, default) of workload `name`'s builder (default inspect.Parameter.empty)."""
    fn = builder(name)
    hints = typing.get_type_hints(fn)
    out = {}
    for p in inspect.signature(fn).parameters.values():
        out[p.name] = (_base_type(hints.get(p.name, str)), p.default)
    return out


def build(name: str, **kwargs) -> Workload:
    """Builds workload `name` with keyword parameters; UsageError for unknown parameters."""
    known = params(name)
    bad = set(kwargs) - set(known)
    if bad:
        raise UsageError(f"workload {name!r} has no parameter(s) {sorted(bad)} (it takes {', '.join(known)})")
    return builder(name)(**kwargs)


MAX_PARAM = 1 << 20  # a size or count parameter from a command line: beyond it, a typo


def build_from_strings(name: str, args: Mapping[str, str]) -> Workload:
    """Builds workload `name` from string values (`{"n": "8"}`), converted by the builder's types.

    What a command line gives is checked before anything is built: numbers finite, counts and
    sizes in 0..MAX_PARAM, probabilities in [0, 1], and the inputs within the memory free (a
    dry build without tensors first). Any error the builder raises is a UsageError naming the
    workload and its parameters.
    """
    known = params(name)
    kwargs = {}
    for k, s in args.items():
        if k not in known:
            raise UsageError(f"workload {name!r} has no parameter {k!r} (it takes {', '.join(known)})")
        try:
            v = kwargs[k] = parse_value(k, s, known[k][0])
        except UsageError as e:
            raise UsageError(f"workload {name!r}: {e}") from None
        bad = _param_range(k, v)
        if bad:
            raise UsageError(f"workload {name!r}: parameter {k}={s[:40]} {bad}")
    said = " ".join(f"{k}={s[:40]}" for k, s in args.items())
    if kwargs.get("materialize", True) and "materialize" in known:
        dry = _build(name, said, {**kwargs, "materialize": False})
        need = sum(v.nbytes for v in dry.taskgraph.caller_inputs())
        free = available_memory()
        if free is not None and need > free:
            raise UsageError(
                f"workload {name!r} ({said}): its inputs need {need} bytes, more than the {free} "
                "bytes of memory free"
            )
    return _build(name, said, kwargs)


def _param_range(key: str, v: object) -> str | None:
    """Why a parsed command-line parameter value is out of range, or None."""
    if isinstance(v, float) and not math.isfinite(v):
        return "is not a finite number"
    if key.endswith("_prob") and isinstance(v, (int, float)) and not 0 <= v <= 1:
        return "is not a probability in [0, 1]"
    if isinstance(v, int) and not isinstance(v, bool):
        hi = 2**63 - 1 if key == "seed" else MAX_PARAM
        if not 0 <= v <= hi:
            return f"is out of range 0..{hi}"
    return None


def _build(name: str, said: str, kwargs: dict) -> Workload:
    """build(name, **kwargs), with whatever the builder raises for bad values as a UsageError."""
    try:
        return build(name, **kwargs)
    except DiscoError as e:
        msg = str(e)
        raise UsageError(
            msg if msg.startswith("workload") else f"workload {name!r} ({said}): {msg}"
        ) from None
    except (
        ValueError,
        TypeError,
        ArithmeticError,
        LookupError,
        AssertionError,
        MemoryError,
        RuntimeError,
    ) as e:
        raise UsageError(f"workload {name!r} ({said}): {type(e).__name__}: {e}") from None


def available_memory() -> int | None:
    """Bytes of memory this machine has free now (None where the OS does not say)."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def parse_value(key: str, s: str, typ: type) -> object:
    """Converts a command-line string to `typ` (int, float, bool, str); 'none' gives None."""
    if s.lower() == "none":
        return None
    try:
        if typ is bool:
            if s.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(s)
            return s.lower() in ("1", "true", "yes")
        return typ(s)
    except ValueError:
        raise UsageError(f"parameter {key}={s!r} is not a valid {typ.__name__}") from None


def random_dag_workload(
    n: int = 40,
    gpus: int = 2,
    seed: int = 0,
    transfer_prob: float = 0.1,
    max_inputs: int = 3,
    far_prob: float = 0.05,
    input_prob: float = 0.05,
    outputs: int | None = None,
    materialize: bool = True,
) -> Workload:
    """A random DAG (`workloads.random_dag`) with random inputs; levels are longest-path depths.

    A random graph has no definition other than itself, so its reference is the graph's own
    evaluation (`graph_workload`), unlike the other workloads.
    """
    try:
        from .random_dag import random_dag
    except ModuleNotFoundError as e:
        raise UsageError(f"workload 'random_dag' is not available: {e}") from None
    from disco_ray.graph.reference import random_inputs

    kw = dict(transfer_prob=transfer_prob, max_inputs=max_inputs, far_prob=far_prob, input_prob=input_prob)
    tg = random_dag(
        n,
        gpus,
        seed,
        outputs=outputs,
        transfer_prob=transfer_prob,
        max_inputs=max_inputs,
        far_prob=far_prob,
        input_prob=input_prob,
    )
    inputs = random_inputs(tg, seed) if materialize else {}
    return graph_workload("random_dag", tg, inputs, dict(n=n, gpus=gpus, seed=seed, outputs=outputs, **kw))


def graph_workload(
    name: str, tg: TaskGraph, inputs: dict[str, torch.Tensor], params: dict | None = None
) -> Workload:
    """A workload of a given TaskGraph (a random one, a user's file): its reference is the graph's
    own evaluation (`disco_ray.graph.reference.evaluate`, the kernels run one by one in plain
    torch), its levels the longest-path depths, every input a weight."""
    from disco_ray.graph.reference import evaluate

    depth: dict[str, int] = {}
    for v in tg:
        depth[v.id] = 1 + max((depth[i] for i in v.inputs), default=-1)
    levels: list[list[str]] = [[] for _ in range(max(depth.values(), default=-1) + 1)]
    for vid, d in depth.items():
        levels[d].append(vid)

    def reference(ins: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return evaluate(tg, ins)

    return Workload(name, tg, inputs, reference, levels, [v.id for v in tg.inputs()], dict(params or {}))


def _base_type(t) -> type:
    """int from `int`, `int | None` or `Optional[int]`."""
    args = [a for a in typing.get_args(t) if a is not type(None)]
    if args:
        return _base_type(args[0])
    return t if isinstance(t, type) else str
