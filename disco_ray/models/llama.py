"""LLaMA inference on disco-ray: a Hugging Face checkpoint loaded onto G workers, prefill and
greedy generation with a KV cache the workers keep.

    model = disco_ray.models.load("ckpt/", gpus=2, capacity="64MiB", engine="local")
    logits = model.prefill([1, 2, 3])                   # [3, vocab] float32
    new = model.generate([1, 2, 3], max_new_tokens=20)  # the new token ids
    model.close()

Every graph of the model runs on one pool of workers (`RayPool` or `LocalPool`), so they share
each worker's arena, its resident weights (each worker reads its own shards from the checkpoint
once) and the KV cache states. Graphs are planned once and kept: a prefill per number of row
tiles of the prompt, a decode step per number of cache blocks (`workloads.llm.model` says how
the cache is cut), so planning is off the per-token path: a new plan is made once per `block`
tokens at most, and never for a length seen before. A decode step is one run: the driver ships
the token, its position and its rotary row, and reads back the logits (one round trip).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from actors.options import STALL_S
from disco_ray.driver.elastic import device_memory, fit_budget
from disco_ray.graph.errors import UsageError
from disco_ray.graph.memgraph import MemGraph
from disco_ray.graph.quant import kv_quant
from disco_ray.graph.sizes import parse_capacity
from workloads.llm.model import ModelGraph

from .batch import BatchGeneration, SequenceOutput, run_batch
from .decode_calls import STEPS_PER_CALL
from .planned import PlannedModel, last_steps
from .programs import one_request, open_checkpoint
from .sampling import SamplingParams, check_logits, sample
from .train_defaults import default_streams


@dataclass(slots=True)
class Generation:
    """What one `LlamaModel.run_generate` did."""

    tokens: list[int]  # the new token ids
    prefill_logits: torch.Tensor | None  # [prompt length, vocab] float32, when asked for
    prefill_s: float  # the prefill run (planning excluded)
    decode_s: list[float] = field(default_factory=list)  # each decode step's run
    planning_s: float = 0.0  # plans made during this call
    stopped: str = "length"  # "length" or "eos"
    bytes_offloaded: int = 0  # by the runs of this call, as their plans say
    bytes_reloaded: int = 0

    def statistics(self) -> dict:
        n = len(self.decode_s)
        total = sum(self.decode_s)
        return {
            "tokens": self.tokens,
            "prompt_prefill_s": round(self.prefill_s, 6),
            "decode_steps": n,
            "decode_s": round(total, 6),
            "decode_tokens_per_s": round(n / total, 3) if total > 0 else None,
            "decode_step_ms_median": round(1e3 * sorted(self.decode_s)[n // 2], 3) if n else None,
            "planning_s": round(self.planning_s, 6),
            "stopped": self.stopped,
            "bytes_offloaded": self.bytes_offloaded,
            "bytes_reloaded": self.bytes_reloaded,
        }


class LlamaModel(PlannedModel):
    """A LLaMA checkpoint on `gpus` workers with `capacity` arena bytes each.

    Args:
        path: a Hugging Face checkpoint directory (config.json + model.safetensors or shards).
        gpus: GPUs (workers) to split the model over (tensor-parallel; heads, key/value heads and
            intermediate_size must divide by it).
        capacity: arena bytes per GPU: an int, a list per GPU, "64MiB" / "64MiB,32MiB", or "auto"
            (the default) / "60%": of each GPU's free memory (docs/MODELS.md#capacity).
        host_capacity: each worker's host-store budget (the same forms; None: unbounded): offloads
            beyond it go to the worker's spill file in `disk_dir` (None: a temporary directory).
        dtype: compute dtype, a name or a torch.dtype (default or "auto": the checkpoint's);
            weights are converted when read.
        block: KV cache block (tokens); prompts are padded to a multiple of it.
        tile: prefill row tile (tokens, a multiple of `block`; default 4 blocks): larger tiles make
            larger matrix products, smaller ones smaller activations.
        engine, backend, streams, ahead, num_cpus, address, placement: as `Program`'s (streams None: 1 on cpu).
        weights: "host" (each worker reads its shards once and keeps them in host memory) or
            "disk" (each load reads them from the checkpoint files: host memory holds none).
        check: run the sanitizer in every run (slow; for tests).
        stall_timeout: ray engine: a worker silent this many seconds (stopped, hung) ends a run.
        quantize: "int8" or "int4": the decoder layers' linear weights are read quantized, kept
            and moved packed, dequantized where used (docs/QUANTIZATION.md); None: as stored.
        quant_group: elements per scale and zero point of a quantized weight's rows.
        kv_cache: "int8": the KV cache blocks stored packed, group-wise within each head, each
            new key and value row quantized as it is written, the blocks dequantized in attention
            (docs/QUANTIZATION.md#kv-cache-in-8-bits); None or "float": in the compute dtype.
        kv_group: elements per scale and zero point of an int8 cache row (a divisor of the head
            dimension; default: the head dimension, one per head).
        pool: a `RayPool` / `LocalPool` to run on and keep (default: one of its own, closed
            with the model).
    """

    def __init__(
        self,
        path: str,
        *,
        gpus: int = 1,
        capacity: int | str | Sequence[int] = "auto",
        dtype: str | torch.dtype | None = None,
        block: int = 64,
        tile: int | None = None,
        engine: str = "ray",
        backend: str = "cpu",
        weights: str = "host",
        streams: int | None = None,
        ahead: int | None = None,
        num_cpus: int | None = None,
        address: str | None = None,
        placement: object | None = None,
        check: bool = False,
        pool: object | None = None,
        host_capacity: int | str | Sequence[int | None] | None = None,
        disk_dir: str | None = None,
        stall_timeout: float = STALL_S,
        quantize: str | None = None,
        quant_group: int = 64,
        kv_cache: str | None = None,
        kv_group: int | None = None,
    ):
        if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1:
            raise UsageError(f"gpus must be a positive integer, got {gpus!r}")
        if not isinstance(block, int) or isinstance(block, bool) or block < 1:
            raise UsageError(f"block must be a positive integer, got {block!r}")
        tile = 4 * block if tile is None else tile
        if not isinstance(tile, int) or isinstance(tile, bool) or tile < block or tile % block:
            raise UsageError(f"tile must be a multiple of block {block}, got {tile!r}")
        self.tile = tile
        self.ck, self.dtype = open_checkpoint(path, gpus, dtype, engine, quantize, quant_group, backend)
        self.ck = self.ck.with_kv_cache(kv_quant(kv_cache, self.ck.config.head_dim, kv_group))
        self.config = self.ck.config
        self.gpus, self.block = gpus, block
        cluster = dict(num_cpus=num_cpus, placement=placement, address=address)
        streams = default_streams(backend) if streams is None else streams  # cpu: one, no hand-overs
        super().__init__(
            engine, pool, cluster, capacity, host_capacity, backend, streams, ahead, weights, disk_dir, check
        )
        self.run_kw["stall_timeout"] = stall_timeout
        self._plans: dict[tuple, tuple[ModelGraph, MemGraph]] = {}  # (key, capacity) -> plan
        self._micros: dict[tuple, int] = {}  # (kind, rows, blocks, capacity) -> chosen micro-batches
        self.micro_choices: list[dict] = []  # each choice made, with every candidate's bytes moved
        self.clamped = 0  # plans made at a vertex's minimum because the capacity was below it
        self.resizes: list[dict] = []
        self._budget = None
        self._budget_seq = 0
        self.planning_s = 0.0
        self.load_s = 0.0  # loading graphs into the workers (the first also reads the weights)

    @one_request
    def resize(self, capacity: int | str | Sequence[int]) -> dict:
        """Runs within `capacity` bytes of arena per GPU from now on (elastic capacity): unloads
        every graph, which frees the arenas (on CUDA the memory goes back to the device), and
        plans or reuses plans for the new capacity as the next runs need them. The KV cache and
        the resident weights stay on the workers. Returns the seconds it took to free the memory."""
        t = time.perf_counter()
        new = parse_capacity(capacity) if isinstance(capacity, str) else capacity
        self._close_programs()
        self.auto = None  # a capacity given from now on, no longer grown from the free memory
        self.capacity = new
        freed = time.perf_counter() - t
        self.resizes.append({"capacity": self._caps(), "free_s": round(freed, 6)})
        return self.resizes[-1]

    def watch(self, budget) -> None:
        """Between decode steps, look for a new capacity in `budget`: anything with `poll()`
        returning a `Budget` (a `BudgetFile`), or a `BudgetActor` handle (disco_ray.driver.elastic);
        None stops watching."""
        self._budget = budget
        self._budget_seq = 0

    def _poll_budget(self) -> None:
        b = self._budget
        if b is None:
            return
        if hasattr(b, "poll"):  # a BudgetFile: each of its warnings once
            got = b.poll().since(self._budget_seq)
            name, warned = getattr(b, "name", "the budget"), getattr(b, "warned", None)
        else:
            import ray

            got, name, warned = ray.get(b.since.remote(self._budget_seq)), "the budget actor", None
        if got is None:
            return
        capacity, asked_at, self._budget_seq = got
        local = getattr(self.pool, "address", None) in (None, "local")  # else another machine's
        limit = device_memory(self.backend, self.gpus) if local else None
        capacity = fit_budget(capacity, self.gpus, limit, name, warned)
        if capacity is not None and capacity != self.capacity:
            r = self.resize(capacity)
            r["since_request_s"] = round(time.time() - asked_at, 6)

    def _run(
        self,
        key: tuple,
        ids: list[int],
        pos: int,
        gen: Generation | None = None,
        timeout: float | None = None,
    ) -> tuple[torch.Tensor, int, float]:
        """Runs graph `key` on `ids` from position `pos`: (logits, the prompt row of their first row, seconds)."""
        mgraph, prog = self._program(key)
        feed = mgraph.feed(self.config, ids, pos)
        t = time.perf_counter()
        outs = prog.run(feed, timeout=timeout, **self.run_kw)
        dt = time.perf_counter() - t
        if gen is not None:
            gen.bytes_offloaded += prog.mg.stats.get("bytes_offloaded", 0)
            gen.bytes_reloaded += prog.mg.stats.get("bytes_reloaded", 0)
        return mgraph.gather(outs), mgraph.logits[0][0], dt

    def _ids(self, ids: Sequence[int]) -> list[int]:
        out = [int(i) for i in ids]
        if not out:
            raise UsageError("the prompt has no token ids")
        bad = [i for i in out if not 0 <= i < self.config.vocab]
        if bad:
            raise UsageError(f"token id {bad[0]} is outside the vocabulary 0..{self.config.vocab - 1}")
        return out

    # ---- the API -------------------------------------------------------------------------------
    @one_request
    def prefill(self, ids: Sequence[int]) -> torch.Tensor:
        """The logits [len(ids), vocab] (float32) of every position of the prompt `ids`;
        NonFiniteError naming the first position with a NaN or infinite one."""
        ids = self._ids(ids)
        self.check_length([len(ids)], [0])  # a prompt past a window not built would be wrong logits
        blocks = math.ceil(len(ids) / self.block)
        logits, _, _ = self._run(("prefill", blocks, "all", False), ids, 0)
        check_logits(logits[: len(ids)], 0, row="position")
        return logits[: len(ids)]

    def generate(
        self,
        prompts: Sequence[int] | Sequence[Sequence[int]],
        max_new_tokens: int | Sequence[int],
        *,
        sampling: SamplingParams | None = None,
        stop_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
        indices: Sequence[int] | None = None,
        stop_at_eos: bool = True,
        micro: int | str = "auto",
        timeout: float | None = None,
        steps_per_call: int = STEPS_PER_CALL,
    ) -> list[int] | list[list[int]]:
        """The new token ids after each prompt (at most `max_new_tokens`, an int or one per
        prompt; a stop id or the config's end-of-sequence token ends a sequence, and is included).

        `prompts` is one list of token ids (greedy, one sequence: its new ids, as before) or a list
        of such lists of any lengths (a batch, `run_generate_batch`: a list of new-id lists).
        `sampling` (`SamplingParams`; default greedy); `stop_ids`: token ids added to its stop ids
        for every sequence, or (a batch) one list per prompt, each sequence's own; `indices`:
        each sequence's sampling index; `steps_per_call`: decode steps per call (`run_generate_batch`)."""
        batch = bool(len(prompts)) and isinstance(prompts[0], Sequence) and not isinstance(prompts[0], str)
        simple = sampling is None and stop_ids is None and indices is None and micro in (1, "auto")
        simple = simple and steps_per_call == STEPS_PER_CALL
        if not batch and simple:
            if not isinstance(max_new_tokens, int):
                raise UsageError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
            return self.run_generate(prompts, max_new_tokens, stop_at_eos=stop_at_eos, timeout=timeout).tokens  # type: ignore[arg-type]
        # a list of lists: one per prompt; a flat list: the same for every sequence
        each = batch and bool(stop_ids) and isinstance(stop_ids[0], Sequence)  # type: ignore[index]
        if stop_ids is not None and not each:
            sampling = sampling or SamplingParams()
            sampling = replace(sampling, stop_ids=tuple(sampling.stop_ids) + tuple(stop_ids))  # type: ignore[arg-type]
        got = self.run_generate_batch(
            prompts if batch else [prompts],  # type: ignore[arg-type,list-item]
            max_new_tokens,
            sampling=sampling,
            stop_ids=stop_ids if each else None,  # type: ignore[arg-type]
            indices=indices,
            stop_at_eos=stop_at_eos,
            micro=micro,
            timeout=timeout,
            steps_per_call=steps_per_call,
        )
        new = [s.new_ids for s in got.sequences]
        return new if batch else new[0]

    @one_request
    def prefill_batch(self, prompts: Sequence[Sequence[int]], *, micro: int = 1) -> torch.Tensor:
        """The logits [len(prompts), vocab] (float32) of each prompt's last token, the prompts
        prefilled together in one run (a ragged batch)."""
        return run_batch(self, prompts, 1, micro=micro, prefill_logits=True).prefill_logits  # type: ignore[return-value]

    @one_request
    def run_generate_batch(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int | Sequence[int],
        *,
        sampling: SamplingParams | None = None,
        stop_ids: Sequence[Sequence[int]] | None = None,
        indices: Sequence[int] | None = None,
        stop_at_eos: bool = True,
        micro: int | str = "auto",
        on_finish: Callable[[SequenceOutput], None] | None = None,
        on_token: Callable[[int, int], None] | None = None,
        timeout: float | None = None,
        steps_per_call: int = STEPS_PER_CALL,
    ) -> BatchGeneration:
        """Generation for a batch of prompts of different lengths: one prefill run for all, then
        one run of one plan per step for every unfinished sequence (`disco_ray.models.batch`).

        Args:
            prompts: token-id lists, any lengths (each checked against the vocabulary).
            max_new_tokens: an int >= 0, or one per prompt.
            sampling: greedy (the default) or sampling, and the stop ids of every sequence.
            stop_ids: each prompt's own stop ids (a list per prompt, beside the sampling's): a
                sequence that produces one finishes ("stop") and frees its row at that step.
            indices: each prompt's index, distinct integers >= 0 (default 0..n-1): sampling
                seeds sequence i's generator from (the seed, indices[i]), so a caller that
                splits a list of prompts into several calls passes each prompt's place in the
                list to get the tokens of one call, whatever the split (greedy ignores them).
            stop_at_eos: the config's end-of-sequence ids also end a sequence.
            micro: micro-batches per step (a power of two; the rows split into that many groups
                that pass each layer in turn, sharing its weight loads), or "auto" (default): per
                step, the count whose plan moves the fewest bytes at the current capacity
                (`choose_micro`), chosen again after a resize.
            on_finish: called with each sequence's `SequenceOutput` as it finishes.
            on_token: called with (sequence index, token) for every new token, in order.
            timeout: bounds each run (RunError past it): a call of several steps as a whole.
            steps_per_call: decode steps per call to the workers (default 32), tokens chosen and
                carried on the device, each reaching `on_token` as its step ends; a call ends after
                a step where a sequence finishes, or at a cache block's end (1: a call per step).

        Raises:
            UsageError: one line naming the bad input (an empty prompt, an id outside the
                vocabulary with its sequence index, max_new_tokens < 0, bad sampling fields,
                stop ids or indices that are not one per prompt, out of the vocabulary or repeated).
        """
        return run_batch(
            self,
            prompts,
            max_new_tokens,
            sampling=sampling,
            stop_ids=stop_ids,
            indices=indices,
            stop_at_eos=stop_at_eos,
            micro=micro,
            on_finish=on_finish,
            on_token=on_token,
            timeout=timeout,
            steps_per_call=steps_per_call,
        )

    @one_request
    def run_generate(
        self,
        ids: Sequence[int],
        max_new_tokens: int,
        *,
        stop_at_eos: bool = True,
        prefill_logits: bool = False,
        timeout: float | None = None,
        on_token: Callable[[int], None] | None = None,
    ) -> Generation:
        """`generate` with its timings; `prefill_logits` also returns every prompt position's logits
        (0 new tokens: prefill only); `timeout` bounds each run (RunError past it); `on_token` is
        called with each new token as it is made. A length beyond the model's positions, or a
        last decode step that does not fit the capacity, is refused before the first run."""
        ids = self._ids(ids)
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
            raise UsageError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
        planned = self.planning_s
        n = len(ids)
        self.check_length([n], [max_new_tokens])
        blocks = math.ceil(n / self.block)
        cache = max_new_tokens > 1
        mode = "all" if prefill_logits else "last"
        if max_new_tokens == 0 and not prefill_logits:
            return Generation([], None, 0.0)
        first_key = ("prefill", blocks, mode, cache)
        self._plan(first_key)  # a capacity too small for the prefill is named by the prefill
        for _, last in last_steps(n, [max_new_tokens], self.block):
            self.plan_ahead(("decode", last), f"max_new_tokens {max_new_tokens}: the last decode step")
        gen = Generation([], None, 0.0)
        logits, first, gen.prefill_s = self._run(first_key, ids, 0, gen, timeout)
        if prefill_logits:
            check_logits(logits[:n], 0, row="position")  # what --logits writes is an answer too
            gen.prefill_logits = logits[:n].clone()
        eos = set(self.config.eos) if stop_at_eos else set()
        greedy = SamplingParams()
        if max_new_tokens:
            gen.tokens.append(int(sample(logits[n - 1 - first : n - first], greedy, step=0)[0]))
            if on_token is not None:
                on_token(gen.tokens[-1])
        for step in range(1, max_new_tokens):
            if gen.tokens[-1] in eos:
                gen.stopped = "eos"
                break
            p = n + step - 1  # the position of the token fed in
            self._poll_budget()  # between steps: a new capacity takes effect here
            self.drop_behind(p, step == 1)  # the cache blocks behind a sliding window go
            logits, _, dt = self._run(("decode", p // self.block + 1), [gen.tokens[-1]], p, gen, timeout)
            gen.decode_s.append(dt)
            gen.tokens.append(int(sample(logits[:1], greedy, step=step)[0]))
            if on_token is not None:
                on_token(gen.tokens[-1])
        else:
            if gen.tokens and gen.tokens[-1] in eos:
                gen.stopped = "eos"
        gen.planning_s = self.planning_s - planned
        return gen

    def statistics(self) -> dict:
        return {
            "model": str(self.ck.path),
            "layers": self.config.layers,
            "gpus": self.gpus,
            "dtype": self.dtype,
            "block": self.block,
            "tile": self.tile,
            "capacity": self.capacity,
            "capacity_choice": None if self.capacity_choice is None else self.capacity_choice.statistics(),
            "weight_bytes": self.ck.weight_bytes(self.dtype),
            "quantize": None if self.ck.quant is None else self.ck.quant.to_dict(),
            "kv_cache": None if self.ck.kv_cache is None else self.ck.kv_cache.to_dict(),
            "plans": list(self.plans),
            "planning_s": round(self.planning_s, 4),
            "load_s": round(self.load_s, 4),
            "resizes": list(self.resizes),
            "clamped_plans": self.clamped,
        }
