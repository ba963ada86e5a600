"""LoRA adapters in a tensor-parallel TaskGraph: their parameters as worker states, and the
linear layers they adapt, forward and backward.

y = x W^T + (alpha/r) (x A^T) B^T with A [r, in], B [out, r] (PEFT's lora_A, lora_B); W frozen.
Split over G GPUs as the base weights are (`workloads.llm.layer.Split`):
- a layer whose output rows are split (q, k, v, gate, up) has B split by rows like W; A is needed
  whole on every GPU: its state lives on the layer's owner GPU, which sends the parameter to the
  others and receives their gradient partials;
- a layer whose input columns are split (o, down) has A split by columns; B lives on the owner,
  where x A^T is summed from the GPUs' partials.
The owner of layer i is GPU i mod G. Each adapter block's state packs the parameter and, for
AdamW, its two moments ([3 r, in] for A): one tensor that one optimizer vertex updates and the
worker keeps from step to step (`TaskGraph` states).

A fused module (Phi-3's qkv_proj, gate_up_proj: `LayerWeights.modules`) has one adapter, as PEFT
does: A [r, in] shared by its parts, B [q + 2 kv, r] whose rows are split into the parts (q, k,
v) and each part's rows over the GPUs like the weight's. Each part computes y_p = x W_p^T +
s (x A^T) B_p^T with x A^T made once; A's gradient is the sum of the parts' partials.
The training graph names the layer's linear layers by LLaMA's module names (its "parts").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from disco_ray.graph.errors import UsageError

from .layer import EXPERT_ROLES, EXPERT_TARGETS
from .model import _Builder

# every family's linear modules: LLaMA's, Phi-3's fused ones, Mixtral's experts'
TARGETS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "qkv_proj",
    "gate_up_proj",
    *EXPERT_TARGETS,
)
COLUMN = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "gate_proj": "gate", "up_proj": "up"}  # rows split
ROW = {"o_proj": "o", "down_proj": "down"}  # input columns split
ROLES = COLUMN | ROW  # module -> the layer builder's name of its weight
GRAD_SUMS = ("sum_into", "add", "chain")  # sum_into: an `accumulate`, planned as sum-into kernels


def module_dims(cfg, mod: str) -> tuple[int, int]:
    """(out, in) of a decoder layer's linear module `mod` of `cfg`'s family, whole (a fused
    module's rows are its parts')."""
    spec = cfg.spec
    roles = spec.weights.modules()[mod]
    return sum(spec.whole(r)[0] for r in roles), spec.whole(roles[0])[1]


def default_targets(cfg) -> tuple[str, ...]:
    """`LoraSpec`'s default targets as `cfg`'s family names its modules (Phi-3: qkv_proj, ...)."""
    want = {ROLES[m] for m in LoraSpec().targets}
    if cfg.moe is not None:  # a mixture's experts take no adapters (`train_graph`)
        want -= set(EXPERT_ROLES)
    return tuple(m for m, roles in cfg.spec.weights.modules().items() if set(roles) <= want)


def check_targets(cfg, targets: tuple[str, ...]) -> None:
    """UsageError naming the targets that are not linear modules of `cfg`'s family."""
    mods = cfg.spec.weights.modules()
    bad = [t for t in targets if t not in mods]
    if bad:
        raise UsageError(
            f"LoRA target module(s) {bad} are not modules of model_type {cfg.family!r} (its modules: "
            f"{', '.join(mods)})"
        )


def check_trainable(cfg, seq: int, where: str) -> None:
    """UsageError for what training does not build: a nonzero dropout of config `where`."""
    if cfg.dropout:
        name, p = cfg.dropout[0]
        raise UsageError(f"{where}: {name} {p}: training with dropout is not built (it trains with none)")


@dataclass(frozen=True, slots=True)
class LoraSpec:
    rank: int = 16
    alpha: float = 32.0
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj")
    rslora: bool = False  # scaling alpha / sqrt(rank) instead of alpha / rank

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    def check(self) -> None:
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise UsageError(f"LoRA rank must be a positive integer, got {self.rank!r}")
        if not isinstance(self.alpha, (int, float)) or isinstance(self.alpha, bool) or not self.alpha > 0:
            raise UsageError(f"LoRA alpha must be a positive number, got {self.alpha!r}")
        bad = [t for t in self.targets if t not in TARGETS]
        if bad or not self.targets:
            raise UsageError(f"LoRA target module(s) {bad or '(none)'} not among {', '.join(TARGETS)}")


@dataclass(frozen=True, slots=True)
class OptimSpec:
    name: str = "adamw"  # or "sgd"
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float | None = None  # clip the global L2 norm of all gradients to it (None: no clipping)

    def check(self) -> None:
        if self.name not in ("adamw", "sgd"):
            raise UsageError(f"optimizer {self.name!r} is not adamw or sgd")
        if not isinstance(self.lr, (int, float)) or isinstance(self.lr, bool) or not self.lr > 0:
            raise UsageError(f"learning rate must be a positive number, got {self.lr!r}")
        if not (isinstance(self.weight_decay, (int, float)) and self.weight_decay >= 0):
            raise UsageError(f"weight decay must be >= 0, got {self.weight_decay!r}")
        c = self.max_grad_norm
        if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float)) or not 0 < c < math.inf):
            raise UsageError(f"max grad norm must be a positive number, got {c!r}")

    @property
    def slots(self) -> int:
        """Rows of state per row of parameter: the parameter, and AdamW's two moments."""
        return 3 if self.name == "adamw" else 1


@dataclass(frozen=True, slots=True)
class Param:
    """One adapter matrix block held by one GPU: its state id, and where it sits in the module's
    whole matrix (rows, cols) of shape `full`."""

    state: str
    gpu: int
    layer: int
    module: str
    which: str  # "A" or "B"
    rows: tuple[int, int]
    cols: tuple[int, int]
    full: tuple[int, int]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows[1] - self.rows[0], self.cols[1] - self.cols[0])


class LoraLayers(_Builder):
    """A `_Builder` whose linear layers carry adapters; records each adapter block's gradient
    partials (`grads`) for the optimizer."""

    def __init__(self, ck, gpus: int, dtype: str, lora: LoraSpec, optim: OptimSpec, grad_sum: str):
        super().__init__(ck, gpus, dtype)
        if self.cfg.kv_heads % gpus:
            raise UsageError(
                f"config num_key_value_heads {self.cfg.kv_heads} does not split over {gpus} GPUs: training "
                "needs each GPU's own key/value heads"
            )
        if grad_sum not in GRAD_SUMS:
            raise UsageError(f"grad_sum {grad_sum!r} is not one of {', '.join(GRAD_SUMS)}")
        check_targets(self.cfg, lora.targets)
        self.lora, self.optim, self.grad_sum = lora, optim, grad_sum
        self.modules = self.cfg.spec.weights.modules()  # the family's modules -> roles
        # a part (LLaMA's module name) -> the family's module holding it
        self.module_of = {
            part: m for m, roles in self.modules.items() for part in ROLES if ROLES[part] in roles
        }
        self.params: list[Param] = []
        self.grads: dict[str, list[str]] = {}  # state id -> gradient partials on its GPU
        self._param_ids: dict[tuple[str, int], str] = {}  # (state, gpu) -> parameter value there

    # ---- adapter parameters --------------------------------------------------------------------
    def owner(self, li: int) -> int:
        return li % self.G

    def module_dims(self, mod: str) -> tuple[int, int]:
        return module_dims(self.cfg, mod)

    def shard(self, mod: str, j: int) -> tuple[int, int]:
        """GPU j's rows of a row-split module's output, or columns of a column-split one's input."""
        return self.split.shard(ROLES[mod], j, self.cfg.head_dim)

    def state(self, li: int, part: str, which: str, j: int) -> str:
        """The state input of one adapter block of `part`'s module (made on first use):
        [slots * rows, cols]; a fused module's B has one per part."""
        mod = self.module_of[part]
        fused = which == "B" and len(self.modules[mod]) > 1
        sid = f"lora.l{li}.{mod}.B.{ROLES[part]}_g{j}" if fused else f"lora.l{li}.{mod}.{which}_g{j}"
        if sid not in self.g:
            out, inn = self.module_dims(mod)
            r = self.lora.rank
            if which == "A":
                rows, cols = (0, r), self.shard(part, j) if part in ROW else (0, inn)
                full = (r, inn)
            else:
                rows = (0, out)
                if part in COLUMN:
                    lo, hi = self.shard(part, j)
                    at = self.cfg.spec.offset(ROLES[part])  # the part's rows in a fused module's B
                    rows = (at + lo, at + hi)
                cols, full = (0, r), (out, r)
            p = Param(sid, j, li, mod, which, rows, cols, full)
            self.params.append(p)
            n, m = p.shape
            self.g.input(sid, (self.optim.slots * n, m), self.dtype, gpu=j, state=True)
            self.grads[sid] = []
        return sid

    def param(self, sid: str, j: int) -> str:
        """The parameter of state `sid` as a value on GPU j (a slice of the packed state, sent over)."""
        key = (sid, j)
        if key not in self._param_ids:
            g = self.g
            home = g[sid].gpu
            if (sid, home) not in self._param_ids:
                rows = g[sid].shape[0] // self.optim.slots
                v = (
                    sid
                    if self.optim.slots == 1
                    else g.kernel("slice", sid, id=f"{sid}.p", axis=0, start=0, stop=rows)
                )
                self._param_ids[(sid, home)] = v
            if j != home:
                self._param_ids[key] = g.transfer(self._param_ids[(sid, home)], j, id=f"{sid}.p_to{j}")
        return self._param_ids[key]

    def grad(self, sid: str, part: str, src_gpu: int, stem: str) -> None:
        """Adds a gradient partial (on `src_gpu`) to the state's sum."""
        home = self.g[sid].gpu
        if src_gpu != home:
            part = self.g.transfer(part, home, id=f"{stem}_to{home}")
        self.grads[sid].append(part)

    def targeted(self, part: str) -> bool:
        return self.module_of[part] in self.lora.targets

    # ---- linear layers with adapters -----------------------------------------------------------
    def col_forward(self, li, mod, x: list[str], stem: str, keep: dict) -> list[str]:
        """y_j = x_j W_j^T (+ s (x_j A^T) B_j^T) per GPU; `keep` gets the adapters' x A^T."""
        g = self.g
        out = []
        for j in range(self.G):
            y = self.layer.project(li, COLUMN[mod], x[j], j, f"{stem}.{mod}_g{j}")
            if self.targeted(mod):
                a = self.param(self.state(li, mod, "A", self.owner(li)), j)
                b = self.param(self.state(li, mod, "B", j), j)
                m = self.module_of[mod]
                if (m, j) not in keep:  # a fused module's parts share x A^T
                    keep[(m, j)] = g.linear(x[j], a, id=f"{stem}.{m}.u_g{j}")
                u = keep[(m, j)]
                y = g.add(
                    y,
                    g.linear(u, b, id=f"{stem}.{mod}.l_g{j}", scale=self.lora.scaling),
                    id=f"{stem}.{mod}.y_g{j}",
                )
            out.append(y)
        return out

    def row_lora(self, li, mod, x: list[str], stem: str, keep: dict, need_out: bool = True) -> str | None:
        """The adapter term s (x A^T) B^T of a column-split layer, on the layer's owner (None if
        not targeted or not `need_out`); `keep` gets x A^T."""
        if not self.targeted(mod):
            return None
        g, o = self.g, self.owner(li)
        parts = []
        for j in range(self.G):
            p = g.linear(x[j], self.param(self.state(li, mod, "A", j), j), id=f"{stem}.{mod}.u_g{j}")
            parts.append(p if j == o else g.transfer(p, o, id=f"{stem}.{mod}.u_p{j}"))
        u = keep[(mod, o)] = parts[0] if self.G == 1 else g.add(*parts, id=f"{stem}.{mod}.u", gpu=o)
        if not need_out:
            return None
        b = self.param(self.state(li, mod, "B", o), o)
        return g.linear(u, b, id=f"{stem}.{mod}.l", scale=self.lora.scaling)

    def residual(
        self, li, role, parts: list[str], lora, h: str, w: int, stem: str, keep: dict, need_out: bool = True
    ) -> str:
        """h plus a block's output (its GPUs' `parts` and its adapter's term `lora`) on GPU w ("" when
        not `need_out`); with a post norm `role` (Gemma 2) the output is summed first, kept as
        keep[role] for the backward, then normed."""
        extra = [lora] if lora else []
        if self.layer.post_norm(li, role) is None:
            return self.reduce(parts, [h, *extra], w, stem) if need_out else ""
        out = keep[role] = self.reduce(parts, extra, w, f"{stem}.sum")
        if not need_out:
            return ""
        return self.g.add(h, self.layer.norm(li, role, out, w, f"{stem}.post"), id=stem, gpu=w)

    def post_grad(self, li, role: str, keep: dict, dy: str, id: str) -> str:
        """The gradient of a block's output before its post norm `role`, from dy after it (on the
        tile's owner); dy itself when the layer has no such norm."""
        if self.layer.post_norm(li, role) is None:
            return dy
        x = keep[role]
        w = self.layer_weights(li, self.g[x].gpu)[role]
        return self.g.kernel("rmsnorm_grad", x, w, dy, id=id, **self.layer.norm_attrs())

    def logits_grad(self, y: str, dy: str, id: str) -> str:
        """The gradient of the logits before the family's soft-cap, from y (capped) and dy (dy
        itself when the family does not cap them)."""
        cap = self.cfg.final_softcap
        return dy if cap is None else self.g.kernel("softcap_grad", y, dy, id=id, cap=cap)

    def reduce(self, parts: list[str], extra: list[str], w: int, stem: str) -> str:
        """Sum on GPU w of one partial per GPU and `extra` values (any GPUs)."""
        g = self.g
        moved = [
            p if g[p].gpu == w else g.transfer(p, w, id=f"{stem}_p{n}") for n, p in enumerate(parts + extra)
        ]
        return moved[0] if len(moved) == 1 else g.add(*moved, id=stem, gpu=w)

    # ---- backward of linear layers ---------------------------------------------------------------
    def col_backward(
        self, li, mod, dy: list[str], x: list[str], keep: dict, stem: str, need_dx: bool
    ) -> list[str]:
        """dx_j partial per GPU (the sum over GPUs and modules is dx); adapter gradients recorded."""
        g, sc = self.g, self.lora.scaling
        out = []
        for j in range(self.G):
            dx = (
                g.matmul(
                    dy[j],
                    self.base_weight(li, COLUMN[mod], j, dy[j], f"{stem}.d{mod}_g{j}.w"),
                    id=f"{stem}.d{mod}_g{j}",
                )
                if need_dx
                else ""
            )
            if self.targeted(mod):
                sa, sb = self.state(li, mod, "A", self.owner(li)), self.state(li, mod, "B", j)
                u = keep[(self.module_of[mod], j)]
                self.grad(
                    sb,
                    g.kernel("linear_grad_w", dy[j], u, id=f"{stem}.{mod}.gB_g{j}", scale=sc),
                    j,
                    f"{stem}.{mod}.gB_g{j}",
                )
                du = g.scale(
                    g.matmul(dy[j], self.param(sb, j), id=f"{stem}.{mod}.du0_g{j}"),
                    sc,
                    id=f"{stem}.{mod}.du_g{j}",
                )
                self.grad(
                    sa,
                    g.kernel("linear_grad_w", du, x[j], id=f"{stem}.{mod}.gA_g{j}"),
                    j,
                    f"{stem}.{mod}.gA_g{j}",
                )
                if need_dx:
                    dx = g.add(
                        dx,
                        g.matmul(du, self.param(sa, j), id=f"{stem}.{mod}.dxl_g{j}"),
                        id=f"{stem}.{mod}.dx_g{j}",
                    )
            out.append(dx)
        return out

    def row_backward(self, li, mod, dy: list[str], x: list[str], keep: dict, stem: str) -> list[str]:
        """dx_j per GPU of a column-split layer (dy whole on every GPU); adapter gradients recorded."""
        g, sc, o = self.g, self.lora.scaling, self.owner(li)
        dxs = [
            g.matmul(
                dy[j],
                self.base_weight(li, ROW[mod], j, dy[j], f"{stem}.d{mod}_g{j}.w"),
                id=f"{stem}.d{mod}_g{j}",
            )
            for j in range(self.G)
        ]
        if not self.targeted(mod):
            return dxs
        sb = self.state(li, mod, "B", o)
        u = keep[(mod, o)]
        self.grad(
            sb, g.kernel("linear_grad_w", dy[o], u, id=f"{stem}.{mod}.gB", scale=sc), o, f"{stem}.{mod}.gB"
        )
        du = g.scale(g.matmul(dy[o], self.param(sb, o), id=f"{stem}.{mod}.du0"), sc, id=f"{stem}.{mod}.du")
        dus = self.layer.broadcast(du, f"{stem}.{mod}.dub")
        for j in range(self.G):
            sa = self.state(li, mod, "A", j)
            self.grad(
                sa,
                g.kernel("linear_grad_w", dus[j], x[j], id=f"{stem}.{mod}.gA_g{j}"),
                j,
                f"{stem}.{mod}.gA_g{j}",
            )
            dxs[j] = g.add(
                dxs[j],
                g.matmul(dus[j], self.param(sa, j), id=f"{stem}.{mod}.dxl_g{j}"),
                id=f"{stem}.{mod}.dx_g{j}",
            )
        return dxs

    def sum_grads(self, parts: list[str], stem: str, gpu: int) -> str:
        g = self.g
        if len(parts) == 1:
            return parts[0]
        if self.grad_sum == "sum_into":
            return g.kernel("accumulate", *parts, id=stem, gpu=gpu)
        if self.grad_sum == "add":
            return g.add(*parts, id=stem, gpu=gpu)
        acc = parts[0]
        for n, p in enumerate(parts[1:]):
            acc = g.add(acc, p, id=f"{stem}.c{n}", gpu=gpu)
        return acc

    def mlp_backward(self, li: int, keep: dict, dys: list[str], w: int, stem: str) -> str:
        """The gradient of the MLP's normed input on owner w, given dys[j] (its output's) per GPU."""
        g, G = self.g, self.G
        dm = self.row_backward(li, "down_proj", dys, keep["m"], keep, stem)
        da = [g.mul(dm[j], keep["up"][j], id=f"{stem}.da_g{j}") for j in range(G)]
        dup = [g.mul(dm[j], keep["a"][j], id=f"{stem}.dup_g{j}") for j in range(G)]
        act = self.cfg.act.grad
        dgt = [g.kernel(act, keep["gate"][j], da[j], id=f"{stem}.dgate_g{j}") for j in range(G)]
        dx2g = self.col_backward(li, "gate_proj", dgt, keep["x2"], keep, stem, True)
        dx2u = self.col_backward(li, "up_proj", dup, keep["x2"], keep, stem, True)
        dx2 = [g.add(dx2g[j], dx2u[j], id=f"{stem}.dx2_g{j}") for j in range(G)]
        return self.reduce(dx2, [], w, f"{stem}.dx2")
