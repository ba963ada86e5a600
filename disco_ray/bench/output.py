"""The files a bench leaves in its folder: results.json, timeline.png and the traces.

results.json holds every figure of a `run.BenchResult`, the settings and the device;
timeline.png a panel per runtime mode (`disco_ray.bench.plot`); trace.json the dynamic run's
Chrome trace (or the first runtime mode's) and trace.MODE.json the other modes'.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Sequence
from pathlib import Path

from disco_ray.graph.files import replacing

from .run import BenchResult, BenchSettings

log = logging.getLogger("disco_ray")


def capacity_text(capacity) -> str:
    """ "64 MiB", "64 MiB, 32 MiB" (one per GPU) or "everything fits"."""
    from disco_ray.graph.sizes import format_size

    if capacity is None:
        return "everything fits"
    caps = capacity if isinstance(capacity, (list, tuple)) else [capacity]
    return ", ".join(format_size(c) for c in caps)


def _where(settings: BenchSettings) -> str:
    if settings.simulate:
        return f"simulated ({settings.simulate})"
    return f"{settings.backend} backend, {settings.engine} engine"


def header(w, settings: BenchSettings, res: BenchResult) -> str:
    """Two lines: the workload and its parameters; the capacity, where it ran and the device."""
    p = " ".join(f"{k}={v}" for k, v in w.params.items() if k != "file")
    return (
        f"{w.name} {p}".rstrip()
        + f"\ncapacity {capacity_text(settings.capacity)} per GPU; {_where(settings)}; device: {res.device}"
    )


def write(
    out: Path, w, settings: BenchSettings, res: BenchResult, head: str, argv: Sequence[str] = ()
) -> list[Path]:
    """Writes results.json, timeline.png and the traces (each atomically) into the folder `out`
    (made if missing); returns what it wrote, after removing such files an earlier bench left
    there that this one did not write. `head`: the `header` lines; `argv`: the command line."""
    from disco_ray.graph.formats import write_doc

    doc = {
        "format": "disco-bench",
        "version": 1,
        "workload": w.name,
        "params": {k: v for k, v in w.params.items() if _plain(v)},
        "capacity": settings.capacity,
        "backend": None if settings.simulate else settings.backend,
        "engine": None if settings.simulate else settings.engine,
        "streams": settings.streams,
        "ahead": res.ahead,
        "order": settings.order,
        "repeat": settings.repeat,
        "warmup": settings.warmup,
        "simulate": settings.simulate,
        "profile": res.profile,
        "device": res.device,
        "time_unit": "units" if res.unit[0] == "units" else "s",
        "lower_bound": res.bound,
        "modes": res.rows,
        "cluster": res.cluster,
        "header": head,
        "argv": list(argv),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "results.json"]
    write_doc(_jsonable(doc), written[0])
    if res.traces:
        written += _write_traces(out, settings, res, head)
    for stale in [out / "timeline.png", out / "trace.json", *out.glob("trace.*.json")]:
        if stale.exists() and stale not in written:
            stale.unlink()
            log.info("removed %s, left by an earlier bench", stale)
    return written


def _write_traces(out: Path, settings: BenchSettings, res: BenchResult, head: str) -> list[Path]:
    """trace.json (the dynamic mode's, or the first), trace.MODE.json and timeline.png."""
    from disco_ray.graph.formats import write_doc

    from . import plot

    written = []
    first = "dynamic" if "dynamic" in res.traces else next(iter(res.traces))
    for mode, trace in res.traces.items():
        path = out / ("trace.json" if mode == first else f"trace.{mode}.json")
        write_doc(trace, path)
        written.append(path)
    png = out / "timeline.png"
    title = f"{head.splitlines()[0]}\ncapacity {capacity_text(settings.capacity)} per GPU; {_where(settings)}"
    with replacing(png) as tmp:
        plot.plot([plot.panel(t, m) for m, t in res.traces.items()], str(tmp), title, res.unit[0])
    return [*written, png]


def _plain(v) -> bool:
    return v is None or isinstance(v, (int, float, str, bool))


def _jsonable(x):
    """Floats that JSON can hold (inf/nan as strings), tuples as lists."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and (x != x or x in (float("inf"), float("-inf"))):
        return str(x)
    if inspect.isclass(x) or callable(x):
        return str(x)
    return x
