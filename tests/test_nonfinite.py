"""Issue 30 item 1: a NaN or an infinity never becomes an answer, an unsupported dtype never runs.

Tiny LLaMA checkpoints (`save_pretrained`) are broken on purpose: every weight NaN, one norm
with a NaN, one float weight whose safetensors header declares I32 (same bytes and shape), a
final norm so large that the logits overflow; and LoRA adapters: one with a NaN, one whose huge
finite values make the loss overflow. Each goes through the command line (exit 2, one
`disco-ray: error:` line naming the tensor or the step, no output file left) and through Python
(the error class and the same names), with weights read once (`--weights host`) and at every
load (`--weights disk`), on the local engine and under Ray.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from disco_ray.cli import main  # noqa: E402
from disco_ray.graph.errors import NonFiniteError, RunError, UsageError  # noqa: E402
from disco_ray.models import LlamaModel, adapter  # noqa: E402
from disco_ray.models.finetune import LoraTrainer  # noqa: E402
from disco_ray.models.sampling import SamplingParams, check_logits, sample  # noqa: E402
from tests.conftest import run_cli  # noqa: E402
from tests.ray_fixtures import joining, pool, ray_address  # noqa: E402, F401  (module fixtures for the ray tests)
from tests.test_models import make_checkpoint  # noqa: E402
from workloads.llm.checkpoint import Checkpoint  # noqa: E402

NORM = "model.layers.0.input_layernorm.weight"
POST_NORM = "model.layers.1.post_attention_layernorm.weight"
PROMPT = "5,17,3,99"


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("good")
    make_checkpoint(path, num_key_value_heads=2, tie_word_embeddings=False)
    return path


def _edited(good: Path, where: Path, edit) -> str:
    """A copy of checkpoint `good` at `where` whose tensors `edit(name, tensor)` changed in place."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(good, where)
    f = where / "model.safetensors"
    w = load_file(str(f))
    for name, t in w.items():
        edit(name, t)
    save_file(w, str(f), metadata={"format": "pt"})
    return str(where)


def all_nan(good: Path, where: Path) -> str:
    return _edited(good, where, lambda _, t: t.fill_(float("nan")))


def one_nan_norm(good: Path, where: Path) -> str:
    return _edited(good, where, lambda n, t: t.__setitem__(3, float("nan")) if n == NORM else None)


def huge_final_norm(good: Path, where: Path) -> str:
    """Finite weights whose logits overflow float32 (the final norm at 3e38)."""
    return _edited(good, where, lambda n, t: t.fill_(3e38) if n == "model.norm.weight" else None)


def declared_i32(good: Path, where: Path, tensor: str = POST_NORM) -> str:
    """A copy whose header declares I32 for float32 `tensor`: the same bytes, the same shape."""
    shutil.copytree(good, where)
    f = where / "model.safetensors"
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    head = json.loads(raw[8 : 8 + n])
    assert head[tensor]["dtype"] == "F32"
    head[tensor]["dtype"] = "I32"
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (n - len(text))  # the same length: the data offsets stay
    assert len(text) == n
    f.write_bytes(raw[:8] + text + raw[8 + n :])
    return str(where)


def _cli(argv: list, capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    got = capsys.readouterr()
    return rc, got.out, got.err


def assert_one_line(rc: int, err: str, *fragments: str) -> str:
    """Exit 2 and one error line, the last (an info line such as Ray's start may come before)."""
    lines = [ln for ln in err.splitlines() if ln.startswith("disco-ray: error:")]
    assert rc == 2, (rc, err[-2000:])
    assert "Traceback" not in err and len(lines) == 1, err[-2000:]
    assert err.rstrip().splitlines()[-1] == lines[0], err[-2000:]
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    return lines[0]


def _generate(path: str, out: Path, *extra: str) -> list:
    return ["generate", path, "--prompt-ids", PROMPT, "--max-new-tokens", "3", "--capacity", "1MiB",
            "--engine", "local", "--block", "4", "--logits", out, *extra]  # fmt: skip


# ---- weights: checked by the worker that reads them ----------------------------------------------
@pytest.mark.parametrize("weights", ["host", "disk"])
@pytest.mark.parametrize(("make", "tensor"), [(all_nan, "model."), (one_nan_norm, NORM)])
def test_a_nan_weight_is_named_and_nothing_is_written(good, tmp_path, capsys, make, tensor, weights):
    path = make(good, tmp_path / "ck")
    out = tmp_path / "logits.npz"
    rc, stdout, err = _cli(_generate(path, out, "--weights", weights), capsys)
    line = assert_one_line(rc, err, tensor, "NaN")
    assert not out.exists() and not stdout, (stdout, line)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary beside it


@pytest.mark.parametrize("weights", ["host", "disk"])
def test_python_raises_a_run_error_naming_the_tensor(good, tmp_path, weights):
    """A worker's error reaches the driver as a RunError (its message, not its class)."""
    path = one_nan_norm(good, tmp_path / "ck")
    want = rf"{NORM}.*1 NaN and 0 infinite values of 64, the first at \[3\]"
    with (
        pytest.raises(RunError, match=want),
        LlamaModel(path, capacity=1 << 20, block=4, engine="local", weights=weights) as m,
    ):
        m.generate([5, 17, 3], 2)


def test_a_weight_that_overflows_the_compute_dtype_is_named(good, tmp_path):
    path = _edited(good, tmp_path / "ck", lambda n, t: t.fill_(1e6) if n == NORM else None)
    want = rf"{NORM}.*finite in the file: they overflow float16"
    with (
        pytest.raises(RunError, match=want),
        LlamaModel(path, capacity=1 << 20, block=4, engine="local", dtype="float16") as m,
    ):
        m.generate([5, 17, 3], 1)


@pytest.mark.ray
@pytest.mark.parametrize("weights", ["host", "disk"])
def test_under_ray_the_worker_names_the_tensor(good, tmp_path, pool, weights):  # noqa: F811
    path = one_nan_norm(good, tmp_path / "ck")
    with (
        pytest.raises(RunError, match=rf"gpu:0:? input .*{NORM}.*1 NaN"),
        LlamaModel(path, capacity=1 << 20, block=4, engine="ray", pool=pool, weights=weights) as m,
    ):
        m.generate([5, 17, 3], 2)


@pytest.mark.ray
@pytest.mark.slow
def test_as_a_user_runs_it(good, tmp_path, ray_address):  # noqa: F811
    """`python -m disco_ray` with the default ray engine (joining a running Ray): one line, exit 2,
    no file."""
    path = one_nan_norm(good, tmp_path / "ck")
    out = tmp_path / "logits.npz"
    argv = [a for a in _generate(path, out, "--weights", "disk") if a not in ("--engine", "local")]
    r = run_cli(*argv, env=joining(ray_address))
    assert_one_line(r.returncode, r.stderr, NORM, "NaN")
    assert not out.exists()


# ---- dtypes: refused when the checkpoint is opened ------------------------------------------------
def test_a_float_weight_declared_i32_is_refused_by_name_before_any_run(good, tmp_path, capsys):
    path = declared_i32(good, tmp_path / "ck")
    with pytest.raises(UsageError, match=rf"tensor '{POST_NORM}' has dtype I32; a weight must be F32"):
        Checkpoint(path)
    out = tmp_path / "logits.npz"
    rc, _, err = _cli(_generate(path, out), capsys)
    assert_one_line(rc, err, POST_NORM, "I32")
    assert not out.exists()
    data = tmp_path / "tokens.npy"
    np.save(data, np.zeros((1, 6), dtype=np.int64))
    rc, _, err = _cli(["finetune", path, "--data", data, "--steps", "1", "--lr", "0.1", "--capacity",
                       "1MiB", "--out", tmp_path / "ad", "--engine", "local"], capsys)  # fmt: skip
    assert_one_line(rc, err, POST_NORM, "I32")
    assert not (tmp_path / "ad").exists()


# ---- logits: checked at every step before a token is chosen ---------------------------------------
def test_a_nonfinite_logit_names_the_step_and_the_sequence():
    logits = torch.zeros(3, 10)
    logits[1, 4] = float("nan")
    for params in (SamplingParams(), SamplingParams(do_sample=True, seed=1)):
        with pytest.raises(NonFiniteError, match=r"decode step 7: the logits of sequence 12 hold 1 NaN"):
            sample(logits, params, [], step=7, rows=[4, 12, 30])
    logits[1, 4] = float("-inf")
    with pytest.raises(NonFiniteError, match=r"the prefill: the logits of position 1 hold 0 NaN and 1 inf"):
        check_logits(logits, 0, row="position")
    check_logits(torch.zeros(2, 5), 3)  # finite rows pass


@pytest.mark.parametrize("how", [[], ["--do-sample", "--seed", "3"]])
def test_overflowing_logits_end_the_generation_with_one_line(good, tmp_path, capsys, how):
    path = huge_final_norm(good, tmp_path / "ck")
    argv = [a for a in _generate(path, tmp_path / "l.npz") if a not in ("--logits", tmp_path / "l.npz")]
    rc, stdout, err = _cli(argv + how, capsys)
    assert_one_line(rc, err, "the prefill: the logits of sequence 0 hold 128 NaN", "no token is sampled")
    assert not stdout
    with LlamaModel(path, capacity=1 << 20, block=4, engine="local") as m:
        with pytest.raises(NonFiniteError, match="the logits of position 0"):
            m.prefill([5, 17, 3])
        with pytest.raises(
            NonFiniteError, match=r"the prefill: the logits of sequence 5 .*\(2 of the 2 rows have some\)"
        ):
            sampled = SamplingParams(do_sample=True, seed=2)
            m.generate([[5, 17], [3, 4, 5]], 2, sampling=sampled, indices=[5, 9])  # named by its index


def test_a_decode_step_names_itself_and_the_sequence(good, monkeypatch):
    """A NaN that appears at a later step (the run's logits corrupted after it, as an overflow in
    one row's activations would): the batch path and the one-prompt path name the step."""
    from disco_ray.graph import kernels

    real, steps = kernels.IMPLS["sample_tokens"], [0]

    def nan_at_step_2(out, ins, attrs):  # the decode graph's token choice, on the device
        steps[0] += 1
        if steps[0] == 2:
            ins[0][1, 7] = float("nan")  # the second live row
        return real(out, ins, attrs)

    monkeypatch.setitem(kernels.IMPLS, "sample_tokens", nan_at_step_2)
    with LlamaModel(str(good), capacity=1 << 20, block=4, engine="local") as m:
        with pytest.raises(NonFiniteError, match=r"^decode step 2: the logits of sequence 9 hold 1 NaN"):
            m.generate([[5, 17], [3, 4, 5], [8]], 4, indices=[5, 9, 11], stop_at_eos=False, micro=1)
        one = m._run

        def nan_in_decode(key, *a, **k):
            logits, first, dt = one(key, *a, **k)
            if key[0] == "decode" and a[1] == 5:  # the third decode step of a 3-token prompt
                logits[0, 0] = float("inf")
            return logits, first, dt

        monkeypatch.setattr(m, "_run", nan_in_decode)
        with pytest.raises(
            NonFiniteError, match=r"^decode step 3: the logits of sequence 0 hold 0 NaN and 1 inf"
        ):
            m.generate([5, 17, 3], 5, stop_at_eos=False)


def test_prefill_logits_holding_nan_are_not_written(good, tmp_path, capsys):
    path = huge_final_norm(good, tmp_path / "ck")
    out = tmp_path / "logits.npz"
    argv = [a if a != "3" else "0" for a in _generate(path, out)]  # prefill only: the logits are the answer
    rc, stdout, err = _cli(argv, capsys)
    assert_one_line(rc, err, "the prefill: the logits of position 0 hold")
    assert not out.exists() and not stdout


# ---- training: the adapter read, each step's loss, the adapter written ----------------------------
@pytest.fixture(scope="module")
def adapter_dir(good, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("adapter")
    cfg = Checkpoint(good).config
    from workloads.llm.train import LoraSpec, module_dims

    spec = LoraSpec(rank=2, alpha=4, targets=("q_proj", "v_proj"))
    dims = {m: module_dims(cfg, m) for m in spec.targets}
    tensors = adapter.init(spec, cfg.layers, dims, seed=1)
    adapter.save(path, spec, {k: v + 0.01 for k, v in tensors.items()}, str(good))
    return path


def _adapter_with(src: Path, where: Path, value: float) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, where)
    f = where / adapter.WEIGHTS
    w = load_file(str(f))
    k = adapter.key(1, "v_proj", "B")
    w[k][0, 0] = value
    if value > 1:  # huge but finite: every value of the matrix, so the loss overflows
        w[k].fill_(value)
        w[adapter.key(1, "v_proj", "A")].fill_(value)
    save_file(w, str(f))
    return where


def _finetune(good: Path, tmp_path: Path, init: Path, out: Path) -> list:
    data = tmp_path / "tokens.npy"
    np.save(data, np.arange(12, dtype=np.int64).reshape(2, 6))
    return ["finetune", good, "--data", data, "--steps", "2", "--lr", "0.01", "--capacity", "1MiB",
            "--out", out, "--init-adapter", init, "--engine", "local", "--block", "4"]  # fmt: skip


def test_a_nan_init_adapter_is_refused_by_tensor_name(good, adapter_dir, tmp_path, capsys):
    bad = _adapter_with(adapter_dir, tmp_path / "nan", float("nan"))
    name = adapter.key(1, "v_proj", "B")
    with pytest.raises(UsageError, match=rf"'{name}' holds 1 NaN and 0 infinite values"):
        LoraTrainer(str(good), capacity=1 << 20, init_adapter=str(bad), engine="local")
    out = tmp_path / "out"
    rc, stdout, err = _cli(_finetune(good, tmp_path, bad, out), capsys)
    assert_one_line(rc, err, name, "NaN")
    assert not out.exists() and not stdout


def test_a_nonfinite_loss_names_the_step_and_keeps_the_last_adapter(good, adapter_dir, tmp_path, capsys):
    huge = _adapter_with(adapter_dir, tmp_path / "huge", 1e30)
    out = tmp_path / "out"
    shutil.copytree(adapter_dir, out)  # the last good adapter, written by an earlier run
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    rc, stdout, err = _cli(_finetune(good, tmp_path, huge, out), capsys)
    assert_one_line(rc, err, "step 1: the loss is", "never written")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before and not stdout
    with LoraTrainer(str(good), capacity=1 << 20, init_adapter=str(huge), engine="local", block=4) as tr:
        with pytest.raises(NonFiniteError, match=r"step 1: the loss is (nan|inf)"):
            tr.train(torch.arange(12).reshape(2, 6), 2)
        assert tr.steps_done == 1  # the second step never ran
        with pytest.raises(NonFiniteError, match=r"not written: step 1's loss"):
            tr.save_adapter(str(tmp_path / "never"))
    assert not (tmp_path / "never").exists()


def test_an_adapter_holding_nan_is_never_written(adapter_dir, tmp_path):
    from workloads.llm.train import LoraSpec

    tensors = {adapter.key(0, "q_proj", "A"): torch.tensor([[1.0, float("inf")]])}
    with pytest.raises(NonFiniteError, match=r"'base_model.*q_proj.lora_A.weight' holds 0 NaN and 1 inf"):
        adapter.save(tmp_path / "a", LoraSpec(rank=1, targets=("q_proj",)), tensors, "base")
    assert not (tmp_path / "a").exists()


def test_from_disk_each_block_is_checked_at_its_first_read_only(good, monkeypatch):
    """`--weights disk` reads every block at every load; the check runs once per block."""
    from actors.tiers.diskio import FileReader
    from disco_ray.graph import sources

    seen: list[str] = []
    reads = [0]
    check, read = sources.check_finite, FileReader.read
    monkeypatch.setattr(sources, "check_finite", lambda t, w, s=None: (seen.append(w), check(t, w, s)))
    monkeypatch.setattr(FileReader, "read", lambda *a: (reads.__setitem__(0, reads[0] + 1), read(*a))[1])
    with LlamaModel(str(good), capacity=1 << 16, block=4, engine="local", weights="disk") as m:
        m.generate([5, 17, 3], 3, stop_at_eos=False)
        m.generate([5, 17, 3], 3, stop_at_eos=False)
    assert len(seen) == len(set(seen)) >= 9 * 2 and reads[0] > 3 * len(seen), (len(seen), reads[0])


def test_a_failed_write_leaves_the_previous_adapter_whole(adapter_dir, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from workloads.llm.train import LoraSpec

    out = tmp_path / "a"
    shutil.copytree(adapter_dir, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    tensors = {k: v * 2 for k, v in load_file(out / adapter.WEIGHTS).items()}

    def full(*_a, **_k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(adapter.json, "dumps", full)  # the config, written after the weights, fails
    with pytest.raises(OSError, match="No space"):
        adapter.save(out, LoraSpec(rank=2, alpha=4, targets=("q_proj", "v_proj")), tensors, "base")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # no temporary left either
