"""Random valid TaskGraphs for property tests and planner benchmarks.

Float32 matrices whose dimensions come from `sizes`, so matmul ([m, k] @ [k, n]) mixes tensor
sizes by (max/min)^2 while every op type-checks. Operands are mostly recent values on the
kernel's GPU, sometimes any older one (long live ranges); transfers move values between GPUs;
fresh inputs (weights) keep arriving; several outputs are returned.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from disco_ray.graph.taskgraph import Kind, TaskGraph

_RECENT = 8  # operands are usually among the last few values on a GPU
_UNARY = ("silu", "softmax", "transpose", "scale")


def random_dag(
    n: int,
    gpus: int,
    seed: int,
    *,
    transfer_prob: float = 0.1,
    max_inputs: int = 3,
    sizes: Sequence[int] = (16, 32, 64, 128),
    far_prob: float = 0.05,
    input_prob: float = 0.05,
    outputs: int | None = None,
) -> TaskGraph:
    """A random valid TaskGraph of `n` vertices over `gpus` GPUs.

    Args:
        n: number of vertices (inputs included); at least 2 * gpus.
        gpus: number of GPUs.
        seed: seeds every random choice.
        transfer_prob: chance that a new vertex is a GPU-to-GPU transfer (needs gpus > 1).
        max_inputs: most operands of an `add`.
        sizes: matrix dimensions to draw from (float32 [a, b] with a, b in sizes).
        far_prob: chance that an operand is drawn from all earlier values on the GPU, not recent ones.
        input_prob: chance that a new vertex is a fresh graph input.
        outputs: number of outputs (default: one per GPU plus n // 500).
    """
    if n < 2 * gpus:
        raise ValueError(f"random_dag needs n >= 2 * gpus, got n={n}, gpus={gpus}")
    rng = random.Random(seed)
    g = TaskGraph(gpus=gpus)
    shape: dict[str, tuple[int, int]] = {}
    on: list[list[str]] = [[] for _ in range(gpus)]  # values on each GPU, oldest first
    by_shape: list[dict[tuple[int, int], list[str]]] = [{} for _ in range(gpus)]
    by_rows: list[dict[int, list[str]]] = [{} for _ in range(gpus)]
    count = 0

    def note(v: str, gpu: int, s: tuple[int, int]) -> None:
        shape[v] = s
        on[gpu].append(v)
        by_shape[gpu].setdefault(s, []).append(v)
        by_rows[gpu].setdefault(s[0], []).append(v)

    def pick(vals: list[str]) -> str:
        if rng.random() < far_prob:
            return rng.choice(vals)
        return vals[-1 - rng.randrange(min(_RECENT, len(vals)))]

    def new_input(gpu: int, s: tuple[int, int] | None = None) -> str:
        nonlocal count
        s = s or (rng.choice(sizes), rng.choice(sizes))
        v = g.input(f"in{count}", s, "float32", gpu=gpu)
        count += 1
        note(v, gpu, s)
        return v

    for gpu in range(gpus):
        new_input(gpu)
        new_input(gpu)
    while count < n:
        gpu = rng.randrange(gpus)
        r = rng.random()
        vid = f"v{count}"
        if r < input_prob:
            new_input(gpu)
            continue
        if gpus > 1 and r < input_prob + transfer_prob:
            src = rng.choice([d for d in range(gpus) if d != gpu])
            x = pick(on[src])
            g.transfer(x, gpu=gpu, id=vid)
            note(vid, gpu, shape[x])
            count += 1
            continue
        a = pick(on[gpu])
        sa = shape[a]
        op = rng.choice(("matmul", "matmul", "add", "mul", "unary"))
        if op == "matmul":
            bs = by_rows[gpu].get(sa[1])
            if bs:
                b = pick(bs)
                g.matmul(a, b, gpu=gpu, id=vid)
                note(vid, gpu, (sa[0], shape[b][1]))
                count += 1
                continue
            op = "unary"
        if op in ("add", "mul"):
            same = by_shape[gpu][sa]
            k = 2 if op == "mul" else rng.randint(1, max(1, max_inputs))
            ins = [a, *(pick(same) for _ in range(k - 1))]
            g.kernel(op, *ins, gpu=gpu, id=vid)
            note(vid, gpu, sa)
        else:
            u = rng.choice(_UNARY)
            if u == "scale":
                g.scale(a, 0.5, gpu=gpu, id=vid)
            else:
                g.kernel(u, a, gpu=gpu, id=vid)
            note(vid, gpu, (sa[1], sa[0]) if u == "transpose" else sa)
        count += 1
    k = outputs if outputs is not None else gpus + n // 500
    computed = [v.id for v in g if v.kind is not Kind.INPUT]
    chosen = [on[d][-1] for d in range(gpus) if g[on[d][-1]].kind is not Kind.INPUT]
    taken = set(chosen)
    rest = [v for v in computed if v not in taken]
    chosen += rng.sample(rest, min(len(rest), max(0, k - len(chosen))))
    g.output(*dict.fromkeys(chosen))
    return g
