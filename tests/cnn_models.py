"""Small CNNs for the frontend tests: torchvision's ResNet-18 (the real one when torchvision imports,
else the same architecture built here, module for module and name for name), and a small net that
uses every other CNN op the frontend maps (conv1d, grouped and dilated convs, pooling, group norm,
rms norm, the activations, pow, cumsum, full)."""

from __future__ import annotations

import torch
from torch import nn


class BasicBlock(nn.Module):
    """torchvision.models.resnet.BasicBlock: two 3x3 convs with batch norm, plus the shortcut."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity  # in place, as torchvision's
        return self.relu(out)


class ResNet18(nn.Module):
    """torchvision.models.resnet18(weights=None): its modules, parameter names and forward."""

    def __init__(self, num_classes: int = 1000):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        widths = [(64, 64, 1), (64, 128, 2), (128, 256, 2), (256, 512, 2)]
        for i, (cin, cout, stride) in enumerate(widths, 1):
            setattr(self, f"layer{i}", nn.Sequential(BasicBlock(cin, cout, stride), BasicBlock(cout, cout)))
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):  # torchvision's initialization
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def _randomize_bn(net: nn.Module, seed: int) -> None:
    """Running statistics and affine weights away from their 0/1 defaults, so a batch norm that
    ignored one of them would show."""
    g = torch.Generator().manual_seed(seed)
    for m in net.modules():
        if isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
            with torch.no_grad():
                if getattr(m, "running_mean", None) is not None:
                    m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g) * 0.1)
                    m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.5)
                if m.weight is not None:
                    m.weight.copy_(torch.rand(m.weight.shape, generator=g) + 0.5)
                    m.bias.copy_(torch.randn(m.bias.shape, generator=g) * 0.1)


def resnet18(seed: int = 0) -> nn.Module:
    """ResNet-18 in eval mode with random weights (torchvision's when it imports)."""
    torch.manual_seed(seed)
    try:
        from torchvision.models import resnet18 as tv_resnet18
    except Exception:  # not installed, or a build for another torch (its C extension fails to load)
        net = ResNet18()
    else:
        net = tv_resnet18(weights=None)
    _randomize_bn(net, seed)
    return net.eval()
