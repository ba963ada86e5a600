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
    b = _Builder(random.Random(seed), TaskGraph(gpus=gpus), sizes, far_prob)
    for gpu in range(gpus):
        b.new_input(gpu)
        b.new_input(gpu)
    while b.count < n:
        gpu = b.rng.randrange(gpus)
        r = b.rng.random()
        if r < input_prob:
            b.new_input(gpu)
        elif gpus > 1 and r < input_prob + transfer_prob:
            b.transfer(gpu)
        else:
            b.kernel(gpu, max_inputs)
    b.outputs(outputs if outputs is not None else gpus + n // 500)
    return b.g


class _Builder:
    """The graph being drawn and, per GPU, its values by age, by shape and by row count."""

    def __init__(self, rng: random.Random, g: TaskGraph, sizes: Sequence[int], far_prob: float):
        self.rng, self.g, self.sizes, self.far_prob = rng, g, sizes, far_prob
        self.shape: dict[str, tuple[int, int]] = {}
        self.on: list[list[str]] = [[] for _ in range(g.gpus)]  # values on each GPU, oldest first
        self.by_shape: list[dict[tuple[int, int], list[str]]] = [{} for _ in range(g.gpus)]
        self.by_rows: list[dict[int, list[str]]] = [{} for _ in range(g.gpus)]
        self.count = 0  # vertices so far, which also numbers the next one

    def note(self, v: str, gpu: int, s: tuple[int, int]) -> None:
        self.shape[v] = s
        self.on[gpu].append(v)
        self.by_shape[gpu].setdefault(s, []).append(v)
        self.by_rows[gpu].setdefault(s[0], []).append(v)
        self.count += 1

    def pick(self, vals: list[str]) -> str:
        if self.rng.random() < self.far_prob:
            return self.rng.choice(vals)
        return vals[-1 - self.rng.randrange(min(_RECENT, len(vals)))]

    def new_input(self, gpu: int) -> None:
        s = (self.rng.choice(self.sizes), self.rng.choice(self.sizes))
        self.note(self.g.input(f"in{self.count}", s, "float32", gpu=gpu), gpu, s)

    def transfer(self, gpu: int) -> None:
        src = self.rng.choice([d for d in range(self.g.gpus) if d != gpu])
        x = self.pick(self.on[src])
        self.note(self.g.transfer(x, gpu=gpu, id=f"v{self.count}"), gpu, self.shape[x])

    def kernel(self, gpu: int, max_inputs: int) -> None:
        """A matmul (where an operand of matching rows exists), an n-ary add, a mul or a unary op."""
        g, vid = self.g, f"v{self.count}"
        a = self.pick(self.on[gpu])
        sa = self.shape[a]
        op = self.rng.choice(("matmul", "matmul", "add", "mul", "unary"))
        if op == "matmul":
            bs = self.by_rows[gpu].get(sa[1])
            if bs:
                b = self.pick(bs)
                self.note(g.matmul(a, b, gpu=gpu, id=vid), gpu, (sa[0], self.shape[b][1]))
                return
            op = "unary"
        if op in ("add", "mul"):
            same = self.by_shape[gpu][sa]
            k = 2 if op == "mul" else self.rng.randint(1, max(1, max_inputs))
            ins = [a, *(self.pick(same) for _ in range(k - 1))]
            self.note(g.kernel(op, *ins, gpu=gpu, id=vid), gpu, sa)
            return
        u = self.rng.choice(_UNARY)
        v = g.scale(a, 0.5, gpu=gpu, id=vid) if u == "scale" else g.kernel(u, a, gpu=gpu, id=vid)
        self.note(v, gpu, (sa[1], sa[0]) if u == "transpose" else sa)

    def outputs(self, k: int) -> None:
        """The last value of each GPU that computed one, then random others, up to `k` outputs."""
        g = self.g
        computed = [v.id for v in g if v.kind is not Kind.INPUT]
        chosen = [self.on[d][-1] for d in range(g.gpus) if g[self.on[d][-1]].kind is not Kind.INPUT]
        taken = set(chosen)
        rest = [v for v in computed if v not in taken]
        chosen += self.rng.sample(rest, min(len(rest), max(0, k - len(chosen))))
        g.output(*dict.fromkeys(chosen))
