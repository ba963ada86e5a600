"""One LoRA fine-tuning step of a LLaMA checkpoint as a TaskGraph: forward with activation
checkpointing, the loss, backward with recomputation, gradient sums and the optimizer.

What the papers evaluate (TURNIP section 8, DISCO section 5): rank-r adapters on chosen linear
layers of a frozen model, the base weights streamed from host exactly as in inference. A step:

- **forward**, per sequence of the batch and row tile of `block` tokens, layer by layer (the
  inference graph's tensor-parallel split, `workloads.llama_model`), keeping only each layer's
  input (activation checkpointing);
- **the loss**: the final norm, the LM head's logits per vocabulary shard, the mean next-token
  cross-entropy (transformers' `labels=input_ids`: row i predicts token i+1, the last row and
  padding ignored), and at once the gradient of the logits, so no logits are kept;
- **backward**, layer by layer in reverse: the layer's forward recomputed from its saved input
  (TURNIP's recomputation), then its gradients: the MLP, attention backward one query tile and
  one key tile at a time (never more scores than one tile pair), the norms, and each adapter's
  weight gradients as one partial per tile and sequence;
- **the sum of each weight gradient** over tiles, sequences and GPUs (`grad_sum`: one n-ary `add`,
  a fixed chain of adds, or sum-into accumulation once the planner has it), and **the optimizer**
  (AdamW or SGD) on each adapter matrix, whose state (parameter, and AdamW's moments, packed in
  one tensor) is a worker state carried from step to step: the adapter never leaves the workers.

Adapters and the split over G GPUs. y = x W^T + (alpha/r) (x A^T) B^T with A [r, in], B [out, r]
(PEFT's lora_A, lora_B). For a layer whose output rows are split (q, k, v, gate, up), B is split
by rows like W, A is needed whole on every GPU: its state lives on the layer's owner GPU, which
sends the parameter to the others and receives their gradient partials. For one whose input
columns are split (o, down), A is split by columns and B lives on the owner, where x A^T is summed
from the GPUs' partials. The owner of layer i is GPU i mod G.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from disco_ray.graph.errors import UsageError
from disco_ray.graph.taskgraph import TaskGraph

from .checkpoint import Checkpoint
from .llama_model import _Builder, rope_tables

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
COLUMN = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "gate_proj": "gate", "up_proj": "up"}  # rows split
ROW = {"o_proj": "o", "down_proj": "down"}  # input columns split
GRAD_SUMS = ("add", "chain")
IGNORE = -100  # transformers' ignored label


def module_dims(cfg, mod: str) -> tuple[int, int]:
    """(out, in) of a decoder layer's linear module `mod`, whole."""
    hd = cfg.head_dim
    return {
        "q_proj": (cfg.heads * hd, cfg.dim),
        "k_proj": (cfg.kv_heads * hd, cfg.dim),
        "v_proj": (cfg.kv_heads * hd, cfg.dim),
        "o_proj": (cfg.dim, cfg.heads * hd),
        "gate_proj": (cfg.ffn, cfg.dim),
        "up_proj": (cfg.ffn, cfg.dim),
        "down_proj": (cfg.dim, cfg.ffn),
    }[mod]


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

    def check(self) -> None:
        if self.name not in ("adamw", "sgd"):
            raise UsageError(f"optimizer {self.name!r} is not adamw or sgd")
        if not isinstance(self.lr, (int, float)) or isinstance(self.lr, bool) or not self.lr > 0:
            raise UsageError(f"learning rate must be a positive number, got {self.lr!r}")
        if not (isinstance(self.weight_decay, (int, float)) and self.weight_decay >= 0):
            raise UsageError(f"weight decay must be >= 0, got {self.weight_decay!r}")

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


@dataclass(slots=True)
class TrainGraph:
    taskgraph: TaskGraph
    batch: int
    seq: int
    block: int
    tiles: int
    params: list[Param] = field(default_factory=list)
    loss: str = "loss"
    dtype: str = "float32"
    optim: OptimSpec = field(default_factory=OptimSpec)

    def feed(self, cfg, tokens: torch.Tensor, step: int) -> dict[str, torch.Tensor]:
        """The caller inputs of one step: `tokens` [batch, seq] (int64) and the step number (1, 2, ...)."""
        tokens = torch.as_tensor(tokens, dtype=torch.int64)
        if tuple(tokens.shape) != (self.batch, self.seq):
            raise UsageError(f"a step takes tokens [{self.batch}, {self.seq}], got {list(tokens.shape)}")
        g, b, rows = self.taskgraph.gpus, self.block, self.tiles * self.block
        ids = torch.zeros(self.batch, rows, dtype=torch.int64)
        ids[:, : self.seq] = tokens
        labels = torch.full((self.batch, rows), IGNORE, dtype=torch.int64)
        labels[:, : self.seq - 1] = tokens[:, 1:]
        cos, sin = rope_tables(cfg, torch.arange(rows), getattr(torch, self.dtype))
        out: dict[str, torch.Tensor] = {}
        for j in range(g):
            out[f"step_g{j}"] = torch.tensor([float(step)], dtype=torch.float32)
            for t in range(self.tiles):
                r = slice(t * b, (t + 1) * b)
                out[f"cos_t{t}_g{j}"] = cos[r].clone()
                out[f"sin_t{t}_g{j}"] = sin[r].clone()
                for s in range(self.batch):
                    out[f"tok_b{s}_t{t}_g{j}"] = ids[s, r].clone()
                    out[f"lab_b{s}_t{t}_g{j}"] = labels[s, r].clone()
        return {k: v for k, v in out.items() if k in self.taskgraph}


class _TrainBuilder(_Builder):
    def __init__(self, ck, gpus, dtype, lora: LoraSpec, optim: OptimSpec, batch, seq, block, grad_sum):
        super().__init__(ck, gpus, dtype)
        cfg = self.cfg
        if cfg.kv_heads % gpus:
            raise UsageError(
                f"config num_key_value_heads {cfg.kv_heads} does not split over {gpus} GPUs: training needs "
                "each GPU's own key/value heads"
            )
        if grad_sum not in GRAD_SUMS:
            raise UsageError(f"grad_sum {grad_sum!r} is not one of {', '.join(GRAD_SUMS)}")
        self.lora, self.optim, self.grad_sum = lora, optim, grad_sum
        self.batch, self.seq, self.block = batch, seq, block
        self.tiles = math.ceil(seq / block)
        self.n_valid = batch * (seq - 1)  # rows with a label: the loss is their mean
        self.params: list[Param] = []
        self.grads: dict[str, list[str]] = {}  # state id -> gradient partials on its GPU
        self._param_ids: dict[tuple[str, int], str] = {}  # (state, gpu) -> parameter value there
        self.step = [self.g.input(f"step_g{j}", (1,), "float32", gpu=j) for j in range(gpus)]
        hd = cfg.head_dim
        T = self.tiles
        self.cos = [
            [self.g.input(f"cos_t{t}_g{j}", (block, hd), dtype, gpu=j) for j in range(gpus)] for t in range(T)
        ]
        self.sin = [
            [self.g.input(f"sin_t{t}_g{j}", (block, hd), dtype, gpu=j) for j in range(gpus)] for t in range(T)
        ]

    # ---- adapter parameters --------------------------------------------------------------------
    def owner(self, li: int) -> int:
        return li % self.G

    def module_dims(self, mod: str) -> tuple[int, int]:
        return module_dims(self.cfg, mod)

    def shard(self, mod: str, j: int) -> tuple[int, int]:
        """GPU j's rows of a row-split module's output, or columns of a column-split one's input."""
        s, hd = self.split, self.cfg.head_dim
        if mod in ("q_proj", "o_proj"):
            return (j * s.heads * hd, (j + 1) * s.heads * hd)
        if mod in ("k_proj", "v_proj"):
            return (j * s.kv_heads * hd, (j + 1) * s.kv_heads * hd)
        return (j * s.ffn, (j + 1) * s.ffn)

    def state(self, li: int, mod: str, which: str, j: int) -> str:
        """The state input of one adapter block (made on first use): [slots * rows, cols]."""
        sid = f"lora.l{li}.{mod}.{which}_g{j}"
        if sid not in self.g:
            out, inn = self.module_dims(mod)
            r = self.lora.rank
            if which == "A":
                rows, cols = (0, r), self.shard(mod, j) if mod in ROW else (0, inn)
                full = (r, inn)
            else:
                rows, cols = self.shard(mod, j) if mod in COLUMN else (0, out), (0, r)
                full = (out, r)
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

    def targeted(self, mod: str) -> bool:
        return mod in self.lora.targets

    # ---- linear layers with adapters -----------------------------------------------------------
    def col_forward(self, li, mod, x: list[str], stem: str, keep: dict) -> list[str]:
        """y_j = x_j W_j^T (+ s (x_j A^T) B_j^T) per GPU; `keep` gets the adapters' x A^T."""
        g = self.g
        out = []
        for j in range(self.G):
            y = g.linear(x[j], self.layer_weights(li, j)[COLUMN[mod]], id=f"{stem}.{mod}_g{j}")
            if self.targeted(mod):
                a = self.param(self.state(li, mod, "A", self.owner(li)), j)
                b = self.param(self.state(li, mod, "B", j), j)
                u = keep[(mod, j)] = g.linear(x[j], a, id=f"{stem}.{mod}.u_g{j}")
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

    def reduce(self, parts: list[str], extra: list[str], w: int, stem: str) -> str:
        """Sum on GPU w of one partial per GPU and `extra` values (any GPUs)."""
        g = self.g
        moved = [
            p if g[p].gpu == w else g.transfer(p, w, id=f"{stem}_p{n}") for n, p in enumerate(parts + extra)
        ]
        return moved[0] if len(moved) == 1 else g.add(*moved, id=stem, gpu=w)

    def bcast(self, x: str, stem: str) -> list[str]:
        g, w = self.g, self.g[x].gpu
        return [x if j == w else g.transfer(x, j, id=f"{stem}_to{j}") for j in range(self.G)]

    # ---- one layer forward (kept: what the backward needs) -------------------------------------
    def layer_forward(self, li: int, h: str, t: int, stem: str) -> tuple[int, dict]:
        """The attention inputs of layer li on hidden tile h (held by its owner GPU w): returns w
        and the values made (what the backward reads)."""
        g, eps, w = self.g, self.cfg.eps, self.g[h].gpu
        keep: dict = {"h": h}
        hs = self.bcast(h, f"{stem}.h")
        x1 = [
            g.rmsnorm(hs[j], self.layer_weights(li, j)["attn_norm"], eps=eps, id=f"{stem}.norm1_g{j}")
            for j in range(self.G)
        ]
        keep["x1"] = x1
        q = self.col_forward(li, "q_proj", x1, stem, keep)
        k = self.col_forward(li, "k_proj", x1, stem, keep)
        v = self.col_forward(li, "v_proj", x1, stem, keep)
        cos, sin = self.cos[t], self.sin[t]
        keep["qr"] = [g.kernel("rope", q[j], cos[j], sin[j], id=f"{stem}.qr_g{j}") for j in range(self.G)]
        keep["kr"] = [g.kernel("rope", k[j], cos[j], sin[j], id=f"{stem}.kr_g{j}") for j in range(self.G)]
        keep["v"] = v
        return w, keep

    def attention(self, li, qr, ks, vs, t, stem, j) -> str:
        s, hd = self.split, self.cfg.head_dim
        return self.g.kernel(
            "attention",
            qr,
            *ks,
            *vs,
            id=f"{stem}.attn_g{j}",
            heads=s.heads,
            kv_heads=s.kv_heads,
            scale=hd**-0.5,
            offset=t * self.block,
            causal=True,
        )

    def layer_rest(self, li: int, keep: dict, att: list[str], w: int, stem: str, full: bool) -> str:
        """From the attention output: o projection, residual, MLP (the down projection's base matmul
        and the second residual only when `full`); returns h out on w (or "")."""
        g, eps = self.g, self.cfg.eps
        keep["att"] = att
        o_parts = [
            g.linear(att[j], self.layer_weights(li, j)["o"], id=f"{stem}.o_g{j}") for j in range(self.G)
        ]
        lo = self.row_lora(li, "o_proj", att, stem, keep)
        h1 = self.reduce(o_parts, [keep["h"], *([lo] if lo else [])], w, f"{stem}.h1")
        keep["h1"] = h1
        h1s = self.bcast(h1, f"{stem}.h1b")
        x2 = [
            g.rmsnorm(h1s[j], self.layer_weights(li, j)["mlp_norm"], eps=eps, id=f"{stem}.norm2_g{j}")
            for j in range(self.G)
        ]
        keep["x2"] = x2
        gt = self.col_forward(li, "gate_proj", x2, stem, keep)
        up = self.col_forward(li, "up_proj", x2, stem, keep)
        a = [g.silu(gt[j], id=f"{stem}.silu_g{j}") for j in range(self.G)]
        m = [g.mul(a[j], up[j], id=f"{stem}.m_g{j}") for j in range(self.G)]
        keep |= {"gate": gt, "up": up, "a": a, "m": m}
        ld = self.row_lora(li, "down_proj", m, stem, keep, need_out=full)
        if not full:
            return ""
        d_parts = [
            g.linear(m[j], self.layer_weights(li, j)["down"], id=f"{stem}.down_g{j}") for j in range(self.G)
        ]
        return self.reduce(d_parts, [h1, *([ld] if ld else [])], w, f"{stem}.h2")

    # ---- backward of linear layers ---------------------------------------------------------------
    def col_backward(
        self, li, mod, dy: list[str], x: list[str], keep: dict, stem: str, need_dx: bool
    ) -> list[str]:
        """dx_j partial per GPU (the sum over GPUs and modules is dx); adapter gradients recorded."""
        g, sc = self.g, self.lora.scaling
        out = []
        for j in range(self.G):
            dx = (
                g.matmul(dy[j], self.layer_weights(li, j)[COLUMN[mod]], id=f"{stem}.d{mod}_g{j}")
                if need_dx
                else ""
            )
            if self.targeted(mod):
                sa, sb = self.state(li, mod, "A", self.owner(li)), self.state(li, mod, "B", j)
                u = keep[(mod, j)]
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
            g.matmul(dy[j], self.layer_weights(li, j)[ROW[mod]], id=f"{stem}.d{mod}_g{j}")
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
        dus = self.bcast(du, f"{stem}.{mod}.dub")
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
        if self.grad_sum == "add":
            return g.add(*parts, id=stem, gpu=gpu)
        acc = parts[0]
        for n, p in enumerate(parts[1:]):
            acc = g.add(acc, p, id=f"{stem}.c{n}", gpu=gpu)
        return acc


def train_graph(
    ck: Checkpoint,
    gpus: int,
    batch: int,
    seq: int,
    block: int,
    lora: LoraSpec,
    optim: OptimSpec,
    dtype: str | None = None,
    grad_sum: str = "add",
) -> TrainGraph:
    """One optimizer step on `batch` sequences of `seq` tokens (row tiles of `block`)."""
    lora.check()
    optim.check()
    if seq < 2:
        raise UsageError(f"a training sequence needs at least 2 tokens, got {seq}")
    b = _TrainBuilder(ck, gpus, dtype or ck.config.dtype, lora, optim, batch, seq, block, grad_sum)
    g, cfg, G, T, L = b.g, b.cfg, gpus, b.tiles, b.cfg.layers
    sp, hd = b.split, cfg.head_dim
    kvw = sp.kv_heads * hd
    inv_n = 1.0 / b.n_valid
    saved: list[list[list[str]]] = [
        [[""] * T for _ in range(batch)] for _ in range(L + 1)
    ]  # [layer][b][t] on owner
    dtop: list[list[str]] = [[""] * T for _ in range(batch)]
    losses: list[str] = []
    # ---- forward, keeping each layer's input; the loss and the logits' gradient per tile
    for s in range(batch):
        for t in range(T):
            tok = [g.input(f"tok_b{s}_t{t}_g{j}", (block,), "int64", gpu=j) for j in range(G)]
            emb = [
                g.kernel(
                    "embedding", tok[j], b.embed_table(j), id=f"b{s}.t{t}.emb_g{j}", start=sp.vocab[j][0]
                )
                for j in range(G)
            ]
            saved[0][s][t] = b.reduce(
                emb, [], (s * T + t) % G, f"b{s}.t{t}.h0"
            )  # owners rotate over tiles and sequences
    for li in range(L):
        for s in range(batch):
            ks: list[list[str]] = [[] for _ in range(G)]
            vs: list[list[str]] = [[] for _ in range(G)]
            for t in range(T):
                stem = f"f.b{s}.t{t}.l{li}"
                w, keep = b.layer_forward(li, saved[li][s][t], t, stem)
                att = []
                for j in range(G):
                    ks[j].append(keep["kr"][j])
                    vs[j].append(keep["v"][j])
                    att.append(b.attention(li, keep["qr"][j], ks[j], vs[j], t, stem, j))
                saved[li + 1][s][t] = b.layer_rest(li, keep, att, w, stem, True)
    for s in range(batch):
        for t in range(T):
            stem = f"loss.b{s}.t{t}"
            hL = saved[L][s][t]
            w = g[hL].gpu
            hs = b.bcast(hL, f"{stem}.h")
            lab = [g.input(f"lab_b{s}_t{t}_g{j}", (block,), "int64", gpu=j) for j in range(G)]
            xf, logits, parts = [], [], []
            for j in range(G):
                norm = b.weight(f"norm_g{j}", "model.norm.weight", j)
                xf.append(g.rmsnorm(hs[j], norm, eps=cfg.eps, id=f"{stem}.normf_g{j}"))
                logits.append(g.linear(xf[j], b.head_table(j), id=f"{stem}.logits_g{j}"))
                parts.append(
                    g.kernel(
                        "cross_entropy_parts", logits[j], lab[j], id=f"{stem}.ce_g{j}", start=sp.vocab[j][0]
                    )
                )
            moved = [p if j == w else g.transfer(p, w, id=f"{stem}.ce_p{j}") for j, p in enumerate(parts)]
            comb = g.kernel("cross_entropy_combine", *moved, lab[w], id=f"{stem}.comb")
            col = g.kernel("slice", comb, id=f"{stem}.rows", axis=1, start=0, stop=1)
            losses.append(g.kernel("reduce_sum", col, id=f"{stem}.loss", scale=inv_n))
            combs = b.bcast(comb, f"{stem}.combb")
            dxf = []
            for j in range(G):
                dl = g.kernel(
                    "cross_entropy_grad",
                    logits[j],
                    lab[j],
                    combs[j],
                    id=f"{stem}.dlogits_g{j}",
                    start=sp.vocab[j][0],
                    scale=inv_n,
                )
                dxf.append(g.matmul(dl, b.head_table(j), id=f"{stem}.dxf_g{j}"))
            dx = b.reduce(dxf, [], w, f"{stem}.dxf")
            dtop[s][t] = g.kernel(
                "rmsnorm_grad",
                hL,
                b.weight(f"norm_g{w}", "model.norm.weight", w),
                dx,
                id=f"{stem}.dh",
                eps=cfg.eps,
            )
    moved = [x if g[x].gpu == 0 else g.transfer(x, 0, id=f"{x}_to0") for x in losses]
    loss = moved[0] if len(moved) == 1 else b.sum_grads(moved, "loss", 0)
    if loss != "loss":
        loss = g.scale(loss, 1.0, id="loss")
    g.output(loss)
    # ---- backward, layer by layer, the layer's forward recomputed from its saved input
    dh2 = dtop  # [b][t]: the gradient of layer li's output, on the tile's owner
    for li in reversed(range(L)):
        dh_below: list[list[str]] = [[""] * T for _ in range(batch)]
        for s in range(batch):
            keeps, ks, vs = [], [[] for _ in range(G)], [[] for _ in range(G)]
            for t in range(T):  # recompute
                stem = f"r.b{s}.t{t}.l{li}"
                w, keep = b.layer_forward(li, saved[li][s][t], t, stem)
                att = []
                for j in range(G):
                    ks[j].append(keep["kr"][j])
                    vs[j].append(keep["v"][j])
                    att.append(b.attention(li, keep["qr"][j], ks[j], vs[j], t, stem, j))
                b.layer_rest(li, keep, att, w, stem, False)
                keep["w"] = w
                keeps.append(keep)
            dkv: list[list[list[str]]] = [
                [[] for _ in range(G)] for _ in range(T)
            ]  # [key tile][gpu] partials
            dqr: list[list[str]] = [[""] * G for _ in range(T)]
            dh1s: list[str] = [""] * T
            for t in reversed(range(T)):  # MLP and attention backward, per query tile
                stem = f"g.b{s}.t{t}.l{li}"
                keep, w = keeps[t], keeps[t]["w"]
                dys = b.bcast(dh2[s][t], f"{stem}.dh2")
                dm = b.row_backward(li, "down_proj", dys, keep["m"], keep, stem)
                da = [g.mul(dm[j], keep["up"][j], id=f"{stem}.da_g{j}") for j in range(G)]
                dup = [g.mul(dm[j], keep["a"][j], id=f"{stem}.dup_g{j}") for j in range(G)]
                dgt = [
                    g.kernel("silu_grad", keep["gate"][j], da[j], id=f"{stem}.dgate_g{j}") for j in range(G)
                ]
                dx2g = b.col_backward(li, "gate_proj", dgt, keep["x2"], keep, stem, True)
                dx2u = b.col_backward(li, "up_proj", dup, keep["x2"], keep, stem, True)
                dx2 = [g.add(dx2g[j], dx2u[j], id=f"{stem}.dx2_g{j}") for j in range(G)]
                dx2w = b.reduce(dx2, [], w, f"{stem}.dx2")
                mlp_norm = b.layer_weights(li, w)["mlp_norm"]
                dn2 = g.kernel("rmsnorm_grad", keep["h1"], mlp_norm, dx2w, id=f"{stem}.dn2", eps=cfg.eps)
                dh1s[t] = g.add(dh2[s][t], dn2, id=f"{stem}.dh1", gpu=w)
                dy1 = b.bcast(dh1s[t], f"{stem}.dh1b")
                dO = b.row_backward(li, "o_proj", dy1, keep["att"], keep, stem)
                for j in range(G):
                    qr, att = keep["qr"][j], keep["att"][j]
                    kk, vv = (
                        [keeps[n]["kr"][j] for n in range(t + 1)],
                        [keeps[n]["v"][j] for n in range(t + 1)],
                    )
                    common = dict(heads=sp.heads, kv_heads=sp.kv_heads, scale=hd**-0.5)
                    st = g.kernel(
                        "attention_stats",
                        qr,
                        *kk,
                        *vv,
                        att,
                        dO[j],
                        id=f"{stem}.stats_g{j}",
                        offset=t * block,
                        causal=True,
                        **common,
                    )
                    dqr[t][j] = g.kernel(
                        "attention_grad_q",
                        qr,
                        st,
                        dO[j],
                        *kk,
                        *vv,
                        id=f"{stem}.dq_g{j}",
                        offset=t * block,
                        causal=True,
                        **common,
                    )
                    for n in range(t + 1):
                        dkv[n][j].append(
                            g.kernel(
                                "attention_grad_kv",
                                qr,
                                st,
                                dO[j],
                                kk[n],
                                vv[n],
                                id=f"{stem}.dkv{n}_g{j}",
                                q_offset=t * block,
                                k_offset=n * block,
                                causal=True,
                                **common,
                            )
                        )
            for t in range(T):  # per key tile: dk, dv; then q/k/v backward, the input norm
                stem = f"g.b{s}.t{t}.l{li}"
                keep, w = keeps[t], keeps[t]["w"]
                cos, sin = b.cos[t], b.sin[t]
                dq, dk, dv = [], [], []
                for j in range(G):
                    acc = b.sum_grads(dkv[t][j], f"{stem}.dkv_g{j}", j)
                    dkr = g.kernel("slice", acc, id=f"{stem}.dkr_g{j}", axis=1, start=0, stop=kvw)
                    dv.append(g.kernel("slice", acc, id=f"{stem}.dv_g{j}", axis=1, start=kvw, stop=2 * kvw))
                    dk.append(g.kernel("rope", dkr, cos[j], sin[j], id=f"{stem}.dk_g{j}", inverse=True))
                    dq.append(
                        g.kernel("rope", dqr[t][j], cos[j], sin[j], id=f"{stem}.dqp_g{j}", inverse=True)
                    )
                need = li > 0  # the embedding is frozen: layer 0's input gradient is not needed
                dxq = b.col_backward(li, "q_proj", dq, keep["x1"], keep, stem, need)
                dxk = b.col_backward(li, "k_proj", dk, keep["x1"], keep, stem, need)
                dxv = b.col_backward(li, "v_proj", dv, keep["x1"], keep, stem, need)
                if not need:
                    continue
                dx1 = [g.add(dxq[j], dxk[j], dxv[j], id=f"{stem}.dx1_g{j}") for j in range(G)]
                dx1w = b.reduce(dx1, [], w, f"{stem}.dx1")
                attn_norm = b.layer_weights(li, w)["attn_norm"]
                dn1 = g.kernel("rmsnorm_grad", keep["h"], attn_norm, dx1w, id=f"{stem}.dn1", eps=cfg.eps)
                dh_below[s][t] = g.add(dh1s[t], dn1, id=f"{stem}.dh", gpu=w)
        dh2 = dh_below
    # ---- the gradient sums and the optimizer step, per adapter block
    o = b.optim
    for p in b.params:
        grad = b.sum_grads(b.grads[p.state], f"{p.state}.grad", p.gpu)
        if o.name == "adamw":
            new = g.kernel(
                "adamw",
                p.state,
                grad,
                b.step[p.gpu],
                id=f"{p.state}.new",
                lr=o.lr,
                beta1=o.betas[0],
                beta2=o.betas[1],
                eps=o.eps,
                weight_decay=o.weight_decay,
            )
        else:
            new = g.kernel("sgd", p.state, grad, id=f"{p.state}.new", lr=o.lr, weight_decay=o.weight_decay)
        g.save_state(new, p.state)
    return TrainGraph(g, batch, seq, block, T, b.params, loss, b.dtype, o)
