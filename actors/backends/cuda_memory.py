"""Memory of the cuda backend: host buffers pinned at their exact size, and the kernel
temporaries kept ready on each compute stream.

Pinned host memory. `torch.empty(..., pin_memory=True)` goes through torch's caching host
allocator, which rounds every block up to a power of two (a 40 GiB host store pins 64 GiB) and
keeps freed blocks pinned for reuse. The papers allocate their CPU storage once with
`cudaHostAlloc` (TURNIP section 5); here a plain host tensor of exactly `nbytes` is page-locked
with `cudaHostRegister(..., cudaHostRegisterPortable)` (through torch's binding of the CUDA
runtime, so no CuPy is needed), and unregistered when that tensor is freed. Portable: every
CUDA context of the process sees it pinned (the NCCL and IPC paths). Not write-combined (the
papers' other flag): the host reads the host store back (outputs, states), and reads of
write-combined memory are uncached.

Kernel temporaries. Kernels allocate temporaries through torch's caching allocator, which keeps
freed blocks per stream. Before a run, `reserve` runs cuBLAS once per dtype on each stream (its
handle and workspace) and allocates and frees, on each stream, a block of the largest
temporary any kernel of the graph needs (`disco_ray.graph.kernels.temp_bytes`, an upper bound)
plus one small-pool segment: during the run those cached blocks serve the temporaries, and no
kernel calls cudaMalloc (a cudaMalloc mid-run synchronizes the device and, beside NCCL kernels,
can deadlock). The arena and these blocks must fit the GPU together: the statistics report the
bytes reserved per stream.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable
_WARM_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SMALL_SEGMENT = 256 << 10  # an allocation that makes torch's allocator cache a 2 MiB small-pool segment


def pinned(nbytes: int) -> torch.Tensor:
    """A uint8 host tensor of exactly `nbytes`, page-locked until it is freed."""
    t = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes == 0:
        return t
    cudart = torch.cuda.cudart()
    ptr = t.data_ptr()
    err = int(cudart.cudaHostRegister(ptr, nbytes, HOST_REGISTER_PORTABLE))
    if err != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {err}")
    weakref.finalize(t, _unregister, cudart, ptr)
    return t


def _unregister(cudart, ptr: int) -> None:
    with contextlib.suppress(Exception):  # at interpreter exit the runtime may be gone already
        cudart.cudaHostUnregister(ptr)


def reserve(stream, device: torch.device, nbytes: int) -> None:
    """On `stream`: creates cuBLAS's handle and workspace, and leaves `nbytes` (one large-pool
    block) and one small-pool segment cached for that stream in torch's allocator."""
    with torch.cuda.stream(stream):
        for dt in _WARM_DTYPES:
            a = torch.ones(64, 64, dtype=dt, device=device)
            torch.matmul(a, a)
        keep = [torch.empty(SMALL_SEGMENT, dtype=torch.uint8, device=device)]
        if nbytes > (1 << 20):
            keep.append(torch.empty(nbytes, dtype=torch.uint8, device=device))
        del keep  # freed into this stream's pools, not to the device
