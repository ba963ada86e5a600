"""Transports: how a transfer vertex gets its source range from another worker (`base`: the
contract; `local`, `objectstore`, `cuda` with its NCCL channel `nccl`: the implementations)."""
