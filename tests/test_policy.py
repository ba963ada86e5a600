"""The batch policy search (disco_ray.bench.policy) on a tiny decode-like graph: only properties that
must hold, each prediction the simulator's under a device profile (deterministic, no wall clock)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from disco_ray.bench import policy, profiles
from disco_ray.bench.policy import Candidate, choose, search
from disco_ray.bench.simulate import simulate
from disco_ray.graph import sources
from disco_ray.graph.errors import CapacityError, RunError, UsageError
from disco_ray.graph.taskgraph import TaskGraph
from planner import build_memgraph, min_capacity
from workloads.llm.checkpoint import Checkpoint
from workloads.llm.model import decode_graph

D, LAYERS, CACHE = 32, 3, 16  # hidden size, layers, cached positions per sequence


def step_graph(batch: int, micro: int) -> TaskGraph:
    """One decode step of `batch` rows in `micro` groups: per layer a shared weight [D, D], then each
    group's rows against that group's own cache (states whose size grows with the group)."""
    if batch % micro:
        raise UsageError(f"micro {micro} does not divide batch {batch}")
    r = batch // micro
    g = TaskGraph(1)
    xs = [g.input(f"x{m}", (r, D)) for m in range(micro)]
    for li in range(LAYERS):
        w = g.input(f"w{li}", (D, D))
        for m in range(micro):
            h = g.matmul(xs[m], w, id=f"h{li}.{m}")
            kt = g.input(f"kt{li}.{m}", (D, r * CACHE), state=True)
            v = g.input(f"v{li}.{m}", (r * CACHE, D), state=True)
            a = g.matmul(h, kt, id=f"a{li}.{m}")
            xs[m] = g.matmul(a, v, id=f"o{li}.{m}")
    g.output(*xs)
    return g


BATCHES, MICROS = (1, 2, 4, 8), (1, 2, 4)
COST = profiles.t4


def need(batch: int, micro: int) -> int:
    return min_capacity(step_graph(batch, micro))[0]


@pytest.fixture(scope="module")
def roomy() -> policy.Policy:
    return search(step_graph, 1 << 30, cost=COST, batches=BATCHES, micros=MICROS)


def test_choice_maximises_the_prediction(roomy):
    fitting = [c for c in roomy.candidates if c.fits]
    assert len(fitting) == sum(1 for b in BATCHES for m in MICROS if m <= b and not b % m)
    best = max(c.tokens_per_s for c in fitting)
    assert roomy.tokens_per_s == best
    assert roomy.tokens_per_s == pytest.approx(roomy.batch / roomy.step_s)
    # the table's figures are the simulator's for that plan, not invented
    c = next(c for c in fitting if (c.batch, c.micro) == (roomy.batch, roomy.micro))
    tg = step_graph(c.batch, c.micro)
    mg = build_memgraph(tg, [1 << 30], order=list(tg.vertices))
    assert c.step_s == simulate(mg, tg, COST).makespan
    # sharing a weight load pays: the roomy choice is not one row per step
    assert roomy.batch > 1


def test_a_graph_the_builder_refuses_is_excluded_with_its_message(roomy):
    got = search(step_graph, 1 << 30, cost=COST, batches=(2, 3), micros=(1, 2, 4))
    assert [(c.batch, c.micro) for c in got.candidates] == [(2, 1), (2, 2), (3, 1), (3, 2)]
    odd = got.candidates[3]
    assert not odd.fits and odd.excluded == "micro 2 does not divide batch 3"
    assert all(c.micro <= c.batch for c in roomy.candidates)


def test_a_capacity_too_small_for_a_batch_excludes_it():
    micros = (1, 2)
    cap = min(need(8, m) for m in micros) - 1  # below every split of batch 8
    assert cap >= min(need(4, m) for m in micros)  # while batch 4 fits in some split
    got = search(step_graph, cap, cost=COST, batches=BATCHES, micros=micros)
    eight = [c for c in got.candidates if c.batch == 8]
    assert len(eight) == 2 and not any(c.fits for c in eight)
    assert all("largest vertex needs" in c.excluded for c in eight)
    assert got.batch < 8 and any(c.fits for c in got.candidates if c.batch == 4)


def test_micro_batches_let_a_batch_fit():
    cap = need(8, 2)  # room for half of batch 8's rows at once, not for all of them
    assert cap < need(8, 1)
    got = search(step_graph, cap, cost=COST, batches=(8,), micros=(1, 2))
    one, two = got.candidates
    assert not one.fits and two.fits
    assert (got.batch, got.micro) == (8, 2)


def test_a_pair_whose_prefill_does_not_plan_is_excluded():
    def prefill(b, m):  # twice the rows of the step, as a prompt's tokens outnumber a step's
        return step_graph(2 * b, m)

    cap = need(8, 1)  # the whole step of batch 8 fits, its prefill only in two micro-batches
    assert need(16, 1) > cap >= need(16, 2)
    got = search(step_graph, cap, cost=COST, batches=(8,), micros=(1, 2), prefill=prefill)
    one, two = got.candidates
    assert not one.fits and "its prefill's largest vertex needs" in one.excluded
    assert two.fits and (got.batch, got.micro) == (8, 2)


def test_a_smaller_capacity_never_chooses_a_larger_batch():
    # a cost that does not depend on the plan (one weight load per step, and per-row work), so
    # the capacity decides only which candidates fit: the choice can only move down with it
    def cost(tg, mg):
        rows = sum(tg[x].shape[0] for x in tg.outputs)
        return 1.0 + 0.1 * rows

    caps = sorted({need(b, m) for b in BATCHES for m in (1,)}, reverse=True)
    chosen = [search(step_graph, c, cost=cost, batches=BATCHES, micros=(1,)).batch for c in caps]
    assert chosen == sorted(chosen, reverse=True)
    assert chosen[0] == max(BATCHES) and len(set(chosen)) > 2


def test_choosing_again_at_a_new_capacity_is_a_call_with_it(roomy):
    small = need(2, 1)
    again = search(step_graph, small, cost=COST, batches=BATCHES, micros=MICROS)
    assert again.batch < roomy.batch
    assert search(step_graph, small, cost=COST, batches=BATCHES, micros=MICROS) == again


def test_host_memory_excludes_what_the_host_cannot_keep():
    held = policy.host_bytes(step_graph(4, 1))[0]
    got = search(step_graph, 1 << 30, cost=COST, batches=BATCHES, micros=(1,), host_memory=held)
    assert got.batch < 8 and any(c.fits for c in got.candidates if c.batch == 4)
    eight = next(c for c in got.candidates if c.batch == 8)
    assert not eight.fits and "host memory" in eight.excluded


def test_nothing_fits_is_one_capacity_error():
    with pytest.raises(CapacityError, match="no batch plans within the capacity"):
        search(step_graph, 64, cost=COST, batches=(1, 2), micros=(1,))
    with pytest.raises(UsageError, match="no \\(batch, micro\\) pair"):
        search(step_graph, 1 << 30, cost=COST, batches=(1,), micros=(2,))


def test_choose_breaks_ties_toward_less_memory():
    cands = [Candidate(4, 2, 2.0), Candidate(2, 1, 1.0), Candidate(4, 1, 2.0), Candidate(8, 1, excluded="x")]
    best = choose(cands)
    assert (best.batch, best.micro) == (2, 1)
    assert "*" in best.table().splitlines()[2] and "x" in best.table().splitlines()[-1]


# ---- a config-only checkpoint: the decode graph of a model with no weights on disk -------------

TINY = dict(
    model_type="llama",
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=False,
)


def test_a_config_only_checkpoint_says_what_a_saved_one_holds(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = {k: v for k, v in TINY.items() if k != "model_type"}
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg))
    model.save_pretrained(tmp_path)
    saved = Checkpoint(tmp_path)
    virtual = Checkpoint.from_config(json.loads((tmp_path / "config.json").read_text()))
    assert virtual.config == dataclasses.replace(saved.config, eos=virtual.config.eos)  # no generation_config
    assert {k: s for k, (_, s, _) in virtual.tensors.items()} == {
        k: s for k, (_, s, _) in saved.tensors.items()
    }
    assert virtual.parameters() == saved.parameters() == sum(p.numel() for p in model.parameters())
    half = Checkpoint.from_config(dict(TINY), "float16")
    assert half.config.dtype == "float16" and half.tensors.keys() == saved.tensors.keys()
    assert {dt for _, _, dt in half.tensors.values()} == {"float16"}
    assert half.weight_bytes() * 2 == saved.weight_bytes()


def test_a_config_only_checkpoint_refuses_to_be_read():
    ck = Checkpoint.from_config(dict(TINY))
    name, (_, shape, dtype) = next(iter(ck.tensors.items()))
    with pytest.raises(RunError, match="config-only checkpoint has no weights to read"):
        sources.read(ck.source(name), shape, dtype, where="embed_g0")
    with pytest.raises(UsageError, match="hidden_act 'gelu' is not supported"):
        Checkpoint.from_config(dict(TINY, hidden_act="gelu"))


def test_a_config_only_decode_step_plans_and_simulates():
    ck = Checkpoint.from_config(dict(TINY), "float16")
    tg = decode_graph(ck, 1, 2, 8).taskgraph
    weights = [v for v in tg if v.source is not None]
    assert weights and all(v.dtype == "float16" for v in weights)
    got = search(lambda b, m: tg, 1 << 30, cost=COST, batches=(1,), micros=(1,))
    assert got.step_s > 0 and got.candidates[0].loaded >= sum(v.nbytes for v in weights)


# ---- `disco-ray generate --batch auto` ------------------------------------------------------------


def test_auto_chooses_again_when_the_capacity_changed():
    from types import SimpleNamespace

    from disco_ray.cli.batches import _Auto
    from disco_ray.cli.prompts import Request

    ck = Checkpoint.from_config(dict(TINY))
    model = SimpleNamespace(
        ck=ck, gpus=1, capacity=1 << 30, block=4, dtype="float32", tile=16, host_capacity=None, resizes=[]
    )
    model.capacity_limit = lambda: model.capacity  # a capacity given as a size: the limit is it
    args = SimpleNamespace(policy_profile="t4", backend="cpu", streams=5)
    reqs = [Request(i, i + 1, tuple(range(1, 9)), 4) for i in range(8)]
    auto = _Auto(args)
    batch = auto.choose(model, reqs, 0)  # the batch size; the steps choose their micro-batches
    first = (batch, auto.chosen[-1]["micro"])  # and the micro-batches the policy predicted with
    kw = dict(gpus=1, prompt=8, new_tokens=4, cost=COST, block=4, dtype="float32", tile=16)
    roomy = policy.for_checkpoint(ck, capacity=1 << 30, batches=(1, 2, 4, 8), **kw)
    assert first == (roomy.batch, roomy.micro) and first[0] > 1
    assert auto.choose(model, reqs, 8) == batch and len(auto.chosen) == 1  # no change, no search
    model.capacity = pair_need(ck, *first) - 1  # the roomy choice no longer fits
    model.resizes.append({"capacity": [model.capacity]})
    again = (auto.choose(model, reqs, 8), auto.chosen[-1]["micro"])
    small = policy.for_checkpoint(ck, capacity=model.capacity, batches=(1, 2, 4, 8), **kw)
    assert again == (small.batch, small.micro) and again != first
    assert not next(c for c in small.candidates if (c.batch, c.micro) == first).fits
    assert [c["first"] for c in auto.chosen] == [0, 8] and auto.chosen[1]["capacity"] == model.capacity
    assert auto.predicted()["predicted_tokens_per_s"] == round(small.tokens_per_s, 3)


def pair_need(ck: Checkpoint, batch: int, micro: int) -> int:
    """The least arena in which both the batch's decode step (8 + 4 tokens, blocks of 4) and its
    prefill have room for their largest vertex."""
    from workloads.llm.batch import batch_decode_graph, batch_prefill_graph

    dec = batch_decode_graph(ck, 1, batch, 3, 4, dtype="float32", micro=micro).taskgraph
    pre = batch_prefill_graph(ck, 1, batch, 2, 4, dtype="float32", micro=micro, tile=16).taskgraph
    return max(min_capacity(dec)[0], min_capacity(pre)[0])


def test_generate_batch_auto_runs_the_choice_and_reports_it_beside_the_measured(tmp_path, capsys):
    pytest.importorskip("transformers")
    from disco_ray.cli.app import main
    from tests.test_models import expected, make_checkpoint

    hf = make_checkpoint(tmp_path / "ck")
    prompts = [[5, 17, 3, 99, 42, 7, 8, 1, 60, 63], [9, 4], [33, 12, 77, 101, 6]]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"ids": p}) + "\n" for p in prompts))
    run = ["--capacity", "1MiB", "--engine", "local", "--block", "4", "--max-new-tokens", "4", "--ignore-eos"]
    args = ["generate", str(tmp_path / "ck"), "--prompts", str(tmp_path / "p.jsonl"), *run]
    code = main([*args, "--batch", "auto", "--policy-profile", "t4", "--stats", str(tmp_path / "s.json")])
    out, err = capsys.readouterr()
    assert code == 0, err
    got = sorted((json.loads(ln) for ln in out.splitlines()), key=lambda d: d["index"])
    assert [d["new_ids"] for d in got] == [expected(hf, p, 4)[1] for p in prompts]
    doc = json.loads((tmp_path / "s.json").read_text())
    (chosen,) = doc["policy"]
    assert chosen["profile"] == "t4" and chosen["batch"] in (1, 2, 4) and chosen["predicted_tokens_per_s"] > 0
    assert doc["batch"] == chosen["batch"]
    # each step's micro-batches, the plans' choice, beside the policy's prediction and the measured
    assert all(len(b["micro_per_step"]) == b["decode_steps"] for b in doc["batches"])
    ran = {m for b in doc["batches"] for m in [b["micro"], *b["micro_per_step"]]}
    assert doc["micro"] == sorted(ran) == [1]  # 1MiB has room for every step at once
    assert all(b["predicted_step_ms"] == chosen["predicted_step_ms"] and b["step_ms"] for b in doc["batches"])
    # the cpu backend's default cost model: this machine measured at start
    code = main([*args, "--batch", "auto", "--stats", str(tmp_path / "s.json")])
    out, err = capsys.readouterr()
    assert code == 0, err
    got = sorted((json.loads(ln) for ln in out.splitlines()), key=lambda d: d["index"])
    assert [d["new_ids"] for d in got] == [expected(hf, p, 4)[1] for p in prompts]
    assert json.loads((tmp_path / "s.json").read_text())["policy"][0]["profile"] == "cpu"
    for bad, message in (
        (["--batch", "2", "--policy-profile", "t4"], "--policy-profile takes --batch auto"),
        (["--batch", "auto", "--policy-profile", "x9"], "unknown device profile 'x9'"),
    ):
        assert main([*args, *bad]) == 2
        assert message in capsys.readouterr().err
