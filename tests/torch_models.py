"""Small real architectures for the frontend tests: an MLP with two named outputs, torch's own
transformer encoder layer, and a convolution-free MLP-Mixer on image patches."""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    """Linear-ReLU-Linear-GELU(tanh)-Linear plus a linear skip from the input; returns
    {"logits", "features"}."""

    def __init__(self, d_in: int = 24, hidden: int = 64, classes: int = 10):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, classes)
        self.skip = nn.Linear(d_in, classes)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        h = nn.functional.gelu(self.fc2(h), approximate="tanh")
        return {"logits": self.head(h) + self.skip(x), "features": h}


class MixerBlock(nn.Module):
    """Token mixing (an MLP across patches, on the transposed activations), then channel mixing."""

    def __init__(self, tokens: int, dim: int, tok_hidden: int, ch_hidden: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.tok = nn.Sequential(nn.Linear(tokens, tok_hidden), nn.GELU(), nn.Linear(tok_hidden, tokens))
        self.norm2 = nn.LayerNorm(dim)
        self.ch = nn.Sequential(nn.Linear(dim, ch_hidden), nn.GELU(), nn.Linear(ch_hidden, dim))

    def forward(self, x):
        x = x + self.tok(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.ch(self.norm2(x))


class Mixer(nn.Module):
    """MLP-Mixer (Tolstikhin et al., 2021): patches by reshape, a linear embedding, mixer
    blocks, a final norm, mean over patches, a linear head."""

    def __init__(self, image: int = 16, patch: int = 4, channels: int = 3, dim: int = 32, depth: int = 2):
        super().__init__()
        self.patch = patch
        tokens = (image // patch) ** 2
        self.embed = nn.Linear(patch * patch * channels, dim)
        self.blocks = nn.Sequential(*[MixerBlock(tokens, dim, 32, 64) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 10)

    def forward(self, img):
        b, c, h, w = img.shape
        p = self.patch
        x = img.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 3, 5, 1).reshape(b, -1, p * p * c)
        x = self.blocks(self.embed(x))
        return self.head(self.norm(x).mean(dim=1))


class Guarded(nn.Module):
    """Mixer blocks with a data-dependent check between them: torch.export cannot capture it whole."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([MixerBlock(8, 16, 16, 32) for _ in range(3)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
            if not torch.isfinite(x).all():
                raise FloatingPointError("diverged")
        return x


def encoder() -> nn.Module:
    return nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True, activation="gelu")


def build(name: str, seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """(module in eval mode, example inputs) of architecture `name`, seeded."""
    torch.manual_seed(seed)
    if name == "mlp":
        return MLP().eval(), (torch.randn(32, 24),)
    if name == "encoder":
        return encoder().eval(), (torch.randn(2, 8, 32),)
    if name == "mixer":
        return Mixer().eval(), (torch.randn(2, 3, 16, 16),)
    raise ValueError(name)
