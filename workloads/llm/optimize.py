"""The optimizer phase of a training step: each adapter block's gradient summed, optionally
clipped by the global norm, then AdamW or SGD at the step's learning rate.

- **Learning rate**: the optimizer vertices read `lr_g{j}`, a graph input (the schedule's factor
  as a float64's bits, `ops_optim`), so the rate changes step by step in one planned graph.
- **Clipping** (`OptimSpec.max_grad_norm`), as `torch.nn.utils.clip_grad_norm_`: each block's sum
  of squares on its GPU, their sum per GPU, sent to GPU 0 and summed there (`clip_coef`: the norm
  and the scale min(1, C / (norm + 1e-6))), sent back to every GPU, each gradient scaled before
  its optimizer. The pre-clip norm is the graph's output `grad_norm` ([norm, scale]).
"""

from __future__ import annotations

from typing import Any

GRAD_NORM = "grad_norm"  # the graph output [norm, scale] of a clipped step


def lr_inputs(g, gpus: int) -> list[str]:
    """The learning-rate factor input of each GPU (int64 [1]: a float64's bits)."""
    return [g.input(f"lr_g{j}", (1,), "int64", gpu=j) for j in range(gpus)]


def optimize(b: Any) -> None:
    """Builds the optimizer phase on step builder `b` (`train._Step`: its graph `g`, `params`,
    `grads`, `optim`, `step` and `lr` inputs, `sum_grads`, `layer.broadcast`)."""
    g, o = b.g, b.optim
    grads = {p.state: b.sum_grads(b.grads[p.state], f"{p.state}.grad", p.gpu) for p in b.params}
    if o.max_grad_norm is not None:
        clip = _clip(b, grads)
        grads = {
            p.state: g.kernel("scale_grad", grads[p.state], clip[p.gpu], id=f"{p.state}.clipped")
            for p in b.params
        }
    for p in b.params:
        grad, lr = grads[p.state], b.lr[p.gpu]
        if o.name == "adamw":
            new = g.kernel(
                "adamw",
                p.state,
                grad,
                b.step[p.gpu],
                lr,
                id=f"{p.state}.new",
                lr=o.lr,
                beta1=o.betas[0],
                beta2=o.betas[1],
                eps=o.eps,
                weight_decay=o.weight_decay,
            )
        else:
            new = g.kernel(
                "sgd", p.state, grad, lr, id=f"{p.state}.new", lr=o.lr, weight_decay=o.weight_decay
            )
        g.save_state(new, p.state)


def _clip(b: Any, grads: dict[str, str]) -> list[str]:
    """The [norm, scale] of clip_grad_norm_ on every GPU; outputs it from GPU 0 as GRAD_NORM."""
    g = b.g
    per_gpu: dict[int, list[str]] = {}
    for p in b.params:
        per_gpu.setdefault(p.gpu, []).append(g.kernel("sum_squares", grads[p.state], id=f"{p.state}.sq"))
    parts = []
    for j, sq in sorted(per_gpu.items()):
        total = sq[0] if len(sq) == 1 else g.add(*sq, id=f"clip.sq_g{j}", gpu=j)
        parts.append(total if j == 0 else g.transfer(total, 0, id=f"clip.sq_g{j}_to0"))
    coef = g.kernel("clip_coef", *parts, id=GRAD_NORM, max_norm=float(b.optim.max_grad_norm))
    g.output(coef)
    return b.layer.broadcast(coef, "clip.coef")
