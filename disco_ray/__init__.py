"""disco-ray: run ML workloads larger than GPU memory on multi-GPU nodes with CPU-RAM offload, on Ray."""

_RUNTIME = ("run", "compile", "run_memgraph", "Program")


def __getattr__(name: str):
    # lazy, so `import disco_ray` does not pull in torch and ray
    if name in _RUNTIME:
        from . import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'disco_ray' has no attribute {name!r}")
