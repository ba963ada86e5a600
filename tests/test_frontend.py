"""`from_torch` against the module's own forward: an MLP, torch's transformer encoder layer and an
MLP-Mixer, split tensor-parallel and by layer over 2 GPUs, at a roomy capacity and at one so
tight that the plan must offload; weights read lazily from safetensors by a module on the meta
device; a module captured a block at a time; the errors for what cannot be mapped."""

from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree as pytree

import disco_ray
from disco_ray.graph.errors import FrontendError, RunError

from .torch_models import Guarded, Mixer, build

ARCHS = ("mlp", "encoder", "mixer")


def _tight(model) -> list[int]:
    """Per GPU, barely above what its largest vertex needs: most values cannot stay there."""
    least, _ = model.capacity_bounds()
    return [n + 512 for n in least]


def _close(got, want) -> None:
    for g, w in zip(pytree.tree_leaves(got), pytree.tree_leaves(want), strict=True):
        torch.testing.assert_close(g, w, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("split", ["tensor", "layers"])
@pytest.mark.parametrize("arch", ARCHS)
def test_outputs_equal_the_modules_forward_roomy_and_tight(arch, split):
    net, args = build(arch)
    with torch.no_grad():
        want = net(*args)
    roomy = disco_ray.from_torch(net, args, gpus=2, split=split, engine="local")
    res = roomy.run(*args)
    assert res.details.plan.stats["bytes_reloaded"] == 0  # everything fits: nothing moves back
    _close(roomy(*args), want)
    tight = roomy.with_capacity(_tight(roomy))  # the same capture, planned again
    res = tight.run(*args)
    assert res.details.plan.stats["bytes_reloaded"] > 0  # the tight plan really offloads
    _close(tight(*args), want)
    # both GPUs hold weights: the split spreads them
    assert all(b > 0 for b in tight.taskgraph.statistics()["tensor_bytes_per_gpu"])
    for m in (roomy, tight):
        m.close()


def test_outputs_are_named_as_the_module_returns_them_and_reassembled():
    net, (x,) = build("mlp")
    model = disco_ray.from_torch(net, (x,), gpus=2, engine="local")
    assert model.output_names == ["logits", "features"]  # the dict's keys
    # head and skip are column-parallel, their sum too: the logits come back in two parts
    parts = dict(model.lowered.outputs)["logits"]
    assert [model.taskgraph[p].gpu for p in parts] == [0, 1]
    res = model.run(x)
    torch.testing.assert_close(res.outputs["logits"], net(x)["logits"])
    got = model(x)
    assert isinstance(got, dict) and set(got) == {"logits", "features"}
    model.close()


def test_a_tensor_parallel_mlp_keeps_its_hidden_layer_on_the_gpus_that_made_it():
    net, (x,) = build("mlp")
    tg = disco_ray.from_torch(net, (x,), gpus=2, engine="local").taskgraph
    ops = {v.id: v.op for v in tg if v.kind.value == "kernel"}
    # fc1 column-parallel, relu on each part, fc2 row-parallel: one add joins the partial sums
    assert ops["relu@g0"] == ops["relu@g1"] == "relu"
    assert tg["relu@g1"].gpu == 1 and tg["linear_1@g1"].inputs[0] == "relu@g1"
    assert ops["linear_1"] == "add"
    assert tg["fc1.weight[0:32]"].shape == (32, 24) and tg["fc2.weight[:,32:64]@g1"].shape == (64, 32)


def test_weights_from_safetensors_are_read_by_the_workers_for_a_meta_module(tmp_path):
    from safetensors.torch import save_file

    net, (img,) = build("mixer")
    save_file(net.state_dict(), str(tmp_path / "model.safetensors"))
    with torch.device("meta"):
        lazy = Mixer().eval()
    model = disco_ray.from_torch(lazy, (img,), gpus=2, weights=tmp_path, engine="local")
    weights = [v for v in model.taskgraph.inputs() if v.id != "img"]
    assert all(v.source is not None for v in weights) and len(weights) > len(net.state_dict())
    assert model.inputs_for(img).keys() == {"img"}  # no weight passes through the driver
    torch.testing.assert_close(model(img), net(img), atol=2e-6, rtol=1e-5)
    model.close()


def test_a_module_export_cannot_capture_whole_is_captured_a_block_at_a_time():
    torch.manual_seed(0)
    net = Guarded().eval()
    x = torch.randn(2, 8, 16)
    with pytest.raises(FrontendError, match=r"torch.export cannot capture Guarded: .*blocks=\["):
        disco_ray.from_torch(net, (x,))
    model = disco_ray.from_torch(net, (x,), blocks=list(net.layers), gpus=2, engine="local")
    assert "layers.2.ch.2.bias" in model.taskgraph  # weights keep their names in the whole module
    torch.testing.assert_close(model(x), net(x), atol=2e-6, rtol=1e-5)
    model.close()


def test_an_unsupported_aten_op_names_the_op_the_node_and_the_module():
    net = torch.nn.Sequential(torch.nn.Softplus(), torch.nn.ReLU())
    with pytest.raises(FrontendError) as e:
        disco_ray.from_torch(net, (torch.randn(1, 4, 10),))
    assert str(e.value).startswith(
        "1 aten op(s) have no mapping: aten.softplus.default x1 (first: node 'softplus', in 0: Softplus"
    )


def test_a_missing_or_misshapen_weight_and_a_wrong_input_are_named(tmp_path):
    net, (x,) = build("mlp")
    sd = dict(net.state_dict())
    sd.pop("fc2.bias")
    with pytest.raises(FrontendError, match=r"weight 'fc2.bias' \(\[64\]\) is in none of the weights given"):
        disco_ray.from_torch(net, (x,), weights=sd)
    sd["fc2.bias"] = torch.zeros(3)
    with pytest.raises(
        FrontendError, match=r"weight 'fc2.bias' is \[3\] in the given tensors, the module's is \[64\]"
    ):
        disco_ray.from_torch(net, (x,), weights=sd)
    model = disco_ray.from_torch(net, (x,), engine="local")
    with pytest.raises(RunError, match=r"input 'x' has shape \[4, 24\], the graph says \[32, 24\]"):
        model(x[:4])


def _apply(t: torch.Tensor, views) -> torch.Tensor:
    for kind, arg in views:
        if kind == "reshape":
            t = t.reshape(arg)
        elif kind == "permute":
            t = t.permute(*arg)
        else:
            t = t.narrow(arg[0], arg[1], arg[2] - arg[1])
    return t


def test_folded_views_compute_what_the_chain_of_views_computes():
    import random

    from disco_ray.frontend.values import fold_views

    for seed in range(100):
        rng = random.Random(seed)
        shape = (2, 3, 4)
        t = torch.arange(24.0).reshape(shape)
        views, cur = [], shape
        for _ in range(rng.randint(1, 5)):
            r = rng.random()
            if r < 0.4:
                dims = tuple(rng.sample(range(len(cur)), len(cur)))
                views.append(("permute", dims))
                cur = tuple(cur[d] for d in dims)
            elif r < 0.8:
                n = _apply(t, views).numel()
                fits = [
                    s
                    for s in ((n,), (2, n // 2), (n // 2, 2), (1, n))
                    if s[0] * (s[1] if len(s) > 1 else 1) == n
                ]
                cur = rng.choice(fits)
                views.append(("reshape", cur))
            else:
                ax = rng.randrange(len(cur))
                views.append(("slice", (ax, 0, max(1, cur[ax] - 1))))
                cur = tuple(max(1, n - 1) if d == ax else n for d, n in enumerate(cur))
        folded = fold_views(shape, views)
        assert torch.equal(_apply(t, folded), _apply(t, views).contiguous()), (seed, views, folded)
        assert len(folded) <= len(views)
