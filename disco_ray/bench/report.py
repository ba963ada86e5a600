"""The pure part of `disco-ray bench`: output checks, the lower bound, the table, timelines, plots.

No Ray and no runtime here: these functions take run summaries, trace records or simulator
results and turn them into figures. `disco_ray.cli.bench` runs the modes and calls them.

Lower bound of a workload on its GPUs (DISCO §1): every GPU must at least run all its kernels and
load each of its graph inputs once over its host-to-GPU link, and those can overlap at best, so

    bound = max over GPUs g of max(kernel seconds of g, input bytes of g / H2D rate).

Where the figures come from is recorded beside the bound (`source`): with a device profile,
its rates; on a real run, the kernel intervals of the in-memory (else the dynamic) run's trace
and an H2D rate measured by a copy probe on the same backend.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from disco_ray.graph.memgraph import MemGraph, MKind
from disco_ray.graph.taskgraph import Kind, TaskGraph

from .profiles import LANES, lane
from .simulate import SimResult

RUNTIME_MODES = ("dynamic", "deterministic", "levelwise", "in_memory")
TORCH_MODES = ("torch_naive", "torch_prefetch", "torch_in_memory")
ALL_MODES = RUNTIME_MODES + TORCH_MODES
# relative Frobenius error allowed against the workload's reference, by output dtype: fp32 differs
# only by summation order; half precision rounds every intermediate (16-level chains, attention)
TOLERANCE = {"float32": 1e-4, "float64": 1e-9, "float16": 2e-2, "bfloat16": 5e-2}


def parse_modes(text: str) -> list[str]:
    """ "dynamic,levelwise" -> ["dynamic", "levelwise"]; ValueError names an unknown mode."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in ALL_MODES]
    if bad or not modes:
        raise ValueError(f"unknown mode(s) {bad or text!r} (choose from {', '.join(ALL_MODES)})")
    return list(dict.fromkeys(modes))


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in float64 (0 when both are zero); inf on a shape mismatch."""
    if tuple(got.shape) != tuple(want.shape):
        return float("inf")
    g, w = got.detach().cpu().double(), want.detach().cpu().double()
    if not torch.isfinite(g).all():
        return float("inf")
    den = w.norm().item()
    num = (g - w).norm().item()
    return num / den if den > 0 else num


def check_outputs(outs: Mapping[str, torch.Tensor], ref: Mapping[str, torch.Tensor]) -> dict:
    """Worst relative error over the reference's outputs, the tolerance of their dtype, and ok."""
    worst, tol, worst_id = 0.0, 1.0, None
    for k, want in ref.items():
        dt = str(want.dtype).removeprefix("torch.")
        t = TOLERANCE.get(dt, 0.0)
        e = rel_err(outs[k], want) if k in outs else float("inf")
        if worst_id is None or e / max(t, 1e-30) > worst / max(tol, 1e-30):
            worst, tol, worst_id = e, t, k
    return {"max_rel_err": worst, "tol": tol, "output": worst_id, "ok": worst <= tol}


def input_bytes(tg: TaskGraph) -> list[int]:
    """Bytes of the graph inputs of each GPU: what its H2D link must carry at least once."""
    out = [0] * tg.gpus
    for v in tg:
        if v.kind is Kind.INPUT:
            out[v.gpu] += v.nbytes
    return out


def kernel_seconds_from_records(mg: MemGraph, records: Sequence[Sequence]) -> list[float]:
    """Per GPU, the union of its kernel intervals in a run (ns records) in seconds."""
    from disco_ray.graph.trace import _union_ns

    out = []
    for recs in records:
        iv = [(a, b) for vid, _, a, b in recs if mg.vertex(vid).kind is MKind.KERNEL]
        out.append(_union_ns(iv) / 1e9)
    return out


def h2d_rate_from_records(mg: MemGraph, records: Sequence[Sequence], min_bytes: int = 1 << 20) -> float:
    """The fastest host-to-GPU copy of a run (bytes / its interval; loads of >= min_bytes), 0 if none.

    A bound must use the best rate the link reaches; a run's own copies may beat a separate probe.
    """
    best = 0.0
    for recs in records:
        for vid, _, a, b in recs:
            v = mg.vertex(vid)
            if v.kind in (MKind.INPUT, MKind.RELOAD) and v.out.nbytes >= min_bytes and b > a:
                best = max(best, v.out.nbytes / ((b - a) / 1e9))
    return best


def seconds_from_cost(mg: MemGraph, tg: TaskGraph, cost) -> tuple[list[float], list[float]]:
    """Per GPU, (kernel seconds, input-load seconds) of a plan under a cost model (profile or unit).

    Given the in-memory plan, every graph input is loaded exactly once: the H2D side of the bound.
    """
    kern, load = [0.0] * mg.gpus, [0.0] * mg.gpus
    for v in mg.vertices:
        if v.kind is MKind.KERNEL:
            tv = tg[v.value]
            kern[v.gpu] += float(cost.time(v, tv, [tg[i].shape for i in tv.inputs]))
        elif v.kind is MKind.INPUT:
            load[v.gpu] += float(cost.time(v, None, []))
    return kern, load


def lower_bound(kernel_s: Sequence[float], h2d_s: Sequence[float], source: str, **extra) -> dict:
    """max over GPUs of max(kernel seconds, H2D seconds of its inputs), with its parts."""
    per = [
        {"gpu": g, "kernel_s": k, "h2d_s": h, "bound_s": max(k, h)}
        for g, (k, h) in enumerate(zip(kernel_s, h2d_s))
    ]
    return {
        "seconds": max((p["bound_s"] for p in per), default=0.0),
        "per_gpu": per,
        "source": source,
        **extra,
    }


def timeline_from_records(mg: MemGraph, records: Sequence[Sequence], label: str = "") -> SimResult:
    """A run's trace records as a SimResult timeline (seconds from the first start), for plotting."""
    flat = [(vid, g, a, b) for g, recs in enumerate(records) for vid, _, a, b in recs]
    if not flat:
        return SimResult(0.0, [], [], label)
    t0 = min(a for _, _, a, _ in flat)
    tl = [(vid, g, lane(mg.vertex(vid)), (a - t0) / 1e9, (b - t0) / 1e9) for vid, g, a, b in flat]
    tl.sort(key=lambda e: (e[3], e[0]))
    span = max(e[4] for e in tl)
    busy = []
    for g in range(len(records)):
        per = {}
        for ln in LANES:
            iv = sorted((s, e) for _, gg, l2, s, e in tl if gg == g and l2 == ln)
            tot, end = 0.0, None
            for s, e in iv:  # union: streams may overlap on one lane
                if end is None or s > end:
                    tot, end = tot + e - s, e
                elif e > end:
                    tot, end = tot + e - end, e
            per[ln] = tot / span if span > 0 else 0.0
        busy.append(per)
    return SimResult(span, busy, tl, label)


def sim_records(result: SimResult, gpus: int, ns_per_unit: float = 1e9) -> list[list[tuple]]:
    """A simulated timeline as trace records (vid, lane index as stream, start ns, end ns) per GPU."""
    recs: list[list[tuple]] = [[] for _ in range(gpus)]
    for vid, g, ln, s, e in result.timeline:
        recs[g].append((vid, LANES.index(ln), round(s * ns_per_unit), round(e * ns_per_unit)))
    return recs


def sim_summary(mg: MemGraph, result: SimResult) -> dict:
    """A simulator result in the shape of a run summary (makespan, busy per GPU, bytes by kind)."""
    moved: dict[str, int] = {}
    for v in mg.vertices:
        if v.kind is not MKind.KERNEL:
            moved[v.kind.value] = moved.get(v.kind.value, 0) + v.out.nbytes
    gpus = [
        {
            "gpu": g,
            "busy_compute": round(b["compute"], 4),
            "busy_h2d": round(b["h2d"], 4),
            "busy_d2h": round(b["d2h"], 4),
            "busy_transfer": round(b["peer"], 4),
        }
        for g, b in enumerate(result.busy)
    ]
    return {"vertices": len(result.timeline), "makespan_s": result.makespan, "gpus": gpus, "bytes": moved}


def row(mode: str, makespan: float | None, summary: dict | None, check: dict | None, note: str = "") -> dict:
    """One mode's figures (speedup and bound ratio are filled in by `finish_rows`)."""
    busy = None
    moved = None
    if summary is not None:
        gs = summary.get("gpus") or []
        busy = sum(g["busy_compute"] for g in gs) / len(gs) if gs else None
        moved = sum(summary.get("bytes", {}).values())
    return {
        "mode": mode,
        "makespan_s": makespan,
        "busy_compute": busy,
        "bytes_moved": moved,
        "check": check,
        "note": note,
    }


def finish_rows(rows: list[dict], bound_s: float | None) -> list[dict]:
    """Adds speedup vs levelwise (levelwise makespan / makespan) and makespan / lower bound."""
    lw = next((r["makespan_s"] for r in rows if r["mode"] == "levelwise" and r["makespan_s"]), None)
    for r in rows:
        m = r["makespan_s"]
        r["speedup_vs_levelwise"] = lw / m if (lw and m) else None
        r["vs_bound"] = m / bound_s if (m and bound_s) else None
        r["bound_fraction"] = bound_s / m if (m and bound_s) else None
    return rows


def _fmt(x, spec: str, none: str = "-") -> str:
    return none if x is None else format(x, spec)


def format_table(rows: Sequence[dict], time_unit: str = "ms", scale: float = 1e3) -> str:
    """The bench table: mode, makespan, speedup vs levelwise, makespan / bound, GPU busy %, bytes."""
    head = (
        f"{'mode':16s} {'makespan ' + time_unit:>13s} {'vs levelwise':>12s} {'/ bound':>8s} "
        f"{'busy %':>7s} {'bytes moved':>12s}  check"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        m = r["makespan_s"]
        c = r["check"]
        if c is None:
            chk = r.get("note") or "-"
        else:
            chk = f"{'ok' if c['ok'] else 'MISMATCH'} (err {c['max_rel_err']:.1e} <= {c['tol']:.0e})"
            if r.get("note"):
                chk += f"; {r['note']}"
        lines.append(
            f"{r['mode']:16s} {_fmt(None if m is None else m * scale, '13.3f'):>13s} "
            f"{_fmt(r['speedup_vs_levelwise'], '11.2f') + ('x' if r['speedup_vs_levelwise'] else ''):>12s} "
            f"{_fmt(r['vs_bound'], '7.2f') + ('x' if r['vs_bound'] else ''):>8s} "
            f"{_fmt(None if r['busy_compute'] is None else 100 * r['busy_compute'], '7.1f'):>7s} "
            f"{_fmt(r['bytes_moved'], '12d'):>12s}  {chk}"
        )
    return "\n".join(lines)


def _lanes(res: SimResult) -> list[tuple[int, str]]:
    """(GPU, lane) rows of a timeline: compute, h2d and d2h of every GPU (empty ones too), peer if used."""
    gpus = {g for _, g, _, _, _ in res.timeline}
    shown = {(g, ln) for g in gpus for ln in ("compute", "h2d", "d2h")}
    shown |= {(g, ln) for _, g, ln, _, _ in res.timeline}
    return sorted(shown, key=lambda r: (r[0], LANES.index(r[1])))


def plot_timelines(
    timelines: Mapping[str, SimResult], path: str, unit: str = "ms", scale: float = 1e3
) -> None:
    """One panel per mode (e.g. dynamic and levelwise), rows = GPU x lane, a shared time axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    items = [(k, v) for k, v in timelines.items() if v.timeline]
    if not items:
        return
    nrows = [len(_lanes(r)) for _, r in items]
    fig, axes = plt.subplots(
        len(items),
        1,
        figsize=(10, 1.0 + 0.45 * sum(nrows) + 0.5 * len(items)),
        sharex=True,
        gridspec_kw={"height_ratios": nrows},
        squeeze=False,
    )
    colors = {"compute": "tab:blue", "h2d": "tab:orange", "d2h": "tab:green", "peer": "tab:purple"}
    for ax, (mode, res) in zip(axes[:, 0], items):
        rows_ = _lanes(res)
        at = {r: i for i, r in enumerate(rows_)}
        for _, g, ln, s, e in res.timeline:
            if e > s:
                ax.broken_barh(
                    [(s * scale, (e - s) * scale)],
                    (at[(g, ln)] - 0.4, 0.8),
                    color=colors[ln],
                    edgecolor="black",
                    lw=0.2,
                )
        ax.set_yticks(range(len(rows_)), [f"gpu{g} {ln}" for g, ln in rows_])
        ax.invert_yaxis()
        ax.set_title(f"{mode}: makespan {res.makespan * scale:.4g} {unit}", fontsize=10)
    axes[-1, 0].set_xlabel(f"time ({unit})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
