"""Mixtral (MixtralForCausalLM) against transformers, and its experts as conditional vertices:
a decode step loads and runs only the experts its token routed to (docs/FORMATS.md,
"Conditional vertices"), read from the run statistics."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from disco_ray.driver.api import run_memgraph  # noqa: E402
from disco_ray.graph.errors import GraphError, RunError, UsageError  # noqa: E402
from disco_ray.graph.memgraph import Edges, MemGraph, edge_columns  # noqa: E402
from disco_ray.graph.taskgraph import TaskGraph  # noqa: E402
from disco_ray.models import LlamaModel  # noqa: E402
from planner import build_memgraph, min_capacity, roomy_capacity  # noqa: E402
from planner.symbolic import check_random_orders  # noqa: E402
from planner.verify import check, verify  # noqa: E402
from tests import family_oracle as oracle  # noqa: E402
from tests.ray_fixtures import pool  # noqa: E402, F401  (module fixture for the ray test)
from workloads.llm.checkpoint import Checkpoint  # noqa: E402
from workloads.llm.lora import default_targets  # noqa: E402
from workloads.llm.model import decode_graph  # noqa: E402
from workloads.llm.train import LoraSpec, OptimSpec, train_graph  # noqa: E402

EXPERTS, TOP_K = 4, 2
CFG = dict(num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, intermediate_size=32)


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixtral")
    return str(path), oracle.save("MixtralForCausalLM", path, **CFG)


@pytest.mark.parametrize("gpus, mode", [(1, "roomy"), (2, "tight")])
def test_tokens_equal_transformers(mixtral, gpus, mode):
    path, hf = mixtral
    oracle.check_generate(path, hf, gpus, mode)


def test_the_ray_engine_generates_the_same_tokens(mixtral, pool):  # noqa: F811
    path, hf = mixtral
    oracle.check_generate(path, hf, 2, "roomy", new=4, engine="ray", pool=pool)


def test_a_ragged_batch(mixtral):
    path, hf = mixtral
    oracle.check_batch(path, hf, 1, "tight")


def _routed(hf, ids: list[int]) -> list[list[set[int]]]:
    """Per position of `ids`, per layer: the experts transformers' router picks."""
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_router_logits=True)
    return [
        [set(torch.topk(logits[p], TOP_K).indices.tolist()) for logits in out.router_logits]
        for p in range(len(ids))
    ]


@pytest.mark.parametrize("gpus, mode", [(1, "tight"), (2, "roomy")])
def test_a_decode_step_loads_only_the_routed_experts(mixtral, gpus, mode):
    """At batch 1 each decode step's expert loads (moved, or held in the arena from an earlier
    step) are the bytes of the experts its token routed to, the others' loads are skipped."""
    path, hf = mixtral
    ck = Checkpoint(path)
    per_expert = 3 * 32 * 64 * 4  # w1, w3, w2 of one expert, float32 (all GPUs' blocks together)
    new = 6
    cap = oracle.capacity(path, gpus, mode, len(oracle.PROMPT), new)
    steps: list[dict] = []
    with LlamaModel(path, gpus=gpus, capacity=cap, block=oracle.BLOCK, engine="local") as m:
        run = m._run

        def recorded(key, ids, pos, gen=None, timeout=None):
            out = run(key, ids, pos, gen, timeout)
            workers = m._program(key)[1].statistics()["engine"]["workers"]
            steps.append({k: sum(w["conditional"][k] for w in workers) for k in workers[0]["conditional"]})
            return out

        m._run = recorded
        tokens = m.generate(oracle.PROMPT, new, stop_at_eos=False)
    routed = _routed(hf, oracle.PROMPT + tokens)
    assert len(steps) == new
    for k, st in enumerate(steps[1:]):
        chosen = routed[len(oracle.PROMPT) + k]  # the position of the token this step fed in
        n = sum(len(c) for c in chosen)
        assert n < ck.config.layers * EXPERTS  # some expert unrouted: the check can fail
        assert st["load_bytes"] + st["held_bytes"] == n * per_expert, (k, st, chosen)
        assert st["skipped_bytes"] == (ck.config.layers * EXPERTS - n) * per_expert, (k, st, chosen)
        assert st["skipped"] >= (ck.config.layers * EXPERTS - n) * 8  # 3 loads + 5 kernels each


def _decode(path: str, gpus: int, tight: bool):
    ck = Checkpoint(path)
    mgr = decode_graph(ck, gpus, 3, oracle.BLOCK)
    tg = mgr.taskgraph
    lo, hi = min_capacity(tg), roomy_capacity(tg)
    cap = [max(a + 4096, b // 8) for a, b in zip(lo, hi)] if tight else hi
    return ck, mgr, tg, build_memgraph(tg, cap)


@pytest.mark.parametrize("gpus, tight", [(1, True), (2, False)])
def test_the_verifier_and_the_symbolic_executor_pass_a_conditional_plan(mixtral, gpus, tight):
    _, _, tg, mg = _decode(mixtral[0], gpus, tight)
    st = mg.stats["conditional"]
    assert st["vertices"] > 0 and st["unconditional"] == 0
    check(tg, mg)
    check_random_orders(tg, mg, 4, seed=3)
    # every conditional vertex comes after the writer of its flag, with an edge from it
    edges = set(zip(*(c.tolist() for c in edge_columns(mg.edges)[:2])))
    for v in mg.vertices:
        for u, n in v.when:
            assert u < v.id and (u, v.id) in edges and 0 <= n < EXPERTS
            assert mg.vertex(u).value.split(".")[-1].startswith("route")
    # planted: without the edges from the flag writers, the verifier names a conditional vertex
    u, w, mem = edge_columns(mg.edges)
    added = {(a, v.id) for v in mg.vertices for a, _ in v.when}
    keep = np.array([(a, b) not in added for a, b in zip(u.tolist(), w.tolist())], dtype=bool)
    cut = MemGraph(mg.capacity, mg.vertices, Edges(u[keep], w[keep], mem[keep]), mg.outputs, mg.host_capacity)
    assert any("its flag writer vertex" in m for m in verify(tg, cut))
    # the formats keep the conditions
    assert TaskGraph.from_dict(json.loads(json.dumps(tg.to_dict()))).vertices == tg.vertices
    again = MemGraph.from_dict(json.loads(json.dumps(mg.to_dict())))
    assert [v.when for v in again.vertices] == [v.when for v in mg.vertices]


def test_the_sanitizer_catches_a_missing_edge_in_a_conditional_plan(mixtral):
    ck, mgr, tg, mg = _decode(mixtral[0], 1, True)
    feed = mgr.feed(ck.config, [5], pos=9)
    run_memgraph(tg, mg, feed, engine="local", check=True)
    # plant: the last layer's combine loses every incoming edge, so it runs at once
    last = next(v.id for v in mg.vertices if v.value == f"d.l{ck.config.layers - 1}.moe_g0")
    u, w, mem = edge_columns(mg.edges)
    keep = w != last
    bad = MemGraph(mg.capacity, mg.vertices, Edges(u[keep], w[keep], mem[keep]), mg.outputs, mg.host_capacity)
    with pytest.raises(RunError, match=r"sanitizer: vertex \d+ \(kernel 'd\.l1\.moe_g0'\)"):
        run_memgraph(tg, bad, feed, engine="local", check=True, trusted=True)


def test_moe_ops_equal_transformers_block():
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    from disco_ray.graph.kernels import IMPLS

    cfg = transformers.MixtralConfig(
        hidden_size=16, intermediate_size=8, num_local_experts=5, num_experts_per_tok=2
    )
    torch.manual_seed(0)
    block = MixtralSparseMoeBlock(cfg).eval()
    for p in block.parameters():
        torch.nn.init.normal_(p)
    x = torch.randn(2, 16)  # 2 rows, top-2 of 5: some expert unrouted
    with torch.no_grad():
        want = block(x[None])[0]
    route = torch.empty(2, 5)
    IMPLS["moe_route"](route, [x @ block.gate.weight.T], {"top_k": 2})
    assert torch.allclose(route.sum(-1), torch.ones(2)) and ((route != 0).sum(-1) == 2).all()
    outs = []
    for n in range(5):
        gate, up = (x @ block.experts.gate_up_proj[n].T).chunk(2, dim=-1)
        outs.append((torch.nn.functional.silu(gate) * up) @ block.experts.down_proj[n].T)
    outs[next(n for n in range(5) if not (route[:, n] != 0).any())].fill_(float("nan"))  # unrouted: unread
    got = torch.empty(2, 16)
    IMPLS["moe_combine"](got, [route, *outs], {})
    assert torch.allclose(got, want, atol=1e-5)


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"sliding_window": 4}, "sliding_window 4 is not supported"),
        ({"router_jitter_noise": 0.1}, "router_jitter_noise 0.1 is not supported"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok 9 exceeds num_local_experts 4"),
        ({"num_local_experts": 3}, r"tensor '.*experts\.3\.w[123]\.weight' is not used"),
    ],
)
def test_what_is_not_built_is_refused_naming_it(mixtral, tmp_path, edit, message):
    import shutil

    shutil.copytree(mixtral[0], tmp_path / "ck")
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    (tmp_path / "ck" / "config.json").write_text(json.dumps(cfg | edit))
    with pytest.raises(UsageError, match=message):
        Checkpoint(tmp_path / "ck")


ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.fixture(scope="module")
def adapter(mixtral, tmp_path_factory):
    return oracle.random_adapter(mixtral[0], "MixtralForCausalLM", ATTENTION, tmp_path_factory.mktemp("ad"))


@pytest.mark.parametrize("gpus, mode", [(1, "roomy"), (2, "tight")])
def test_lora_on_the_attention_equals_peft(mixtral, adapter, gpus, mode):
    """The backward through the experts and the router's choice: losses and adapters equal to
    peft's after AdamW steps."""
    oracle.check_finetune(mixtral[0], "MixtralForCausalLM", ATTENTION, adapter, gpus, mode)


ALL = [*ATTENTION, "w1", "w2", "w3"]


@pytest.fixture(scope="module")
def expert_adapter(mixtral, tmp_path_factory):
    return oracle.random_adapter(mixtral[0], "MixtralForCausalLM", ALL, tmp_path_factory.mktemp("ad"))


@pytest.mark.parametrize("gpus, mode", [(1, "roomy"), (2, "tight")])  # the others: the unrouted test
def test_lora_on_the_experts_equals_peft(mixtral, expert_adapter, gpus, mode):
    """Each expert's own adapters on w1, w3 (peft's fused gate_up, rank 2r) and w2: losses and
    every adapter weight equal to peft's after three AdamW steps."""
    oracle.check_finetune(mixtral[0], "MixtralForCausalLM", ALL, expert_adapter, gpus, mode)


@pytest.fixture(scope="module")
def sparse(tmp_path_factory):
    """Eight experts, one per token: a 6-token step leaves some unrouted."""
    path = tmp_path_factory.mktemp("sparse")
    hf = oracle.save(
        "MixtralForCausalLM", path, num_local_experts=8, num_experts_per_tok=1, intermediate_size=32
    )
    ad = oracle.random_adapter(
        str(path), "MixtralForCausalLM", ["w1", "w2", "w3"], tmp_path_factory.mktemp("ad")
    )
    return str(path), hf, ad


@pytest.mark.parametrize("gpus, mode", [(1, "tight"), (2, "roomy")])
def test_an_unrouted_experts_adapter_steps_as_torch_does(sparse, gpus, mode, tmp_path):
    """An expert no token of a step routed to gets a zero gradient, and AdamW still steps its
    adapter from its moments (peft's one tensor per layer holds every expert's): equal to peft
    over steps whose routes differ; the saved adapter loads into peft."""
    path, hf, ad = sparse
    data = torch.randint(0, 128, (3, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():  # layer 0's routes do not depend on the (expert-only) adapter
        logits = hf(data, output_router_logits=True).router_logits[0].reshape(3, 6, -1)
    routed = [set(logits[k].argmax(-1).tolist()) for k in range(3)]
    assert routed[0] - routed[1] and len(routed[1]) < 8, routed  # routed at step 1, not at step 2
    oracle.check_finetune_rows(
        path, "MixtralForCausalLM", ["w1", "w2", "w3"], ad, gpus, mode, data, tmp_path / "out"
    )


def test_an_expert_adapter_with_other_patterns_is_refused(sparse, tmp_path):
    """peft's expert layout is read only with its own rank and alpha pattern, and only for a model
    with experts."""
    import shutil

    from disco_ray.models import adapter

    ad = sparse[2]
    dims = {"w1": (32, 64)}
    shutil.copytree(ad, tmp_path / "ad")
    cfg = json.loads((tmp_path / "ad" / adapter.CONFIG).read_text())
    with pytest.raises(UsageError, match=r"target_parameters .*: the model has no experts"):
        adapter.load(tmp_path / "ad", 2, dims, experts=0)
    (tmp_path / "ad" / adapter.CONFIG).write_text(
        json.dumps(cfg | {"rank_pattern": {r".*\.gate_up_proj": 3}})
    )
    with pytest.raises(UsageError, match=r"rank_pattern .* is not supported"):
        adapter.load(tmp_path / "ad", 2, dims, experts=8)


def test_expert_targets_are_all_or_none(mixtral):
    """The default targets are the attention's; w1 without w2 and w3 is refused by name."""
    ck = Checkpoint(mixtral[0])
    assert default_targets(ck.config) == ("q_proj", "k_proj", "v_proj")
    with pytest.raises(
        UsageError, match=r"target\(s\) w1 of model_type 'mixtral': the experts take adapters on all"
    ):
        train_graph(ck, 1, 1, 8, 4, LoraSpec(targets=("q_proj", "w1")), OptimSpec())


def test_the_route_gradient_equals_autograd():
    from disco_ray.graph.kernels import IMPLS

    torch.manual_seed(1)
    logits = torch.randn(5, EXPERTS, requires_grad=True)
    droute = torch.randn(5, EXPERTS)
    route = torch.empty(5, EXPERTS)
    IMPLS["moe_route"](route, [logits.detach()], {"top_k": TOP_K})
    p = torch.softmax(logits, -1)
    top, idx = torch.topk(p, TOP_K, -1)
    want = torch.zeros_like(p).scatter(-1, idx, top / top.sum(-1, keepdim=True))
    assert torch.equal(route, want.detach())
    (want * droute).sum().backward()
    got = torch.empty(5, EXPERTS)
    IMPLS["moe_route_grad"](got, [logits.detach(), droute], {"top_k": TOP_K})
    assert torch.allclose(got, logits.grad, atol=1e-6)


def test_a_flag_that_depends_on_its_conditional_vertex_is_refused():
    """A vertex conditional on a flag computed from it would wait for itself: refused when planned."""
    g = TaskGraph(1)
    x = g.input("x", (2, 4))
    w = g.input("w", (3, 4))
    route = g.kernel("moe_route", g.linear(x, w, id="logits"), id="route", top_k=1)
    g.condition("w", route, 0)
    with pytest.raises(
        GraphError, match=r"vertex 'w': conditional on flag\(s\) \['route'\], one of which depends on it"
    ):
        build_memgraph(g, 1 << 20)
    with pytest.raises(GraphError, match=r"index 3 out of range 0\.\.2"):
        g.condition("x", route, 3)
