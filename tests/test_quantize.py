"""Weight-only quantization (docs/QUANTIZATION.md): the packing, a quantized tiny LLaMA's logits,
tokens and bytes moved, LoRA on a quantized base against peft, and the command line."""

from __future__ import annotations

import pytest
import torch

from actors.tiers.diskio import FileBlock
from disco_ray.cli.app import main
from disco_ray.graph.errors import FormatError, RunError, UsageError
from disco_ray.graph.kernels_quant import dequantize, quantize
from disco_ray.graph.memgraph import MKind
from disco_ray.graph.quant import Quant
from disco_ray.graph.sources import Source
from disco_ray.models import LlamaModel
from disco_ray.models.finetune import LoraTrainer
from disco_ray.models.graphs import capacity_bounds
from planner import build_memgraph, min_capacity, roomy_capacity
from tests import family_oracle as oracle
from workloads.llm.checkpoint import Checkpoint
from workloads.llm.model import decode_graph
from workloads.llm.train import LoraSpec, OptimSpec, train_graph

ARCH = "LlamaForCausalLM"
INT8_LOGITS = 3e-2  # int8 prefill logits: max |error| / max |logit| of the float model
INT4_TOP1 = 0.8  # int4: share of the prompt's positions whose argmax is the float model's


def on_grid(rows: int, cols: int, q: Quant, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Values code * scale + zero with a scale and zero of their own per row and group (exact in
    float16), every group holding codes 0 and 2^bits-1 (so min-max finds that scale and zero)."""
    gen = torch.Generator().manual_seed(seed)
    top, ng = (1 << q.bits) - 1, q.groups(cols)
    codes = torch.randint(0, top + 1, (rows, cols), generator=gen)
    for k in range(ng):
        lo, hi = k * q.group, min(cols, (k + 1) * q.group)
        codes[:, lo] = 0
        codes[:, hi - 1] = top if hi - lo > 1 else 0
    scale = torch.randint(1, 9, (rows, ng), generator=gen) / 64.0
    zero = torch.randint(-64, 64, (rows, ng), generator=gen) / 16.0
    idx = torch.arange(cols) // q.group
    return codes * scale[:, idx] + zero[:, idx], scale, zero


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("group, cols", [(32, 64), (64, 128), (128, 256), (32, 100), (64, 37), (16, 7)])
def test_round_trip_exact_on_the_grid(bits, group, cols):
    # a row length that is not a multiple of the group is handled: its last group is shorter
    q = Quant(bits, group)
    w, scale, zero = on_grid(6, cols, q, seed=bits * 1000 + cols)
    packed = quantize(w, q)
    assert packed.dtype == torch.uint8 and tuple(packed.shape) == q.packed_shape((6, cols))
    assert torch.equal(dequantize(packed, q, cols), w)
    sz = packed[:, q.code_bytes(cols) :].view(torch.float16).view(6, 2, -1).float()
    full = [k for k in range(q.groups(cols)) if min(cols, (k + 1) * q.group) - k * q.group > 1]
    assert torch.equal(sz[:, 0, full], scale[:, full]) and torch.equal(sz[:, 1], zero)


@pytest.mark.parametrize("bits", [8, 4])
def test_error_within_half_a_step(bits):
    q = Quant(bits, 64)
    w = torch.randn(16, 200, generator=torch.Generator().manual_seed(3))
    packed = quantize(w, q)
    err = (dequantize(packed, q, 200) - w).abs()
    step = packed[:, q.code_bytes(200) :].view(torch.float16).view(16, 2, -1)[:, 0].float()
    assert (err <= step[:, torch.arange(200) // 64] * 0.5 + 1e-3).all()


def test_packed_sizes():
    assert Quant(8, 64).packed_shape((10, 128)) == (10, 128 + 2 * 4)
    assert Quant(4, 64).packed_shape((10, 128)) == (10, 64 + 2 * 4)
    assert Quant(4, 64).packed_shape((10, 7)) == (10, 4 + 4)  # 4 bytes of codes: even, for alignment
    for bad in (dict(bits=3), dict(bits=8, group=0), dict(bits=True)):
        with pytest.raises(UsageError):
            Quant(**bad)


def test_a_block_beyond_float16_is_refused_naming_it(tmp_path):
    from safetensors.torch import save_file

    from disco_ray.graph import sources

    save_file({"w": torch.tensor([[-1e5, 1.0], [1.0, 2.0]])}, tmp_path / "m.safetensors")
    src = Source(str(tmp_path / "m.safetensors"), "w", (), True, Quant(8, 2))
    with pytest.raises(RunError, match=r"l0\.q: source w of .*int8, group 2.*cannot be quantized"):
        sources.read(src, (2, 6), "uint8", "l0.q")


def test_source_quant_round_trips_through_json():
    src = Source("m.safetensors", "w", ((0, 4), None), True, Quant(4, 32))
    assert src.to_dict()["quant"] == {"bits": 4, "group": 32}
    assert Source.from_dict(src.to_dict(), "x") == src
    for bad in ({"bits": 5}, {"group": 64}, [4], {"bits": 4, "group": 64, "sym": True}):
        with pytest.raises(FormatError, match=r"x: .*source\.quant"):
            Source.from_dict({"path": "m", "tensor": "w", "quant": bad}, "x")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("ck")
    return str(path), oracle.save(ARCH, path)


def _model(path: str, mode: str, quantize: str | None, **kw) -> LlamaModel:
    cap = oracle.capacity(path, 1, mode, len(oracle.PROMPT), 6)
    return LlamaModel(path, capacity=cap, block=oracle.BLOCK, engine="local", quantize=quantize, **kw)


def test_int8_logits_and_greedy_tokens(tiny):
    path, hf = tiny
    with torch.no_grad():
        want = hf(torch.tensor([oracle.PROMPT])).logits[0]
    with _model(path, "roomy", "int8", check=True) as m:
        assert oracle.rel_err(m.prefill(oracle.PROMPT), want) <= INT8_LOGITS
        assert m.generate(oracle.PROMPT, 6, stop_at_eos=False) == oracle.greedy(hf, oracle.PROMPT, 6)


def test_two_gpus_split_the_packed_shards(tiny):
    # o and down are split by input columns (32 and 48 per GPU): each row one short group of 64
    path, hf = tiny
    cap = oracle.capacity(path, 2, "tight", len(oracle.PROMPT), 5)
    with LlamaModel(path, gpus=2, capacity=cap, block=oracle.BLOCK, engine="local", quantize="int8") as m:
        assert m.generate(oracle.PROMPT, 5, stop_at_eos=False) == oracle.greedy(hf, oracle.PROMPT, 5)
        assert sum(p["bytes_reloaded"] for p in m.plans) > 0


def test_int4_top1_agreement_and_tight_equals_roomy(tiny):
    path, hf = tiny
    with torch.no_grad():
        want = hf(torch.tensor([oracle.PROMPT])).logits[0]
    tokens = {}
    for mode in ("roomy", "tight"):
        with _model(path, mode, "int4") as m:
            logits = m.prefill(oracle.PROMPT)
            tokens[mode] = m.generate(oracle.PROMPT, 6, stop_at_eos=False)
            reloaded = sum(p["bytes_reloaded"] for p in m.plans)
            assert (reloaded > 0) == (mode == "tight"), m.plans
        agree = float((logits.argmax(-1) == want.argmax(-1)).float().mean())
        assert agree >= INT4_TOP1, agree
    assert tokens["tight"] == tokens["roomy"]


def _weight_bytes_moved(ck: Checkpoint) -> tuple[int, int]:
    """(bytes of the projection weights in a decode graph, bytes its tight plan loads and reloads
    of them)."""
    tg = decode_graph(ck, 1, 3, oracle.BLOCK).taskgraph
    weights = {v.id for v in tg if v.source is not None and v.source.tensor in _projections(ck.path)}
    cap = max(min_capacity(tg)[0] + 4096, roomy_capacity(tg)[0] // 4)
    mg = build_memgraph(tg, cap)
    moved = sum(
        v.out.nbytes for v in mg.vertices if v.value in weights and v.kind in (MKind.INPUT, MKind.RELOAD)
    )
    return sum(tg[w].nbytes for w in weights), moved


def test_plans_move_the_packed_bytes(tiny):
    path, _ = tiny
    ck = Checkpoint(path)
    tg = decode_graph(ck.quantized(Quant(4, 32)), 1, 1, oracle.BLOCK).taskgraph
    assert tg["embed_g0"].source.quant == Quant(8, 32)  # the tables: int8 whatever the layers' bits
    assert tg["head_g0"].source.quant == Quant(8, 32) and tg["l0.q_g0"].source.quant == Quant(4, 32)
    assert tg["norm_g0"].dtype == tg["l0.attn_norm_g0"].dtype == "float32"
    whole, moved = _weight_bytes_moved(ck)
    assert whole == 4 * sum(t.numel() for n, t in _projections(path).items())
    for name, ratio in (("int8", 3.5), ("int4", 6.0)):
        q = Quant.named(name)
        packed, packed_moved = _weight_bytes_moved(ck.quantized(q))
        want = sum(
            q.packed_shape(tuple(t.shape))[0] * q.packed_shape(tuple(t.shape))[1]
            for t in _projections(path).values()
        )
        assert packed == want and whole / packed >= ratio, (name, whole, packed)
        assert packed_moved >= packed and moved / packed_moved >= ratio * 0.9, (name, moved, packed_moved)


def test_the_least_capacity_of_a_quantized_model_runs(tiny):
    # its bounds are the quantized graphs': a dequantized weight and its packed form at once
    path, hf = tiny
    kw = dict(prompt=len(oracle.PROMPT), new_tokens=4, block=oracle.BLOCK)
    low = capacity_bounds(path, quantize="int8", **kw).min
    assert low != capacity_bounds(path, **kw).min
    with LlamaModel(path, capacity=low, block=oracle.BLOCK, engine="local", quantize="int8") as m:
        assert m.generate(oracle.PROMPT, 4, stop_at_eos=False) == oracle.greedy(hf, oracle.PROMPT, 4)


def _projections(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    t = load_file(f"{path}/model.safetensors")
    return {n: w for n, w in t.items() if n.startswith("model.layers.") and w.dim() == 2}


def test_weights_from_disk_stream_the_packed_bytes(tiny):
    path, hf = tiny
    q = Quant(4, 32)
    tg = decode_graph(Checkpoint(path).quantized(q), 1, 1, oracle.BLOCK).taskgraph
    v = tg["l1.down_g0"]
    block = FileBlock.of(v)  # what each load of it reads: its packed bytes, packed once
    assert (block.file_dtype, block.nbytes, block.cols) == ("uint8", v.nbytes, None)
    want = quantize(_projections(path)["model.layers.1.mlp.down_proj.weight"], q)
    assert torch.equal(torch.from_file(block.path, size=block.nbytes, dtype=torch.uint8).view(v.shape), want)
    with _model(path, "tight", "int8", weights="disk") as m:
        assert m.generate(oracle.PROMPT, 6, stop_at_eos=False) == oracle.greedy(hf, oracle.PROMPT, 6)


def test_lora_on_an_int8_base_matches_peft_on_the_dequantized_base(tiny, tmp_path):
    import transformers

    path, _ = tiny
    q = Quant(8, 64)
    ref = transformers.LlamaForCausalLM.from_pretrained(path)
    with torch.no_grad():  # the reference: the base with each matrix as int8 dequantizes it
        for p in ref.parameters():
            if p.dim() == 2:
                p.copy_(dequantize(quantize(p, q), q, p.shape[1]))
    ref.save_pretrained(tmp_path / "deq")
    targets = ["q_proj", "v_proj", "down_proj"]
    adapter = oracle.random_adapter(path, ARCH, targets, tmp_path / "adapter")
    data = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    want, _ = oracle.peft_train(str(tmp_path / "deq"), ARCH, adapter, data, steps=4)
    lora = LoraSpec(rank=4, alpha=8, targets=tuple(targets))
    tg = train_graph(Checkpoint(path).quantized(q), 1, 2, 9, oracle.BLOCK, lora, OptimSpec(lr=1e-2)).taskgraph
    with LoraTrainer(
        path, capacity=roomy_capacity(tg)[0], init_adapter=adapter, optim=OptimSpec(lr=1e-2),
        block=oracle.BLOCK, engine="local", quantize="int8",
    ) as tr:  # fmt: skip
        got = tr.train(data, steps=4)
    assert got[-1] < got[0]
    for a, b in zip(got, want):
        assert abs(a - b) <= 1e-4 * abs(b), (got, want)


def test_cli_quantize(tiny, capsys):
    path, _ = tiny
    ids = ",".join(map(str, oracle.PROMPT))
    run = [
        "generate",
        path,
        "--prompt-ids",
        ids,
        "--max-new-tokens",
        "4",
        "--capacity",
        "4MiB",
        "--engine",
        "local",
    ]
    assert main([*run, "--quantize", "int4", "--quant-group", "32", "--block", "4"]) == 0
    assert len(capsys.readouterr().out.strip().split(",")) == 4
    for bad in (["--quantize", "int3"], ["--quant-group", "0"], ["--quant-group", "x"]):
        code = main([*run, *bad])
        out, err = capsys.readouterr()
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
        assert bad[0] in err


@pytest.mark.parametrize(
    "arch, over",
    [("Gemma2ForCausalLM", {"head_dim": 16}), ("Phi3ForCausalLM", {}), ("Qwen2ForCausalLM", {})],
)
def test_int8_on_the_other_families(arch, over, tmp_path):
    # Gemma 2: a tied, scaled embedding and a soft-capped head; Phi-3: fused projections; Qwen2: biases
    hf = oracle.save(arch, tmp_path, **over)
    cap = oracle.capacity(str(tmp_path), 2, "tight", len(oracle.PROMPT), 5)
    with torch.no_grad():
        want = hf(torch.tensor([oracle.PROMPT])).logits[0]
    with LlamaModel(
        str(tmp_path), gpus=2, capacity=cap, block=oracle.BLOCK, engine="local", quantize="int8"
    ) as m:
        assert oracle.rel_err(m.prefill(oracle.PROMPT), want) <= INT8_LOGITS
        assert m.generate(oracle.PROMPT, 5, stop_at_eos=False) == oracle.greedy(hf, oracle.PROMPT, 5)
