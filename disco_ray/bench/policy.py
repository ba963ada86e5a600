"""The batch policy search: the batch size and micro-batches per step that maximise predicted
new tokens/s within a capacity.

FlexGen (section 4, "Policy search") enumerates the batch size and the number of batches per block
(the batches that share one load of a layer's weights) and keeps the policy whose cost model
predicts the most tokens/s under the memory constraints; the elastic-FlexGen report (section
2.1.2, ../shared/papers/elastic-flexgen-report.md) runs that search again when the memory changes.
Here the same two knobs are searched, `batch` rows per decode step split into `micro` groups that
each pass a layer before the next layer (sharing its weight loads), but nothing is modelled by
hand: each candidate's decode-step graph is planned by the planner at the capacity (so the plan's
own offloads, reloads and spill-file traffic are what is costed), and the cost model predicts the
plan's step time: the simulator under a device profile or a replayed trace
(`disco_ray.bench.simulate`), or any function of (TaskGraph, MemGraph) -> seconds. FlexGen's placement
percentages (weights, cache, activations on GPU/CPU/disk) are the planner's decisions here, not
searched; FlexGen solves an LP per (batch, block) pair, this enumerates the pairs and plans each.

    from disco_ray.bench import policy, profiles
    best = policy.search(make_graph, capacity=16 * 2**30, cost=profiles.t4)
    print(best.table())
    again = policy.search(make_graph, capacity=new_budget, cost=profiles.t4)  # the budget changed

Choosing again when the capacity changes between steps (a `--budget-file`) is one more call with
the new capacity: the search is a pure function of its arguments.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from disco_ray.graph.errors import CapacityError, UsageError
from disco_ray.graph.memgraph import MemGraph, MKind
from disco_ray.graph.sizes import format_size
from disco_ray.graph.taskgraph import Kind, TaskGraph

from .profiles import Profile, UnitCost
from .replay import Replay

if TYPE_CHECKING:
    from workloads.llm.checkpoint import Checkpoint

BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MICROS = (1, 2, 4, 8)

MakeGraph = Callable[[int, int], TaskGraph]
CostFn = Callable[[TaskGraph, MemGraph], float]


@dataclass(frozen=True, slots=True)
class Candidate:
    """One (batch, micro) pair: its predicted step, or why it does not plan within the capacity."""

    batch: int
    micro: int
    step_s: float | None = None  # predicted seconds of one decode step; None when excluded
    loaded: int = 0  # bytes moved host -> GPU per step (inputs and reloads, all GPUs)
    excluded: str = ""  # why it does not fit (empty when it does)

    @property
    def tokens_per_s(self) -> float:
        """Predicted new tokens/s: one token per sequence per step (0 when excluded)."""
        return self.batch / self.step_s if self.step_s else 0.0

    @property
    def fits(self) -> bool:
        return self.step_s is not None


@dataclass(frozen=True, slots=True)
class Policy:
    """The chosen batch and micro-batches per step, and every candidate the choice was made from."""

    batch: int
    micro: int
    step_s: float  # predicted seconds of one decode step
    tokens_per_s: float  # predicted new tokens/s: batch / step_s
    candidates: tuple[Candidate, ...]

    def table(self) -> str:
        """The candidates as a text table, the chosen one marked with '*'."""
        rows = [f"{'':1} {'batch':>6} {'micro':>5} {'step s':>10} {'tokens/s':>10} {'H2D/step':>10}  note"]
        for c in self.candidates:
            mark = "*" if (c.batch, c.micro) == (self.batch, self.micro) else ""
            if c.fits:
                step, tps, h2d = f"{c.step_s:.4g}", f"{c.tokens_per_s:.4g}", format_size(c.loaded)
                rows.append(f"{mark:1} {c.batch:>6} {c.micro:>5} {step:>10} {tps:>10} {h2d:>10}")
            else:
                rows.append(f"{mark:1} {c.batch:>6} {c.micro:>5} {'-':>10} {'-':>10} {'-':>10}  {c.excluded}")
        return "\n".join(rows)

    def statistics(self) -> dict:
        return {
            "batch": self.batch,
            "micro": self.micro,
            "step_s": self.step_s,
            "tokens_per_s": self.tokens_per_s,
            "candidates": [
                {
                    "batch": c.batch,
                    "micro": c.micro,
                    "step_s": c.step_s,
                    "tokens_per_s": c.tokens_per_s,
                    "h2d_bytes": c.loaded,
                    "excluded": c.excluded,
                }
                for c in self.candidates
            ],
        }


def choose(candidates: Iterable[Candidate]) -> Policy:
    """The candidate of the most predicted tokens/s (ties: the smaller batch, then fewer micro-
    batches: less memory for the same speed); CapacityError when none fits."""
    cands = tuple(candidates)
    fitting = [c for c in cands if c.fits]
    if not fitting:
        why = "; ".join(f"batch {c.batch} micro {c.micro}: {c.excluded}" for c in cands[:4])
        raise CapacityError(f"no batch plans within the capacity ({why})")
    best = max(fitting, key=lambda c: (c.tokens_per_s, -c.batch, -c.micro))
    assert best.step_s is not None
    return Policy(best.batch, best.micro, best.step_s, best.tokens_per_s, cands)


def search(
    make_graph: MakeGraph,
    capacity: int | Sequence[int],
    *,
    cost: Profile | UnitCost | Replay | CostFn,
    batches: Iterable[int] = BATCHES,
    micros: Iterable[int] = MICROS,
    host_capacity: int | Sequence[int | None] | None = None,
    host_memory: int | None = None,
    prefill: MakeGraph | None = None,
) -> Policy:
    """Plans and costs every (batch, micro) pair and chooses (`choose`) the fastest per token.

    Args:
        make_graph: `(batch, micro) -> TaskGraph`, one decode step of `batch` sequences split into
            `micro` groups, at the batch's cache length. A UsageError from it excludes the pair.
        capacity: arena bytes per GPU (one int for all, or one per GPU).
        cost: a device profile, `UnitCost` or a replayed trace (the simulator predicts the plan's
            makespan), or a function (TaskGraph, MemGraph) -> seconds.
        batches, micros: the values tried; pairs with more micro-batches than rows are skipped.
        host_capacity: the host store's budget per GPU, passed to the planner (offloads beyond it
            go to the spill file, which the simulator costs on the disk lanes).
        host_memory: bytes of host RAM per GPU for what the step's inputs keep there (weights,
            the KV cache states); a pair whose inputs exceed it is excluded. None: unbounded.
        prefill: `(batch, micro) -> TaskGraph` of the batch's prefill, which must plan too (its
            largest vertex within the arena); not costed (the step is what repeats).

    Raises:
        CapacityError: no pair plans within the capacity.
        UsageError: no pair to try.
    """
    pairs = [(b, m) for b in sorted(set(batches)) for m in sorted(set(micros)) if 1 <= m <= b]
    if not pairs:
        raise UsageError(
            f"the policy search has no (batch, micro) pair to try (batches {batches}, micros {micros})"
        )
    return choose(
        evaluate(make_graph, b, m, capacity, cost, host_capacity, host_memory, prefill) for b, m in pairs
    )


def for_checkpoint(
    ck: Checkpoint,
    *,
    gpus: int,
    prompt: int,
    new_tokens: int,
    capacity: int | Sequence[int],
    cost: Profile | UnitCost | Replay | CostFn,
    block: int = 64,
    dtype: str | None = None,
    tile: int | None = None,
    host_capacity: int | Sequence[int | None] | None = None,
    host_memory: int | None = None,
    batches: Iterable[int] = BATCHES,
    micros: Iterable[int] = MICROS,
) -> Policy:
    """`search` over a checkpoint's batched decode step (`workloads.llm.batch`) at the cache length
    of the last step of `new_tokens` after prompts of up to `prompt` tokens, each pair's batched
    prefill required to plan too: what `disco-ray generate --batch auto` runs."""
    from workloads.llm.batch import batch_decode_graph, batch_prefill_graph

    blocks = (prompt + max(new_tokens, 2) - 2) // block + 1
    pblocks = -(-prompt // block)
    tile = 4 * block if tile is None else tile
    return search(
        lambda b, m: batch_decode_graph(ck, gpus, b, blocks, block, dtype=dtype, micro=m).taskgraph,
        capacity,
        cost=cost,
        batches=batches,
        micros=micros,
        host_capacity=host_capacity,
        host_memory=host_memory,
        prefill=lambda b, m: (
            batch_prefill_graph(ck, gpus, b, pblocks, block, dtype=dtype, micro=m, tile=tile).taskgraph
        ),
    )


def evaluate(
    make_graph: MakeGraph,
    batch: int,
    micro: int,
    capacity: int | Sequence[int],
    cost: Profile | UnitCost | Replay | CostFn,
    host_capacity: int | Sequence[int | None] | None = None,
    host_memory: int | None = None,
    prefill: MakeGraph | None = None,
) -> Candidate:
    """One pair: its graph planned at `capacity` and its step predicted, or why it is excluded."""
    from planner import build_memgraph, min_capacity

    try:
        tg = make_graph(batch, micro)
        pre = prefill(batch, micro) if prefill is not None else None
    except UsageError as e:
        return Candidate(batch, micro, excluded=str(e))
    caps = [capacity] * tg.gpus if isinstance(capacity, int) else list(capacity)
    if pre is not None:
        need = min_capacity(pre)
        short = [g for g in range(pre.gpus) if need[g] > caps[g]]
        if short:
            g = short[0]
            return Candidate(
                batch,
                micro,
                excluded=f"its prefill's largest vertex needs {need[g]} bytes on gpu:{g}, the arena is "
                f"{caps[g]} ({format_size(need[g])} > {format_size(caps[g])})",
            )
    if host_memory is not None:
        held = host_bytes(tg)
        over = [g for g in range(tg.gpus) if held[g] > host_memory]
        if over:
            g = over[0]
            return Candidate(
                batch,
                micro,
                excluded=f"its inputs need {format_size(held[g])} of host memory on gpu:{g}, "
                f"more than {format_size(host_memory)}",
            )
    need = min_capacity(tg)
    short = [g for g in range(tg.gpus) if need[g] > caps[g]]
    if short:  # cheaper than a plan that fails on its first large vertex
        g = short[0]
        return Candidate(
            batch,
            micro,
            excluded=f"its largest vertex needs {need[g]} bytes on gpu:{g}, the arena is {caps[g]} "
            f"({format_size(need[g])} > {format_size(caps[g])})",
        )
    try:
        mg = build_memgraph(tg, caps, order=list(tg.vertices), host_capacity=host_capacity)
    except CapacityError as e:
        return Candidate(batch, micro, excluded=str(e))
    step = predict(tg, mg, cost)
    loaded = sum(v.out.nbytes for v in mg.vertices if v.kind in (MKind.INPUT, MKind.RELOAD))
    return Candidate(batch, micro, step, loaded)


def predict(tg: TaskGraph, mg: MemGraph, cost: Profile | UnitCost | Replay | CostFn) -> float:
    """Predicted seconds of one run of plan `mg`: the simulator's makespan, or `cost(tg, mg)`."""
    if isinstance(cost, (Profile, UnitCost, Replay)):
        from .simulate import simulate

        return simulate(mg, tg, cost).makespan
    return float(cost(tg, mg))


def host_bytes(tg: TaskGraph) -> list[int]:
    """Per GPU, the bytes of the graph's inputs (weights, states such as the KV cache): what the
    worker keeps in host memory for a step."""
    held = [0] * tg.gpus
    for v in tg:
        if v.kind is Kind.INPUT:
            held[v.gpu] += v.nbytes
    return held
