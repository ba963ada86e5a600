"""Capturing an nn.Module with torch.export: as one graph, or a block at a time.

`torch.export` (non-strict) turns a module's forward into an ATen graph of static shapes. Where it
cannot (data-dependent control flow between the layers, a forward that returns something other
than tensors), the module is captured as the blocks its forward applies one after another:
`blocks=[model.embed, *model.layers, model.head]`, or the children of an `nn.Sequential`
automatically. Each block is exported on the example outputs of the block before it (run
eagerly once, on the meta device when the module lives there), and its parameters keep their
names in the whole module. The chain of blocks must compute the module's forward: its result on
the example input is compared with the forward's (`check_staged`), and blocks that leave out work
the forward does between them (a residual) are refused.
"""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from disco_ray.graph.errors import FrontendError


@dataclass(frozen=True, slots=True)
class Block:
    program: torch.export.ExportedProgram
    prefix: str  # the block's qualified name in the module ("" for the whole module)
    tag: str  # the stem of its vertex ids ("" for one block, "b0.", "b1.", ...)

    def weight_name(self, target: str) -> str:
        """The name in the whole module of the block's parameter or buffer `target`."""
        return f"{self.prefix}.{target}" if self.prefix else target


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return next((ln.strip() for ln in text.splitlines() if ln.strip()), type(e).__name__)


@contextlib.contextmanager
def _quiet():
    """torch logs and prints a failed capture's whole graph; the FrontendError says what failed."""
    loggers = [logging.getLogger(n) for n in ("torch.fx.experimental.symbolic_shapes", "torch.export")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for lg, lv in zip(loggers, levels):
            lg.setLevel(lv)


def _export(module: nn.Module, args: tuple, kwargs: Mapping, what: str) -> torch.export.ExportedProgram:
    try:
        with _quiet():
            return torch.export.export(module, args, dict(kwargs), strict=False)
    except Exception as e:
        raise FrontendError(f"torch.export cannot capture {what}: {_first_line(e)}") from None


def capture(
    module: nn.Module, args: tuple, kwargs: Mapping, blocks: Sequence[nn.Module] | None
) -> list[Block]:
    """The module as exported programs: one, or one per block in order (see module docstring).

    Raises:
        FrontendError: torch.export fails (its reason, and `blocks=` as the way out), or a block
            is not a submodule of `module`, or a block returns something other than tensors.
    """
    if any(p.device.type == "meta" for p in module.parameters()):
        # weights read from files later: capture on the meta device too (only shapes matter)
        from torch.utils import _pytree as pytree

        args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, dict(kwargs)))
    was_training = module.training
    module.eval()  # inference: dropout off, norms in their running statistics
    try:
        if blocks is None:
            try:
                return [Block(_export(module, args, kwargs, type(module).__name__), "", "")]
            except FrontendError as e:
                if not isinstance(module, nn.Sequential):
                    raise FrontendError(
                        f"{e}; capture it a block at a time with blocks=[...] (the submodules its "
                        "forward applies in order, e.g. blocks=[model.embed, *model.layers, model.head])"
                    ) from None
                blocks = list(module)
        return _blocks(module, args, kwargs, blocks)
    finally:
        module.train(was_training)


def _blocks(module: nn.Module, args: tuple, kwargs: Mapping, blocks: Sequence[nn.Module]) -> list[Block]:
    names = {id(m): n for n, m in module.named_modules()}
    out = []
    example = (args, kwargs)
    for i, blk in enumerate(blocks):
        if id(blk) not in names:
            raise FrontendError(
                f"blocks[{i}] ({type(blk).__name__}) is not a submodule of {type(module).__name__}"
            )
        prefix = names[id(blk)]
        ep = _export(blk, args, kwargs if i == 0 else {}, f"block {prefix or i} ({type(blk).__name__})")
        out.append(Block(ep, prefix, f"b{i}."))
        with torch.no_grad():
            res = blk(*args, **(kwargs if i == 0 else {}))
        args = res if isinstance(res, tuple) else (res,)
        if not all(isinstance(a, torch.Tensor) for a in args):
            raise FrontendError(
                f"block {prefix or i} ({type(blk).__name__}) returns {type(res).__name__}, not a "
                "tensor or a tuple of tensors for the next block"
            )
    check_staged(module, *example, args)
    return out


def check_staged(module: nn.Module, args: tuple, kwargs: Mapping, staged: tuple) -> None:
    """Refuses blocks whose chain computes something else than the module's forward on the example
    input (work the forward does between the blocks, a residual, a scale, would be left out):
    each staged output against the forward's tensor output in the same place, within
    |staged - eager| <= 1e-5 + 1e-4 |eager|. On the meta device only shapes and dtypes compare.

    Raises:
        FrontendError: naming the output and the max abs error (or the shapes), or the forward's
            own error when it does not run.
    """
    from torch.utils import _pytree as pytree

    what = f"blocks= of {type(module).__name__}"
    try:
        with torch.no_grad():
            eager = [t for t in pytree.tree_leaves(module(*args, **kwargs)) if isinstance(t, torch.Tensor)]
    except Exception as e:
        raise FrontendError(
            f"{what} cannot be checked: the module's forward fails ({_first_line(e)})"
        ) from None
    if len(eager) < len(staged):
        raise FrontendError(
            f"{what}: the blocks give {len(staged)} tensors, the module's forward {len(eager)}"
        )
    for k, (got, want) in enumerate(zip(staged, eager)):
        if (got.shape, got.dtype) != (want.shape, want.dtype):
            raise FrontendError(
                f"{what}: output {k} of the blocks is {list(got.shape)} {got.dtype}, the module's "
                f"forward gives {list(want.shape)} {want.dtype}"
            )
        if got.device.type == "meta":
            continue
        err = (got.double() - want.double()).abs()
        if not bool((err <= 1e-5 + 1e-4 * want.double().abs()).all()):
            raise FrontendError(
                f"{what} compute something else than its forward: output {k} differs by max abs error "
                f"{err.max().item():.3g} on the example input (the forward does work between the "
                "blocks, e.g. a residual, that a chain of blocks leaves out); give blocks whose chain "
                "is the forward, or move that work into a block"
            )
