"""Test and benchmark ops, registered on import (not part of the op set of FORMATS.md).

- `noop(*xs, shape, dtype="float32", fail=False, sleep=0)`: does nothing and leaves its output as
  it was (so its value is undefined: never compare it); with `fail=True` it raises RuntimeError,
  for fault tests; with `sleep=S` it takes S seconds (a long kernel: the heartbeat must not take
  it for a stall). It measures the runtime's per-vertex cost with no kernel work.

Workers in other processes import this module when it is named in `op_modules` (the runtime's
option to load extra op modules before a graph is loaded). In a process that also runs other
code (a test session), `unregister()` takes the op out again, so it does not show up in
listings of the op set.
"""

from __future__ import annotations

import sys
import time

from disco_ray.graph import kernels, ops


def _infer_noop(shapes, dtypes, attrs):
    return tuple(int(d) for d in attrs["shape"]), str(attrs["dtype"])


ops.register(
    ops.OpSpec(
        "noop",
        0,
        None,
        _infer_noop,
        attrs={"shape": ops.REQUIRED, "dtype": "float32", "fail": False, "sleep": 0.0},
        flops=lambda s, o, a: 0.0,
        doc="does nothing (test/benchmark op); fail=True raises; sleep=S takes S seconds",
    )
)


@kernels.impl("noop")
def _noop(out, ins, attrs):
    if attrs["fail"]:
        raise RuntimeError("noop kernel told to fail")
    if attrs["sleep"]:  # time.sleep(0) still gives the GIL away: ~100 us a call on a busy box
        time.sleep(float(attrs["sleep"]))  # releases the GIL, as a long torch kernel does


def unregister() -> None:
    """Removes `noop` from the op and kernel registries; importing this module again re-adds it."""
    ops.OPS.pop("noop", None)
    kernels.IMPLS.pop("noop", None)
    sys.modules.pop(__name__, None)
