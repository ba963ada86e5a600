"""`from_torch`: an nn.Module as a planned Program, called like the module.

    model = disco_ray.from_torch(net, (x,), gpus=2, capacity="1MiB", engine="local")
    y = model(x)                       # as net(x): the same structure, tensors reassembled
    res = model.run(x)                 # outputs by name, with the plan and the run's statistics
    model.close()

The module is captured (`capture`), lowered to a TaskGraph split over `gpus` (`lower`), its
weights bound by name (`weights`), planned for `capacity` bytes of arena per GPU, and run on the
engine asked for; the engine starts on the first call. Shapes are those of the example inputs:
another shape is refused (capture again for it).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from disco_ray.driver.api import compile
from disco_ray.driver.program import Program, RunResult
from disco_ray.graph.errors import FrontendError, RunError
from disco_ray.graph.taskgraph import TaskGraph
from planner.capacity import CapacityBounds

from .capture import capture
from .lower import Lowered, Lowering, declared_weights
from .weights import Weights


@dataclass(frozen=True, slots=True)
class TorchResult:
    """One run of a TorchModel: outputs by the module's output names, and the run's details."""

    outputs: dict[str, torch.Tensor]
    details: RunResult  # the TaskGraph-level result: plan (MemGraph), summary, records

    def statistics(self) -> dict:
        return self.details.statistics()


class TorchModel:
    """A module captured, split and planned; see `from_torch` for the arguments."""

    def __init__(
        self,
        module: nn.Module,
        example_inputs: object,
        *,
        gpus: int = 1,
        capacity: int | str | Sequence[int] | None = None,
        split: str = "tensor",
        weights: str | Path | Mapping[str, torch.Tensor] | None = None,
        blocks: Sequence[nn.Module] | None = None,
        example_kwargs: Mapping[str, object] | None = None,
        **program_kw,
    ):
        args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
        kwargs = dict(example_kwargs or {})
        if blocks is None:  # blocks[0] gets the kwargs: its forward may take no use_cache
            kwargs = without_cache(module, kwargs)
        self._kwargs = kwargs  # their order is the capture's; the non-tensor ones are fixed
        self.blocks = capture(module, args, kwargs, blocks)
        declared = declared_weights(self.blocks)
        tensors: dict[str, torch.Tensor] = {}
        files = None
        if weights is None or isinstance(weights, Mapping):
            tensors.update(_own_tensors(module) if weights is None else dict(weights))
        else:
            files = weights
        for b in self.blocks:  # constants the capture lifted out of the code
            tensors.update({f"{b.tag}{k}": v for k, v in b.program.constants.items()})
        self.weights = Weights(declared, tensors, files)
        example = _flat((args, kwargs))
        self.lowered: Lowered = Lowering(self.blocks, gpus, split, self.weights).run(example)
        self.taskgraph: TaskGraph = self.lowered.graph.tg
        self._program_kw = dict(program_kw)
        self.program: Program = compile(self.taskgraph, capacity, **program_kw)
        self.output_names = [name for name, _ in self.lowered.outputs]
        self._spec = self.blocks[-1].program.call_spec.out_spec

    @property
    def memgraph(self):
        return self.program.mg

    def inputs_for(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        """The TaskGraph inputs of one call: the module's tensor arguments by input id, and the
        weights the workers do not hold yet."""
        flat = _flat((args, self._ordered(kwargs)))
        if len(flat) != len(self.lowered.inputs):
            raise RunError(f"the module was captured with {len(self.lowered.inputs)} inputs, got {len(flat)}")
        out: dict[str, torch.Tensor] = {}
        for (name, id, const), x in zip(self.lowered.inputs, flat):
            if id is None:
                if x != const:
                    raise RunError(f"input {name!r} was {const!r} when captured, got {x!r}: capture again")
                continue
            if not isinstance(x, torch.Tensor):
                raise RunError(f"input {name!r} must be a tensor, got {type(x).__name__}")
            out[id] = x.detach()
        held = self.program.held
        out.update({k: v for k, v in self.weights.values().items() if k not in held})
        return out

    def _ordered(self, kwargs: Mapping[str, object]) -> dict[str, object]:
        """A call's keyword arguments in the capture's order; a non-tensor one left out takes its
        captured value (e.g. use_cache=False)."""
        unknown = sorted(set(kwargs) - set(self._kwargs))
        if unknown:
            raise RunError(
                f"keyword argument(s) {', '.join(unknown)} were not given when captured (captured with: "
                f"{', '.join(self._kwargs) or 'none'}): capture again with them in example_kwargs"
            )
        out = {}
        for k, captured in self._kwargs.items():
            if k in kwargs:
                out[k] = kwargs[k]
            elif isinstance(captured, torch.Tensor):
                raise RunError(f"keyword argument {k!r} (a tensor when captured) is missing")
            else:
                out[k] = captured
        return out

    def run(self, *args, **kwargs) -> TorchResult:
        """Runs on the module's arguments; outputs keyed by name ('output' for a lone tensor, the
        index in a tuple, the key in a dict), each reassembled from its parts on the GPUs."""
        run_kw = {k: kwargs.pop(k) for k in ("trace", "check", "timeout", "progress") if k in kwargs}
        res = self.program.run(self.inputs_for(*args, **kwargs), details=True, **run_kw)
        assert isinstance(res, RunResult)
        outs = {
            name: res.outputs[ids[0]] if len(ids) == 1 else torch.cat([res.outputs[i] for i in ids], dim=-1)
            for name, ids in self.lowered.outputs
        }
        return TorchResult(outs, res)

    def __call__(self, *args, **kwargs):
        """As the module's forward: the outputs in the module's own structure."""
        from torch.utils import _pytree as pytree

        outs = self.run(*args, **kwargs).outputs
        return pytree.tree_unflatten([outs[n] for n in self.output_names], self._spec)

    def with_capacity(self, capacity: int | str | Sequence[int] | None) -> TorchModel:
        """The same captured and split graph planned for another capacity (no new export); the
        engine options are this model's. Close it as any other."""
        other = copy.copy(self)
        other.program = compile(self.taskgraph, capacity, **self._program_kw)
        return other

    def capacity_bounds(self) -> CapacityBounds:
        """Per GPU, the least capacity any plan works with (`min`) and room for every tensor at
        once (`roomy`)."""
        return CapacityBounds.of([self.taskgraph])

    def statistics(self) -> dict:
        return {"taskgraph": self.taskgraph.statistics(), **self.program.statistics()}

    def close(self) -> None:
        self.program.close()

    def __enter__(self) -> TorchModel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def from_torch(module: nn.Module, example_inputs: object, **kw) -> TorchModel:
    """Captures `module` with torch.export and makes it a Program over `gpus` GPUs.

    Args:
        module: the model (in eval mode while captured; its parameters may be on the meta
            device when `weights` names safetensors files).
        example_inputs: a tensor or a tuple of the forward's positional arguments; their shapes
            and dtypes are the graph's.
        gpus: GPUs to split over. split: "tensor" (linear layers tensor-parallel, the rest on GPU
            0) or "layers" (consecutive ops in stages of equal weight bytes).
        capacity: arena bytes per GPU ("64MiB", a list per GPU; default: everything fits), or
            "auto" / "60%" of each GPU's free memory (`disco_ray.driver.free_memory`).
        weights: None (the module's own tensors), a mapping name -> tensor (a state_dict), or a
            .safetensors file or directory whose tensors the workers read themselves, each only
            its block.
        blocks: capture these submodules one at a time, in order, each fed the previous one's
            outputs (for a forward torch.export cannot capture whole); an nn.Sequential falls
            back to its children by itself.
        example_kwargs: keyword arguments of the forward (a call passes them by name; a
            non-tensor one is fixed at its value here and may be left out of a call). A forward
            that takes `use_cache` (a Hugging Face model) is captured with use_cache=False unless
            it is given.
        engine, backend, streams, pool, ...: as `disco_ray.compile` (engine "ray" or "local").

    Raises:
        FrontendError: torch.export fails, an aten op that reads a value of the call has no
            mapping (naming op and node; one on constants alone is folded at capture), or a
            weight is missing or of another shape.
        CapacityError: "auto" / "60%" of the free memory is below the graph's least capacity.
    """
    return TorchModel(module, example_inputs, **kw)


def without_cache(module: nn.Module, kwargs: dict[str, object]) -> dict[str, object]:
    """`kwargs` with use_cache=False added when the forward takes `use_cache` (a Hugging Face
    model) and it is not given: a key/value cache is for decoding a token at a time, which a
    graph of static shapes does not do, and torch.export cannot return the cache object."""
    import inspect

    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return kwargs
    if "use_cache" in params and "use_cache" not in kwargs:
        return {**kwargs, "use_cache": False}
    return kwargs


def _own_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's parameters and buffers (non-persistent ones too) by name."""
    out: dict[str, torch.Tensor] = dict(module.named_parameters(remove_duplicate=False))
    out.update(dict(module.named_buffers(remove_duplicate=False)))
    return out


def _flat(tree) -> list:
    from torch.utils import _pytree as pytree

    return pytree.tree_leaves(tree)


__all__ = ["FrontendError", "TorchModel", "TorchResult", "from_torch"]
