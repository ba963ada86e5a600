"""From torch: an nn.Module captured with torch.export, mapped onto the op set, split over GPUs,
planned and run (`from_torch`). Modules: `capture` (torch.export, whole or a block at a time),
`aten` and `aten_hf` (the op mapping), `fold` (what depends on no input of the call, run at
capture), `lower` (the TaskGraph, split tensor-parallel or by layer), `values`
(how values move between GPUs), `weights` (binding parameters by name), `model` (TorchModel).

Layer 3, as `disco_ray.models`: it imports the graph, planner and driver packages, never the CLI.
"""

from .aten import register_aten, unregister_aten
from .model import TorchModel, TorchResult, from_torch

__all__ = ["TorchModel", "TorchResult", "from_torch", "register_aten", "unregister_aten"]
