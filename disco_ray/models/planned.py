"""A model's plans: the graph of each plan key planned at the current capacity on first use and
kept per capacity, its Program loaded into the pool's workers, the micro-batches of a batch
step chosen by the plans (`choose_micro`), and a generation's last steps planned before its
first token (`plan_ahead`), so that one that cannot finish fails before the work."""

from __future__ import annotations

import bisect
import time
from collections.abc import Sequence

from disco_ray.driver.program import Program
from disco_ray.graph.errors import CapacityError, UsageError
from disco_ray.graph.memgraph import MemGraph
from disco_ray.graph.sizes import format_size
from planner import build_memgraph, min_capacity
from workloads.llm.batch import BatchLayout
from workloads.llm.checkpoint import Checkpoint
from workloads.llm.model import ModelGraph, behind_window

from .graphs import bytes_moved, model_graph
from .programs import Programs, plan_entry


def positions_beyond(prompt: int, new: int, max_positions: int) -> str | None:
    """Why `new` tokens after a prompt of `prompt` do not fit the model's positions (None: they do)."""
    n = prompt + new
    if n <= max_positions:
        return None
    return f"{prompt} prompt tokens + {new} new = {n} positions, beyond the model's max_position_embeddings {max_positions}"


def last_steps(start: int, maxes: Sequence[int], block: int) -> list[tuple[int, int]]:
    """(rows, cache blocks) of the last decode step at each row count of a batch whose cache index
    starts at `start`, every sequence running to its maximum (`maxes`): decode step k feeds cache
    index start + k - 1 for the pow2(#{max > k}) rows left, so each row count needs the most at
    its last step, the last step of some sequence (k = max - 1)."""
    ends = sorted(maxes)
    last: dict[int, int] = {}
    for k in {m - 1 for m in maxes if m > 1}:
        live = len(ends) - bisect.bisect_right(ends, k)
        rows = 1 << (live - 1).bit_length()
        last[rows] = max(last.get(rows, 0), k)
    return sorted((rows, (start + k - 1) // block + 1) for rows, k in last.items())


class PlannedModel(Programs):
    """The plans of a model on a pool of workers; `LlamaModel` sets the state below."""

    ck: Checkpoint
    gpus: int
    block: int
    dtype: str
    tile: int
    planning_s: float
    load_s: float
    clamped: int  # plans made at a vertex's minimum because the capacity was below it
    resizes: list[dict]
    micro_choices: list[dict]
    _plans: dict[tuple, tuple[ModelGraph, MemGraph]]
    _micros: dict[tuple, int]

    def check_length(self, prompts: Sequence[int], maxes: Sequence[int]) -> None:
        """UsageError naming the sequence whose prompt and new tokens exceed the model's positions."""
        for i, (n, m) in enumerate(zip(prompts, maxes)):
            why = positions_beyond(n, m, self.ck.config.max_positions)
            if why is not None:
                raise UsageError(f"{f'sequence {i}: ' if len(maxes) > 1 else ''}max_new_tokens {m}: {why}")

    def _caps(self) -> list[int]:
        c = self.capacity
        return [int(c)] * self.gpus if isinstance(c, int) else [int(x) for x in c]

    def _program(self, key: tuple) -> tuple[ModelGraph, Program]:
        """The graph and Program of `key` at the current capacity: planned on first use (plans
        are kept per capacity, so going back to a capacity plans nothing)."""
        got = self._programs.get(key)
        if got is not None:
            return got
        mgraph, mg = self._plan(key)
        prog = Program(mgraph.taskgraph, mg, **self._prog_kw)
        t = time.perf_counter()
        prog.engine  # noqa: B018  (loads the graph into the workers now, not in the first run)
        self.load_s += time.perf_counter() - t
        got = self._programs[key] = (mgraph, prog)
        return got

    def _plan(self, key: tuple) -> tuple[ModelGraph, MemGraph]:
        """The graph of `key` and its plan at the current capacity, planned on first use."""
        caps = self._caps()
        planned = self._plans.get((key, tuple(caps)))
        if planned is None:
            t = time.perf_counter()
            mgraph = model_graph(self.ck, self.gpus, key, self.block, self.dtype, self.tile)
            tg = mgraph.taskgraph
            self.fit_capacity(tg, f"graph {'/'.join(str(k) for k in key)}")  # "auto": grows to fit
            caps = self._caps()
            need = min_capacity(tg)
            if self.resizes and any(c < n for c, n in zip(caps, need)):
                # an elastic budget below what one vertex needs: run at that minimum, not fail
                # (a capacity given at the start that small is an error, the planner's)
                self.clamped += 1
                caps = [max(c, n) for c, n in zip(caps, need)]
            # the builder's order: layer by layer, each tile's vertices together
            order = mgraph.order or list(tg.vertices)  # a batch's micro-batches: zig-zag
            mg = build_memgraph(tg, caps, order=order, host_capacity=self.host_capacity)
            dt = time.perf_counter() - t
            self.planning_s += dt
            self.plans.append(plan_entry("/".join(str(k) for k in key), tg, mg, dt, capacity=caps))
            planned = self._plans[(key, tuple(self._caps()))] = (mgraph, mg)
        return planned

    def drop_behind(self, p: int, first: bool) -> None:
        """Before the decode step at position p (the generation's `first`): the workers drop the
        KV cache blocks that no step from p on reads (`behind_window`)."""
        gone = behind_window(self.ck.config, self.gpus, p, self.block, first)
        if gone:
            self.pool.move_states({}, gone)  # type: ignore[attr-defined]

    def choose_micro(self, kind: str, rows: int, blocks: int, extra: tuple = ()) -> int:
        """The micro-batches of a batch step (`kind` "batch_prefill" or "batch_decode", `rows`
        rows, `blocks` cache blocks) at the current capacity, chosen by the plans: each power of
        two up to `rows` is planned and the one whose plan moves the fewest bytes between host
        and device wins (ties: fewer micro-batches). Made once per (step, capacity), so a resize
        chooses again at the next step, and going back to a capacity chooses nothing. `extra`: the
        rest of the plan key (a sampling decode step's stop ids per row)."""
        caps = tuple(self._caps())
        got = self._micros.get((kind, rows, blocks, caps, *extra))
        if got is not None:
            return got
        moved: dict[int, int | str] = {}
        while not moved or tuple(self._caps()) != caps:  # "auto" grew the capacity: compare again
            caps, m = tuple(self._caps()), 1
            while m <= rows:
                try:
                    moved[m] = bytes_moved(self._plan((kind, rows, blocks, m, *extra))[1])
                except (CapacityError, UsageError) as e:  # this split does not plan: the others may
                    moved[m] = str(e)
                m *= 2
        fits = [m for m, b in moved.items() if isinstance(b, int)]
        if not fits:
            raise CapacityError(f"{kind} of {rows} rows plans with no micro-batch count: {moved[1]}")
        best = min(fits, key=lambda m: (moved[m], m))
        key = (kind, rows, blocks, caps, *extra)
        self._micros[key] = best
        self.micro_choices.append(
            {
                "kind": kind,
                "rows": rows,
                "blocks": blocks,
                "capacity": list(caps),
                "micro": best,
                "moved": moved,
            }
        )
        return best

    def plan_ahead(self, key: tuple, what: str) -> None:
        """Plans step `key` now, before the first token of a run that will reach it (kept, so the
        step plans nothing then); a batch step's key (kind, rows, blocks, None) lets the plans
        choose its micro-batches. CapacityError naming `what` and the capacity it needs."""
        try:
            if key[-1] is None:
                self.choose_micro(*key[:3])
            else:
                self._plan(key)
        except CapacityError as e:
            if self.auto is not None:  # the budget's own message names the numbers
                raise CapacityError(f"{what}: {e}") from None
            one = key if key[-1] is not None else (*key[:3], 1)
            mgraph = model_graph(self.ck, self.gpus, one, self.block, self.dtype, self.tile)
            need, caps = min_capacity(mgraph.taskgraph), self._caps()
            if all(c >= n for c, n in zip(caps, need)):  # not one vertex: the planner says why
                raise CapacityError(f"{what} does not plan at the capacity: {e}") from None
            raise CapacityError(
                f"{what} needs a capacity of at least {format_size(max(need))} per GPU, above "
                f"{format_size(min(caps))}: give a larger capacity or fewer new tokens"
            ) from None

    def plan_batch_ahead(
        self, prompts: Sequence[Sequence[int]], maxes: Sequence[int], micro: int | None
    ) -> None:
        """Before a batch's first token: its lengths checked (`check_length`), its prefill planned
        (a capacity too small for it is named by it), then the last decode step of each row count
        (`last_steps`, `plan_ahead`). `micro`: the caller's micro-batch count, or None (the plans
        choose)."""
        self.check_length([len(p) for p in prompts], maxes)
        live = [i for i, m in enumerate(maxes) if m > 0]
        if not live:
            return
        rows = 1 << (len(live) - 1).bit_length()
        layout = BatchLayout.of([len(prompts[i]) for i in live], self.block, rows)
        if micro is None:
            self.choose_micro("batch_prefill", rows, layout.blocks)
        else:
            self._plan(("batch_prefill", rows, layout.blocks, min(micro, rows)))
        for r, b in last_steps(layout.length, [maxes[i] for i in live], self.block):
            key = ("batch_decode", r, b, None if micro is None else min(micro, r))
            self.plan_ahead(
                key, f"max_new_tokens {max(maxes)}: the decode step of {r} rows at {b} cache blocks"
            )
