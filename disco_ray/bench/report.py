"""The pure part of `disco-ray bench`: output checks, rows, the table, simulated timelines.

No Ray and no runtime here: these functions take run summaries or simulator results and turn
them into figures. `disco_ray.bench.run` runs the modes and calls them; the lower bound is
`disco_ray.bench.bound`, the timeline plot `disco_ray.bench.plot`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from disco_ray.graph.memgraph import MemGraph, MKind

from .profiles import LANES
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
            "busy_disk": round(max(b["disk_w"], b["disk_r"]), 4),
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


def format_table(rows: Sequence[dict], time_unit: str = "ms", scale: float = 1e3, bound: bool = True) -> str:
    """The bench table: mode, makespan, speedup vs levelwise, makespan / bound (when there is a
    bound), GPU busy %, bytes."""
    head = (
        f"{'mode':16s} {'makespan ' + time_unit:>13s} {'vs levelwise':>12s} "
        + (f"{'/ bound':>8s} " if bound else "")
        + f"{'busy %':>7s} {'bytes moved':>12s}  check"
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
        ratio = _fmt(r["vs_bound"], "7.2f") + ("x" if r["vs_bound"] else "")
        lines.append(
            f"{r['mode']:16s} {_fmt(None if m is None else m * scale, '13.3f'):>13s} "
            f"{_fmt(r['speedup_vs_levelwise'], '11.2f') + ('x' if r['speedup_vs_levelwise'] else ''):>12s} "
            + (f"{ratio:>8s} " if bound else "")
            + f"{_fmt(None if r['busy_compute'] is None else 100 * r['busy_compute'], '7.1f'):>7s} "
            f"{_fmt(r['bytes_moved'], '12d'):>12s}  {chk}"
        )
    return "\n".join(lines)
