"""Batched generation (`LlamaModel.run_generate_batch`) with transformers as the oracle.

A ragged batch (prompts of 3, 17 and 69 tokens, left-padded to a shared cache length) must give
every sequence the greedy tokens transformers gives that prompt alone (argmax of a full forward
per step), with per-sequence maxima, a stop id and the end-of-sequence token, at a roomy
capacity, at one that offloads to the host store and one that offloads to the spill file, on 1
and 2 GPUs, on the local and the ray engine; its prefill
the last-token logits of each prompt alone (relative error <= 1e-4). Sampling gives a sequence
the same tokens alone and in a batch; finished sequences free their KV cache states; plans are
reused; micro-batches give the same tokens and load each weight once per step.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from disco_ray.graph.errors import UsageError  # noqa: E402
from disco_ray.graph.memgraph import MKind  # noqa: E402
from disco_ray.models import LlamaModel  # noqa: E402
from disco_ray.models.graphs import capacity_bounds  # noqa: E402
from disco_ray.models.sampling import SamplingParams  # noqa: E402
from planner import min_capacity, roomy_capacity  # noqa: E402
from tests.family_oracle import greedy  # noqa: E402
from tests.ray_fixtures import pool  # noqa: E402, F401  (module fixture for the ray test)
from tests.test_models import make_checkpoint, rel_err  # noqa: E402
from workloads.llm.batch import batch_decode_graph, batch_prefill_graph  # noqa: E402
from workloads.llm.checkpoint import Checkpoint  # noqa: E402

BLOCK = 4
PROMPTS = [
    [5, 17, 3],
    [(7 * i + 3) % 128 for i in range(17)],
    [(11 * i + 1) % 128 for i in range(69)],
]
MAX_NEW = [6, 9, 7]  # the longest prompt (cache index 72) crosses a block boundary at 76


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("batch")
    hf = make_checkpoint(path, num_key_value_heads=2, tie_word_embeddings=False)
    return str(path), hf


def last_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1]


@pytest.fixture(scope="module")
def free(ckpt):
    """Each prompt's greedy tokens alone, up to its maximum, with no stop."""
    _, hf = ckpt
    return [greedy(hf, p, n) for p, n in zip(PROMPTS, MAX_NEW)]


def until(tokens: list[int], stops: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in stops:
            return tokens[: i + 1]
    return tokens


def capacity(path: str, gpus: int, mode: str) -> list[int]:
    """Roomy: every tensor of the largest graph at once; tight: an eighth of it (offloads)."""
    b = capacity_bounds(path, gpus=gpus, prompt=69, new_tokens=max(MAX_NEW), block=BLOCK, batch=len(PROMPTS))
    return list(b.roomy) if mode == "roomy" else [max(lo + 4096, hi // 8) for lo, hi in zip(b.min, b.roomy)]


@pytest.mark.parametrize("gpus", [1, 2])
@pytest.mark.parametrize("mode", ["roomy", "tight", "disk"])
def test_a_ragged_batch_gives_each_prompt_its_own_greedy_tokens_and_logits(ckpt, free, gpus, mode):
    path, hf = ckpt
    stop = free[1][3]  # a token greedy decoding reaches in the second sequence
    want = [until(f, {stop, 2}) for f in free]  # 2: the checkpoint's end of sequence
    assert want[1][-1] == stop
    finished: list[int] = []
    cap = capacity(path, gpus, "roomy" if mode == "roomy" else "tight")
    host = 0 if mode == "disk" else None  # no host store: the offloads go to the spill file
    with LlamaModel(path, gpus=gpus, capacity=cap, host_capacity=host, block=BLOCK, engine="local") as m:
        logits = m.prefill_batch(PROMPTS)
        for row, p in zip(logits, PROMPTS):
            assert rel_err(row, last_logits(hf, p)) <= 1e-4
        g = m.run_generate_batch(
            PROMPTS,
            MAX_NEW,
            sampling=SamplingParams(stop_ids=(stop,)),
            on_finish=lambda s: finished.append(s.index),
        )
        assert [s.new_ids for s in g.sequences] == want
        assert [s.finish_reason for s in g.sequences] == [
            "stop" if w[-1] in (stop, 2) else "length" for w in want
        ]
        assert sorted(finished) == [0, 1, 2] and [s.prompt_ids for s in g.sequences] == PROMPTS
        moved = sum(p["bytes_reloaded"] for p in m.plans)
        assert (moved > 0) == (mode != "roomy"), m.plans  # the tight plans really reload
        assert (sum(p["bytes_offloaded_disk"] for p in m.plans) > 0) == (mode == "disk")
        assert len(g.bytes_loaded) == len(g.decode_s) == max(map(len, want)) - 1


@pytest.mark.ray
@pytest.mark.parametrize("gpus, mode", [(2, "tight"), (1, "roomy")])
def test_the_ray_engine_gives_the_same_batch(ckpt, free, pool, gpus, mode):  # noqa: F811
    path, hf = ckpt
    stop, k = own_stop(free)
    cap = capacity(path, gpus, mode)
    with LlamaModel(path, gpus=gpus, capacity=cap, block=BLOCK, engine="ray", pool=pool) as m:
        before = pool.state_count()
        for row, p in zip(m.prefill_batch(PROMPTS), PROMPTS):
            assert rel_err(row, last_logits(hf, p)) <= 1e-4
        assert m.generate(PROMPTS, MAX_NEW, stop_at_eos=False) == free
        own = m.generate(PROMPTS, MAX_NEW, stop_ids=[[], [], [stop]], stop_at_eos=False)
        assert own == [free[0], free[1], free[2][:k]]
        assert pool.state_count() == before  # the batch's KV cache is gone with it
        assert (sum(p["bytes_reloaded"] for p in m.plans) > 0) == (mode == "tight")


def test_finished_sequences_free_their_states_and_plans_are_reused(ckpt, free):
    path, _ = ckpt
    counts: list[tuple[int, int]] = []  # (the longest sequence's new tokens, the workers' states)
    with LlamaModel(path, capacity=1 << 24, block=BLOCK, engine="local") as m:

        def seen(i: int, _t: int) -> None:
            if i == 2:
                counts.append((len(counts), sum(m.pool.state_count())))

        g = m.run_generate_batch(PROMPTS, [1, 2, 7], stop_at_eos=False, on_token=seen)
        assert [s.new_ids for s in g.sequences] == [f[:n] for f, n in zip(free, [1, 2, 7])]
        assert g.rows == [2, 1, 1, 1, 1, 1]  # 3 live rows padded to 4, then compacted at 2 and 1
        per = 2 * 2  # states per row and block: layers x (k, v)
        # after the prefill (4 rows, 18 blocks), then after each step: its rows x its cache blocks
        assert [c for _, c in counts] == [4 * 18 * per, 2 * 19 * per] + [19 * per] * 3 + [20 * per] * 2
        assert m.pool.state_count() == [0]
        plans = len(m.plans)
        again = m.run_generate_batch(PROMPTS, [1, 2, 7], stop_at_eos=False)
        assert [s.new_ids for s in again.sequences] == [s.new_ids for s in g.sequences]
        assert len(m.plans) == plans and again.plans_made == 0


def own_stop(free: list[list[int]]) -> tuple[int, int]:
    """A token sequence 2 makes that sequence 0 makes too (and must go past) and sequence 1
    never, and how many tokens sequence 2 has with it."""
    stop = next(t for t in free[2] if t in free[0][:-1] and t not in free[1])
    return stop, free[2].index(stop) + 1


def test_a_sequences_own_stop_id_ends_it_alone_and_frees_its_row(ckpt, free):
    path, _ = ckpt
    stop, k = own_stop(free)
    lengths = [len(free[0]), len(free[1]), k]
    counts: list[int] = []  # the workers' states at each token of the longest sequence
    with LlamaModel(path, capacity=1 << 24, block=BLOCK, engine="local") as m:

        def seen(i: int, _t: int) -> None:
            if i == 1:
                counts.append(sum(m.pool.state_count()))

        g = m.run_generate_batch(
            PROMPTS, MAX_NEW, stop_ids=[[], [], [stop]], stop_at_eos=False, on_token=seen
        )
    assert [s.new_ids for s in g.sequences] == [free[0], free[1], free[2][:k]]
    assert [s.finish_reason for s in g.sequences] == ["length", "length", "stop"]
    # decode step j runs the sequences with more than j tokens, rows rounded up to a power of two
    rows = [1 << (sum(n > j for n in lengths) - 1).bit_length() for j in range(1, max(lengths))]
    assert g.rows == rows and rows[k - 1] < rows[k - 2]  # sequence 2's row went at its stop
    per = 2 * 2  # states per row and block: layers x (k, v)
    blocks = [(72 + j - 1) // BLOCK + 1 for j in range(1, max(lengths))]  # prompts fill 72 indices
    assert counts == [4 * 18 * per] + [r * b * per for r, b in zip(rows, blocks)]


def test_indices_make_a_sequences_samples_independent_of_the_calls_it_is_split_into(ckpt):
    path, _ = ckpt
    params = SamplingParams(do_sample=True, temperature=1.5, seed=3)
    with LlamaModel(path, capacity=1 << 24, block=BLOCK, engine="local") as m:

        def new(prompts, **kw) -> list[list[int]]:
            g = m.run_generate_batch(prompts, 6, sampling=params, stop_at_eos=False, **kw)
            return [s.new_ids for s in g.sequences]

        whole = new(PROMPTS)
        assert new(PROMPTS[:1], indices=[0]) + new(PROMPTS[1:], indices=[1, 2]) == whole
        assert new(PROMPTS[::-1], indices=[2, 1, 0]) == whole[::-1]
        assert new(PROMPTS[1:]) != whole[1:]  # by default a call counts its own prompts from 0
        assert m.generate(PROMPTS[2], 6, sampling=params, indices=[2], stop_at_eos=False) == whole[2]


def test_sampled_tokens_of_a_sequence_do_not_depend_on_its_batch(ckpt):
    path, _ = ckpt
    params = SamplingParams(do_sample=True, temperature=1.5, top_k=40, top_p=0.95, seed=7)
    with LlamaModel(path, capacity=1 << 24, block=BLOCK, engine="local") as m:
        batch = m.run_generate_batch(PROMPTS, 8, sampling=params, stop_at_eos=False)
        alone = m.run_generate_batch(PROMPTS[:1], 8, sampling=params, stop_at_eos=False)
        # the others finish early: sequence 2 moves from row 2 to row 0, its stream stays its own
        moved = m.run_generate_batch(PROMPTS, [1, 2, 8], sampling=params, stop_at_eos=False)
        other = m.run_generate_batch(
            PROMPTS[:1], 8, sampling=SamplingParams(**{**_fields(params), "seed": 8})
        )
    assert moved.rows[-1] == 1
    assert alone.sequences[0].new_ids == batch.sequences[0].new_ids
    assert moved.sequences[2].new_ids == batch.sequences[2].new_ids
    assert [s.new_ids for s in moved.sequences[:2]] == [
        batch.sequences[0].new_ids[:1],
        batch.sequences[1].new_ids[:2],
    ]
    assert other.sequences[0].new_ids != batch.sequences[0].new_ids  # the seed matters


def _fields(p: SamplingParams) -> dict:
    return {f: getattr(p, f) for f in p.__slots__}  # type: ignore[attr-defined]


def test_micro_batches_give_the_same_tokens_and_load_each_weight_once_per_step(ckpt, free):
    path, _ = ckpt
    prompts = [*PROMPTS, PROMPTS[0][::-1]]  # 4 live rows: 2 micro-batches of 2
    ck = Checkpoint(path)
    step = batch_decode_graph(ck, 1, 4, 19, BLOCK, micro=2).taskgraph
    lo, hi = min_capacity(step)[0], roomy_capacity(step)[0]
    # a quarter of the way from the least capacity to room for everything
    cap = max(
        lo + (hi - lo) // 4, min_capacity(batch_prefill_graph(ck, 1, 4, 18, BLOCK, tile=16).taskgraph)[0]
    )
    with LlamaModel(path, capacity=cap, block=BLOCK, engine="local") as m:
        one = m.run_generate_batch(prompts, [*MAX_NEW, 3], stop_at_eos=False, micro=1)
        two = m.run_generate_batch(prompts, [*MAX_NEW, 3], stop_at_eos=False, micro=2)
        assert [s.new_ids for s in two.sequences] == [s.new_ids for s in one.sequences]
        assert [s.new_ids for s in one.sequences][:3] == free
        assert two.micro == 2
        _, prog = m._program(("batch_decode", 4, 19, 2))
        tg, mg = prog.tg, prog.mg
        weights = {v.id for v in tg.vertices.values() if v.source is not None}
        loads: dict[str, int] = {}
        for v in mg:
            if v.kind in (MKind.INPUT, MKind.RELOAD) and v.value in weights:
                loads[v.value] = loads.get(v.value, 0) + 1
        assert cap < hi  # no room for every tensor of the step at once
        assert set(loads) == weights and set(loads.values()) == {1}, loads


@pytest.mark.parametrize("how", ["resize", "budget-file"])
def test_the_plans_choose_the_micro_batches_again_when_the_capacity_shrinks_mid_generation(
    ckpt, free, tmp_path, how
):
    """micro="auto": at room for the whole step one micro-batch moves the fewest bytes; the
    capacity cut between steps (a resize from on_token, or a budget file rewritten then, which
    the model polls between steps as --budget-file does) makes the next step choose again."""
    import os

    from disco_ray.driver.elastic import BudgetFile

    path, _ = ckpt
    step = batch_decode_graph(Checkpoint(path), 1, 4, 19, BLOCK).taskgraph
    lo, hi = min_capacity(step)[0], roomy_capacity(step)[0]
    tight = lo + (hi - lo) // 10  # one micro-batch reloads here, two or four share the loads
    roomy = capacity(path, 1, "roomy")[0]
    budget = tmp_path / "budget"
    budget.write_text(str(roomy))
    seen: list[int] = []
    with LlamaModel(path, capacity=roomy, block=BLOCK, engine="local") as m:
        if how == "budget-file":
            m.watch(BudgetFile(str(budget)))

        def cut(_s: int, t: int) -> None:
            seen.append(t)
            if len(seen) == 2 * len(PROMPTS):  # the prefill's tokens and the first step's
                if how == "resize":
                    m.resize(tight)
                else:
                    mtime = budget.stat().st_mtime_ns
                    budget.write_text(str(tight))
                    os.utime(budget, ns=(mtime + 10**9, mtime + 10**9))  # a change whatever the clock

        # one step per call: a new capacity takes effect at the next call, here the next step
        g = m.run_generate_batch(PROMPTS, MAX_NEW, stop_at_eos=False, on_token=cut, steps_per_call=1)
        assert [s.new_ids for s in g.sequences] == free
        assert g.micro == 1 and g.micros[0] == 1 and g.rows[1] == 4
        assert g.micros[1] > 1, g.micros  # chosen again at the new capacity
        chosen = {(c["capacity"][0], c["rows"], c["micro"]) for c in m.micro_choices}
        assert (tight, 4, g.micros[1]) in chosen
        assert g.statistics()["micro_per_step"] == g.micros
        assert [r["capacity"][0] for r in m.resizes][-1] == tight
        m.watch(None)
        m.resize(roomy)  # back to room for everything: one micro-batch
        assert m.choose_micro("batch_decode", 4, 19) == 1


def test_one_prompt_keeps_its_api_and_a_batch_of_one_agrees(ckpt, free):
    path, _ = ckpt
    with LlamaModel(path, capacity=1 << 24, block=BLOCK, engine="local") as m:
        assert m.generate(PROMPTS[1], 9, stop_at_eos=False) == free[1]
        assert m.generate([PROMPTS[1]], [9], stop_at_eos=False) == [free[1]]
        assert m.generate(PROMPTS[1], 9, stop_ids=[free[1][2]]) == until(free[1], {free[1][2], 2})


def test_the_batch_bookkeeping_pads_finished_rows_and_compacts_at_powers_of_two():
    from disco_ray.models.batch import BatchRows
    from disco_ray.models.sampling import FinishReason

    book = BatchRows([0, 1, 3, 2, 5, 4], SamplingParams(stop_ids=(9,)))
    assert book.rows == [1, 2, 3, 4, 5, None, None, None] and book.done == {0: FinishReason.LENGTH}
    assert book.advance([7, 7, 7, 7, 7]) == [(1, 7, FinishReason.LENGTH)] + [
        (s, 7, None) for s in (2, 3, 4, 5)
    ]
    assert book.compaction() == [1, 2, 3, 4]  # 4 live rows fit in 4: rows 1..4 become 0..3
    assert book.rows == [2, 3, 4, 5] and book.tokens() == [7, 7, 7, 7]
    assert book.advance([1, 9, 2, 3]) == [(2, 1, None), (3, 9, FinishReason.STOP), (4, 2, None), (5, 3, None)]
    assert book.compaction() is None and book.rows == [2, None, 4, 5]  # 3 live rows: padded to 4
    assert book.tokens() == [1, 0, 2, 3]
    assert book.advance([4, 4, 4])[0] == (2, 4, FinishReason.LENGTH)
    assert book.compaction() == [2, 3] and book.rows == [4, 5]
    book.advance([5, 9])
    assert book.compaction() == [0] and book.rows == [4] and book.done[5] is FinishReason.STOP
    book.advance([6])
    assert book.live() == [] and book.new[4] == [7, 2, 4, 5, 6] and book.compaction() is None
    # a sequence's own stop ids join the request's, for it alone
    book = BatchRows([3, 3], SamplingParams(stop_ids=(9,)), [[5], []])
    assert book.advance([5, 5]) == [(0, 5, FinishReason.STOP), (1, 5, None)]
    assert book.advance([9]) == [(1, 9, FinishReason.STOP)]


@pytest.mark.parametrize(
    "prompts, new, kw, message",
    [
        ([[1, 2], []], 3, {}, "sequence 1: the prompt has no token ids"),
        ([[1, 2], [3, 128]], 3, {}, "sequence 1: token id 128 is outside the vocabulary 0..127"),
        ([[1, -1]], 3, {}, "sequence 0: token id -1 is outside"),
        ([[1, 2]], -1, {}, "sequence 0: max_new_tokens must be an integer >= 0, got -1"),
        ([[1, 2], [3]], [1], {}, "max_new_tokens has 1 entries for 2 prompts"),
        ([], 1, {}, "prompts must be a non-empty list"),
        ([[1], [2]], 3, {"stop_ids": [[5]]}, "stop_ids has 1 entries for 2 prompts"),
        ([[1], [2]], 3, {"stop_ids": [[], [7, 128]]}, "sequence 1: stop id 128 is outside the vocabulary"),
        ([[1], [2]], 3, {"stop_ids": [[], 7]}, "sequence 1: its stop ids must be a list of token ids"),
        ([[1], [2]], 3, {"stop_ids": [[True], []]}, "sequence 0: stop id True is not an integer"),
        ([[1], [2]], 3, {"indices": [4]}, "indices has 1 entries for 2 prompts"),
        ([[1], [2]], 3, {"indices": [4, -1]}, "sequence 1: index -1 is not an integer >= 0"),
        ([[1], [2], [3]], 3, {"indices": [4, 0, 4]}, "sequences 0 and 2 have the same index 4"),
    ],
)
def test_bad_input_is_one_usage_error_naming_it(ckpt, prompts, new, kw, message):
    path, _ = ckpt
    with LlamaModel(path, capacity=1 << 24, block=BLOCK, engine="local") as m:
        with pytest.raises(UsageError, match=message.replace("(", r"\(")):
            m.run_generate_batch(prompts, new, **kw)
        with pytest.raises(UsageError, match="top_p must be in"):
            m.run_generate_batch([[1]], 1, sampling=SamplingParams(do_sample=True, top_p=0.0))
        assert m.plans == []  # refused before anything was planned


def test_one_row_in_one_micro_batch_is_the_single_sequence_decode_graph_with_spans(ckpt):
    """micro=1 and one row: the same kernels in the same order as the one-sequence decode step,
    but for the attention that reads the row's span; micro=2 keeps one weight input per weight."""
    from workloads.llm.model import decode_graph

    ck = Checkpoint(ckpt[0])
    one = decode_graph(ck, 2, 3, BLOCK).taskgraph
    row = batch_decode_graph(ck, 2, 1, 3, BLOCK).taskgraph

    def kernels(tg):
        return [v.op for v in tg.vertices.values() if v.op is not None]

    assert kernels(row) == [{"attention_at": "attention_span"}.get(op, op) for op in kernels(one)]
    states = [v for v in row.vertices.values() if v.state]
    assert len(states) == sum(v.state for v in one.vertices.values())
    two = batch_decode_graph(ck, 2, 4, 3, BLOCK, micro=2)
    sourced = [v.id for v in two.taskgraph.vertices.values() if v.source is not None]
    assert sorted(sourced) == sorted(v.id for v in one.vertices.values() if v.source is not None)
    assert sorted(two.order) == sorted(two.taskgraph.vertices)  # the zig-zag order holds every vertex
