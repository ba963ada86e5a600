"""Capacities asked as "auto" or "P%" of each GPU's free memory (`disco_ray.driver.free_memory`):
the probe's sources at exact numbers (a fake /proc and cgroup tree, a fake CUDA), the capacity
chosen from them (margin, roomy cap, the minimum's error), and real runs on the cpu backend:
`from_torch`, `models.load` (which defaults to "auto"), `LoraTrainer` and the CLI's --capacity."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch

import disco_ray
from disco_ray.cli.app import main
from disco_ray.driver import free_memory as fm
from disco_ray.driver.free_memory import CUDA_RESERVE, MARGIN, FreeMemory, RelativeCapacity, relative
from disco_ray.graph.errors import CapacityError, UsageError
from planner.capacity import CapacityBounds

from .conftest import run_cli, two_gpu_graph
from .torch_models import build

MiB = 1 << 20
pytest.importorskip("transformers")


def _host(monkeypatch, nbytes: int) -> None:
    """This machine has exactly `nbytes` available (the probe's host source)."""
    monkeypatch.setattr(fm, "host_available", lambda: (nbytes, "MemAvailable"))


# ---- parsing and choosing ------------------------------------------------------------------------
def test_relative_forms_and_bad_shares():
    assert relative("auto") == relative(" AUTO ") == "auto"
    assert relative("60%") == "60%" and relative(" 12.50 % ") == "12.5%" and relative("100%") == "100%"
    assert relative("64MiB") is None and relative(64 << 20) is None and relative([1, 2]) is None
    for bad in ("0%", "150%", "100.5%", "-5%", "abc%", "%"):
        with pytest.raises(UsageError, match=r"a percentage in \(0, 100\]"):
            relative(bad)


def test_auto_keeps_a_margin_and_a_share_does_not():
    free = FreeMemory((10 * MiB, 20 * MiB), "MemAvailable")
    auto = RelativeCapacity.of("auto", free)
    assert auto.margin == (int(MARGIN * 10 * MiB), int(MARGIN * 20 * MiB))
    assert auto.budget == tuple((f - int(MARGIN * f)) // 256 * 256 for f in free.per_gpu)
    share = RelativeCapacity.of("60%", free)
    assert share.margin == (0, 0) and share.budget == (int(0.6 * 10 * MiB) // 256 * 256, int(0.6 * 20 * MiB))
    cuda = RelativeCapacity.of("auto", FreeMemory((4 << 30,), "torch.cuda.mem_get_info"), "cuda")
    assert cuda.budget == (((4 << 30) - int(MARGIN * (4 << 30)) - CUDA_RESERVE) // 256 * 256,)


def test_the_choice_is_capped_at_roomy_and_refused_below_the_minimum():
    asked = RelativeCapacity.of("auto", FreeMemory((10 * MiB, 10 * MiB), "host_capacity"))
    b = asked.budget[0]
    got = asked.choose(CapacityBounds(min=(MiB, MiB), roomy=(4 * MiB, 64 * MiB)))
    assert got.capacity == (4 * MiB, b)  # gpu 0 needs no more than its roomy capacity
    assert got.statistics()["capped_at_roomy"] == [True, False]
    assert got.describe().startswith("capacity auto: 4 MiB, ") and "host_capacity" in got.describe()
    with pytest.raises(CapacityError) as e:
        asked.choose(CapacityBounds(min=(MiB, 12 * MiB), roomy=(64 * MiB, 64 * MiB)), "the step")
    msg = str(e.value)
    assert "gpu 1" in msg and "the least the step works with, 12 MiB" in msg and "10 MiB free" in msg


def test_bounds_of_several_graphs_take_each_gpus_largest():
    tg = two_gpu_graph()
    one = CapacityBounds.of([tg])
    assert CapacityBounds.of([tg, tg]) == one
    least, roomy = one  # unpacks as the pair
    assert least == one.min and roomy == one.roomy and all(m <= r for m, r in zip(least, roomy))
    assert one.fits(list(one.min)) and one.fits(max(one.min)) and not one.fits([m - 1 for m in one.min])
    assert one.to_dict() == {"min": list(one.min), "roomy": list(one.roomy)}


# ---- the probe's sources ---------------------------------------------------------------------------
def _tree(tmp_path: Path, available: int, cgroup: str, files: dict[str, str]) -> Path:
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/meminfo").write_text(f"MemTotal: 99999999 kB\nMemAvailable: {available // 1024} kB\n")
    (tmp_path / "proc/self/cgroup").write_text(cgroup)
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def test_host_memory_is_memavailable_lowered_to_what_the_cgroup_leaves(tmp_path):
    v2 = {"sys/fs/cgroup/job/memory.max": str(1 << 30), "sys/fs/cgroup/job/memory.current": str(256 * MiB)}
    root = _tree(tmp_path / "v2", 4 << 30, "0::/job\n", v2)
    assert fm.host_available(root) == (768 * MiB, "the memory cgroup's limit less its usage")
    unlimited = {"sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712"}
    unlimited["sys/fs/cgroup/memory/memory.usage_in_bytes"] = "4096"
    root = _tree(tmp_path / "v1", 3 << 30, "4:memory:/elsewhere\n", unlimited)
    assert fm.host_available(root) == (3 << 30, "MemAvailable")


def test_cpu_free_memory_is_shared_by_the_gpus_unless_host_capacity_says(monkeypatch):
    _host(monkeypatch, 100 * MiB)
    got = fm.free_memory("cpu", 2)
    assert got.per_gpu == (50 * MiB, 50 * MiB) and got.source == "MemAvailable 100 MiB / 2 GPU(s)"
    assert fm.free_memory("cpu", 2, 8 * MiB) == FreeMemory((8 * MiB, 8 * MiB), "host_capacity")
    assert fm.free_memory("cpu", 2, [8 * MiB, None]).per_gpu == (8 * MiB, 50 * MiB)
    assert fm.free_memory("cpu", 2, 8 * MiB, remote=True).per_gpu == (8 * MiB, 8 * MiB)  # a budget given
    with pytest.raises(UsageError, match="another machine"):
        fm.free_memory("cpu", 2, remote=True)
    monkeypatch.setattr(fm, "host_available", lambda: None)
    with pytest.raises(UsageError, match="cannot tell"):
        fm.free_memory("cpu", 2)


def test_cuda_free_memory_is_each_devices_mem_get_info(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: ((3 + d) << 30, 80 << 30))
    asked = fm.measure("auto", backend="cuda", gpus=2)
    assert asked.free.per_gpu == (3 << 30, 4 << 30) and asked.free.source == "torch.cuda.mem_get_info"
    assert asked.budget == tuple(
        (f - int(MARGIN * f) - CUDA_RESERVE) // 256 * 256 for f in asked.free.per_gpu
    )
    with pytest.raises(UsageError, match=r"capacity 60%: 3 CUDA device\(s\) to measure, 2 visible"):
        fm.measure("60%", backend="cuda", gpus=3)
    with pytest.raises(UsageError, match="a cluster elsewhere"):
        fm.measure("auto", backend="cuda", gpus=2, remote=True)


# ---- real runs ---------------------------------------------------------------------------------------
def test_from_torch_auto_runs_roomy_and_a_share_offloads(monkeypatch):
    net, args = build("mlp")
    with torch.no_grad():
        want = net(*args)
    with disco_ray.from_torch(net, args, gpus=2, capacity="auto", engine="local") as model:
        bounds = model.capacity_bounds()
        choice = model.statistics()["capacity_choice"]
        assert choice["asked"] == "auto" and choice["capacity"] == list(bounds.roomy)  # this machine: GiBs
        assert model.memgraph.capacity == list(bounds.roomy)
        torch.testing.assert_close(model(*args), want)
    # free memory of which 60% lies between each GPU's minimum and its roomy capacity: it offloads
    assert max(bounds.min) < min(bounds.roomy)
    free = (max(bounds.min) + min(bounds.roomy)) // 2 * 10 // 6
    _host(monkeypatch, 2 * free)
    with disco_ray.from_torch(net, args, gpus=2, capacity="60%", engine="local") as model:
        share = free * 6 // 10 // 256 * 256
        assert model.memgraph.capacity == [share, share] and share < min(bounds.roomy)
        res = model.run(*args)
        assert res.details.plan.stats["bytes_reloaded"] > 0
        torch.testing.assert_close(model(*args), want)
    _host(monkeypatch, bounds.min[0])  # half of the least per GPU
    with pytest.raises(CapacityError, match=r"capacity auto: .* is below the least the plan works with"):
        disco_ray.from_torch(net, args, gpus=2, capacity="auto", engine="local")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from . import family_oracle as oracle

    path = tmp_path_factory.mktemp("auto") / "m"
    hf = oracle.save("LlamaForCausalLM", path)
    return str(path), oracle.greedy(hf, oracle.PROMPT, 9)


def test_models_load_defaults_to_auto_and_grows_to_the_generations_roomy(ckpt):
    from disco_ray.models import load
    from disco_ray.models.graphs import capacity_bounds

    from . import family_oracle as oracle

    path, want = ckpt
    with load(path, gpus=2, engine="local", block=oracle.BLOCK) as model:
        assert model.generate(oracle.PROMPT, 9, stop_at_eos=False) == want
        stats = model.statistics()
    roomy = capacity_bounds(path, gpus=2, prompt=len(oracle.PROMPT), new_tokens=9, block=oracle.BLOCK).roomy
    assert stats["capacity"] == list(roomy) == stats["capacity_choice"]["capacity"]
    assert stats["capacity_choice"]["asked"] == "auto"


def test_a_share_below_roomy_offloads_and_one_below_the_minimum_is_refused(ckpt, monkeypatch):
    from disco_ray.models import LlamaModel
    from disco_ray.models.graphs import capacity_bounds

    from . import family_oracle as oracle

    path, want = ckpt
    b = capacity_bounds(path, gpus=2, prompt=len(oracle.PROMPT), new_tokens=9, block=oracle.BLOCK)
    free = max(max(b.min) + 4096, min(b.roomy) // 8)  # above each minimum, far below roomy
    _host(monkeypatch, 2 * free)
    with LlamaModel(path, gpus=2, capacity="100%", engine="local", block=oracle.BLOCK) as model:
        assert model.capacity == [0, 0] and model.capacity_limit() == [free // 256 * 256] * 2  # grows to it
        gen = model.run_generate(oracle.PROMPT, 9, stop_at_eos=False)
        assert gen.tokens == want and gen.bytes_reloaded > 0
        assert model.statistics()["capacity"] == [free // 256 * 256] * 2
    _host(monkeypatch, 2 * (max(b.min) - 1024))
    small = LlamaModel(path, gpus=2, capacity="auto", engine="local", block=oracle.BLOCK)
    below = r"capacity auto: .* free by MemAvailable .* is below the least"
    with small, pytest.raises(CapacityError, match=below):
        small.generate(oracle.PROMPT, 9)


def test_lora_trainer_takes_auto(ckpt):
    from disco_ray.models.finetune import LoraTrainer

    path, _ = ckpt
    tokens = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    with LoraTrainer(path, gpus=2, engine="local", block=4) as tr:  # capacity: "auto" by default
        loss = tr.step(tokens)
        stats = tr.statistics()
    assert torch.isfinite(torch.tensor(loss))
    choice = stats["capacity_choice"]
    assert (
        choice["asked"] == "auto"
        and choice["capacity"] == stats["capacity"]
        and all(choice["capped_at_roomy"])
    )


# ---- models.load's options -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (
            {"device_map": "auto"},
            "load: device_map= is transformers' option, not disco-ray's: .*gpus=.*capacity=",
        ),
        ({"max_memory": {0: "1GiB"}}, "max_memory= .*capacity=.*host_capacity="),
        ({"load_in_8bit": True}, "quantize='int8'"),
        ({"torch_dtype": "float32", "dtype": "float16"}, "give dtype only"),
        ({"trust_remote_code": True}, r"unknown option 'trust_remote_code' \(options: .*capacity"),
        ({"dtype": "int8"}, "dtype 'int8' is not one of"),
    ],
)
def test_models_load_refuses_transformers_words_naming_its_own(ckpt, kw, message):
    from disco_ray.models import load

    with pytest.raises(UsageError, match=message):
        load(ckpt[0], engine="local", **kw)


def test_models_load_takes_dtype_as_transformers_5_does(ckpt, caplog):
    from disco_ray.models import load

    for kw, want in (({"dtype": torch.float16}, "float16"), ({"dtype": "auto"}, "float32")):
        with load(ckpt[0], engine="local", **kw) as model:
            assert model.dtype == want
    log = logging.getLogger("disco_ray")
    log.addHandler(caplog.handler)  # the CLI's tests stop its propagation to the root
    try:
        with load(ckpt[0], engine="local", torch_dtype=torch.bfloat16) as model:
            assert model.dtype == "bfloat16"
    finally:
        log.removeHandler(caplog.handler)
    assert "`torch_dtype` is deprecated" in caplog.text


# ---- the CLI ---------------------------------------------------------------------------------------
def test_cli_generate_with_capacity_auto_reports_the_choice(ckpt):
    from . import family_oracle as oracle

    path, want = ckpt
    ids = ",".join(map(str, oracle.PROMPT))
    args = ["--prompt-ids", ids, "--max-new-tokens", "9", "--ignore-eos", "--block", "4", "--gpus", "2"]
    r = run_cli("generate", path, *args, "--capacity", "auto", "--engine", "local", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["tokens"] == want and doc["capacity_choice"]["asked"] == "auto"
    assert "capacity auto: " in r.stderr and "free by MemAvailable" in r.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["plan", "G", "-o", "P.json", "--capacity", "auto"], "--capacity auto: plan makes no run"),
        (["run", "G", "--out", "O.npz", "--capacity", "150%"], r"a percentage in \(0, 100\]"),
        (
            ["run", "G", "--out", "O.npz", "--capacity", "auto", "--capacity-gpu", "0=1MiB"],
            "overrides a size",
        ),
    ],
)
def test_cli_capacity_errors(tmp_path, capsys, args, message):
    from disco_ray.graph import formats

    graph = tmp_path / "g.json"
    formats.save(two_gpu_graph(), graph)
    argv = [str(graph) if a == "G" else str(tmp_path / a) if a.endswith(("json", "npz")) else a for a in args]
    try:
        status = main(argv)
    except SystemExit as e:  # argparse's own refusal
        status = e.code
    assert status == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert any(re.search(message, line) for line in err), err


def test_cli_run_with_capacity_auto(tmp_path, capsys):
    from disco_ray.graph import formats

    graph, out = tmp_path / "g.json", tmp_path / "o.npz"
    formats.save(two_gpu_graph(), graph)
    assert main(["run", str(graph), "--out", str(out), "--capacity", "auto", "--engine", "local"]) == 0
    assert out.exists() and "capacity auto: " in capsys.readouterr().err
