"""The loss of a LoRA-adapted checkpoint on a batch, forward only: the evaluation graph.

Built from the training step's pieces (`workloads.llm.train._Step`): the same embedding, layers
(their adapters read from the same worker states) and final norm, then per tile the logits per
vocabulary shard and the cross-entropy, and nothing else: no logits' gradient, no backward, no
gradient sums, no optimizer, no state saved. The adapter on the workers is read, never written.

The output "loss" is the *sum* of the batch's labelled rows' cross-entropies (row i predicts
token i+1, transformers' `labels=input_ids`), so that the caller's mean over several batches is
weighted by tokens, as one forward over all of them would be.
"""

from __future__ import annotations

from disco_ray.graph.errors import UsageError

from .checkpoint import Checkpoint
from .lora import check_trainable
from .moe_lora import expert_targets
from .train import LoraSpec, OptimSpec, TrainGraph, _Step


class _Eval(_Step):
    """A training step's forward and its loss; its phases are `forward` and `loss_sum`."""

    def loss_sum(self) -> None:
        """Per tile: final norm, logits per vocabulary shard and the cross-entropy of its labelled
        rows; outputs "loss", their sum over the batch."""
        g, G, sp = self.g, self.G, self.split
        sums: list[str] = []
        for s in range(self.batch):
            for t in range(self.tiles):
                stem = f"loss.b{s}.t{t}"
                hL = self.saved[self.cfg.layers][s][t]
                w = g[hL].gpu
                hs = self.layer.broadcast(hL, f"{stem}.h")
                lab = [g.input(f"lab_b{s}_t{t}_g{j}", (self.block,), "int64", gpu=j) for j in range(G)]
                parts = []
                for j in range(G):
                    norm = self.weight(f"norm_g{j}", "model.norm.weight", j)
                    xf = g.rmsnorm(hs[j], norm, id=f"{stem}.normf_g{j}", **self.layer.norm_attrs())
                    logits = self.logits(xf, j, f"{stem}.logits_g{j}")
                    parts.append(
                        g.kernel(
                            "cross_entropy_parts", logits, lab[j], id=f"{stem}.ce_g{j}", start=sp.vocab[j][0]
                        )
                    )
                moved = [p if j == w else g.transfer(p, w, id=f"{stem}.ce_p{j}") for j, p in enumerate(parts)]
                comb = g.kernel("cross_entropy_combine", *moved, lab[w], id=f"{stem}.comb")
                col = g.kernel("slice", comb, id=f"{stem}.rows", axis=1, start=0, stop=1)
                sums.append(g.kernel("reduce_sum", col, id=f"{stem}.loss", scale=1.0))
        moved = [x if g[x].gpu == 0 else g.transfer(x, 0, id=f"{x}_to0") for x in sums]
        total = moved[0] if len(moved) == 1 else self.sum_grads(moved, "loss", 0)
        if total != "loss":
            total = g.scale(total, 1.0, id="loss")
        g.output(total)


def eval_graph(
    ck: Checkpoint,
    gpus: int,
    batch: int,
    seq: int,
    block: int,
    lora: LoraSpec,
    optim: OptimSpec,
    dtype: str | None = None,
    grad_sum: str = "sum_into",
) -> TrainGraph:
    """The summed loss of `batch` sequences of `seq` tokens (row tiles of `block`) under the
    adapter held in the training graph's states (`optim`: their layout, the parameter and its
    moments; `grad_sum`: how the tiles' sums are added)."""
    expert_targets(ck.config, lora.targets)
    lora.check()
    optim.check()
    if seq < 2:
        raise UsageError(f"an evaluated sequence needs at least 2 tokens, got {seq}")
    check_trainable(ck.config, seq, str(ck.path / "config.json"))
    b = _Eval(ck, gpus, dtype or ck.config.dtype, lora, optim, batch, seq, block, grad_sum)
    b.forward(range(batch))
    b.loss_sum()
    return TrainGraph(b.g, batch, seq, block, b.tiles, b.params, "loss", b.dtype, optim)
