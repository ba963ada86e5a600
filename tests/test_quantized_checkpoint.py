"""A quantized checkpoint on disk (`disco-ray quantize`, docs/QUANTIZATION.md): the command, its
files, a model read from it equal to one quantized at load (every family), with nothing quantized
again, from host memory and streamed from disk, and bad files refused naming the file."""

from __future__ import annotations

import json
import os
import shutil
import stat
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from actors.tiers.diskio import _PACKED, FileBlock, FileReader, aligned
from disco_ray.cli.app import main
from disco_ray.graph import kernels_quant
from disco_ray.graph.errors import RunError, UsageError
from disco_ray.graph.quant import Quant
from disco_ray.graph.sources import PACKED_KEY, read
from disco_ray.models import LlamaModel
from disco_ray.models.finetune import LoraTrainer
from tests import family_oracle as oracle
from workloads.llm.checkpoint import Checkpoint
from workloads.llm.model import decode_graph
from workloads.llm.train import OptimSpec

ARCH = "LlamaForCausalLM"
TABLES = ("model.embed_tokens.weight", "lm_head.weight")  # int8 whatever the layers' bits
EXTRA = {"tokenizer.json": '{"version": "1.0"}', "tokenizer_config.json": "{}", "pytorch_model.bin": "x"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(float checkpoint, its int4 group-32 copy, its int8 group-16 copy): a tokenizer file and
    a float .bin beside the float one."""
    base = tmp_path_factory.mktemp("ck")
    oracle.save(ARCH, base)
    for name, text in EXTRA.items():
        (base / name).write_text(text)
    out = tmp_path_factory.mktemp("q")
    q4, q8 = str(out / "q4"), str(out / "q8")
    assert main(["-q", "quantize", str(base), q4, "--bits", "4", "--group", "32"]) == 0
    assert main(["-q", "quantize", str(base), q8, "--bits", "8", "--group", "16"]) == 0
    return str(base), q4, q8


def _run(path: str, gpus: int = 1, new: int = 5, **kw) -> tuple[torch.Tensor, list[int]]:
    cap = oracle.capacity(path, gpus, "tight", len(oracle.PROMPT), new)
    with LlamaModel(path, gpus=gpus, capacity=cap, block=oracle.BLOCK, engine="local", **kw) as m:
        return m.prefill(oracle.PROMPT), m.generate(oracle.PROMPT, new, stop_at_eos=False)


@pytest.fixture
def quantizations(monkeypatch) -> list[int]:
    """Counts the calls of the quantizer (workers run in this process: engine local)."""
    calls: list[int] = []
    real = kernels_quant.quantize

    def counted(w, q):
        calls.append(w.shape[0])
        return real(w, q)

    monkeypatch.setattr(kernels_quant, "quantize", counted)
    _PACKED.clear()  # the packed files of earlier tests: this one's loads pack again
    return calls


def test_the_files_it_writes(tiny):
    base, q4, _ = tiny
    cfg = json.loads(Path(f"{q4}/config.json").read_text())
    assert cfg["quantization_config"] == {
        "quant_method": "disco-ray",
        "layout_version": 1,
        "bits": 4,
        "group_size": 32,
    }
    assert cfg | {"quantization_config": None} == json.loads(Path(f"{base}/config.json").read_text()) | {
        "quantization_config": None
    }
    names = sorted(os.listdir(q4))
    assert names == sorted(["config.json", "generation_config.json", "model.safetensors", *EXTRA][:-1])
    assert Path(f"{q4}/tokenizer.json").read_text() == EXTRA["tokenizer.json"]
    floats, packed = load_file(f"{base}/model.safetensors"), load_file(f"{q4}/model.safetensors")
    with safe_open(f"{q4}/model.safetensors", framework="pt") as f:
        records = json.loads(f.metadata()[PACKED_KEY])
    for name, w in floats.items():
        q = Quant(8 if name in TABLES else 4, 32) if w.dim() == 2 else None
        if q is None:  # the norms: as stored
            assert name not in records and torch.equal(packed[name], w)
        else:  # the bytes quantizing at load gives, and the record of how
            assert torch.equal(packed[name], kernels_quant.quantize(w, q)), name
            assert records[name] == {"bits": q.bits, "group": 32, "shape": list(w.shape)}


@pytest.mark.parametrize("weights", ["host", "disk"])
def test_read_as_stored_equals_quantized_at_load(tiny, weights, quantizations):
    base, q4, _ = tiny
    want = _run(base, quantize="int4", quant_group=32, weights=weights)
    assert quantizations  # quantizing at load calls the quantizer: the count below can fail
    quantizations.clear()
    got = _run(q4, weights=weights)
    assert quantizations == []  # nothing quantized again: the loads read the stored bytes
    assert torch.equal(got[0], want[0]) and got[1] == want[1]
    assert _run(q4, quantize="int4", quant_group=32, weights=weights)[1] == want[1]  # its own: accepted


def test_two_gpus_cut_packed_columns_on_group_boundaries(tiny, quantizations):
    # o and down are split by input columns (32 and 48 per GPU): groups of 16 fall on the cuts
    base, _, q8 = tiny
    want = _run(base, gpus=2, quantize="int8", quant_group=16, weights="disk")
    quantizations.clear()
    for weights in ("host", "disk"):
        got = _run(q8, gpus=2, weights=weights)
        assert torch.equal(got[0], want[0]) and got[1] == want[1], weights
    assert quantizations == []


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("group, cols, block", [(16, 96, (48, 96)), (32, 100, (32, 64)), (8, 37, (8, 37))])
def test_a_column_block_of_packed_rows_is_the_block_packed(bits, group, cols, block):
    from disco_ray.graph.sources import packed_columns

    q = Quant(bits, group)
    w = torch.randn(5, cols, generator=torch.Generator().manual_seed(cols))
    got = packed_columns(kernels_quant.quantize(w, q), q, cols, block)
    assert torch.equal(got, kernels_quant.quantize(w[:, block[0] : block[1]], q))


def test_a_split_off_the_groups_is_refused_naming_the_tensor(tiny):
    _, q4, _ = tiny  # group 32: the down projection's 48 columns per GPU cut a group
    with pytest.raises(UsageError, match=r"model.safetensors: tensor '.*down_proj.weight'.*columns 0:48"):
        decode_graph(Checkpoint(q4), 2, 1, oracle.BLOCK)


def test_disk_loads_read_the_stored_packed_bytes(tiny, quantizations):
    _, q4, _ = tiny
    tg = decode_graph(Checkpoint(q4), 1, 1, oracle.BLOCK).taskgraph
    v = tg["l1.down_g0"]
    block = FileBlock.of(v)  # each load reads this range of the quantized checkpoint's file
    assert block.path == f"{q4}/model.safetensors" and (block.file_dtype, block.nbytes) == ("uint8", v.nbytes)
    assert not any(k != "dir" for k in _PACKED) and quantizations == []  # no packed file made
    reader = FileReader()
    raw = reader.read(block.path, block.offset, block.nbytes, aligned(block.nbytes + 8192, _host))
    out = torch.empty(v.nbytes, dtype=torch.uint8)
    block.copy_into(raw, out, v.dtype, v.shape)
    want = load_file(f"{q4}/model.safetensors")["model.layers.1.mlp.down_proj.weight"]
    assert torch.equal(out.view(v.shape), want) and torch.equal(read(v.source, v.shape, v.dtype), want)
    st = reader.statistics()
    assert st["bytes_read"] == v.nbytes and st["direct_reads"] + st["buffered_reads"] == 1
    if not _tmpfs(q4):  # O_DIRECT where the file system takes it
        assert st["direct_reads"] == 1, st


def _host(n: int, pinned: bool) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8)


def _tmpfs(path: str) -> bool:
    best = ("", "")
    with open("/proc/mounts") as f:
        for line in f:
            _, mount, kind = line.split()[:3]
            if os.path.realpath(path).startswith(mount) and len(mount) > len(best[0]):
                best = (mount, kind)
    return best[1] == "tmpfs"


@pytest.mark.parametrize(
    "arch, over, shard",
    [
        ("Gemma2ForCausalLM", {"head_dim": 16}, None),
        ("Phi3ForCausalLM", {}, None),
        ("Qwen2ForCausalLM", {}, "100KB"),
        (
            "MixtralForCausalLM",
            {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32},
            None,
        ),
    ],
)
def test_every_family_from_its_quantized_checkpoint(arch, over, shard, tmp_path, quantizations):
    # Gemma 2: a tied, scaled table; Phi-3: fused projections; Qwen2: biases, sharded files; Mixtral: experts as stored
    oracle.save(arch, tmp_path / "f", max_shard_size=shard, **over)
    base, q = str(tmp_path / "f"), str(tmp_path / "q")
    assert main(["-q", "quantize", base, q, "--bits", "4", "--group", "32"]) == 0
    if shard:
        assert (
            len({*json.loads(Path(f"{q}/model.safetensors.index.json").read_text())["weight_map"].values()})
            > 1
        )
    want = _run(base, quantize="int4", quant_group=32, weights="disk")
    quantizations.clear()
    got = _run(q, weights="disk")
    assert quantizations == []
    assert torch.equal(got[0], want[0]) and got[1] == want[1]


def test_lora_on_the_quantized_checkpoint(tiny, quantizations):
    base, _, q8 = tiny
    data = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    kw = dict(capacity=8 << 20, block=oracle.BLOCK, engine="local", optim=OptimSpec(lr=1e-2), seed=3)
    with LoraTrainer(base, quantize="int8", quant_group=16, **kw) as tr:
        want = tr.train(data, steps=3)
    quantizations.clear()
    with LoraTrainer(q8, **kw) as tr:
        got = tr.train(data, steps=3)
    assert got == want and got[-1] < got[0] and quantizations == []


def _one_line(capsys) -> str:
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1, (out, err)
    return err


def test_usage_errors_exit_2_writing_nothing(tiny, tmp_path, capsys):
    base, q4, _ = tiny
    new = str(tmp_path / "new")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "a").write_text("")
    for args, says in (
        ([base, new, "--bits", "3"], "--bits"),
        ([base, new, "--bits", "4", "--group", "0"], "--group"),
        ([base, new], "--bits"),
        ([str(tmp_path / "none"), new, "--bits", "4"], "not a checkpoint directory"),
        ([str(tmp_path), new, "--bits", "4"], "config.json"),
        ([q4, new, "--bits", "8"], "quantized already (int4, group 32)"),
        ([base, str(tmp_path / "full"), "--bits", "4"], "not an empty directory"),
        ([base, f"{base}/config.json/x", "--bits", "4"], "OUT_DIR"),
    ):
        assert main(["quantize", *args]) == 2, args
        assert says in _one_line(capsys), args
        assert not os.path.exists(new)
    assert sorted(os.listdir(tmp_path)) == ["full"]  # no hidden half-written sibling either


def test_a_failure_half_way_leaves_no_directory(tiny, tmp_path, capsys):
    base, _, _ = tiny
    src = tmp_path / "nan"
    shutil.copytree(base, src)
    w = load_file(f"{src}/model.safetensors")
    w["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")  # found after layer 0 is packed
    save_file(w, f"{src}/model.safetensors", metadata={"format": "pt"})
    assert main(["quantize", str(src), str(tmp_path / "out"), "--bits", "4"]) == 2
    assert "up_proj.weight" in _one_line(capsys)
    assert sorted(os.listdir(tmp_path)) == ["nan"]


def test_files_take_the_umask(tiny, tmp_path):
    base, _, _ = tiny
    old = os.umask(0o027)
    try:
        assert main(["-q", "quantize", base, str(tmp_path / "q"), "--bits", "8"]) == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "q").st_mode) == 0o750
    for name in os.listdir(tmp_path / "q"):
        assert stat.S_IMODE(os.stat(tmp_path / "q" / name).st_mode) == 0o640, name


def test_a_conflicting_quantize_is_refused(tiny, capsys):
    _, q4, _ = tiny
    run = ["generate", q4, "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--capacity", "4MiB"]
    for bad in (["--quantize", "int8", "--quant-group", "32"], ["--quantize", "int4"]):
        assert main([*run, "--engine", "local", *bad]) == 2
        err = _one_line(capsys)
        assert "quantized int4, group 32" in err and "conflicts" in err, err
    assert main([*run, "--engine", "local", "--weights", "disk"]) == 0
    assert len(capsys.readouterr().out.strip().split(",")) == 2


def _rewrite(path: str, name: str, edit) -> None:
    """Rewrites `path`'s safetensors file with `edit(tensors, metadata)` applied."""
    f = f"{path}/model.safetensors"
    with safe_open(f, framework="pt") as h:
        meta = dict(h.metadata())
    tensors = load_file(f)
    edit(tensors, meta)
    save_file(tensors, f, metadata=meta)


@pytest.mark.parametrize(
    "edit, says",
    [
        (lambda t, m: m.update({"disco_ray.layout": "2"}), r"model.safetensors: packed layout version '2'"),
        (
            lambda t, m: t.update(
                {
                    "model.layers.0.mlp.up_proj.weight": t["model.layers.0.mlp.up_proj.weight"][
                        :, 1:
                    ].contiguous()
                }
            ),
            r"model.safetensors: tensor 'model.layers.0.mlp.up_proj.weight' is U8 \[96, 39\]; packed "
            r"\(int4, group 32\) from \[96, 64\] it is U8 \[96, 40\]",
        ),
        (
            lambda t, m: m.update({PACKED_KEY: m[PACKED_KEY].replace('"bits": 4', '"bits": 5', 1)}),
            r"model.safetensors: metadata 'disco_ray.packed' is not a record",
        ),
    ],
)
def test_a_file_packed_otherwise_is_refused_naming_it(tiny, tmp_path, capsys, edit, says):
    _, q4, _ = tiny
    bad = str(tmp_path / "bad")
    shutil.copytree(q4, bad)
    _rewrite(bad, "model.safetensors", edit)
    with pytest.raises(UsageError, match=says):
        Checkpoint(bad)
    run = ["generate", bad, "--prompt-ids", "1", "--max-new-tokens", "1", "--capacity", "4MiB"]
    assert main([*run, "--engine", "local"]) == 2
    assert "model.safetensors" in _one_line(capsys)


def test_a_config_it_does_not_read_is_refused(tiny, tmp_path):
    _, q4, _ = tiny
    for qc, says in (
        ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq' is not read here"),
        ({"quant_method": "disco-ray", "layout_version": 0, "bits": 4, "group_size": 32}, "layout_version 0"),
        (
            {"quant_method": "disco-ray", "layout_version": 1, "bits": 3, "group_size": 32},
            "bits must be 8 or 4",
        ),
    ):
        bad = tmp_path / qc["quant_method"] / str(qc.get("layout_version"))
        shutil.copytree(q4, bad)
        cfg = json.loads((bad / "config.json").read_text()) | {"quantization_config": qc}
        (bad / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(UsageError, match=r"config.json: .*" + says):
            Checkpoint(bad)


def test_a_worker_refuses_a_block_recorded_otherwise(tiny, tmp_path):
    # a file changed after the graph was made: the worker's read names the input and its source
    _, q4, _ = tiny
    v = decode_graph(Checkpoint(q4), 1, 1, oracle.BLOCK).taskgraph["l0.q_g0"]
    shutil.copytree(q4, tmp_path / "c")
    _rewrite(str(tmp_path / "c"), "model.safetensors", lambda t, m: m.update({"disco_ray.layout": "9"}))
    moved = replace(v, source=replace(v.source, path=f"{tmp_path}/c/model.safetensors"))
    with pytest.raises(RunError, match=r"input 'x': source .*stored packed.*layout version '9'"):
        read(moved.source, v.shape, v.dtype, "input 'x'")
    with pytest.raises(RunError, match=r"input 'l0.q_g0': source .*stored packed.*layout version '9'"):
        FileBlock.of(moved)


def test_a_stored_packed_source_round_trips_through_json(tiny):
    from disco_ray.graph.errors import FormatError
    from disco_ray.graph.sources import Source

    _, q4, _ = tiny
    src = decode_graph(Checkpoint(q4), 1, 1, oracle.BLOCK).taskgraph["l0.q_g0"].source
    assert src.packed and src.to_dict()["packed"] is True
    assert Source.from_dict(json.loads(json.dumps(src.to_dict())), "x") == src
    for bad in ({"packed": True}, {"packed": 1, "quant": {"bits": 4}}):
        with pytest.raises(FormatError, match=r'x: "source.packed"'):
            Source.from_dict({"path": "m", "tensor": "w", **bad}, "x")


def test_a_tensor_read_otherwise_than_stored_is_refused(tiny):
    _, q4, _ = tiny
    ck, name = Checkpoint(q4), "model.layers.0.mlp.up_proj.weight"
    assert ck.source(name, packed=Quant(4, 32)).packed
    for how, says in ((None, "as floats"), (Quant(8, 32), "as int8, group 32")):
        with pytest.raises(
            UsageError,
            match=rf"model.safetensors: tensor '{name}' is stored packed \(int4, group 32\); it is read {says}",
        ):
            ck.source(name, packed=how)
