"""LoRA fine-tuning of a LLaMA checkpoint on disco-ray.

    trainer = disco_ray.models.finetune.LoraTrainer("ckpt/", gpus=2, capacity="64MiB",
                                                    lora=LoraSpec(rank=16, alpha=32), optim=OptimSpec(lr=1e-4))
    losses = trainer.train(tokens, steps=10)     # tokens: int64 [batch, seq]
    trainer.save_adapter("adapter/")             # PEFT's layout: PeftModel.from_pretrained loads it
    trainer.close()

One step is one run of one TaskGraph (`workloads.llm.train`): forward, loss, backward and the
optimizer on the batch's sequences. The graph is planned once per batch shape and reused for
every step. The adapter's matrices and the optimizer's moments are worker states: written once
before the first step, updated in place by every step's optimizer vertices, read back only when
asked for (`adapter()`, `save_adapter`).

Each step's loss is checked: a NaN or infinite one raises `NonFiniteError` naming the step, and
the adapter on the workers (updated by that step) is never written: `save_adapter` refuses it,
and one holding a NaN or infinite value by the tensor's name, so a file written earlier stays.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch

from actors.options import STALL_S
from disco_ray.driver.program import Program
from disco_ray.graph.errors import NonFiniteError, UsageError
from planner import build_memgraph
from workloads.llm.lora import check_targets, default_targets
from workloads.llm.train import LoraSpec, OptimSpec, TrainGraph, module_dims, train_graph

from . import adapter, adapter_experts
from .programs import Programs, one_request, open_checkpoint, plan_entry

TRAIN_TILE = 512  # the default tile's most tokens: large matmuls, and a tile's scores stay small


class LoraTrainer(Programs):
    """A checkpoint with a LoRA adapter on `gpus` workers, trained one optimizer step per run.

    Args:
        path: the Hugging Face checkpoint directory (its weights stay frozen).
        lora: rank, alpha and target modules of a new adapter (ignored with `init_adapter`).
        init_adapter: a PEFT adapter directory to start from.
        optim: AdamW (torch.optim.AdamW's update; weight decay 0 unless given) or SGD.
        seed: of a new adapter's A matrices (B starts at zero, as PEFT does).
        grad_sum: how a weight gradient's partials are summed ("sum_into", the default: sum-into
            kernels, each adding one partial as soon as it exists; "add": one n-ary add; "chain").
        block: the row tile, in tokens; None: each sequence in the fewest tiles of at most
            `TRAIN_TILE` tokens (`train_block`). Smaller tiles plan into smaller arenas; larger
            ones run fewer, larger kernels.
        streams: compute streams per GPU; None: 1 on the cpu backend (one kernel at a time, each
            on all the cores, as torch runs a step; see docs/TRAINING.md "Speed"), 5 otherwise.
        capacity, host_capacity, disk_dir, gpus, dtype, engine, backend, ahead,
            weights, pool, check, stall_timeout, quantize, quant_group: as for
            `disco_ray.models.LlamaModel` (quantize: LoRA on a frozen quantized base, as QLoRA).
    """

    def __init__(
        self,
        path: str,
        *,
        gpus: int = 1,
        capacity: int | str | Sequence[int],
        lora: LoraSpec | None = None,
        init_adapter: str | None = None,
        optim: OptimSpec | None = None,
        dtype: str | None = None,
        block: int | None = None,
        seed: int = 0,
        grad_sum: str = "sum_into",
        engine: str = "ray",
        backend: str = "cpu",
        weights: str = "host",
        streams: int | None = None,
        ahead: int | None = None,
        pool: object | None = None,
        check: bool = False,
        host_capacity: int | str | Sequence[int | None] | None = None,
        disk_dir: str | None = None,
        stall_timeout: float = STALL_S,
        quantize: str | None = None,
        quant_group: int = 64,
        **cluster: object,
    ):
        self.ck, self.dtype = open_checkpoint(path, gpus, dtype, engine, quantize, quant_group)
        self.config = self.ck.config
        self.gpus, self.block, self.grad_sum = gpus, block, grad_sum
        if block is not None and (isinstance(block, bool) or not isinstance(block, int) or block < 1):
            raise UsageError(f"block must be a whole number of tokens >= 1, got {block!r}")
        streams = default_streams(backend) if streams is None else streams
        self.optim = optim or OptimSpec()
        self.optim.check()
        dims = {m: module_dims(self.config, m) for m in self.config.spec.weights.modules()}
        self._experts = self.config.moe.experts if self.config.moe is not None else 0
        if init_adapter is not None:
            self.lora, self._start = adapter.load(init_adapter, self.config.layers, dims, self._experts)
        else:
            self.lora = lora or LoraSpec(targets=default_targets(self.config))
            self.lora.check()
            check_targets(self.config, self.lora.targets)
            self._start = adapter.init(self.lora, self.config.layers, dims, seed, self._experts)
        super().__init__(
            engine, pool, cluster, capacity, host_capacity, backend, streams, ahead, weights, disk_dir, check
        )
        self.run_kw["stall_timeout"] = stall_timeout
        self._written = False  # the adapter's initial states are on the workers
        self.steps_done = 0
        self.losses: list[float] = []
        self.step_s: list[float] = []
        self.bad_step: int | None = None  # the first step whose loss was not finite

    def _program(self, batch: int, seq: int) -> tuple[TrainGraph, Program]:
        got = self._programs.get((batch, seq))
        if got is not None:
            return got
        t = time.perf_counter()
        block = self.tile(seq)
        tgraph = train_graph(
            self.ck, self.gpus, batch, seq, block, self.lora, self.optim, self.dtype, self.grad_sum
        )
        tg = tgraph.taskgraph
        mg = build_memgraph(tg, self.capacity, order=list(tg.vertices), host_capacity=self.host_capacity)
        dt = time.perf_counter() - t
        self.plans.append(plan_entry(f"train/{batch}x{seq}", tg, mg, dt, sum_into=mg.stats.get("sum_into")))
        prog = Program(tg, mg, **self._prog_kw)
        prog.engine  # noqa: B018  (loads the graph, and makes its states, now)
        if not self._written:
            for p in tgraph.params:
                self.pool.write_state(p.gpu, p.state, self._packed(p))  # type: ignore[attr-defined]
            self._written = True
        got = self._programs[(batch, seq)] = (tgraph, prog)
        return got

    def tile(self, seq: int) -> int:
        """The row tile of sequences of `seq` tokens: `block`, or by default `train_block(seq)`."""
        return self.block or train_block(seq)

    def _packed(self, p) -> torch.Tensor:
        full = self._start[adapter.key(p.layer, p.module, p.which)]
        block = full[p.rows[0] : p.rows[1], p.cols[0] : p.cols[1]].to(getattr(torch, self.dtype))
        if self.optim.slots == 1:
            return block.contiguous()
        return torch.cat([block, torch.zeros_like(block), torch.zeros_like(block)]).contiguous()

    @one_request
    def step(self, tokens: torch.Tensor, timeout: float | None = None) -> float:
        """One optimizer step on `tokens` [batch, seq]; returns the step's mean loss."""
        tokens = _check_tokens(tokens, self.config.vocab)
        tgraph, prog = self._program(*tokens.shape)
        feed = tgraph.feed(self.config, tokens, self.steps_done + 1)
        t = time.perf_counter()
        outs = prog.run(feed, timeout=timeout, **self.run_kw)
        self.step_s.append(time.perf_counter() - t)
        self.steps_done += 1
        loss = float(outs[tgraph.loss].float().reshape(-1)[0])
        self.losses.append(loss)
        if not math.isfinite(loss):
            self.bad_step = self.bad_step or self.steps_done
            raise NonFiniteError(
                f"step {self.steps_done}: the loss is {loss}: the adapter this step updated is never written"
            )
        return loss

    @one_request
    def train(
        self, tokens: torch.Tensor, steps: int, batch: int | None = None, timeout: float | None = None
    ) -> list[float]:
        """`steps` optimizer steps over `tokens` [N, seq]: step k takes `batch` rows (default all N),
        cycling through the file; returns each step's loss."""
        tokens = _check_tokens(tokens, self.config.vocab)
        n = tokens.shape[0]
        batch = n if batch is None else batch
        if not isinstance(batch, int) or isinstance(batch, bool) or not 1 <= batch <= n:
            raise UsageError(f"batch must be between 1 and the {n} sequences given, got {batch!r}")
        out = []
        for k in range(steps):
            rows = [(k * batch + i) % n for i in range(batch)]
            out.append(self.step(tokens[rows], timeout))
        return out

    @one_request
    def adapter(self) -> dict[str, torch.Tensor]:
        """The adapter now, whole matrices keyed as PEFT saves them (float32)."""
        if not self._programs:
            return self._peft({k: v.clone() for k, v in self._start.items()})
        tgraph = next(iter(self._programs.values()))[0]
        out = {k: torch.zeros_like(v) for k, v in self._start.items()}
        for p in tgraph.params:
            n, m = p.shape
            st = self.pool.read_state(p.gpu, p.state, (self.optim.slots * n, m), self.dtype)  # type: ignore[attr-defined]
            out[adapter.key(p.layer, p.module, p.which)][p.rows[0] : p.rows[1], p.cols[0] : p.cols[1]] = st[
                :n
            ].float()
        return self._peft(out)

    def _peft(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Expert adapters (kept per expert) fused as peft saves them (`adapter_experts`)."""
        if not any(".mlp.experts." in k for k in tensors):
            return tensors
        return adapter_experts.fuse(tensors, self.config.layers, self._experts)

    def save_adapter(self, path: str) -> None:
        """Writes the adapter to directory `path` in PEFT's layout (whole files or nothing).

        Raises:
            NonFiniteError: a step's loss was not finite, or a matrix holds NaN or infinity
                (named): nothing is written.
        """
        if self.bad_step is not None:
            raise NonFiniteError(
                f"{path}: not written: step {self.bad_step}'s loss was {self.losses[self.bad_step - 1]} "
                "and its update made the adapter unusable"
            )
        adapter.save(path, self.lora, self.adapter(), str(self.ck.path))

    def statistics(self) -> dict:
        return {
            "model": str(self.ck.path),
            "gpus": self.gpus,
            "dtype": self.dtype,
            "lora": {"rank": self.lora.rank, "alpha": self.lora.alpha, "targets": list(self.lora.targets)},
            "optimizer": self.optim.name,
            "lr": self.optim.lr,
            "steps": self.steps_done,
            "losses": list(self.losses),
            "step_s": [round(s, 6) for s in self.step_s],
            "plans": list(self.plans),
        }


def default_streams(backend: str) -> int:
    """Compute streams per GPU for training: one on the cpu backend, where concurrent kernels
    would share the same cores (each kernel uses them all), TURNIP's five on a GPU."""
    return 1 if backend == "cpu" else 5


def train_block(seq: int) -> int:
    """The default row tile for sequences of `seq` tokens: the fewest tiles of at most
    `TRAIN_TILE` tokens, equal in size, so that little is padded."""
    tiles = -(-seq // TRAIN_TILE)
    return -(-seq // tiles)


def _check_tokens(tokens, vocab: int) -> torch.Tensor:
    t = torch.as_tensor(tokens)
    if t.dtype not in (torch.int64, torch.int32) or t.dim() != 2:
        raise UsageError(f"tokens must be an integer array [batch, seq], got {t.dtype} {list(t.shape)}")
    if t.shape[0] < 1 or t.shape[1] < 2:
        raise UsageError(f"tokens [batch, seq] need a row and 2 tokens a row, got {list(t.shape)}")
    bad = t[(t < 0) | (t >= vocab)]
    if bad.numel():
        raise UsageError(f"token id {int(bad[0])} is outside the vocabulary 0..{vocab - 1}")
    return t.long()
