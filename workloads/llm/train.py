"""One LoRA fine-tuning step of a LLaMA checkpoint as a TaskGraph: forward with activation
checkpointing, the loss, backward with recomputation, gradient sums and the optimizer.

What the papers evaluate (TURNIP section 8, DISCO section 5): rank-r adapters on chosen linear
layers of a frozen model, the base weights streamed from host exactly as in inference. A step:

- **forward**, per sequence of the batch and row tile of `block` tokens, layer by layer (the
  inference graph's tensor-parallel split, `workloads.llm.model`), keeping only each layer's
  input (activation checkpointing);
- **the loss**: the final norm, the LM head's logits per vocabulary shard, the mean next-token
  cross-entropy (transformers' `labels=input_ids`: row i predicts token i+1, the last row and
  padding ignored), and at once the gradient of the logits, so no logits are kept;
- **backward**, layer by layer in reverse: the layer's forward recomputed from its saved input
  (TURNIP's recomputation), then its gradients: the MLP, attention backward one query tile and
  one key tile at a time (never more scores than one tile pair), the norms, and each adapter's
  weight gradients as one partial per tile and sequence;
- **the sum of each weight gradient** over tiles, sequences and GPUs (`grad_sum`: "sum_into", the
  default, one `accumulate` that the planner turns into sum-into kernels, each adding one partial
  as soon as it exists (TURNIP appendix A); "add", one n-ary `add`; "chain", a fixed chain of
  adds), and **the optimizer**
  (AdamW or SGD) on each adapter matrix, whose state (parameter, and AdamW's moments, packed in
  one tensor) is a worker state carried from step to step: the adapter never leaves the workers.

The adapters, their split over the GPUs and their backward are in `workloads.llm.lora`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from disco_ray.graph.errors import UsageError
from disco_ray.graph.kernels_sample import as_bits
from disco_ray.graph.taskgraph import TaskGraph

from .checkpoint import Checkpoint
from .layer import rope_tables
from .lora import TARGETS, LoraLayers, LoraSpec, OptimSpec, Param, check_trainable, module_dims
from .moe_lora import expert_targets
from .moe_train import moe_backward, moe_forward, moe_output
from .optimize import GRAD_NORM, lr_inputs, optimize

IGNORE = -100  # transformers' ignored label
__all__ = ["TARGETS", "LoraSpec", "OptimSpec", "Param", "TrainGraph", "module_dims", "train_graph"]


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
    micro: int = 1  # micro-batches of batch // micro sequences (gradient accumulation)
    grad_norm: str | None = None  # the output [pre-clip norm, scale] when clipping

    def feed(self, cfg, tokens: torch.Tensor, step: int, lr_factor: float = 1.0) -> dict[str, torch.Tensor]:
        """The caller inputs of one step: `tokens` [batch, seq] (int64), the step number (1, 2, ...)
        and the factor of the optimizer's learning rate this step (a schedule's)."""
        tokens = torch.as_tensor(tokens, dtype=torch.int64)
        if tuple(tokens.shape) != (self.batch, self.seq):
            raise UsageError(f"a step takes tokens [{self.batch}, {self.seq}], got {list(tokens.shape)}")
        g, b, rows = self.taskgraph.gpus, self.block, self.tiles * self.block
        ids = torch.zeros(self.batch, rows, dtype=torch.int64)
        ids[:, : self.seq] = tokens
        labels = torch.full((self.batch, rows), IGNORE, dtype=torch.int64)
        labels[:, : self.seq - 1] = tokens[:, 1:]
        cos, sin = rope_tables(cfg.spec, torch.arange(rows), getattr(torch, self.dtype))
        out: dict[str, torch.Tensor] = {}
        for j in range(g):
            out[f"step_g{j}"] = torch.tensor([float(step)], dtype=torch.float32)
            out[f"lr_g{j}"] = as_bits(torch.tensor([lr_factor], dtype=torch.float64))
            for t in range(self.tiles):
                r = slice(t * b, (t + 1) * b)
                out[f"cos_t{t}_g{j}"] = cos[r].clone()
                out[f"sin_t{t}_g{j}"] = sin[r].clone()
                for s in range(self.batch):
                    out[f"tok_b{s}_t{t}_g{j}"] = ids[s, r].clone()
                    out[f"lab_b{s}_t{t}_g{j}"] = labels[s, r].clone()
        return {k: v for k, v in out.items() if k in self.taskgraph}


class _Step(LoraLayers):
    """Builds one training step; its phases are `forward`, `loss`, `backward`, `optimize`."""

    def __init__(self, ck, gpus, dtype, lora: LoraSpec, optim: OptimSpec, batch, seq, block, grad_sum):
        super().__init__(ck, gpus, dtype, lora, optim, grad_sum)
        self.batch, self.seq, self.block = batch, seq, block
        self.tiles = T = math.ceil(seq / block)
        self.n_valid = batch * (seq - 1)  # rows with a label: the loss is their mean
        self.step = [self.g.input(f"step_g{j}", (1,), "float32", gpu=j) for j in range(gpus)]
        self.lr = lr_inputs(self.g, gpus)
        self.losses: list[str] = []  # per sequence and tile: its share of the mean loss
        hd = self.cfg.head_dim
        self.cos = [
            [self.g.input(f"cos_t{t}_g{j}", (block, hd), dtype, gpu=j) for j in range(gpus)] for t in range(T)
        ]
        self.sin = [
            [self.g.input(f"sin_t{t}_g{j}", (block, hd), dtype, gpu=j) for j in range(gpus)] for t in range(T)
        ]
        # [layer][sequence][tile]: each layer's input, kept on the tile's owner GPU
        self.saved: list[list[list[str]]] = [
            [[""] * T for _ in range(batch)] for _ in range(self.cfg.layers + 1)
        ]

    # ---- one layer forward (kept: what the backward needs) -------------------------------------
    def layer_forward(self, li: int, h: str, t: int, stem: str) -> tuple[int, dict]:
        """The attention inputs of layer li on hidden tile h (held by its owner GPU w): returns w
        and the values made (what the backward reads)."""
        lay, w = self.layer, self.g[h].gpu
        keep: dict = {"h": h}
        hs = lay.broadcast(h, f"{stem}.h")
        x1 = [lay.norm(li, "attn_norm", hs[j], j, f"{stem}.norm1_g{j}") for j in range(self.G)]
        keep["x1"] = x1
        q = self.col_forward(li, "q_proj", x1, stem, keep)
        k = self.col_forward(li, "k_proj", x1, stem, keep)
        v = self.col_forward(li, "v_proj", x1, stem, keep)
        keep["q"], keep["k"] = q, k  # before the per-head norms (when the layer has them)
        q = [lay.head_norm(li, "q_norm", q[j], j, f"{stem}.qn_g{j}") for j in range(self.G)]
        k = [lay.head_norm(li, "k_norm", k[j], j, f"{stem}.kn_g{j}") for j in range(self.G)]
        cos, sin = self.cos[t], self.sin[t]
        keep["qr"] = [lay.rope(q[j], cos[j], sin[j], f"{stem}.qr_g{j}") for j in range(self.G)]
        keep["kr"] = [lay.rope(k[j], cos[j], sin[j], f"{stem}.kr_g{j}") for j in range(self.G)]
        keep["v"] = v
        return w, keep

    def layer_rest(self, li: int, keep: dict, att: list[str], w: int, stem: str, full: bool) -> str:
        """From the attention output: o projection, residual, MLP (the down projection's base matmul
        and the second residual only when `full`); returns h out on w (or "")."""
        g, lay = self.g, self.layer
        keep["att"] = att
        o_parts = [lay.project(li, "o", att[j], j, f"{stem}.o_g{j}") for j in range(self.G)]
        lo = self.row_lora(li, "o_proj", att, stem, keep)
        h1 = self.residual(li, "attn_post_norm", o_parts, lo, keep["h"], w, f"{stem}.h1", keep)
        keep["h1"] = h1
        h1s = lay.broadcast(h1, f"{stem}.h1b")
        x2 = [lay.norm(li, "mlp_norm", h1s[j], j, f"{stem}.norm2_g{j}") for j in range(self.G)]
        keep["x2"] = x2
        if self.cfg.spec.moe is not None:  # a mixture of experts (workloads.llm.moe_train)
            moe_forward(self, li, x2, stem, keep)
            if not full:
                return ""
            return self.reduce(
                [moe_output(self, li, keep, j, stem) for j in range(self.G)], [h1], w, f"{stem}.h2"
            )
        gt = self.col_forward(li, "gate_proj", x2, stem, keep)
        up = self.col_forward(li, "up_proj", x2, stem, keep)
        a = [lay.act(gt[j], f"{stem}.{lay.spec.act.value}_g{j}") for j in range(self.G)]
        m = [g.mul(a[j], up[j], id=f"{stem}.m_g{j}") for j in range(self.G)]
        keep |= {"gate": gt, "up": up, "a": a, "m": m}
        post = lay.post_norm(li, "mlp_post_norm") is not None  # its backward reads the MLP's output
        ld = self.row_lora(li, "down_proj", m, stem, keep, need_out=full or post)
        if not (full or post):
            return ""
        d_parts = [lay.project(li, "down", m[j], j, f"{stem}.down_g{j}") for j in range(self.G)]
        return self.residual(li, "mlp_post_norm", d_parts, ld, h1, w, f"{stem}.h2", keep, full)

    # ---- the phases of a step ---------------------------------------------------------------------
    def forward(self, seqs: range) -> None:
        """Embedding and every layer per sequence of `seqs` and tile, keeping only each layer's input."""
        g, G, T = self.g, self.G, self.tiles
        for s in seqs:
            for t in range(T):
                tok = [g.input(f"tok_b{s}_t{t}_g{j}", (self.block,), "int64", gpu=j) for j in range(G)]
                emb = [self.lookup(tok[j], j, f"b{s}.t{t}.emb_g{j}") for j in range(G)]
                # the tiles' owner GPUs rotate over tiles and sequences
                self.saved[0][s][t] = self.reduce(emb, [], (s * T + t) % G, f"b{s}.t{t}.h0")
        for li in range(self.cfg.layers):
            for s in seqs:
                for t, (out, _) in enumerate(self.layer_tiles(li, s, "f", True)):
                    self.saved[li + 1][s][t] = out

    def loss(self, seqs: range) -> list[list[str]]:
        """Per tile of `seqs`: final norm, logits per vocabulary shard, the cross-entropy and at once
        the logits' gradient (no logits kept); each tile's loss, a share of the mean over the
        batch's labelled rows, kept for `loss_output`; returns the gradient of the last layer's
        output per sequence (indexed as in the batch) and tile."""
        g, G, cfg, sp = self.g, self.G, self.cfg, self.split
        inv_n = 1.0 / self.n_valid
        dtop: list[list[str]] = [[""] * self.tiles for _ in range(self.batch)]
        losses = self.losses
        for s in seqs:
            for t in range(self.tiles):
                stem = f"loss.b{s}.t{t}"
                hL = self.saved[cfg.layers][s][t]
                w = g[hL].gpu
                hs = self.layer.broadcast(hL, f"{stem}.h")
                lab = [g.input(f"lab_b{s}_t{t}_g{j}", (self.block,), "int64", gpu=j) for j in range(G)]
                logits, parts = [], []
                for j in range(G):
                    norm = self.weight(f"norm_g{j}", "model.norm.weight", j)
                    xf = g.rmsnorm(hs[j], norm, id=f"{stem}.normf_g{j}", **self.layer.norm_attrs())
                    logits.append(self.logits(xf, j, f"{stem}.logits_g{j}"))
                    parts.append(
                        g.kernel(
                            "cross_entropy_parts",
                            logits[j],
                            lab[j],
                            id=f"{stem}.ce_g{j}",
                            start=sp.vocab[j][0],
                        )
                    )
                moved = [p if j == w else g.transfer(p, w, id=f"{stem}.ce_p{j}") for j, p in enumerate(parts)]
                comb = g.kernel("cross_entropy_combine", *moved, lab[w], id=f"{stem}.comb")
                col = g.kernel("slice", comb, id=f"{stem}.rows", axis=1, start=0, stop=1)
                losses.append(g.kernel("reduce_sum", col, id=f"{stem}.loss", scale=inv_n))
                combs = self.layer.broadcast(comb, f"{stem}.combb")
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
                    dl = self.logits_grad(logits[j], dl, f"{stem}.dcap_g{j}")
                    dxf.append(
                        g.matmul(dl, self.head_weight(j, dl, f"{stem}.dxf_g{j}.w"), id=f"{stem}.dxf_g{j}")
                    )
                dx = self.reduce(dxf, [], w, f"{stem}.dxf")
                norm = self.weight(f"norm_g{w}", "model.norm.weight", w)
                dtop[s][t] = g.kernel(
                    "rmsnorm_grad", hL, norm, dx, id=f"{stem}.dh", **self.layer.norm_attrs()
                )
        return dtop

    def loss_output(self) -> None:
        """Outputs "loss": every tile's share summed on GPU 0."""
        g = self.g
        moved = [x if g[x].gpu == 0 else g.transfer(x, 0, id=f"{x}_to0") for x in self.losses]
        total = moved[0] if len(moved) == 1 else self.sum_grads(moved, "loss", 0)
        if total != "loss":
            total = g.scale(total, 1.0, id="loss")
        g.output(total)

    def backward(self, dh2: list[list[str]], seqs: range) -> None:
        """Layer by layer in reverse: the layer's forward recomputed from its saved input, then its
        gradients, given `dh2[s][t]`, the gradient of its output (on the tile's owner), s in `seqs`."""
        T = self.tiles
        for li in reversed(range(self.cfg.layers)):
            below: list[list[str]] = [[""] * T for _ in range(self.batch)]
            for s in seqs:
                keeps = self.recompute(li, s)
                dkv, dqr, dh1 = self.mlp_attention_backward(li, s, keeps, dh2[s])
                for t in range(T):
                    below[s][t] = self.qkv_backward(li, s, t, keeps[t], dkv[t], dqr[t], dh1[t])
            dh2 = below

    def recompute(self, li: int, s: int) -> list[dict]:
        """Layer li's forward of sequence s again, every tile, keeping what the backward reads."""
        return [keep for _, keep in self.layer_tiles(li, s, "r", False)]

    def layer_tiles(self, li: int, s: int, phase: str, full: bool) -> list[tuple[str, dict]]:
        """Layer li's forward of sequence s from its saved input, tile by tile, each tile attending
        to the keys and values of the tiles up to it; ids stem from `phase` ("f": the forward,
        "r": the backward's recomputation). Per tile: its output ("" unless `full`) and what the
        backward reads (`keep`, with the tile's owner GPU under "w")."""
        G = self.G
        tiles: list[tuple[str, dict]] = []
        ks: list[list[str]] = [[] for _ in range(G)]
        vs: list[list[str]] = [[] for _ in range(G)]
        for t in range(self.tiles):
            stem = f"{phase}.b{s}.t{t}.l{li}"
            w, keep = self.layer_forward(li, self.saved[li][s][t], t, stem)
            att = []
            n0 = self.first_tile(li, t)
            for j in range(G):
                ks[j].append(keep["kr"][j])
                vs[j].append(keep["v"][j])
                att.append(
                    self.layer.attention(
                        keep["qr"][j], ks[j][n0:], vs[j][n0:], f"{stem}.attn_g{j}", (t - n0) * self.block, li
                    )
                )
            out = self.layer_rest(li, keep, att, w, stem, full)
            keep["w"] = w
            tiles.append((out, keep))
        return tiles

    def first_tile(self, li: int, t: int) -> int:
        """The first key tile that layer li's query tile t reads: those before lie wholly outside
        the window of its first row."""
        return self.layer.spec.first_key(li, t * self.block) // self.block

    def mlp_attention_backward(self, li: int, s: int, keeps: list[dict], dh2: list[str]):
        """Per query tile, last first: the MLP's backward, the second norm's, the output
        projection's and attention's, one key tile at a time. Returns per key tile and GPU the
        dk|dv partials of every query tile, per tile and GPU the gradient of the rotated q, and
        per tile the gradient of the attention block's output (dh1, on the owner)."""
        g, G, T, cfg = self.g, self.G, self.tiles, self.cfg
        dkv: list[list[list[str]]] = [[[] for _ in range(G)] for _ in range(T)]
        dqr: list[list[str]] = [[""] * G for _ in range(T)]
        dh1s: list[str] = [""] * T
        for t in reversed(range(T)):
            stem = f"g.b{s}.t{t}.l{li}"
            keep, w = keeps[t], keeps[t]["w"]
            dys = self.layer.broadcast(
                self.post_grad(li, "mlp_post_norm", keep, dh2[t], f"{stem}.dp2"), f"{stem}.dh2"
            )
            if cfg.spec.moe is not None:
                dx2w = moe_backward(self, li, keep, dys, w, stem)
            else:
                dx2w = self.mlp_backward(li, keep, dys, w, stem)
            mlp_norm = self.layer_weights(li, w)["mlp_norm"]
            dn2 = g.kernel(
                "rmsnorm_grad", keep["h1"], mlp_norm, dx2w, id=f"{stem}.dn2", **self.layer.norm_attrs()
            )
            dh1s[t] = g.add(dh2[t], dn2, id=f"{stem}.dh1", gpu=w)
            dy1 = self.layer.broadcast(
                self.post_grad(li, "attn_post_norm", keep, dh1s[t], f"{stem}.dp1"), f"{stem}.dh1b"
            )
            dO = self.row_backward(li, "o_proj", dy1, keep["att"], keep, stem)
            for j in range(G):
                dqr[t][j] = self.attention_backward(li, keeps, t, j, dO[j], dkv, stem)
        return dkv, dqr, dh1s

    def attention_backward(
        self, li: int, keeps: list[dict], t: int, j: int, dO: str, dkv: list, stem: str
    ) -> str:
        """Query tile t's attention backward on GPU j, given dO, the gradient of its output:
        appends the dk|dv partial of each key tile n0 <= n <= t (`first_tile`) to dkv[n][j];
        returns the gradient of the rotated q."""
        g, b, attrs = self.g, self.block, self.layer.attention_attrs(li)
        n0 = self.first_tile(li, t)
        qr, att = keeps[t]["qr"][j], keeps[t]["att"][j]
        kk = [keeps[n]["kr"][j] for n in range(n0, t + 1)]
        vv = [keeps[n]["v"][j] for n in range(n0, t + 1)]
        tile = dict(offset=(t - n0) * b, causal=True, **attrs)
        st = g.kernel("attention_stats", qr, *kk, *vv, att, dO, id=f"{stem}.stats_g{j}", **tile)
        # dq and every key tile's dk|dv from one P and dS per tile pair (ops_attn_grad)
        grads = g.kernel("attention_grad", qr, st, dO, *kk, *vv, id=f"{stem}.dqkv_g{j}", **tile)
        qw, kvw = g[qr].shape[1], 2 * g[kk[0]].shape[1]
        for i, n in enumerate(range(n0, t + 1)):
            c = qw + i * kvw
            dkv[n][j].append(
                g.kernel("slice", grads, id=f"{stem}.dkv{n}_g{j}", axis=1, start=c, stop=c + kvw)
            )
        return g.kernel("slice", grads, id=f"{stem}.dq_g{j}", axis=1, start=0, stop=qw)

    def qkv_backward(
        self, li: int, s: int, t: int, keep: dict, dkv: list[list[str]], dqr: list[str], dh1: str
    ) -> str:
        """Tile t's key/value gradient sums, the rotations undone, the q/k/v projections' and the
        input norm's backward: the gradient of the layer's input (on the owner; "" for layer 0,
        whose input, the frozen embedding, needs none)."""
        g, G, cfg = self.g, self.G, self.cfg
        kvw = self.split.kv_heads * cfg.head_dim
        stem = f"g.b{s}.t{t}.l{li}"
        w = keep["w"]
        cos, sin = self.cos[t], self.sin[t]
        dq, dk, dv = [], [], []
        for j in range(G):
            acc = self.sum_grads(dkv[j], f"{stem}.dkv_g{j}", j)
            dkr = g.kernel("slice", acc, id=f"{stem}.dkr_g{j}", axis=1, start=0, stop=kvw)
            dv.append(g.kernel("slice", acc, id=f"{stem}.dv_g{j}", axis=1, start=kvw, stop=2 * kvw))
            dkn = g.kernel("rope", dkr, cos[j], sin[j], id=f"{stem}.dk_g{j}", inverse=True)
            dqn = g.kernel("rope", dqr[j], cos[j], sin[j], id=f"{stem}.dqp_g{j}", inverse=True)
            dk.append(self.layer.head_norm_grad(li, "k_norm", keep["k"][j], dkn, j, f"{stem}.dkn_g{j}"))
            dq.append(self.layer.head_norm_grad(li, "q_norm", keep["q"][j], dqn, j, f"{stem}.dqn_g{j}"))
        need = li > 0
        dxq = self.col_backward(li, "q_proj", dq, keep["x1"], keep, stem, need)
        dxk = self.col_backward(li, "k_proj", dk, keep["x1"], keep, stem, need)
        dxv = self.col_backward(li, "v_proj", dv, keep["x1"], keep, stem, need)
        if not need:
            return ""
        dx1 = [g.add(dxq[j], dxk[j], dxv[j], id=f"{stem}.dx1_g{j}") for j in range(G)]
        dx1w = self.reduce(dx1, [], w, f"{stem}.dx1")
        attn_norm = self.layer_weights(li, w)["attn_norm"]
        dn1 = g.kernel(
            "rmsnorm_grad", keep["h"], attn_norm, dx1w, id=f"{stem}.dn1", **self.layer.norm_attrs()
        )
        return g.add(dh1, dn1, id=f"{stem}.dh", gpu=w)


def check_step(ck: Checkpoint, lora: LoraSpec, optim: OptimSpec, seq: int, what: str) -> None:
    """UsageError for a step the graphs do not build: LoRA and optimizer settings, a sequence of
    fewer than 2 tokens (`what` names it), what the checkpoint's config rules out for training."""
    expert_targets(ck.config, lora.targets)  # all of w1, w2, w3 or none
    lora.check()
    optim.check()
    if seq < 2:
        raise UsageError(f"{what} needs at least 2 tokens, got {seq}")
    check_trainable(ck.config, seq, str(ck.path / "config.json"))


def train_graph(
    ck: Checkpoint,
    gpus: int,
    batch: int,
    seq: int,
    block: int,
    lora: LoraSpec,
    optim: OptimSpec,
    dtype: str | None = None,
    grad_sum: str = "sum_into",
    micro: int = 1,
) -> TrainGraph:
    """One optimizer step on `batch` sequences of `seq` tokens (row tiles of `block`), in `micro`
    micro-batches of batch // micro sequences each: forward, loss and backward of one after the
    other, their gradient partials summed into the same sums (gradient accumulation)."""
    check_step(ck, lora, optim, seq, "a training sequence")
    if isinstance(micro, bool) or not isinstance(micro, int) or micro < 1 or batch % micro:
        raise UsageError(f"a batch of {batch} sequences does not split into {micro!r} equal micro-batches")
    b = _Step(ck, gpus, dtype or ck.config.dtype, lora, optim, batch, seq, block, grad_sum)
    size = batch // micro
    for m in range(micro):
        seqs = range(m * size, (m + 1) * size)
        b.forward(seqs)
        b.backward(b.loss(seqs), seqs)
    b.loss_output()
    optimize(b)
    norm = GRAD_NORM if optim.max_grad_norm is not None else None
    return TrainGraph(b.g, batch, seq, block, b.tiles, b.params, "loss", b.dtype, optim, micro, norm)
