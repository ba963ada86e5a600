"""Torch implementations of the training ops (`ops_train`; AdamW and SGD of `ops_optim`), each
writing into a given output view.

`KERNELS` maps op names to functions `(out, ins, attrs)`; `kernels` merges it into its `IMPLS`
(this module imports nothing of the project, so no cycle). As there, the same code runs on the CPU
and on CUDA arena views: no host syncs (no `.item()`, no data-dependent shapes), temporaries from
torch's allocator, `out` never resized. Low-precision inputs are computed in float32 where the
result depends on sums over many terms (norms, softmax statistics).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

Impl = Callable[[torch.Tensor, list[torch.Tensor], Mapping], None]


def _rmsnorm_grad(out, ins, attrs):
    # y = x * r * w, r = (mean(x^2) + eps)^-1/2  =>  dx = r * g - r^3 * x * mean(g * x), g = dy * w
    x, w, dy = (t.float() for t in ins)
    g = dy * (w + attrs["offset"]) if attrs.get("offset") else dy * w
    r = torch.rsqrt(x.square().mean(-1, keepdim=True) + attrs["eps"])
    out.copy_(r * (g - x * r.square() * (g * x).mean(-1, keepdim=True)))


def _silu_grad(out, ins, attrs):
    # d/da a*s(a) = s * (1 + a * (1 - s)); aten's own backward, as autograd runs it
    a, dh = ins
    torch.ops.aten.silu_backward.grad_input(dh, a, grad_input=out)


# ---- attention: FlashAttention-2's backward, one key tile at a time ----------------------------
# Query heads are grouped by their key/value head (head i uses key/value head i // g, g =
# heads/kv_heads, as repeat_interleave does), so q becomes [kv_heads, g*t, d]: one batched matmul
# per tile scores all query heads, and dk, dv come out summed over each group without repeating k, v.
def _grouped(x: torch.Tensor, kvh: int, h: int) -> torch.Tensor:
    """[t, h*d] -> [kvh, g*t, d] in float32, row i*t + r holding head kv*g + i of row r."""
    return x.float().unflatten(1, (kvh, h // kvh, -1)).permute(1, 2, 0, 3).reshape(kvh, -1, x.shape[1] // h)


def _ungrouped(y: torch.Tensor, t: int) -> torch.Tensor:
    """The inverse of `_grouped`: [kvh, g*t, ...] -> [t, kvh*g, ...] (then flattened by the caller)."""
    return y.unflatten(1, (-1, t)).movedim(2, 0).flatten(1, 2)


def _heads(x: torch.Tensor, n: int) -> torch.Tensor:
    """[rows, n*d] -> [n, rows, d] in float32."""
    return x.float().unflatten(1, (n, -1)).transpose(0, 1)


def _scores(qg, k, scale: float, mask, cap: float | None = None) -> torch.Tensor:
    """Masked scaled scores [kvh, g*t, t_j] of grouped queries against one key tile [kvh, t_j, d],
    soft-capped to cap * tanh(s / cap) before the mask when `cap`."""
    s = torch.matmul(qg, k.transpose(1, 2)).mul_(scale)
    if cap is not None:
        s.div_(cap).tanh_().mul_(cap)
    return s if mask is None else s.masked_fill_(~mask, float("-inf"))


def _mask(t: int, tj: int, g: int, q_pos, k_pos: int, attrs: Mapping, device):
    """[g*t, t_j]: key position k_pos + c visible to query position q_pos + r, within the sliding
    window when attrs has one (None: all visible)."""
    if not attrs["causal"]:
        return None
    rows = torch.arange(t, device=device) + q_pos
    keys = torch.arange(tj, device=device) + k_pos
    mask = keys.unsqueeze(0) <= rows.unsqueeze(1)
    window = attrs.get("window", 0)  # .get: vertices saved before the attribute existed
    if window:
        mask &= keys.unsqueeze(0) > rows.unsqueeze(1) - window
    return mask.repeat(g, 1)


def _stats(stats: torch.Tensor, kvh: int, h: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(lse, D) of attention_stats' result, each [kvh, g*t, 1] in float32; a row that sees no key
    (lse -inf) gets lse +inf so that its probabilities exp(-inf - lse) are 0, not NaN."""

    def grouped(cols):
        return cols.float().unflatten(1, (kvh, h // kvh)).permute(1, 2, 0).reshape(kvh, -1, 1)

    lse = grouped(stats[:, :h])
    return lse.masked_fill(lse == float("-inf"), float("inf")), grouped(stats[:, h:])


def _probs_and_dscores(qg, dog, lse, dsum, k, v, scale, mask, cap=None):
    # P = exp(S - lse) (the forward's softmax, recomputed); dS = P * (dO V^T - D), D = rowsum(dO * O);
    # capped scores S = cap * tanh(s / cap): dS times 1 - (S / cap)^2, taken before the mask's -inf
    s = _scores(qg, k, scale, None, cap)
    dcap = None if cap is None else (s / cap).square_().neg_().add_(1.0)
    if mask is not None:
        s.masked_fill_(~mask, float("-inf"))
    p = s.sub_(lse).exp_()
    ds = torch.matmul(dog, v.transpose(1, 2)).sub_(dsum).mul_(p)
    return p, ds if dcap is None else ds.mul_(dcap)


def _attention_dims(attrs) -> tuple[int, int]:
    h = attrs["heads"]
    return h, attrs["kv_heads"] or h


def _attention_stats(out, ins, attrs):
    # lse = log sum_j exp(S_j) over the key tiles, combined tile by tile with logaddexp
    q, kv, o, do = ins[0], ins[1:-2], ins[-2], ins[-1]
    h, kvh = _attention_dims(attrs)
    t, m = q.shape[0], len(kv) // 2
    qg = _grouped(q, kvh, h)
    lse, pos = None, 0
    for k in kv[:m]:
        mask = _mask(t, k.shape[0], h // kvh, attrs["offset"], pos, attrs, q.device)
        part = _scores(qg, _heads(k, kvh), attrs["scale"], mask, attrs.get("softcap")).logsumexp(-1)
        lse = part if lse is None else torch.logaddexp(lse, part)
        pos += k.shape[0]
    out[:, :h].copy_(_ungrouped(lse, t))
    out[:, h:].copy_((do.float() * o.float()).unflatten(1, (h, -1)).sum(-1))


def _attention_grad_q(out, ins, attrs):
    # dQ = scale * sum_j dS_j K_j
    q, stats, do, kv = ins[0], ins[1], ins[2], ins[3:]
    h, kvh = _attention_dims(attrs)
    t, m = q.shape[0], len(kv) // 2
    qg, dog = _grouped(q, kvh, h), _grouped(do, kvh, h)
    lse, dsum = _stats(stats, kvh, h)
    dq = torch.zeros_like(qg)
    pos = 0
    for k, v in zip(kv[:m], kv[m:]):
        mask = _mask(t, k.shape[0], h // kvh, attrs["offset"], pos, attrs, q.device)
        kh = _heads(k, kvh)
        vh, cap = _heads(v, kvh), attrs.get("softcap")
        _, ds = _probs_and_dscores(qg, dog, lse, dsum, kh, vh, attrs["scale"], mask, cap)
        dq.baddbmm_(ds, kh)
        pos += k.shape[0]
    out.copy_(_ungrouped(dq.mul_(attrs["scale"]), t).flatten(1))


def _attention_grad_kv(out, ins, attrs):
    # dV_j = P_j^T dO, dK_j = scale * dS_j^T Q (the matmuls over g*t rows sum each group's heads)
    q, stats, do, k, v = ins
    h, kvh = _attention_dims(attrs)
    t, tj = q.shape[0], k.shape[0]
    qg, dog = _grouped(q, kvh, h), _grouped(do, kvh, h)
    lse, dsum = _stats(stats, kvh, h)
    mask = _mask(t, tj, h // kvh, attrs["q_offset"], attrs["k_offset"], attrs, q.device)
    kh, vh, cap = _heads(k, kvh), _heads(v, kvh), attrs.get("softcap")
    p, ds = _probs_and_dscores(qg, dog, lse, dsum, kh, vh, attrs["scale"], mask, cap)
    width = k.shape[1]
    dk = torch.matmul(ds.transpose(1, 2), qg).mul_(attrs["scale"])
    out[:, :width].unflatten(1, (kvh, -1)).copy_(dk.transpose(0, 1))
    out[:, width:].unflatten(1, (kvh, -1)).copy_(torch.matmul(p.transpose(1, 2), dog).transpose(0, 1))


# ---- linear, cross-entropy, embedding ----------------------------------------------------------
def _linear_grad_w(out, ins, attrs):
    # y = x W^T  =>  dW = dy^T x, summed over the rows (tokens)
    dy, x = ins
    torch.mm(dy.reshape(-1, dy.shape[-1]).t(), x.reshape(-1, x.shape[-1]), out=out)
    if attrs["scale"] != 1.0:
        out.mul_(attrs["scale"])


def _label_in_shard(labels: torch.Tensor, start: int, v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(column of each row's label in the shard clamped into range, whether the shard holds it);
    -100 never lies in a shard since start >= 0."""
    local = labels.long() - start
    return local.clamp(0, v - 1).unsqueeze(1), (local >= 0) & (local < v)


def _cross_entropy_parts(out, ins, attrs):
    logits, labels = ins
    x = logits.float()
    col, inside = _label_in_shard(labels, attrs["start"], x.shape[1])
    out[:, 0].copy_(x.logsumexp(-1))
    out[:, 1].copy_(torch.where(inside, x.gather(1, col).squeeze(1), 0.0))


def _cross_entropy_combine(out, ins, attrs):
    # loss = log sum_g exp(lse_g) - x_label: the log-softmax of the label over the whole vocabulary
    parts, labels = ins[:-1], ins[-1]
    lse = torch.stack([p[:, 0] for p in parts]).float().logsumexp(0)
    picked = torch.stack([p[:, 1] for p in parts]).float().sum(0)
    out[:, 0].copy_(torch.where(labels != -100, lse - picked, 0.0))
    out[:, 1].copy_(lse)


def _cross_entropy_grad(out, ins, attrs):
    # d loss / d x_c = softmax_c - [c == label], times scale; ignored rows have no loss
    logits, labels, combined = ins
    p = (logits.float() - combined[:, 1:2].float()).exp_()
    col, inside = _label_in_shard(labels, attrs["start"], p.shape[1])
    p.scatter_add_(1, col, inside.float().neg_().unsqueeze(1))
    out.copy_(torch.where((labels != -100).unsqueeze(1), p.mul_(attrs["scale"]), 0.0))


def _embedding_grad(out, ins, attrs):
    # y_i = T[ids_i]  =>  dT[r] = sum of dy_i over i with ids_i = r; accumulated in out's dtype
    # (a float32 copy of a vocabulary shard would double the op's memory)
    ids, dy = ins
    rows = out.shape[0]
    local = ids.long() - attrs["start"]
    inside = (local >= 0) & (local < rows)
    out.zero_()
    out.index_add_(0, local.clamp(0, rows - 1), torch.where(inside.unsqueeze(1), dy, 0).to(out.dtype))


# ---- optimizer steps and slicing ---------------------------------------------------------------
def _adamw(out, ins, attrs):
    # torch.optim.AdamW's single-tensor step, op for op, with the bias corrections computed on the
    # device from the step tensor (torch reads the step with .item(), a host sync per parameter)
    state, grad, step = ins[:3]
    if out.data_ptr() != state.data_ptr():
        out.copy_(state)
    r = grad.shape[0]
    param, exp_avg, exp_avg_sq = out[:r], out[r : 2 * r], out[2 * r :]
    lr, beta1, beta2 = _lr(ins[3:], attrs), attrs["beta1"], attrs["beta2"]
    if attrs["weight_decay"] != 0:
        param.mul_(1 - lr * attrs["weight_decay"])
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    t = step.reshape(()).to(torch.float64)  # 0-dim: combines with param's dtype without promoting
    neg_step_size = -lr / (1 - torch.pow(beta1, t))
    denom = (exp_avg_sq.sqrt() / (1 - torch.pow(beta2, t)).sqrt()).add_(attrs["eps"])
    # addcdiv_(exp_avg, denom, value=-step_size) computes param + (value * exp_avg) / denom
    param.add_(exp_avg.mul(neg_step_size).div_(denom))


def _lr(factor: list[torch.Tensor], attrs) -> float | torch.Tensor:
    """The step's learning rate: attribute lr, times the optional factor input (a float64's bits)
    as a float64 0-dim tensor on the device: LambdaLR's product, with no host sync."""
    if not factor:
        return attrs["lr"]
    return attrs["lr"] * factor[0].view(torch.float64).reshape(())


def _sgd(out, ins, attrs):
    # torch.optim.SGD without momentum: d = grad + weight_decay * param; param -= lr * d
    param, grad = ins[:2]
    if attrs["weight_decay"] != 0:
        grad = grad.add(param, alpha=attrs["weight_decay"])
    lr = _lr(ins[2:], attrs)
    if not isinstance(lr, torch.Tensor):
        torch.add(param, grad, alpha=-lr, out=out)
    else:  # param + (-lr) * grad, the scalar in param's dtype as torch.add's alpha is
        torch.addcmul(param, grad, lr.neg().to(param.dtype), out=out)


def _slice(out, ins, attrs):
    out.copy_(ins[0].narrow(attrs["axis"], attrs["start"], attrs["stop"] - attrs["start"]))


KERNELS: dict[str, Impl] = {
    "rmsnorm_grad": _rmsnorm_grad,
    "silu_grad": _silu_grad,
    "attention_stats": _attention_stats,
    "attention_grad_q": _attention_grad_q,
    "attention_grad_kv": _attention_grad_kv,
    "linear_grad_w": _linear_grad_w,
    "cross_entropy_parts": _cross_entropy_parts,
    "cross_entropy_combine": _cross_entropy_combine,
    "cross_entropy_grad": _cross_entropy_grad,
    "embedding_grad": _embedding_grad,
    "adamw": _adamw,
    "sgd": _sgd,
    "slice": _slice,
}
