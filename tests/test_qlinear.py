"""The fused quantized ops (docs/QUANTIZATION.md#the-fused-cpu-path): Layout.CPU is the layout of
torch's CPU int4 kernel, `qlinear` and `qembedding` against dequantize-then-linear and lookup, and
a tiny LLaMA whose every packed weight takes the fused path."""

from __future__ import annotations

import pytest
import torch

from disco_ray.graph.errors import FormatError
from disco_ray.graph.kernels_quant import KERNEL_ROWS, KERNELS, dequantize, quantize
from disco_ray.graph.quant import Layout, Quant
from disco_ray.models import LlamaModel
from tests import family_oracle as oracle

ARCH = "LlamaForCausalLM"
# qlinear on Layout.CPU rounds x and the product to bfloat16 (8 significant bits): max |error|
# over max |x @ w^T| of the float32 product by the same dequantized weight (measured: 3e-3)
BF16_REL = 1e-2
# the tiny model of tests/family_oracle.py with every projection and the table a whole number of
# 64-row blocks and 64-column groups, so that all of them take Layout.CPU
FITS = {"intermediate_size": 128, "num_key_value_heads": 4}
SHAPES = [(128, 256, 64), (64, 96, 32), (192, 512, 128)]  # rows, cols, group


def _weight(rows: int, cols: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=gen) + torch.rand(rows, 1, generator=gen)  # rows off zero


def _codes(packed: torch.Tensor, q: Quant, cols: int) -> torch.Tensor:
    """The codes [rows, cols] (int32) of a Layout.ROWS packed weight."""
    cb = q.code_bytes(cols)
    if q.bits == 8:
        return packed[:, :cols].int()
    c = torch.stack([packed[:, :cb] & 15, packed[:, :cb] >> 4], dim=-1)
    return c.view(packed.shape[0], -1)[:, :cols].int()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows, cols, group", SHAPES)
def test_cpu_layout_is_torchs_int4pack(bits, rows, cols, group):
    # each plane (int8: the high nibbles', then the low ones') as _convert_weight_to_int4pack_for_cpu lays it
    w = _weight(rows, cols, 0)
    codes = _codes(quantize(w, Quant(bits, group)), Quant(bits, group), cols)
    packed = quantize(w, Quant(bits, group, Layout.CPU))
    planes = [codes] if bits == 4 else [codes >> 4, codes & 15]
    n = rows * cols // 2
    for k, plane in enumerate(planes):
        want = torch.ops.aten._convert_weight_to_int4pack_for_cpu(plane.contiguous(), 1)
        assert torch.equal(packed.view(-1)[k * n : (k + 1) * n].view(rows, cols // 2), want), k


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows, cols, group", SHAPES)
def test_cpu_layout_dequantizes_within_bfloat16_of_rows(bits, rows, cols, group):
    # scale' = lift s and zero' = zero + 8 lift s in bfloat16 (rel. error 2^-9 each) move a value
    # by at most 2^-9 (|zero| + 16 lift s); 2^-8 leaves room for float32 rounding
    w = _weight(rows, cols, 1)
    q = Quant(bits, group)
    packed = quantize(w, q)
    cb, ng, lift = q.code_bytes(cols), q.groups(cols), 1 << (bits - 4)
    sz = packed[:, cb:].contiguous().view(torch.float16).view(rows, 2, ng).float()
    bound = 2**-8 * (sz[:, 1].abs() + 16 * lift * sz[:, 0]).repeat_interleave(group, dim=1)
    got = dequantize(quantize(w, Quant(bits, group, Layout.CPU)), Quant(bits, group, Layout.CPU), cols)
    assert ((got - dequantize(packed, q, cols)).abs() <= bound).all()


def _qlinear(x: torch.Tensor, packed: torch.Tensor, q: Quant, cols: int) -> torch.Tensor:
    out = torch.empty(*x.shape[:-1], packed.shape[0])
    KERNELS["qlinear"](
        out, [x, packed], {"bits": q.bits, "group": q.group, "cols": cols, "layout": q.layout.value}
    )
    return out


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows, cols, group", SHAPES)
@pytest.mark.parametrize("m", [1, 16, KERNEL_ROWS + 1])
def test_qlinear_is_dequantize_then_linear(bits, rows, cols, group, m):
    w = _weight(rows, cols, 2)
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(3))
    for layout in Layout:
        q = Quant(bits, group, layout)
        packed = quantize(w, q)
        got, want = _qlinear(x, packed, q, cols), x @ dequantize(packed, q, cols).t()
        err = float((got - want).abs().max() / want.abs().max())
        # Layout.ROWS and past KERNEL_ROWS: the float32 product itself; the int4 kernel: bfloat16
        assert err <= (BF16_REL if layout is Layout.CPU and m <= KERNEL_ROWS else 1e-6), (layout, err)


@pytest.mark.parametrize("layout", list(Layout))
def test_qembedding_is_the_dequantized_rows_and_zeros_outside(layout):
    rows, cols, q = 128, 64, Quant(8, 32, layout)
    packed = quantize(_weight(rows, cols, 4), q)
    ids = torch.tensor([[100, 0, 63, 64, 127, 227, 99]])  # start 100: local 0, -100, ..., 127, -1
    out = torch.empty(1, 7, cols)
    at = {"bits": 8, "group": 32, "cols": cols, "layout": layout.value, "start": 100, "dtype": "float32"}
    KERNELS["qembedding"](out, [ids, packed], at)
    full = dequantize(packed, q, cols)
    for k, i in enumerate(ids[0].tolist()):
        want = full[i - 100] if 0 <= i - 100 < rows else torch.zeros(cols)
        assert torch.equal(out[0, k], want), i


def test_dequant_of_a_row_span_of_the_cpu_layout():
    # the LM head's blocks and LoRA's backward read spans that need not start on a 64-row block
    q = Quant(4, 64, Layout.CPU)
    packed = quantize(_weight(192, 128, 5), q)
    full = dequantize(packed, q, 128)
    for start, stop in [(0, 192), (5, 70), (64, 128), (130, 192)]:
        out = torch.empty(stop - start, 128)
        KERNELS["dequant"](
            out, [packed], {"bits": 4, "group": 64, "cols": 128, "layout": "cpu", "start": start}
        )
        assert torch.equal(out, full[start:stop]), (start, stop)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("ck")
    return str(path), oracle.save(ARCH, path, **FITS)


def test_every_packed_weight_takes_the_fused_path_and_int8_keeps_the_tokens(tiny):
    path, hf = tiny
    with torch.no_grad():
        want = hf(torch.tensor([oracle.PROMPT])).logits[0]
    cap = oracle.capacity(path, 1, "tight", len(oracle.PROMPT), 6)
    with LlamaModel(path, capacity=cap, block=oracle.BLOCK, engine="local", quantize="int8", check=True) as m:
        assert oracle.rel_err(m.prefill(oracle.PROMPT), want) <= 3e-2  # test_quantize's INT8_LOGITS
        assert m.generate(oracle.PROMPT, 6, stop_at_eos=False) == oracle.greedy(hf, oracle.PROMPT, 6)
        tg = next(iter(m._plans.values()))[0].taskgraph
        ops = {v.op for v in tg}
        packed = [v for v in tg if v.dtype == "uint8"]
    assert packed and all(v.source.quant.layout is Layout.CPU for v in packed)
    assert {"qlinear", "qembedding"} <= ops and "dequant" not in ops, ops


def test_int4_on_the_fused_path_agrees_with_the_float_model(tiny):
    path, hf = tiny
    with torch.no_grad():
        want = hf(torch.tensor([oracle.PROMPT])).logits[0]
    cap = oracle.capacity(path, 1, "roomy", len(oracle.PROMPT), 6)
    with LlamaModel(path, capacity=cap, block=oracle.BLOCK, engine="local", quantize="int4") as m:
        logits = m.prefill(oracle.PROMPT)
    assert float((logits.argmax(-1) == want.argmax(-1)).float().mean()) >= 0.8  # test_quantize's INT4_TOP1


def test_the_cpu_layout_only_where_it_fits_and_in_json():
    q = Quant(4, 64, Layout.CPU)
    assert q.for_weight((128, 256)) is q
    assert q.for_weight((96, 256)).layout is Layout.ROWS  # rows not a multiple of 64
    assert q.for_weight((128, 100)).layout is Layout.ROWS  # a short last group
    assert Quant(4, 16, Layout.CPU).for_weight((128, 256)).layout is Layout.ROWS  # group not 32..256
    with pytest.raises(ValueError, match="layout cpu needs rows a multiple of 64"):
        quantize(torch.zeros(96, 256), q)
    assert Quant.from_dict(q.to_dict(), "x") == q
    assert "layout" not in Quant(4, 64).to_dict()  # files and graphs of the portable layout as before
    with pytest.raises(FormatError, match=r"x: \"source.quant.layout\" must be"):
        Quant.from_dict({"bits": 4, "layout": "cuda"}, "x")
