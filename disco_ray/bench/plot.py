"""Timeline plots drawn from Chrome/Perfetto trace-event documents (ours or anyone's).

One panel per trace (a bench mode, or a file given to `disco-ray plot`), sharing the time axis:

- lanes: per process (a GPU), the slices ("ph": "X") of each lane: compute (kernels), h2d (inputs
  and reloads), d2h (offloads) and peer (transfers) by their category, or, for a category this
  project does not write, by thread; a lane where slices run at once (several streams) gets as many
  rows as it needs, so no slice hides another; a lane without slices is not drawn;
- occupancy: the counter events ("ph": "C") of each process, e.g. the arena and host-store bytes
  our traces carry, as step lines under the lanes.

The figure gets a title, the panels the makespan, and one legend names the lane colours and the
counter lines.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

LANES = ("compute", "h2d", "d2h", "peer", "disk")
LANE_OF = {"kernel": "compute", "input": "h2d", "reload": "h2d", "offload": "d2h", "transfer": "peer"}
COLORS = {
    "compute": "tab:blue",
    "h2d": "tab:orange",
    "d2h": "tab:green",
    "peer": "tab:purple",
    "disk": "tab:brown",
}
OTHER = "tab:gray"


@dataclass
class Panel:
    """One trace as rows of slices and counter curves, times in ms from the trace's first event."""

    label: str
    rows: list[tuple[str, str, list[tuple[float, float]]]] = field(
        default_factory=list
    )  # (name, lane, slices)
    counters: dict[str, list[tuple[float, float]]] = field(
        default_factory=dict
    )  # "gpu:0 arena bytes" -> curve
    span: float = 0.0
    makespan: float | None = None  # seconds, when the trace says
    capacity: list[int] = field(default_factory=list)  # arena bytes per GPU, when the trace says


def pack(slices: Sequence[tuple[float, float]]) -> list[list[tuple[float, float]]]:
    """Slices put into as few rows as none overlap in (greedy by start: optimal for intervals)."""
    rows: list[list[tuple[float, float]]] = []
    for s, e in sorted(slices):
        for row in rows:
            if row[-1][1] <= s:
                row.append((s, e))
                break
        else:
            rows.append([(s, e)])
    return rows


def panel(doc: dict, label: str) -> Panel:
    """The lanes and counters of trace document `doc` (a dict with "traceEvents", or a bare list)."""
    events = doc.get("traceEvents", []) if isinstance(doc, dict) else list(doc)
    procs, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e.get("pid")] = str(e.get("args", {}).get("name", e.get("pid")))
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e.get("pid"), e.get("tid"))] = str(e.get("args", {}).get("name", e.get("tid")))
    stamped = [e for e in events if e.get("ph") in ("X", "C") and isinstance(e.get("ts"), (int, float))]
    t0 = min((e["ts"] for e in stamped), default=0.0)
    lanes: dict[tuple, list[tuple[float, float]]] = {}
    p = Panel(label)
    for e in stamped:
        pid = e.get("pid", 0)
        who = procs.get(pid, f"pid {pid}")
        t = (e["ts"] - t0) / 1e3
        if e["ph"] == "X":
            dur = float(e.get("dur", 0.0)) / 1e3
            lane = LANE_OF.get(str(e.get("cat", "")), threads.get((pid, e.get("tid")), f"tid {e.get('tid')}"))
            if (e.get("args") or {}).get("tier") == "disk":  # the spill file's lanes
                lane = "disk"
            order = LANES.index(lane) if lane in LANES else len(LANES)
            lanes.setdefault((str(pid).zfill(6), order, lane, who), []).append((t, t + dur))
            p.span = max(p.span, t + dur)
        else:
            for k, v in (e.get("args") or {}).items():
                if isinstance(v, (int, float)):
                    name = f"{who} {e.get('name', '')}" + ("" if k in ("bytes", "value") else f" {k}")
                    p.counters.setdefault(name.strip(), []).append((t, float(v)))
            p.span = max(p.span, t)
    for (_, _, lane, who), slices in sorted(lanes.items()):
        for k, row in enumerate(pack(slices)):
            p.rows.append((f"{who} {lane}" if k == 0 else f"{lane} +{k}", lane, row))
    other = doc.get("otherData") if isinstance(doc, dict) else None
    if isinstance(other, dict) and isinstance(other.get("makespan_s"), (int, float)):
        p.makespan = float(other["makespan_s"])
    if isinstance(other, dict) and isinstance(other.get("capacity"), list):
        p.capacity = [int(c) for c in other["capacity"] if isinstance(c, (int, float))]
    return p


def _bytes_unit(top: float) -> tuple[str, float]:
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if top >= k:
            return unit, k
    return "B", 1.0


def plot(panels: Sequence[Panel], path: str, title: str, unit: str = "ms") -> None:
    """Draws `panels` one above the other into a PNG at `path` (see module docstring)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    panels = [p for p in panels if p.rows or p.counters]
    if not panels:
        raise ValueError("nothing to draw: the traces have no slices and no counters")
    heights: list[float] = []
    for p in panels:
        heights += [max(len(p.rows), 1) * 0.32 + 0.5] + ([1.3] if p.counters else [])
    fig, axes = plt.subplots(
        len(heights),
        1,
        figsize=(11, 1.2 + sum(heights)),
        sharex=True,
        gridspec_kw={"height_ratios": heights},
        squeeze=False,
    )
    ax_iter = iter(axes[:, 0])
    seen: dict[str, str] = {}
    for p in panels:
        ax = next(ax_iter)
        for i, (_, lane, row) in enumerate(p.rows):
            color = COLORS.get(lane, OTHER)
            seen.setdefault(lane if lane in COLORS else "other", color)
            ax.broken_barh([(s, max(e - s, 1e-9)) for s, e in row], (i - 0.4, 0.8), color=color, lw=0)
        ax.set_yticks(range(len(p.rows)), [name for name, _, _ in p.rows], fontsize=8)
        ax.set_ylim(len(p.rows) - 0.5, -0.5)
        span = p.makespan * 1e3 if p.makespan is not None else p.span
        ax.set_title(f"{p.label}: makespan {span:.4g} {unit}", fontsize=10, loc="left")
        ax.grid(axis="x", alpha=0.3)
        if p.counters:
            cax = next(ax_iter)
            top = max(v for curve in p.counters.values() for _, v in curve)
            bu, k = _bytes_unit(max([top, *p.capacity]))
            for name, curve in sorted(p.counters.items()):
                xs = [t for t, _ in curve] + [p.span]
                ys = [v / k for _, v in curve]
                ys.append(ys[-1])
                cax.step(xs, ys, where="post", lw=1.2, label=name)
            for c in sorted(set(p.capacity)):
                cax.axhline(c / k, color="black", ls="--", lw=0.8)
            if p.capacity:
                cax.plot([], [], color="black", ls="--", lw=0.8, label="arena capacity")
            cax.set_ylabel(bu, fontsize=8)
            cax.tick_params(labelsize=8)
            cax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.005, 1.02), frameon=False)
            cax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel(f"time ({unit})")
    order = [k for k in (*LANES, "other") if k in seen]
    names = {"compute": "compute (kernels)", "h2d": "h2d (inputs, reloads)", "d2h": "d2h (offloads)"}
    names["peer"] = "peer (transfers)"
    names["disk"] = "disk (spill file)"
    fig.legend(
        [Patch(color=seen[k]) for k in order],
        [names.get(k, k) for k in order],
        loc="lower center",
        ncol=len(order),
        fontsize=8,
        frameon=False,
    )
    fig.suptitle(title, x=0.01, ha="left", fontsize=10)
    inches = 1.2 + sum(heights)
    fig.tight_layout(rect=(0, 0.35 / inches, 1, 1 - 0.2 * (title.count("\n") + 1) / inches))
    fig.savefig(path, dpi=100)
    plt.close(fig)
