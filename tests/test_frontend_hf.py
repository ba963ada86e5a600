"""`from_torch` on Hugging Face causal LMs (GPT-2, LLaMA, Mistral, Qwen2, Phi-3; tiny random
configs of the transformers classes) against their own forward, on 2 GPUs at a capacity where
the plan offloads; attention masks (an HF padding mask as int64 and bool, a float mask, a bool
key padding mask, is_causal) and keyword and non-tensor arguments; what depends on shapes alone
is folded at capture; the mask ops' kernels against torch's indexing."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn
from torch.nn import functional as F

import disco_ray
from disco_ray.graph.errors import RunError
from disco_ray.graph.kernels import run_kernel
from disco_ray.graph.ops_mask import index_shape
from tests.ray_fixtures import pool  # noqa: F401  (module fixture)

SIZES = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
HEADS = dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
HF = {  # name: (config class, model class, config arguments)
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        dict(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64),
    ),
    "llama": ("LlamaConfig", "LlamaForCausalLM", {**SIZES, **HEADS}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {**SIZES, **HEADS, "sliding_window": 4}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {**SIZES, **HEADS}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {**SIZES, **HEADS, "pad_token_id": 0}),
}
IDS = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
FULL = torch.ones(2, 8, dtype=torch.long)
PADDED = FULL.clone()
PADDED[0, :3] = 0  # the first row left-padded by 3 tokens


def _hf(name: str) -> nn.Module:
    cfg, cls, kw = HF[name]
    torch.manual_seed(0)
    return getattr(transformers, cls)(getattr(transformers, cfg)(**kw)).eval()


def _logits(net, **kw) -> torch.Tensor:
    with torch.no_grad():
        return net(IDS, **kw).logits


def _close(got, want) -> None:
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def _offloading(model):
    """The same graph planned barely above its largest vertex on each GPU: values must move out."""
    least, roomy = model.capacity_bounds()
    assert least[0] + 512 < roomy[0]
    return model.with_capacity([n + 512 for n in least])


@pytest.mark.parametrize(
    "name, split", [*((n, "tensor") for n in HF), ("gpt2", "layers"), ("phi3", "layers")]
)
def test_a_causal_lm_gives_its_forwards_logits_on_2_gpus_at_an_offloading_capacity(name, split):
    net = _hf(name)
    # use_cache left out: captured with use_cache=False (a cache object is no tensor output)
    kw = {"attention_mask": PADDED}
    model = disco_ray.from_torch(net, (IDS,), example_kwargs=kw, gpus=2, split=split, engine="local")
    assert model.output_names == ["logits"]
    tight = _offloading(model)
    for mask in (PADDED, FULL):  # the mask is an input of the graph: any values, one capture
        res = tight.run(IDS, attention_mask=mask)
        assert res.details.plan.stats["bytes_reloaded"] > 0
        _close(res.outputs["logits"], _logits(net, attention_mask=mask))
    _close(tight(IDS, attention_mask=PADDED).logits, _logits(net, attention_mask=PADDED))
    for m in (model, tight):
        m.close()


def test_without_a_mask_positions_rotary_tables_and_the_causal_mask_are_folded_at_capture():
    net = _hf("llama")
    model = disco_ray.from_torch(net, IDS, gpus=2, engine="local")
    used = {v.op for v in model.taskgraph if v.kind.value == "kernel"}
    # arange, cumsum, comparisons, index, sin, cos: all shape-only, run once while capturing
    assert not used & {"index", "le", "eq", "logical_and", "sin", "cos"}, used
    consts = [i for i in model.weights.handed if model.weights.handed[i][0] not in net.state_dict()]
    assert {model.taskgraph[i].dtype for i in consts} >= {"bool", "float32"}  # the mask, the tables
    _close(model(IDS).logits, _logits(net))
    model.close()


def test_a_bool_padding_mask_and_the_arguments_fixed_at_capture():
    net = _hf("qwen2")
    mask = PADDED.bool()
    model = disco_ray.from_torch(net, IDS, example_kwargs={"attention_mask": mask}, gpus=2, engine="local")
    assert model.taskgraph["attention_mask"].dtype == "bool"
    _close(model(IDS, attention_mask=mask).logits, _logits(net, attention_mask=mask))
    _close(model(IDS, attention_mask=mask, use_cache=False).logits, _logits(net, attention_mask=mask))
    with pytest.raises(RunError, match=r"input 'use_cache' was False when captured, got True"):
        model(IDS, attention_mask=mask, use_cache=True)
    with pytest.raises(RunError, match=r"keyword argument\(s\) position_ids were not given when captured"):
        model(IDS, attention_mask=mask, position_ids=torch.arange(8)[None])
    with pytest.raises(RunError, match=r"keyword argument 'attention_mask' \(a tensor when captured\)"):
        model(IDS)
    model.close()


class Attention(nn.Module):
    """Self-attention whose forward takes a float (non-tensor) scale, a mask and is_causal."""

    def __init__(self, d: int = 32, heads: int = 4):
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x, scale, attention_mask=None, is_causal=False):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        h = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attention_mask, is_causal=is_causal, scale=scale
        )
        return self.out(h.transpose(1, 2).reshape(b, t, d))


X = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))
CAUSAL = nn.Transformer.generate_square_subsequent_mask(8)  # float: 0 and -inf
KEEP = torch.ones(2, 1, 1, 8, dtype=torch.bool)
KEEP[0, ..., 5:] = False  # bool: the first row's last 3 keys masked out


@pytest.mark.parametrize(
    "args, kwargs",
    [
        ((X, 0.5), {}),
        ((X, 0.5), {"is_causal": True}),
        ((X, 0.25), {"attention_mask": CAUSAL}),
        ((X, 0.25), {"attention_mask": KEEP}),
    ],
    ids=["scale", "is_causal", "float-mask", "bool-mask"],
)
def test_non_tensor_and_keyword_arguments_and_masks_equal_the_forward(args, kwargs):
    torch.manual_seed(0)
    net = Attention().eval()
    model = disco_ray.from_torch(net, args, example_kwargs=kwargs, gpus=2, engine="local")
    with torch.no_grad():
        _close(model(*args, **kwargs), net(*args, **kwargs))
    with pytest.raises(RunError, match=rf"input 'scale' was {args[1]} when captured, got 0.3: capture again"):
        model(X, 0.3, **kwargs)
    model.close()


@pytest.mark.filterwarnings("ignore:Support for mismatched src_key_padding_mask")
def test_torchs_encoder_layer_with_a_float_src_mask_and_a_bool_key_padding_mask():
    torch.manual_seed(0)
    net = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, batch_first=True).eval()
    kw = {"src_mask": CAUSAL, "src_key_padding_mask": ~KEEP[:, 0, 0]}
    model = disco_ray.from_torch(net, X, example_kwargs=kw, gpus=2, engine="local")
    with torch.no_grad():
        torch.testing.assert_close(model(X, **kw), net(X, **kw), atol=1e-5, rtol=1e-5)
    model.close()


class IntegerOps(nn.Module):
    """Integer and bool arithmetic on the call's own tensors: ids moved and compared, a keep mask
    combined, sin/cos of positions, an RMSNorm written out with rsqrt."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 8)

    def forward(self, ids, keep):
        j = ids * 2 + 1 - ids  # int64 arithmetic with Python ints
        j = torch.where(j > 30, j - 30, j)
        pos = ids / 7  # int / int: float
        h = self.emb(j) + (torch.sin(pos) * torch.cos(pos))[..., None]
        ok = ((ids != 3) & keep) | ~keep.logical_not().logical_or(ids < 2)
        h = h.masked_fill(~ok[..., None], -1.5)
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)


def test_integer_and_bool_arithmetic_on_the_calls_values():
    torch.manual_seed(0)
    net = IntegerOps().eval()
    gen = torch.Generator().manual_seed(2)
    ids, keep = torch.randint(0, 40, (2, 8), generator=gen), torch.rand(2, 8, generator=gen) > 0.3
    model = disco_ray.from_torch(net, (ids, keep), gpus=2, engine="local")
    used = {v.op for v in model.taskgraph if v.kind.value == "kernel"}
    assert {"gt", "ne", "lt", "where", "logical_and", "logical_not", "sin", "rsqrt"} <= used, used
    for _ in range(2):  # other values of the same shapes
        with torch.no_grad():
            _close(model(ids, keep), net(ids, keep))
        ids, keep = torch.randint(0, 40, (2, 8), generator=gen), torch.rand(2, 8, generator=gen) > 0.5
    model.close()


@pytest.mark.parametrize("dims", [[0], [1], [0, 1], [0, 2], [1, 2], [0, 1, 2]])
def test_the_index_op_is_torchs_advanced_indexing(dims):
    gen = torch.Generator().manual_seed(len(dims))
    x = torch.randn(3, 4, 5, generator=gen)
    idx = [torch.randint(0, x.shape[d], (2, 1) if k else (3,), generator=gen) for k, d in enumerate(dims)]
    at: list = [slice(None)] * 3
    for d, i in zip(dims, idx):
        at[d] = i
    want = x[tuple(at)]
    assert index_shape(tuple(x.shape), dims, [tuple(i.shape) for i in idx]) == tuple(want.shape)
    out = torch.empty_like(want)
    run_kernel("index", out, [x, *idx], {"dims": dims})
    assert torch.equal(out, want)


@pytest.mark.ray
def test_a_causal_lm_with_a_padding_mask_on_the_ray_workers_with_offload(pool):  # noqa: F811
    net = _hf("mistral")
    kw = {"attention_mask": PADDED}
    model = disco_ray.from_torch(net, IDS, example_kwargs=kw, gpus=2, engine="local")
    least, _ = model.capacity_bounds()
    model.close()
    model = disco_ray.from_torch(
        net, IDS, example_kwargs=kw, gpus=2, engine="ray", pool=pool, capacity=[n + 512 for n in least]
    )
    res = model.run(IDS, **kw)
    assert res.details.plan.stats["bytes_reloaded"] > 0
    _close(res.outputs["logits"], _logits(net, **kw))
    model.close()
