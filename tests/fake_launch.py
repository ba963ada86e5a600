"""How the stand-in CUDA (tests/fake_cuda.py) gets a vertex's work onto its stream: the cuda
backend's launch loop with its `work` wrapped (`deferring_loop`), so that the work the loop runs
with the vertex's stream current is enqueued on that stream (`FakeStream.launch`, run later on
the stream's thread: tests/fake_device.py), and the range it writes is poisoned meanwhile.

The loop learns each vertex's mode from `submit` (the Backend contract, actors/backends/base.py):
LAUNCH work is enqueued; BLOCKING work (a wait on the host, then a copy) runs on its helper once
its stream has run everything before it (the copy after the host wait, as on a GPU); a DEFERRED
vertex's `work` (registering an NCCL receive with the channel) runs at once, on the host.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from tests.fake_device import _local, _lock, _soon, settled

POISON = 0xFF  # the byte a range holds while the work that writes it is enqueued, not run


def deferring_loop(base: type) -> type:
    """The backend's launch loop, with each vertex's `work` enqueued on the vertex's stream
    (`FakeStream.launch`) instead of run at launch. The loop learns each vertex's mode from
    `submit` (the Backend contract): BLOCKING work runs on its helper once its stream is there,
    a DEFERRED vertex's registration at once."""
    from actors.backends.base import Mode

    params = inspect.signature(base.__init__).parameters
    assert "work" in params and "streams" in params, f"{base.__name__}.__init__ takes no work or streams"
    params = inspect.signature(base.submit).parameters
    assert "vid" in params and "mode" in params, f"{base.__name__}.submit takes no vid or mode"
    names = list(params)[1:]  # after self
    at_vid, at_mode = names.index("vid"), names.index("mode")
    default_mode = (
        params["mode"].default if params["mode"].default is not inspect.Parameter.empty else Mode.LAUNCH
    )

    class DeferringLoop(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args, **kw):
            bound = inspect.signature(base.__init__).bind(self, *args, **kw)
            self.modes: dict[int, Mode] = {}
            bound.arguments["work"] = deferred(
                bound.arguments["work"], bound.arguments["streams"], self.modes
            )
            super().__init__(*bound.args[1:], **bound.kwargs)

        def submit(self, *args, **kw):
            vid = kw["vid"] if "vid" in kw else args[at_vid]
            mode = kw.get("mode", args[at_mode] if len(args) > at_mode else default_mode)
            self.modes[vid] = mode
            super().submit(*args, **kw)

    return DeferringLoop


def deferred(work: Callable[[int, int], None], streams: list, modes: dict) -> Callable[[int, int], None]:
    """`work` as the stand-in runs it: enqueued on the vertex's stream, by mode (`modes`: vid ->
    Mode, LAUNCH when absent)."""
    from actors.backends.base import Mode

    def enqueue(vid: int, s: int) -> None:
        mode = modes.get(vid, Mode.LAUNCH)
        if mode == Mode.DEFERRED:  # it registers the receive with the channel: host work
            work(vid, s)
            return
        stream = streams[s]
        assert getattr(_local, "stream", None) is stream, (
            f"vertex {vid}: its work was launched with another stream than its own ({s}) current"
        )
        if mode == Mode.BLOCKING:  # the host waits, then copies: after what its stream waits on
            stream.synchronize()
            work(vid, s)
            return
        out = written(work, vid)
        if out is not None and settled(stream.tail):  # what it waits on has run: poison now
            _poison(out)
        elif out is not None:  # earlier readers of the range may still run: poison once they have
            with _lock:
                _soon.append(stream.launch(lambda: _poison(out)))
        stream.launch(lambda: work(vid, s))

    return enqueue


def written(work: Callable, vid: int) -> torch.Tensor | None:
    """The range vertex `vid`'s work overwrites whole, from the executor's plan (None: it may read
    it, keep it or write nothing: a sum-into member, a conditional vertex, a load the arena still
    holds, an offload to disk, a kernel whose output overlaps an input; or `work` is no executor's)."""
    from actors.plans import PlanKind

    ex = getattr(work, "__self__", None)
    plan = getattr(ex, "plans", {}).get(vid)
    if plan is None or vid in ex._skip or vid in ex.core.groups or vid in ex._cond.when:
        return None
    if plan.kind not in (
        PlanKind.KERNEL,
        PlanKind.COPY,
        PlanKind.INPUT,
        PlanKind.RELOAD_INPUT,
        PlanKind.TRANSFER,
    ):
        return None
    out = plan.out
    lo, hi = out.data_ptr(), out.data_ptr() + out.numel() * out.element_size()
    for x in plan.ins:
        a = x.data_ptr()
        if a < hi and lo < a + x.numel() * x.element_size():
            return None
    return out if out.is_contiguous() else None


def _poison(out: torch.Tensor | None) -> None:
    if out is not None and out.numel():
        out.reshape(-1).view(torch.uint8).fill_(POISON)
