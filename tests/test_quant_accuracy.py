"""benchmarks/bench_quant_accuracy.py: its KL divergence, top-1 and loss against cases computed by
hand, and one run end to end on the tiny random LLaMA (tests/family_oracle.py)."""

from __future__ import annotations

import importlib.util
import json
import math
import pathlib

import pytest
import torch

from tests import family_oracle as oracle

TEXT = "The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. " * 3


def _load():
    path = pathlib.Path(__file__).parents[1] / "benchmarks" / "bench_quant_accuracy.py"
    spec = importlib.util.spec_from_file_location("bench_quant_accuracy", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


bench = _load()


def test_identical_logits_give_kl_zero_and_full_agreement():
    x = torch.randn(7, 50, generator=torch.Generator().manual_seed(0)) * 5
    assert bench.kl_divergence(x, x).abs().max() < 1e-12
    assert (
        bench.kl_divergence(x, x + 3.0).abs().max() < 1e-12
    )  # a shift of every logit: the same distribution
    assert bench.top1_agreement(x, x) == 1.0


def test_kl_of_a_case_by_hand():
    # p = (1/2, 1/2), q = (3/4, 1/4): KL(p || q) = 1/2 ln(2/3) + 1/2 ln 2 = 1/2 ln(4/3)
    ref, got = (
        torch.tensor([[0.0, 0.0]], dtype=torch.float64),
        torch.tensor([[math.log(3.0), 0.0]], dtype=torch.float64),
    )
    assert bench.kl_divergence(ref, got).item() == pytest.approx(0.5 * math.log(4 / 3), abs=1e-12)
    # the other direction differs (3/4 ln(3/2) + 1/4 ln(1/2)): the float model is the reference
    assert bench.kl_divergence(got, ref).item() == pytest.approx(0.75 * math.log(1.5) + 0.25 * math.log(0.5))


def test_top1_and_loss_of_a_case_by_hand():
    ref = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 2.0]])
    got = torch.tensor([[2.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 1.0, 0.5]])
    assert bench.top1_agreement(ref, got) == pytest.approx(1 / 3)
    # row 0 predicts token 2 with logits (1, 0, 0): -ln(1 / (e + 2)); row 1 token 1: -ln(e / (e + 2))
    loss = bench.next_token_loss(ref, torch.tensor([9, 2, 1]))
    want = [math.log(math.e + 2), math.log(math.e + 2) - 1]
    assert loss.tolist() == pytest.approx(want, abs=1e-12)


def test_float_stats_of_a_flat_and_a_peaked_row():
    entropy, margin = bench.float_stats(torch.tensor([[0.0, 0.0, 0.0, 0.0], [9.0, 1.0, 0.0, 0.0]]))
    assert entropy[0].item() == pytest.approx(math.log(4)) and margin[0].item() == 0.0
    assert entropy[1].item() < 0.01 and margin[1].item() == 8.0


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    path = tmp_path_factory.mktemp("ck")
    hf = oracle.save("LlamaForCausalLM", path)
    text = path / "text.txt"
    text.write_text(TEXT)
    out = path / "acc.json"
    argv = ["--dir", str(path), "--text", str(text), "--windows", "2", "--length", "24", "--block", "4"]
    assert bench.main([*argv, "--json", str(out)]) == 0
    return path, hf, json.loads(out.read_text())


def test_end_to_end_on_the_tiny_checkpoint(run):
    _, hf, got = run
    assert [(r["weights"], r["group"]) for r in got["rows"]] == [
        (f"int{b}", g) for b in (8, 4) for g in (32, 64, 128)
    ]
    # the float reference's loss is transformers' on the same windows (bytes of TEXT as ids)
    ids = torch.tensor(list(TEXT.encode())[:48]).view(2, 24)
    with torch.no_grad():
        want = sum(float(hf(input_ids=r[None], labels=r[None]).loss) for r in ids) / 2
    assert got["float32_loss"] == pytest.approx(want, rel=1e-4)
    assert got["ln_vocab"] == pytest.approx(math.log(128))
    for r in got["rows"]:
        assert 0 <= r["kl_mean"] <= r["kl_max"] and r["max_abs_err"] > 0, r
        if r["weights"] == "int8":  # as tests/test_quantize.py's tolerance: int8 near the float model
            assert r["kl_mean"] < 1e-3 and r["top1"] >= 0.9, r
    int8, int4 = got["rows"][1], got["rows"][4]  # group 64 both
    assert int4["kl_mean"] > int8["kl_mean"] and int4["max_abs_err"] > int8["max_abs_err"]


def test_a_byte_beyond_the_vocabulary_is_refused(run, tmp_path, capsys):
    path = run[0]
    text = tmp_path / "t.txt"
    text.write_text("caf\u00e9 " * 40)  # é is two bytes, 0xc3 0xa9: beyond the tiny model's 128
    assert bench.main(["--dir", str(path), "--text", str(text), "--windows", "1", "--length", "8"]) == 2
    err = capsys.readouterr().err
    assert "byte" in err and "195 at token 3 is outside the vocabulary 0..127" in err


def test_a_missing_text_file_is_refused_naming_it(run, tmp_path, capsys):
    gone = tmp_path / "gone.txt"
    assert bench.main(["--dir", str(run[0]), "--text", str(gone)]) == 2
    assert f"error: --text {gone}: " in capsys.readouterr().err
