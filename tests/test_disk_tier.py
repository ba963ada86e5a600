"""Memory tiers (issue 14): a host-store budget per GPU and the disk tier below it.

The planner sends offloads that do not fit the host budget to the GPU's spill file; the verifier
and the symbolic executor check disk ranges like host ranges (planted errors: overlapping disk
ranges, a reload before its offload, ranges over a capacity); workers write and read spill files
on lanes of their own, and the outputs stay those of the reference (local and ray engines, the
CUDA path on the stand-in device, the command line).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

from actors.tiers.diskio import ALIGN
from actors.tiers.spill import SpillFile
from disco_ray.driver.api import compile
from disco_ray.graph.errors import GraphError, VerifyError
from disco_ray.graph.memgraph import DISK, HOST, INPUT, Loc, MemGraph, MemVertex, MKind, Read
from disco_ray.graph.reference import evaluate, random_inputs
from planner import build_memgraph, tight_capacity
from planner.symbolic import check_random_orders
from planner.verify import verify
from tests.memgraph_helpers import replaced
from tests.test_verify import S, one_of
from workloads import build

SEED = 20261124
LLAMA = {"preset": "tiny", "layers": 4, "seq": 256, "tile": 64}  # offloads at 5% of its tensor bytes


@pytest.fixture(scope="module")
def llama():
    w = build("llama_prefill", **LLAMA)
    return w, tight_capacity(w.taskgraph, 0.05)


def offloads(mg: MemGraph, tier: int) -> list[MemVertex]:
    return [v for v in mg if v.kind is MKind.OFFLOAD and v.out.device == tier]


def disk_reloads(mg: MemGraph) -> list[MemVertex]:
    return [v for v in mg if v.kind is MKind.RELOAD and v.ins[0].loc.device == DISK]


# ---- the planner -------------------------------------------------------------------------------
def test_unbounded_host_never_spills(llama):
    w, cap = llama
    mg = build_memgraph(w.taskgraph, cap)
    assert offloads(mg, HOST) and not offloads(mg, DISK)
    assert mg.disk_capacity == [0, 0] and mg.stats["bytes_offloaded_disk"] == 0


def test_zero_host_budget_sends_every_offload_to_disk(llama):
    w, cap = llama
    tg = w.taskgraph
    mg = build_memgraph(tg, cap, host_capacity=0)
    assert not offloads(mg, HOST) and offloads(mg, DISK) and disk_reloads(mg)
    for v in offloads(mg, DISK):  # O_DIRECT: aligned offsets, within the spill file
        assert v.out.offset % ALIGN == 0 and v.out.end <= mg.disk_capacity[v.gpu]
    st = mg.stats
    assert st["bytes_offloaded_disk"] == st["bytes_offloaded"] > 0
    assert st["peak_host_bytes"] == [0, 0] and mg.host_capacity == [0, 0]
    assert all(p > 0 for p in st["peak_disk_bytes"]) and mg.disk_capacity == [
        max(v.out.end for v in offloads(mg, DISK) if v.gpu == g) for g in range(tg.gpus)
    ]
    assert verify(tg, mg) == []
    check_random_orders(tg, mg, 16, SEED)


def test_small_host_budget_uses_both_tiers_and_returns_to_host(llama):
    w, cap = llama
    tg = w.taskgraph
    budget = 32 << 10
    mg = build_memgraph(tg, cap, host_capacity=budget)
    host, disk = offloads(mg, HOST), offloads(mg, DISK)
    assert host and disk
    assert all(v.out.end <= budget for v in host) and max(mg.host_capacity) <= budget
    # host ranges free up again: some offload goes to the host after one went to disk
    assert any(h.id > d.id and h.gpu == d.gpu for h in host for d in disk)
    st = mg.stats
    assert st["bytes_offloaded"] == sum(v.out.nbytes for v in host + disk)
    assert st["bytes_offloaded_disk"] == sum(v.out.nbytes for v in disk)
    assert st["bytes_reloaded_disk"] == sum(v.out.nbytes for v in disk_reloads(mg))
    assert st["host_budget"] == [budget, budget]
    # the same offloads as without a budget (the same victims), only their tier differs
    free = build_memgraph(tg, cap)
    assert st["bytes_offloaded"] == free.stats["bytes_offloaded"]
    assert verify(tg, mg) == []
    check_random_orders(tg, mg, 16, SEED)
    again = MemGraph.from_dict(mg.to_dict())
    assert again == mg and again.to_dict()["devices"][0]["disk_capacity"] == mg.disk_capacity[0]


def test_host_capacity_forms(llama):
    w, cap = llama
    tg = w.taskgraph
    per_gpu = build_memgraph(tg, cap, host_capacity=[0, None])
    assert offloads(per_gpu, DISK) and all(v.gpu == 0 for v in offloads(per_gpu, DISK))
    assert any(v.gpu == 1 for v in offloads(per_gpu, HOST))
    as_dict = build_memgraph(tg, cap, host_capacity={0: 0})
    assert as_dict.to_dict() == {**per_gpu.to_dict(), "stats": as_dict.stats}
    with pytest.raises(GraphError, match="host capacity of gpu 0 must be >= 0"):
        build_memgraph(tg, cap, host_capacity=-1)
    with pytest.raises(GraphError, match="3 values for 2 GPUs"):
        build_memgraph(tg, cap, host_capacity=[1, 2, 3])


# ---- the verifier and the symbolic executor: planted errors ------------------------------------
def disk_graph():
    """tests/test_verify.py's offload_graph with y offloaded to disk instead of the host store."""
    from tests.test_verify import offload_graph

    tg, mg = offload_graph()
    disk = Loc(DISK, 0, S)
    vs = list(mg.vertices)
    vs[2] = dataclasses.replace(vs[2], out=disk)
    vs[4] = dataclasses.replace(vs[4], ins=(Read("y", 2, disk),))
    return tg, replaced(mg, vertices=vs, host_capacity=[0], disk_capacity=[ALIGN])


def test_disk_offload_graph_is_correct():
    tg, mg = disk_graph()
    assert verify(tg, mg) == []
    check_random_orders(tg, mg, 100, SEED)


def test_reload_from_disk_before_its_offload_is_caught():
    tg, mg = disk_graph()
    # the reload of y from disk (4) no longer waits for its offload (2), directly or through 3
    bad = replaced(mg, edges=[e for e in mg.edges if (e[0], e[1]) not in ((2, 4), (3, 4))])
    one_of(verify(tg, bad), "vertex 4", "disk(gpu:0)[0:1024]", "src vertex 2", "not an ancestor")
    with pytest.raises(VerifyError, match=r"vertex 4 .*expects 'y' from vertex 2 at disk\(gpu:0\)"):
        check_random_orders(tg, bad, 200, SEED)


def test_reload_of_another_gpus_spill_file_is_caught():
    tg, mg = disk_graph()
    vs = list(mg.vertices)
    vs[2] = dataclasses.replace(vs[2], gpu=1)  # written to gpu 1's spill file, read from gpu 0's
    bad = replaced(mg, vertices=vs, capacity=[3 * S, 3 * S])
    one_of(verify(tg, bad), "vertex 4", "src vertex 2", "wrote 'y' at disk(gpu:1)")


def test_overlapping_disk_ranges_are_caught(llama):
    w, cap = llama
    tg = w.taskgraph
    mg = build_memgraph(tg, cap, host_capacity=0)
    # two disk offloads on one GPU, the second written while the first still awaits a reload of it
    reloads = disk_reloads(mg)
    pair = next(
        (a, b)
        for a in offloads(mg, DISK)
        for b in offloads(mg, DISK)
        if a.gpu == b.gpu and a.id < b.id and any(r.ins[0].src == a.id and r.id > b.id for r in reloads)
    )
    a, b = pair
    moved = Loc(DISK, a.out.offset, b.out.nbytes)  # b's value now lands on a's range
    vs = [
        dataclasses.replace(v, out=moved)
        if v.id == b.id
        else dataclasses.replace(v, ins=(Read(v.value, b.id, moved),))
        if v.kind is MKind.RELOAD and v.ins[0].src == b.id
        else v
        for v in mg.vertices
    ]
    bad = replaced(mg, vertices=vs)
    one_of(verify(tg, bad), f"writes disk(gpu:{a.gpu})[{a.out.offset}:", f"written by {a.id}")
    with pytest.raises(VerifyError, match=rf"expects {a.value!r} from vertex {a.id} at disk\(gpu:{a.gpu}\)"):
        check_random_orders(tg, bad, 50, SEED)


def test_ranges_over_the_host_or_disk_capacity_are_caught(llama):
    w, cap = llama
    tg = w.taskgraph
    mg = build_memgraph(tg, cap, host_capacity=32 << 10)
    g = offloads(mg, HOST)[0].gpu
    host = list(mg.host_capacity)
    host[g] = 256
    one_of(verify(tg, replaced(mg, host_capacity=host)), "exceeds the host store capacity 256", f"of gpu:{g}")
    d = offloads(mg, DISK)[0].gpu
    disk = list(mg.disk_capacity)
    disk[d] = ALIGN // 2
    one_of(verify(tg, replaced(mg, disk_capacity=disk)), f"exceeds the spill file capacity {ALIGN // 2}")


def test_an_offload_to_the_callers_input_copy_is_refused():
    tg, mg = disk_graph()
    vs = list(mg.vertices)
    vs[2] = dataclasses.replace(vs[2], out=Loc(INPUT, 0, S))
    one_of(verify(tg, replaced(mg, vertices=vs)), "an offload must write the host store or the spill file")


# ---- the spill file ----------------------------------------------------------------------------
@pytest.mark.parametrize("direct", [True, False])
def test_spill_file_round_trip(tmp_path, direct):
    alloc = lambda n, host: torch.zeros(n, dtype=torch.uint8)  # noqa: E731
    f = SpillFile(str(tmp_path / "spill"), 0, 3 * ALIGN, 2 * ALIGN, alloc, direct=direct)
    assert os.path.getsize(f.path) == 3 * ALIGN and f.direct == (direct and hasattr(os, "O_DIRECT"))
    a = torch.randint(0, 255, (ALIGN + 100,), dtype=torch.uint8)
    b = torch.randint(0, 255, (10,), dtype=torch.uint8)
    f.write(0, a)
    f.write(2 * ALIGN, b)
    got_a, got_b = torch.empty_like(a), torch.empty_like(b)
    f.read(0, got_a, lambda d, s: d.copy_(s))
    f.read(2 * ALIGN, got_b, lambda d, s: d.copy_(s))
    assert torch.equal(got_a, a) and torch.equal(got_b, b)
    st = f.statistics()
    assert st["bytes_written"] == st["bytes_read"] == 3 * ALIGN and st["writes"] == st["reads"] == 2
    path = Path(f.path)
    f.close()
    f.close()  # twice is harmless
    assert not path.exists() and path.parent.exists()  # a directory of the user's stays


def test_spill_file_moves_a_large_value_a_chunk_at_a_time(tmp_path):
    alloc = lambda n, host: torch.zeros(n, dtype=torch.uint8)  # noqa: E731
    f = SpillFile(str(tmp_path), 0, 8 * ALIGN, 4 * ALIGN, alloc, chunk=ALIGN + 7)  # rounded to ALIGN
    try:
        a = torch.randint(0, 255, (3 * ALIGN + 5,), dtype=torch.uint8)
        f.write(ALIGN, a)
        got = torch.zeros_like(a)
        f.read(ALIGN, got, lambda d, s: d.copy_(s))
        assert torch.equal(got, a)
        st = f.statistics()
        assert st["writes"] == st["reads"] == 1 and st["bytes_written"] == 4 * ALIGN
    finally:
        f.close()


def test_a_failed_write_behind_is_raised_by_the_next_call(tmp_path):
    from disco_ray.graph.errors import RunError

    f = SpillFile(str(tmp_path), 0, ALIGN, ALIGN, lambda n, host: torch.zeros(n, dtype=torch.uint8))
    try:
        f.write(ALIGN, torch.ones(16, dtype=torch.uint8))  # beyond the file: fails in the writer
        with pytest.raises(RunError, match=r"a write failed: .*beyond its 4096 bytes"):
            f.flush()
    finally:
        f.close()


def test_spill_file_in_a_temporary_directory_is_removed():
    f = SpillFile(None, 3, ALIGN, ALIGN, lambda n, host: torch.zeros(n, dtype=torch.uint8))
    d = Path(f.path).parent
    assert d.exists() and d.name.startswith("disco-spill-")
    f.close()
    assert not d.exists()


# ---- runs --------------------------------------------------------------------------------------
def _check_run(w, cap, host_capacity, engine, disk_dir=None, **kw):
    ref = w.reference(w.inputs)
    with compile(
        w.taskgraph, cap, host_capacity=host_capacity, engine=engine, disk_dir=disk_dir, **kw
    ) as prog:
        for run in range(2):  # the spill file is reused by the next run
            res = prog.run(w.inputs, details=True, check=True, timeout=120)
            for k, v in ref.items():
                torch.testing.assert_close(res.outputs[k], v, rtol=1e-4, atol=1e-4, msg=f"{k} run {run}")
            d = res.summary["disk"]
            plan = prog.mg.stats
            assert d["bytes_written"] >= plan["bytes_offloaded_disk"] > 0
            assert d["bytes_read"] >= plan["bytes_reloaded_disk"] > 0
            assert res.summary["bytes"]["offload_disk"] == plan["bytes_offloaded_disk"]
            assert d["write_gb_per_s"] > 0 and d["read_gb_per_s"] > 0
            assert all(x["direct"] for x in d["workers"])  # ext4 and xfs take O_DIRECT
            for x in d["workers"]:  # every reload from disk was read ahead or read by itself
                ra = x["read_ahead"]
                mine = [v for v in disk_reloads(prog.mg) if v.gpu == x["gpu"]]
                assert ra["hits"] + ra["misses"] == len(mine) and ra["hits"] > 0, ra
        return res


@pytest.mark.parametrize("host_capacity", [0, 32 << 10])
def test_llama_spills_to_disk_and_back_on_the_local_engine(llama, tmp_path, host_capacity):
    w, cap = llama
    res = _check_run(w, cap, host_capacity, "local", disk_dir=str(tmp_path), streams=3)
    assert list(tmp_path.iterdir()) == []  # the spill files are gone with the engine
    from disco_ray.graph.trace import chrome_trace

    events = chrome_trace(res.plan, res.records)["traceEvents"]
    disk = [e for e in events if e["ph"] == "X" and e["args"].get("tier") == "disk"]
    assert len(disk) == len(offloads(res.plan, DISK)) + len(disk_reloads(res.plan))
    assert any(e["ph"] == "C" and e["name"] == "spill file bytes" for e in events)


def test_random_dag_spills_to_disk_with_random_delays():
    from workloads.random_dag import random_dag

    spilled = 0
    for seed in range(3):
        tg = random_dag(60, 2, seed)
        mg = build_memgraph(tg, tight_capacity(tg, 0.02), host_capacity=[0, 4096])
        if not offloads(mg, DISK):
            continue
        spilled += 1
        inputs = random_inputs(tg, seed)
        from disco_ray.driver.program import Program

        with Program(tg, mg, engine="local", streams=2) as prog:
            out = prog.run(inputs, check=True, delay=(0, 5e-4), seed=seed, timeout=120)
        ref = evaluate(tg, inputs)
        for k in ref:
            torch.testing.assert_close(out[k], ref[k], rtol=1e-4, atol=1e-4)
    assert spilled >= 2


def test_an_output_the_plan_leaves_on_disk_is_read_back():
    """A kept value evicted to the spill file stays there (the MemGraph's output is its offload):
    the worker reads it back from the file when the caller asks for the outputs."""
    from disco_ray.driver.program import Program
    from workloads.random_dag import random_dag

    tg = random_dag(60, 2, 20)
    mg = build_memgraph(tg, tight_capacity(tg, 0.02), host_capacity=0)
    assert any(mg.vertex(v).out.device == DISK for v in mg.outputs.values())
    inputs = random_inputs(tg, 20)
    with Program(tg, mg, engine="local", streams=2) as prog:
        out = prog.run(inputs, check=True, timeout=120)
    ref = evaluate(tg, inputs)
    for k in ref:
        torch.testing.assert_close(out[k], ref[k], rtol=1e-4, atol=1e-4)


@pytest.mark.ray
def test_llama_spills_to_disk_and_back_on_the_ray_engine(llama):
    from tests.ray_fixtures import local_ray

    w, cap = llama
    with local_ray(2):
        res = _check_run(w, cap, 0, "ray", streams=3)
        assert len(res.summary["disk"]["workers"]) == 2


def test_disk_lanes_on_the_stand_in_cuda_device(monkeypatch, llama):
    """The CUDA path: offloads and reloads to disk run BLOCKING on the two disk lanes, through
    (pinned) bounce buffers; the outputs match the reference."""
    from actors import resources
    from actors.backends.cuda import CudaBackend
    from actors.options import RunOptions, WorkerConfig
    from disco_ray.driver.engine_local import LocalEngine
    from tests.fake_cuda import install

    install(monkeypatch.setattr)
    monkeypatch.setattr(resources, "make_backend", lambda name, device=None: CudaBackend())
    w, cap = llama
    tg = w.taskgraph
    mg = build_memgraph(tg, cap, host_capacity=16 << 10)
    eng = LocalEngine(tg, mg, config=WorkerConfig(backend="cuda", streams=2))
    try:
        out, traces = eng.run(w.inputs, RunOptions(timeout=60))
        for k, v in w.reference(w.inputs).items():
            torch.testing.assert_close(out[k], v, rtol=1e-4, atol=1e-4)
        for g, ex in enumerate(eng.execs):
            for vid, s, *_ in traces[g]:
                v = mg.vertex(vid)
                if v.kind is MKind.OFFLOAD:
                    assert s == (ex.disk_w if v.out.device == DISK else ex.d2h)
                elif v.kind is MKind.RELOAD and v.ins[0].loc.device == DISK:
                    assert s == ex.disk_r
        blocking = sum(x["backend"]["host"]["blocking"] for x in eng.statistics()["workers"])
        assert blocking == len(offloads(mg, DISK)) + len(disk_reloads(mg))
    finally:
        eng.close()


# ---- the command line --------------------------------------------------------------------------
def test_cli_run_with_a_host_budget_and_a_disk_directory(tmp_path, capsys):
    from disco_ray.cli.app import main

    args = ["run", "llama_prefill", *(f"{k}={v}" for k, v in LLAMA.items())]
    args += ["--capacity", "200KiB", "--host-capacity", "16KiB", "--disk", str(tmp_path / "spill")]
    args += ["--engine", "local", "--out", str(tmp_path / "o.npz"), "--check-reference"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "disk bandwidth: write" in err and "offload_disk" in err and "outputs match" in err
    assert list((tmp_path / "spill").iterdir()) == []


def test_cli_bench_with_a_host_budget_spills_into_the_disk_directory(tmp_path):
    import json

    from disco_ray.cli.app import main

    spill = tmp_path / "spill"
    args = ["bench", "llama_prefill", *(f"{k}={v}" for k, v in LLAMA.items()), "--capacity", "200KiB"]
    args += ["--host-capacity", "16KiB", "--disk", str(spill), "--engine", "local", "--modes", "dynamic"]
    assert main([*args, "--warmup", "0", "--out", str(tmp_path / "b")]) == 0
    row = json.loads((tmp_path / "b" / "results.json").read_text())["modes"][0]
    assert row["check"]["ok"] and row["summary"]["plan"]["bytes_offloaded_disk"] > 0
    workers = row["summary"]["disk"]["workers"]
    assert workers and all(Path(w["path"]).parent == spill for w in workers)
    assert list(spill.iterdir()) == []


def test_cli_plan_and_info_show_the_tiers(tmp_path, capsys):
    from disco_ray.cli.app import main

    out = tmp_path / "m.json"
    assert (
        main(["plan", "examples/chain.json", "--capacity", "48KiB", "--host-capacity", "0", "-o", str(out)])
        == 0
    )
    err = capsys.readouterr().err
    assert "disk offloaded 16 KiB, reloaded 16 KiB" in err and "spill file size: gpu:0 16 KiB" in err
    assert main(["verify", "examples/chain.json", str(out)]) == 0
    capsys.readouterr()
    assert main(["info", str(out), "--json"]) == 0
    import json

    st = json.loads(capsys.readouterr().out)
    assert st["bytes_offloaded_disk"] == 16384 and st["disk_capacity"] == [16384, 0]


@pytest.mark.parametrize(
    "args,msg",
    [
        (
            ["plan", "examples/chain.json", "--capacity", "48KiB", "--host-capacity", "lots"],
            "bad size 'lots'",
        ),
        (["plan", "examples/chain.json", "--capacity", "48KiB", "--host-capacity", "1,2,3"], "3 sizes for 2"),
        (["run", "examples/chain.json", "--disk", "examples/chain.json"], "not a directory"),
        (  # a directory that cannot be made: refused when the worker makes its spill file
            [
                *("run", "examples/chain.json", "--capacity", "48KiB", "--host-capacity", "0"),
                *("--engine", "local", "--disk", "/proc/no-such-dir/spill"),
            ],
            "cannot make its spill file in /proc/no-such-dir/spill",
        ),
    ],
)
def test_cli_bad_tier_values_are_one_line_errors(tmp_path, capsys, args, msg):
    from disco_ray.cli.app import main

    assert (
        main([*args, *(["-o", str(tmp_path / "m.json")] if args[0] == "plan" else ["--out", "x.npz"])]) == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("disco-ray: error:")]  # (info lines may precede)
    assert len(errors) == 1 and msg in errors[0] and not any("Traceback" in line for line in err), err


# ---- models ------------------------------------------------------------------------------------
def test_generate_spills_to_disk_with_the_tokens_of_transformers(tmp_path):
    """LlamaModel passes host_capacity and disk_dir through: greedy tokens as transformers'."""
    pytest.importorskip("transformers")
    from disco_ray.models import LlamaModel
    from tests.test_models import BLOCK, PROMPT, capacity, expected, make_checkpoint

    hf = make_checkpoint(tmp_path / "ck", num_key_value_heads=4, tie_word_embeddings=False)
    path = str(tmp_path / "ck")
    new = 6
    _, want = expected(hf, PROMPT, new)
    cap = capacity(path, 1, "tight", new)
    with LlamaModel(
        path,
        capacity=cap,
        host_capacity=0,
        disk_dir=str(tmp_path / "spill"),
        block=BLOCK,
        engine="local",
        check=True,
    ) as m:
        gen = m.run_generate(PROMPT, new, stop_at_eos=False)
        assert gen.tokens == want
        assert sum(p["bytes_offloaded_disk"] for p in m.plans) > 0, m.plans
    assert list((tmp_path / "spill").iterdir()) == []


def test_cli_generate_with_a_host_budget_and_a_disk_directory(tmp_path, capsys):
    pytest.importorskip("transformers")
    from disco_ray.cli.app import main
    from tests.test_models import BLOCK, PROMPT, capacity, expected, make_checkpoint

    hf = make_checkpoint(tmp_path / "ck", num_key_value_heads=4, tie_word_embeddings=False)
    path = str(tmp_path / "ck")
    _, want = expected(hf, PROMPT, 4)
    cap = capacity(path, 1, "tight", 4)[0]
    args = ["generate", path, "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "4"]
    args += ["--capacity", str(cap), "--block", str(BLOCK), "--engine", "local", "--ignore-eos"]
    args += ["--host-capacity", "0", "--disk", str(tmp_path / "spill")]
    assert main(args) == 0
    assert capsys.readouterr().out.strip() == ",".join(map(str, want))
    assert list((tmp_path / "spill").iterdir()) == []


def test_the_simulator_prices_disk_moves_on_the_disk_lanes(llama):
    from disco_ray.bench.profiles import h100
    from disco_ray.bench.simulate import simulate

    w, cap = llama
    tg = w.taskgraph
    host = simulate(build_memgraph(tg, cap), tg, h100)
    mg = build_memgraph(tg, cap, host_capacity=0)
    disk = simulate(mg, tg, h100)
    lanes = {ln for _, _, ln, _, _ in disk.timeline}
    assert {"disk_w", "disk_r"} <= lanes and not {"disk_w", "disk_r"} & {ln for *_, ln, _, _ in host.timeline}
    assert disk.makespan >= host.makespan
    slow = simulate(mg, tg, h100.with_(disk_read=1e8, disk_write=1e8))
    assert slow.makespan > disk.makespan
