"""`disco-ray plot`: draw any Chrome/Perfetto trace-event JSON as a timeline PNG.

    disco-ray plot TRACE.json [TRACE.json ...] [-o timeline.png] [--title TEXT]

Each file is one panel (`disco_ray.bench.plot`): the lanes of each process, rows added where
slices run at once, and the counters (our traces' arena and host-store bytes) under them. The
traces `disco-ray run --trace` and `bench` write, or any other tool's.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from disco_ray.graph.errors import UsageError
from disco_ray.graph.files import replacing

from .app import command, writable_file

log = logging.getLogger("disco_ray")


@command(
    "plot",
    help="draw trace files (Chrome/Perfetto JSON) as a timeline PNG",
    description="Draw each TRACE (trace-event JSON) as a panel of one PNG: lanes per process, "
    "counters under them.",
)
def add_plot(p) -> None:
    p.add_argument("traces", nargs="+", metavar="TRACE.json", help="trace-event JSON files")
    p.add_argument(
        "-o",
        "--output",
        default="timeline.png",
        type=writable_file("-o"),
        metavar="OUT.png",
        help="default timeline.png",
    )
    p.add_argument("--title", help="the figure's title (default: the files' names)")


def _read(path: str) -> dict:
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as e:
        raise UsageError(f"{path}: cannot read ({e.strerror})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"{path}: not a JSON trace ({e})") from None
    if isinstance(doc, list):
        doc = {"traceEvents": doc}
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise UsageError(f'{path}: not a trace-event document (no "traceEvents" list)')
    return doc


def cmd_plot(args) -> int:
    from disco_ray.bench import plot

    out = Path(args.output)
    if out.suffix.lower() != ".png":
        raise UsageError(f"-o {args.output}: the timeline is written as .png")
    panels = []
    for path in args.traces:
        doc = _read(path)
        got = doc.get("otherData")
        other: dict = got if isinstance(got, dict) else {}
        label = f"{other['mode']} ({Path(path).name})" if other.get("mode") else Path(path).name
        p = plot.panel(doc, label)
        if not p.rows and not p.counters:
            raise UsageError(f"{path}: no slices and no counters to draw")
        panels.append(p)
    try:
        with replacing(out) as tmp:
            plot.plot(panels, str(tmp), args.title or ", ".join(Path(t).name for t in args.traces))
    except OSError as e:
        raise UsageError(f"{out}: cannot write ({e.strerror})") from None
    log.info("wrote %s", out)
    return 0
