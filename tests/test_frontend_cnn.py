"""`from_torch` for CNNs and what fails loudly (issue #29, items 3 to 5): torchvision's ResNet-18 on
2 GPUs with offload on the Ray workers, a small net using every other CNN op, both splits; the
convolutions split by output channels; every unsupported op named at once; one's own mapping
(`register_aten`); `blocks=` refused when the chain of blocks is not the forward; in-place ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import disco_ray
from disco_ray.frontend import register_aten, unregister_aten
from disco_ray.graph import kernels, ops
from disco_ray.graph.errors import FrontendError, UsageError
from tests.cnn_models import resnet18
from tests.ray_fixtures import pool  # noqa: F401  (module fixture)

TOL = dict(atol=2e-6, rtol=1e-5)  # the same torch kernels on the same values: rounding only


class Zoo(nn.Module):
    """Every CNN op the frontend maps but ResNet's: conv1d grouped and dilated, conv2d with bias,
    stride and padding='same', a depthwise conv, group norm, average and max pooling (ceil mode),
    rms norm, leaky_relu and hardswish in place, powers, cumsum, log_softmax and constants."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv1d(4, 8, 3, padding=2, dilation=2, groups=2)
        self.c2 = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.same = nn.Conv2d(8, 8, 3, padding="same")
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.gn = nn.GroupNorm(4, 8)
        self.act = nn.LeakyReLU(0.2, inplace=True)
        self.hs = nn.Hardswish(inplace=True)
        self.rms = nn.RMSNorm(8)
        self.head = nn.Linear(8, 5)

    def forward(self, img, seq):
        s = self.act(self.c1(seq)).mean(-1)  # [N, 8]
        x = self.hs(self.gn(self.same(self.c2(img))))
        x = F.max_pool2d(self.dw(x), 2, ceil_mode=True) + F.avg_pool2d(x, 3, 2, 1, count_include_pad=False)
        x = F.adaptive_avg_pool2d(x, (2, 3)).flatten(2).mean(-1)  # [N, 8]
        h = self.rms(x + s) ** 3 + (torch.sigmoid(x) + 1) ** 0.5 + 2**s + (torch.sigmoid(s) + 1) ** x
        h = h + torch.cumsum(h, -1) + torch.ones(8) + torch.full((8,), 0.5) + torch.zeros_like(h)
        return F.log_softmax(self.head(h), -1)


def _zoo():
    torch.manual_seed(0)
    net = Zoo().eval()
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, (nn.GroupNorm, nn.RMSNorm)):
                m.weight.uniform_(0.5, 1.5)
    return net, (torch.randn(2, 3, 12, 12), torch.randn(2, 4, 10))


@pytest.mark.ray
def test_resnet18_runs_on_2_gpus_with_offload_on_the_ray_workers_and_matches_eager(pool):  # noqa: F811
    net, x = resnet18(), torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = net(x)
    roomy = disco_ray.from_torch(net, x, gpus=2, engine="ray", pool=pool)
    least, most = roomy.capacity_bounds()
    model = roomy.with_capacity([n + 512 for n in least])  # barely above the largest vertex
    roomy.close()
    assert all(n + 512 < m for n, m in zip(least, most))
    res = model.run(x)
    assert res.details.plan.stats["bytes_reloaded"] > 0  # the plan really offloads
    torch.testing.assert_close(res.outputs["output"], want, **TOL)
    model.close()


def test_resnet18_convolutions_split_by_output_channels_and_batch_norm_runs_on_the_parts():
    net, x = resnet18(), torch.randn(1, 3, 32, 32)
    model = disco_ray.from_torch(net, x, gpus=2, engine="local")
    tg = model.taskgraph
    assert tg["conv1.weight[0:32]"].shape == (32, 3, 7, 7) and tg["conv1.weight[32:64]@g1"].gpu == 1
    on1 = {v.op for v in tg if v.kind.value == "kernel" and v.gpu == 1}
    assert {"conv", "batchnorm", "relu", "max_pool2d"} <= on1  # channelwise ops stay on the parts
    assert tg["bn1.running_var[32:64]@g1"].shape == (32,)
    weights = tg.statistics()["tensor_bytes_per_gpu"]
    assert min(weights) > 0.9 * max(weights)  # the weights spread evenly
    with torch.no_grad():
        torch.testing.assert_close(model(x), net(x), **TOL)


@pytest.mark.parametrize("split", ["tensor", "layers"])
def test_every_other_cnn_op_matches_eager_roomy_and_tight(split):
    net, args = _zoo()
    with torch.no_grad():
        want = net(*args)
    model = disco_ray.from_torch(net, args, gpus=2, split=split, engine="local")
    torch.testing.assert_close(model(*args), want, **TOL)
    least, _ = model.capacity_bounds()
    tight = model.with_capacity(least)  # the least any plan works with
    res = tight.run(*args)
    assert res.details.plan.stats["bytes_reloaded"] > 0
    torch.testing.assert_close(res.outputs["output"], want, **TOL)
    used = {v.op for v in model.taskgraph if v.kind.value == "kernel"}
    assert {"conv", "group_norm", "max_pool2d", "avg_pool2d", "adaptive_avg_pool2d", "rmsnorm"} <= used
    assert {
        "leaky_relu",
        "hardswish",
        "pow_scalar",
        "scalar_pow",
        "pow",
        "cumsum",
        "log_softmax",
    } <= used
    assert "full" not in used  # ones, full, zeros_like: constants, folded at capture (fold.py)


class Special(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Sequential(nn.Linear(4, 4))

    def forward(self, x):
        return torch.lgamma(self.a(x)) + torch.lgamma(self.b(x)) + torch.special.i0(x) + torch.erfinv(x / 9)


def test_every_unsupported_op_is_named_at_once_with_its_count_and_first_module():
    with pytest.raises(FrontendError) as e:
        disco_ray.from_torch(Special().eval(), torch.randn(2, 4))
    msg = str(e.value)
    assert msg.startswith(
        "3 aten op(s) have no mapping: aten.erfinv.default x1 (first: node 'erfinv', in the module: Special, at "
    )
    assert "aten.lgamma.default x2 (first: node 'lgamma', in the module: Special" in msg
    assert "; aten.special_i0.default x1 (first: node 'special_i0'" in msg
    assert msg.endswith(
        "Map one onto an op of your own with disco_ray.frontend.register_aten (docs/FRONTEND.md#your-own-mapping)"
    )
    net = nn.Sequential(nn.Linear(4, 4), nn.Softplus(), nn.Softplus())
    with pytest.raises(
        FrontendError,
        match=r"^1 aten op\(s\) have no mapping: aten.softplus.default x2 \(first: node 'softplus', in 1: Softplus",
    ):
        disco_ray.from_torch(net, torch.randn(2, 4))


def _own(name: str, fn) -> None:
    ops.register(ops.OpSpec(name, 1, 1, lambda s, d, a: (s[0], d[0]), doc=name))
    kernels.impl(name)(lambda out, ins, attrs: out.copy_(fn(ins[0])))


def test_register_aten_maps_ops_onto_ones_own_ops():
    _own("lgamma_own", torch.lgamma)
    _own("i0_own", torch.special.i0)
    _own("erfinv_own", torch.erfinv)
    register_aten("aten.lgamma.default", lambda cx, x: cx.unary("lgamma_own", x))  # one overload
    register_aten("special_i0", lambda cx, x: cx.op("i0_own", x))  # every overload of the aten op
    register_aten("torch.ops.aten.erfinv.default", lambda cx, x: cx.op("erfinv_own", x))
    try:
        net, x = Special().eval(), torch.randn(2, 4)
        model = disco_ray.from_torch(net, x, gpus=2, engine="local")
        used = [v.op for v in model.taskgraph if v.kind.value == "kernel"]
        assert {"lgamma_own", "i0_own", "erfinv_own"} <= set(used)
        with torch.no_grad():
            torch.testing.assert_close(model(x), net(x), **TOL)
    finally:
        for name in ("aten.lgamma.default", "special_i0", "aten.erfinv.default"):
            unregister_aten(name)
        for op in ("lgamma_own", "i0_own", "erfinv_own"):
            kernels.unregister(op)
    with pytest.raises(FrontendError, match=r"^3 aten op\(s\) have no mapping"):  # unregistered again
        disco_ray.from_torch(Special().eval(), torch.randn(2, 4))
    with pytest.raises(UsageError, match=r"register_aten\('x'\): handler must be callable, got int"):
        register_aten("x", 3)


class Residual(nn.Module):
    """Layers with a residual the forward adds between them: blocks=[*layers] leaves it out."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(3)])

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def test_blocks_that_leave_out_the_forwards_glue_are_refused_naming_the_error():
    torch.manual_seed(0)
    net, x = Residual().eval(), torch.randn(4, 16)
    with pytest.raises(
        FrontendError,
        match=r"blocks= of Residual compute something else than its forward: output 0 differs by max abs error 3\.38 on the example input",
    ):
        disco_ray.from_torch(net, x, blocks=list(net.layers), engine="local")
    plain = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(3)]).eval()
    model = disco_ray.from_torch(
        plain, x, blocks=list(plain), gpus=2, engine="local"
    )  # the chain is the forward
    torch.testing.assert_close(model(x), plain(x), **TOL)
    with pytest.raises(
        FrontendError,
        match=r"output 0 of the blocks is \[4, 16\] torch.float32, the module's forward gives \[4\]",
    ):
        disco_ray.from_torch(_Summed(plain), x, blocks=list(plain), engine="local")


class _Summed(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x).sum(-1)


class _ReadAfter(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        v = h[:, :2]  # a view taken before the update: eager torch sees the update through it
        h.relu_()
        return v + 1


def test_an_in_place_op_is_mapped_only_when_nothing_else_sees_the_update():
    with pytest.raises(
        FrontendError, match=r"aten op aten.relu_.default on 'linear', which slice_1 read too"
    ):
        disco_ray.from_torch(_ReadAfter().eval(), torch.randn(2, 4), engine="local")


class _LowLevel(nn.Module):
    """The aten forms a decomposed or hand-written graph holds: convolution, the no-training batch
    norm, conv3d, the _like and new_ constants, in-place arithmetic, _log_softmax."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.c3 = nn.Conv3d(1, 2, 2)

    def forward(self, x, v):
        a = torch.ops.aten.convolution(
            x, self.conv.weight, self.conv.bias, [1, 1], [1, 1], [1, 1], False, [0, 0], 1
        )
        bn = self.bn
        a = torch.ops.aten._native_batch_norm_legit_no_training(
            a, bn.weight, bn.bias, bn.running_mean, bn.running_var, 0.1, 1e-5
        )[0]
        a = torch.ops.aten._adaptive_avg_pool2d(a, [2, 2]).flatten(1)  # [N, 16]
        b = self.c3(v).flatten(1)[:, :16]
        c = a * 2
        c.mul_(torch.ones_like(a)).sub_(a.new_ones((16,))).div_(
            torch.full_like(a, 2.0) + a.new_full((16,), 1.0)
        )
        return torch.ops.aten._log_softmax(c + b + a.new_zeros((16,)), 1, False)


def test_the_low_level_aten_forms_map_too():
    torch.manual_seed(0)
    net = _LowLevel().eval()
    args = (torch.randn(2, 3, 8, 8), torch.randn(2, 1, 4, 4, 4))
    with torch.no_grad():
        net.bn.running_var.uniform_(0.5, 1.5)
        want = net(*args)
    model = disco_ray.from_torch(net, args, gpus=2, engine="local")
    assert {"conv", "batchnorm", "adaptive_avg_pool2d", "log_softmax"} <= {
        v.op for v in model.taskgraph if v.kind.value == "kernel"
    }
    torch.testing.assert_close(model(*args), want, **TOL)
