"""LoRA fine-tuning of a LLaMA checkpoint on disco-ray.

    trainer = disco_ray.models.finetune.LoraTrainer("ckpt/", gpus=2, capacity="64MiB",
                                                    lora=LoraSpec(rank=16, alpha=32), optim=OptimSpec(lr=1e-4))
    losses = trainer.train(tokens, steps=10)     # tokens: int64 [batch, seq] (`textdata.load_tokens`)
    result = trainer.evaluate(eval_tokens)       # mean loss and perplexity, forward only
    trainer.save_adapter("adapter/")             # PEFT's layout: PeftModel.from_pretrained loads it
    trainer.close()

One step is one run of one TaskGraph (`workloads.llm.train`): forward, loss, backward and the
optimizer on the batch's sequences. The graph is planned once per batch shape and reused for
every step. The adapter's matrices and the optimizer's moments are worker states: written once
before the first step, updated in place by every step's optimizer vertices, read back only when
asked for (`adapter()`, `save_adapter`). `evaluate` runs a forward-only graph
(`workloads.llm.eval_graph`) that reads the same states and writes none. Every step's figures
are kept (`records`, `progress.StepRecord`) and handed to `train`'s `on_step` as it ends.

Each step's loss is checked: a NaN or infinite one raises `NonFiniteError` naming the step, and
the adapter on the workers (updated by that step) is never written: `save_adapter` refuses it,
and one holding a NaN or infinite value by the tensor's name, so a file written earlier stays.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import torch

from actors.options import STALL_S
from disco_ray.driver.program import Program
from disco_ray.graph.errors import NonFiniteError, UsageError
from planner import build_memgraph
from workloads.llm.eval_graph import eval_graph
from workloads.llm.lora import check_targets, default_targets
from workloads.llm.train import LoraSpec, OptimSpec, TrainGraph, module_dims, train_graph

from . import adapter, adapter_experts, train_state
from .evaluate import evaluate as evaluate_rows
from .programs import Programs, one_request, open_checkpoint, plan_entry
from .progress import EvalResult, StepRecord
from .schedule import LrSchedule
from .train_defaults import check_block, default_streams, train_block
from .train_state import TrainState


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
        grad_accum: micro-batches per step (gradient accumulation in the step's graph).
        lr_schedule: the learning rate step by step (`schedule.LrSchedule`; default constant).
        total_steps: the run's last step, for a schedule that decays (default: where `train` ends).
        resume: a checkpoint directory (`train(save_every=...)`, `train_state`) to continue from:
            its adapter, optimizer moments, step, data position and RNG state.
        block, streams: the row tile in tokens and the compute streams per GPU; None: the
            defaults for speed (`train_defaults`: tiles of up to 512 tokens; 1 stream on cpu).
        capacity, host_capacity, disk_dir, gpus, dtype, engine, backend, ahead,
            weights, pool, check, stall_timeout, quantize, quant_group: as for
            `disco_ray.models.LlamaModel` (quantize: LoRA on a frozen quantized base, as QLoRA).
    """

    total_steps: int | None  # the run's last step: where a decaying schedule reaches 0

    def __init__(
        self,
        path: str,
        *,
        gpus: int = 1,
        capacity: int | str | Sequence[int] = "auto",
        lora: LoraSpec | None = None,
        init_adapter: str | None = None,
        optim: OptimSpec | None = None,
        dtype: str | torch.dtype | None = None,
        block: int | None = None,
        seed: int = 0,
        grad_sum: str = "sum_into",
        grad_accum: int = 1,
        lr_schedule: LrSchedule | None = None,
        total_steps: int | None = None,
        resume: str | None = None,
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
        check_block(block)
        streams = default_streams(backend) if streams is None else streams
        self.optim = optim or OptimSpec()
        self.optim.check()
        dims = {m: module_dims(self.config, m) for m in self.config.spec.weights.modules()}
        self._experts = self.config.moe.experts if self.config.moe is not None else 0
        self._set_run(grad_accum, lr_schedule, total_steps)
        self._state = TrainState(0, 0, 0)  # a new run: step 0, the data's first row
        if resume is not None:
            self._resume(resume, lora, dims)
        elif init_adapter is not None:
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
        self.steps_done = self._state.step
        self.data_position = self._state.data_position  # the next row of the data
        self.losses: list[float] = list(self._state.settings.get("losses", []))
        self.lrs: list[float] = []
        self.grad_norms: list[float] = []  # each step's norm before clipping (with max_grad_norm)
        self.step_s: list[float] = []
        self.records: list[StepRecord] = []  # one per step, as it ends
        self.bad_step: int | None = None  # the first step whose loss was not finite

    def _program(self, batch: int, seq: int, evaluate: bool = False) -> tuple[TrainGraph, Program]:
        """The step's graph and Program for tokens [batch, seq] (`evaluate`: the forward-only one)."""
        key = ("eval", batch, seq) if evaluate else (batch, seq)
        got = self._programs.get(key)
        if got is not None:
            return got
        t = time.perf_counter()
        args = (
            self.ck,
            self.gpus,
            batch,
            seq,
            self.block or train_block(seq),
            self.lora,
            self.optim,
            self.dtype,
            self.grad_sum,
        )
        tgraph = eval_graph(*args) if evaluate else train_graph(*args, self.grad_accum)
        tg = tgraph.taskgraph
        self.fit_capacity(tg, f"the training step of {batch}x{seq} tokens")  # "auto": grows to fit
        mg = build_memgraph(tg, self.capacity, order=list(tg.vertices), host_capacity=self.host_capacity)
        dt = time.perf_counter() - t
        name = f"{'eval' if evaluate else 'train'}/{batch}x{seq}"
        self.plans.append(plan_entry(name, tg, mg, dt, sum_into=mg.stats.get("sum_into")))
        prog = Program(tg, mg, **self._prog_kw)
        prog.engine  # noqa: B018  (loads the graph, and makes its states, now)
        if not self._written:
            for p in tgraph.params:
                self.pool.write_state(p.gpu, p.state, self._packed(p))  # type: ignore[attr-defined]
            self._written = True
        got = self._programs[key] = (tgraph, prog)
        return got

    def _packed(self, p) -> torch.Tensor:
        full = self._start[adapter.key(p.layer, p.module, p.which)]
        block = full[p.rows[0] : p.rows[1], p.cols[0] : p.cols[1]].to(getattr(torch, self.dtype))
        if self.optim.slots == 1:
            return block.contiguous()
        moments = self._state.moments.get(adapter.key(p.layer, p.module, p.which))
        if moments is None:
            return torch.cat([block, torch.zeros_like(block), torch.zeros_like(block)]).contiguous()
        parts = [m[p.rows[0] : p.rows[1], p.cols[0] : p.cols[1]].to(block.dtype) for m in moments]
        return torch.cat([block, *parts]).contiguous()

    @one_request
    def step(self, tokens: torch.Tensor, timeout: float | None = None) -> float:
        """One optimizer step on `tokens` [batch, seq] (grad_accum micro-batches of its rows in
        order); returns the step's mean loss."""
        tokens = _check_tokens(tokens, self.config.vocab)
        if tokens.shape[0] % self.grad_accum:
            raise UsageError(
                f"a step's {tokens.shape[0]} sequences do not split into {self.grad_accum} micro-batches"
            )
        tgraph, prog = self._program(*tokens.shape)
        factor = self.lr_schedule.factor(self.steps_done, self.total_steps)
        feed = tgraph.feed(self.config, tokens, self.steps_done + 1, factor)
        t = time.perf_counter()
        outs = prog.run(feed, timeout=timeout, **self.run_kw)
        self.step_s.append(time.perf_counter() - t)
        self.steps_done += 1
        self.lrs.append(self.optim.lr * factor)  # LambdaLR's product: the rate the step ran at
        if tgraph.grad_norm is not None:
            self.grad_norms.append(float(outs[tgraph.grad_norm].reshape(-1)[0]))
        loss = float(outs[tgraph.loss].float().reshape(-1)[0])
        self.losses.append(loss)
        self.records.append(StepRecord(self.steps_done, loss, self.lrs[-1], tokens.numel(), self.step_s[-1]))
        if not math.isfinite(loss):
            self.bad_step = self.bad_step or self.steps_done
            raise NonFiniteError(
                f"step {self.steps_done}: the loss is {loss}: the adapter this step updated is never written"
            )
        return loss

    @one_request
    def train(
        self,
        tokens: torch.Tensor,
        steps: int,
        batch: int | None = None,
        timeout: float | None = None,
        *,
        save_every: int | None = None,
        out: str | None = None,
        on_step: Callable[[StepRecord], None] | None = None,
    ) -> list[float]:
        """`steps` more optimizer steps over `tokens` [N, seq]: each takes grad_accum micro-batches
        of `batch` rows (default N // grad_accum), cycling through the rows from `data_position`;
        every `save_every` steps (counted from the run's start) a checkpoint `out/step-K`
        (`save_checkpoint`). Returns each step's loss. `on_step` is called with each step's record
        as soon as the step ends (it may call `evaluate`)."""
        tokens = _check_tokens(tokens, self.config.vocab)
        n, k = tokens.shape[0], self.grad_accum
        batch = max(1, n // k) if batch is None else batch
        if not isinstance(batch, int) or isinstance(batch, bool) or not 1 <= batch * k <= n:
            raise UsageError(
                f"batch must be between 1 and the {n} sequences given / {k} micro-batches, got {batch!r}"
            )
        if save_every is not None and (out is None or not isinstance(save_every, int) or save_every < 1):
            raise UsageError(f"save_every must be an integer >= 1 with out, got {save_every!r} and {out!r}")
        if self._state.data_rows and n != self._state.data_rows:
            raise UsageError(
                f"the data has {n} sequences; the resumed checkpoint's had {self._state.data_rows}"
            )
        self._data_rows = n
        if self._total is None:
            self.total_steps = self.steps_done + steps
        losses = []
        for _ in range(steps):
            rows = [(self.data_position + i) % n for i in range(batch * k)]
            losses.append(self.step(tokens[rows], timeout))
            self.data_position = (self.data_position + batch * k) % n
            if save_every is not None and self.steps_done % save_every == 0:
                self.save_checkpoint(f"{out}/step-{self.steps_done}")
            if on_step is not None:
                on_step(self.records[-1])
        return losses

    @one_request
    def evaluate(
        self, tokens: torch.Tensor, batch: int | None = None, timeout: float | None = None
    ) -> EvalResult:
        """The adapter's mean next-token loss (over every labelled token) and perplexity on
        `tokens` [N, seq], forward only, `batch` rows a run (default all N); the adapter stays."""
        return evaluate_rows(self, _check_tokens(tokens, self.config.vocab), batch, timeout)

    @one_request
    def adapter(self) -> dict[str, torch.Tensor]:
        """The adapter now, whole matrices keyed as PEFT saves them (float32)."""
        if not self._programs:
            return self._peft({k: v.clone() for k, v in self._start.items()})
        return self._peft({k: v[0] for k, v in self._states().items()})

    def _states(self) -> dict[str, torch.Tensor]:
        """The workers' states as whole matrices [slots, rows, cols] by adapter key (float32)."""
        tgraph = next(iter(self._programs.values()))[0]
        slots = self.optim.slots
        out = {k: torch.zeros(slots, *v.shape) for k, v in self._start.items()}
        for p in tgraph.params:
            n, m = p.shape
            st = self.pool.read_state(p.gpu, p.state, (slots * n, m), self.dtype)  # type: ignore[attr-defined]
            rows, cols = slice(*p.rows), slice(*p.cols)
            out[adapter.key(p.layer, p.module, p.which)][:, rows, cols] = st.float().reshape(slots, n, m)
        return out

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

    def save_checkpoint(self, path: str) -> None:
        """Writes a checkpoint to directory `path`, atomically (`train_state`): the adapter in PEFT's
        layout, the optimizer's moments, the step, the data position and torch's RNG state.

        Raises:
            NonFiniteError: as `save_adapter`.
        """
        if self.bad_step is not None:
            raise NonFiniteError(f"{path}: not written: step {self.bad_step}'s loss was not finite")
        states = self._states() if self._programs else None
        tensors = self._peft({k: v[0] for k, v in states.items()}) if states else self.adapter()
        if states is None:  # nothing ran since the start (zero moments) or the resumed checkpoint
            zero = {k: (torch.zeros_like(v), torch.zeros_like(v)) for k, v in self._start.items()}
            moments = dict(self._state.moments or zero) if self.optim.slots == 3 else {}
        else:
            moments = {k: (v[1], v[2]) for k, v in states.items()} if self.optim.slots == 3 else {}
        settings = {**self._settings(), "losses": list(self.losses), "total_steps": self.total_steps}
        state = TrainState(
            self.steps_done, self.data_position, self._data_rows, settings, moments, torch.get_rng_state()
        )
        train_state.save(path, self.lora, tensors, str(self.ck.path), state)

    def _settings(self) -> dict:
        """What a resumed run must share with the checkpoint (`train_state.load` compares them)."""
        o = self.optim
        return {
            "model": train_state.model_config(self.ck.path),
            "lora": {
                "r": self.lora.rank,
                "lora_alpha": self.lora.alpha,
                "target_modules": list(self.lora.targets),
                "use_rslora": self.lora.rslora,
            },
            "optimizer": {"name": o.name},
        }

    def _set_run(self, grad_accum: int, lr_schedule: LrSchedule | None, total_steps: int | None) -> None:
        if isinstance(grad_accum, bool) or not isinstance(grad_accum, int) or grad_accum < 1:
            raise UsageError(f"grad_accum must be an integer >= 1, got {grad_accum!r}")
        if total_steps is not None and (
            isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 0
        ):
            raise UsageError(f"total_steps must be an integer >= 0, got {total_steps!r}")
        self.grad_accum = grad_accum
        self.lr_schedule = lr_schedule or LrSchedule()
        self.lr_schedule.check()
        self.total_steps = self._total = total_steps
        self._data_rows = 0

    def _resume(self, path: str, lora: LoraSpec | None, dims: dict) -> None:
        """The adapter, moments, step, data position and RNG state of checkpoint `path`; refuses
        one whose model, LoRA settings, optimizer or shapes differ from this run's (named)."""
        self.lora, self._start = adapter.load(path, self.config.layers, dims, self._experts)
        if lora is not None:
            for name in ("rank", "alpha", "targets", "rslora"):
                if getattr(lora, name) != getattr(self.lora, name):
                    raise UsageError(
                        f"--resume {path}: LoRA {name} differs: {getattr(lora, name)!r} in this run, "
                        f"{getattr(self.lora, name)!r} in the checkpoint"
                    )
        self._state = train_state.load(path, self._start, self._settings())
        if self._state.rng is not None:
            torch.set_rng_state(self._state.rng)
        self._data_rows = self._state.data_rows

    def statistics(self) -> dict:
        return {
            "model": str(self.ck.path),
            "gpus": self.gpus,
            "dtype": self.dtype,
            "lora": {"rank": self.lora.rank, "alpha": self.lora.alpha, "targets": list(self.lora.targets)},
            "optimizer": self.optim.name,
            "lr": self.optim.lr,
            "lr_schedule": self.lr_schedule.name.value,
            "warmup_steps": self.lr_schedule.warmup,
            "grad_accum": self.grad_accum,
            "max_grad_norm": self.optim.max_grad_norm,
            "lrs": list(self.lrs),
            "grad_norms": list(self.grad_norms),
            "steps": self.steps_done,
            "losses": list(self.losses),
            "step_s": [round(s, 6) for s in self.step_s],
            "plans": list(self.plans),
            "capacity": self.capacity,
            "capacity_choice": None if self.capacity_choice is None else self.capacity_choice.statistics(),
        }


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
