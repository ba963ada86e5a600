"""The training step's defaults for speed: the row tile and the compute streams per GPU (also
generation's, `LlamaModel`) (docs/TRAINING.md, "Speed and memory")."""

from __future__ import annotations

from disco_ray.graph.errors import UsageError

TRAIN_TILE = 512  # the default tile's most tokens: large matmuls, and a tile's scores stay small


def default_streams(backend: str) -> int:
    """Compute streams per GPU for training and generation: one on the cpu backend, where
    concurrent kernels would share the same cores (each kernel uses them all) and each hand-over
    between stream threads waits for a core, TURNIP's five on a GPU."""
    return 1 if backend == "cpu" else 5


def train_block(seq: int) -> int:
    """The default row tile for sequences of `seq` tokens: the fewest tiles of at most
    `TRAIN_TILE` tokens, equal in size, so that little is padded."""
    tiles = -(-seq // TRAIN_TILE)
    return -(-seq // tiles)


def check_block(block: object) -> None:
    """Refuses a row tile that is not None or a whole number >= 1 (UsageError)."""
    if block is not None and (isinstance(block, bool) or not isinstance(block, int) or block < 1):
        raise UsageError(f"block must be a whole number of tokens >= 1, got {block!r}")
