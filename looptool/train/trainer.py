"""Mixed-depth training of a looped model (Accordion Eq. 2-3; ELR Sec. 3.2, 3.4, App. A.2-A.3).

One budget per micro-batch from :class:`~looptool.train.sampling.BudgetSampler` (uniform, with
the shallowest-budget override), an optional delayed start (ELR Eq. 5: the first ``delay``
fraction of steps at the shallowest budget; optimizer state and LR schedule carry over),
next-token loss plus, for MoE, a sequence-level load-balance loss (lambda = 1e-4, counted
once per route-replayed router and scaled by k), AdamW without weight decay on tensors the
passes tag, gradient clipping, warmup then constant / cosine / 1-sqrt decay.

Runs as one process or under ``torchrun`` with DDP (gloo on CPU, nccl on GPU). Checkpoints
are atomic: the output directory is rebuilt in a temp directory and renamed over the old
one, so a kill at any moment leaves the last good checkpoint; ``resume=True`` continues a
killed run to the same weights and per-step losses as an uninterrupted one, from the
optimizer state, step and RNG states a checkpoint keeps in ``trainer_state.pt`` beside the
model (AdamW's two moments: about twice the trained weights; ``save_optimizer=False`` leaves
it out, and the run cannot be resumed).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers.loss.loss_utils import ForCausalLMLoss

from looptool.core.graph import ROLE_EMBEDDING, ROLE_HEAD, dtype_from_str, parameter_reader_roles
from looptool.passes.exit_gate import EXIT_PREFIX
from looptool.runtime.convert import add_exit_gates, load
from looptool.runtime.devices import check_dtype, resolve_device
from looptool.runtime.model import LoopedModel
from looptool.storage.load import read_looptool_json
from looptool.storage.resume import (
    STATE_FILE,
    has_checkpoint,
    resumable_state,
    rng_states,
    set_rng_states,
    write_checkpoint,
)
from looptool.storage.save import LOOPTOOL_JSON
from looptool.train.config import (
    _RESUME_FREE,
    ARGS_FILE,
    DEFAULT_TOKENS,
    LOG_FILE,
    TrainConfig,
    TrainingError,
)
from looptool.train.data import training_rows
from looptool.train.exit_objective import IGNORE, expected_exit_loss, gate_fit_loss, token_losses
from looptool.train.sampling import BudgetSampler

log = logging.getLogger(__name__)


def exit_weighted_loss(out, labels: torch.Tensor, weight: float) -> torch.Tensor:
    """Deep supervision over the loop exits of an ELR budget-``k`` path: the weighted mean
    ``(L_k + w * sum_{i<k} L_i) / (1 + w * (k - 1))`` of the next-token losses read at every
    loop's state ``s_i`` through the output block (weight 1 for the last exit, ``w`` for the
    earlier ones), so its scale matches the plain loss at any ``k``."""
    total = out.loss
    for logits in out.exit_logits:
        total = total + weight * ForCausalLMLoss(logits, labels, vocab_size=logits.shape[-1])
    return total / (1 + weight * len(out.exit_logits))


def lr_factor(step: int, total: int, warmup_steps: int, schedule: str) -> float:
    """Linear warmup, then constant, cosine or ``1 - sqrt`` decay to zero."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant" or total <= warmup_steps:
        return 1.0
    progress = (step - warmup_steps) / max(1, total - warmup_steps)
    if schedule == "cosine":
        return 0.5 * (1 + math.cos(math.pi * progress))
    return 1 - math.sqrt(progress)


def balance_loss(router_logits, weights, top_k: int, batch: int, num_routers: int) -> torch.Tensor:
    """Sequence-level load-balance loss (Accordion Eq. 3's L_seq): per sequence and router
    evaluation ``E * sum_i f_i P_i`` (f_i: share of the sequence's top-k picks routed to
    expert i, P_i: its mean router probability), averaged over sequences, weighted by each
    evaluation's loop count (route replay, ELR Sec. 3.4) and normalised by the number of
    distinct routers."""
    total = router_logits[0].new_zeros((), dtype=torch.float32)
    for logits, w in zip(router_logits, weights, strict=True):
        probs = logits.float().softmax(-1).view(batch, -1, logits.shape[-1])
        experts = probs.shape[-1]
        picks = probs.topk(top_k, dim=-1).indices
        counts = F.one_hot(picks, experts).sum(dim=2).float().mean(dim=1) / top_k  # [B, E]
        total = total + w * (experts * (counts * probs.mean(dim=1)).sum(-1)).mean()
    return total / max(1, num_routers)


def adamw(model: LoopedModel, lr: float, new_lr: float | None, weight_decay: float) -> torch.optim.AdamW:
    """AdamW over ``model``'s trainable parameters: the new ``loop.*`` parameters at
    ``new_lr`` (default ``lr``); no weight decay on tagged parameters, norms and biases.
    Each group records ``initial_lr`` for the LR schedule."""
    no_decay = model.no_decay_parameter_names()
    groups: dict[tuple[float, float], list] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        is_new = name.startswith("loop.")
        # norms and biases (1-D) take no decay either, as is standard
        decay = 0.0 if (name in no_decay or p.dim() < 2) else weight_decay
        groups.setdefault(((new_lr or lr) if is_new else lr, decay), []).append(p)
    param_groups = [
        {"params": ps, "lr": g_lr, "initial_lr": g_lr, "weight_decay": wd} for (g_lr, wd), ps in groups.items()
    ]
    return torch.optim.AdamW(param_groups, betas=(0.9, 0.95), eps=1e-8)


class Trainer:
    """Runs a :class:`TrainConfig` on a looped model directory."""

    def __init__(
        self,
        model_dir: str | os.PathLike,
        config: TrainConfig,
        *,
        tokenizer=None,
        on_step: Callable[[dict], None] | None = None,
    ):
        config.check()
        self.config = config
        self.model_dir = Path(model_dir)
        self.output = Path(config.output)
        self.on_step = on_step
        self.rank, self.world = _init_distributed()
        if config.strategy == "fsdp" and self.world == 1:
            raise TrainingError(
                "strategy 'fsdp' shards the model across processes; launch with torchrun with "
                "N ≥ 2 processes per node, or use strategy='ddp'.",
                parameter="strategy",
            )
        self.fsdp = config.strategy == "fsdp"
        resuming = config.resume and has_checkpoint(self.output)
        if config.resume and not resuming and (self.output / LOOPTOOL_JSON).exists():
            raise TrainingError(
                f"'{self.output}' holds a model without the optimizer state that resume continues from (no "
                f"{STATE_FILE}, as a run with save_optimizer=False leaves it); start a new run with it as the "
                "model and another output.",
                parameter="resume",
            )
        if not config.resume and self.output.exists():
            raise TrainingError(
                f"output directory '{self.output}' exists; pass resume=True to continue it or choose another.",
                parameter="resume",
            )
        if self.world > 1:  # every rank has checked the output before rank 0 creates it
            dist.barrier()
        source = self.output if resuming else self.model_dir
        if not (source / LOOPTOOL_JSON).exists():
            raise TrainingError(f"'{source}' is not a looped model directory; run looptool convert first.")
        self.device = resolve_device(config.device)
        self.tokens_per_step = config.seq_len * config.batch * config.grad_accum * self.world
        self.total_steps = config.steps or max(1, (config.tokens or DEFAULT_TOKENS) // self.tokens_per_step)
        # before the slow load: a changed command or a run that is already complete stops here
        self._state = (
            resumable_state(self.output, config, _RESUME_FREE, self.total_steps, self.device, TrainingError)
            if resuming
            else None
        )
        dtype = dtype_from_str(read_looptool_json(source)["source"]["dtype"])
        check_dtype(self.device, dtype)
        if dtype == torch.float16:
            raise TrainingError(
                "training float16 weights needs loss scaling, which looptool does not do; convert the source "
                "with dtype=torch.bfloat16 or torch.float32 (and set bf16=True for bf16 autocast).",
                parameter="dtype",
                rerun="convert",
            )
        if dtype == torch.bfloat16:
            log.warning(
                "training bfloat16 weights directly: AdamW updates them in bf16 (no fp32 master copy); "
                "for fp32 master weights convert the source in float32 and train it with bf16 autocast."
            )
        # straight onto the device; under FSDP onto the CPU, and each layer moves as it is sharded
        self.model: LoopedModel = load(source, device="cpu" if self.fsdp else str(self.device))
        self.exits = config.exit_gate or config.exit_gate_only
        if self.exits:  # heads at their initial values where the model has none yet
            self.model = add_exit_gates(self.model)
        if config.checkpoint:
            self.model.gradient_checkpointing_enable()
        if config.compile:
            self.model.compile()
        if tokenizer is not None:
            self.model.tokenizer = tokenizer
        self.model.train()
        self.resuming = resuming
        self.data = training_rows(config.data, self.model.tokenizer, config.seq_len, config.format)
        self.switch_step = round(config.delay * self.total_steps)
        menu = tuple(config.budgets) if config.budgets else self.model.budgets
        for k in menu:
            self.model.check_budget(k)
        self.exit_menu = tuple(sorted(menu))
        if self.exits and len(self.exit_menu) < 2:
            raise TrainingError(
                f"exit_gate trains when to stop between depths, and the menu {list(self.exit_menu)} has one; "
                "give budgets with at least two.",
                parameter="budgets",
            )
        # Under FSDP every rank must run the same layer applications (their all-gathers are
        # collectives), so all ranks draw alike and overrides rotate over accumulation micro-batches.
        self.sampler = BudgetSampler(
            menu,
            config.override,
            config.grad_accum,
            1 if self.fsdp else self.world,
            config.seed,
            curriculum_steps=round(config.depth_curriculum * self.total_steps),
        )
        self.floor_steps = round(config.gate_floor_until * self.total_steps) if config.gate_floor > 0 else 0
        self.gates = [p for _, p in self.model.gate_parameters()]  # declared as gates by the passes
        if config.gate_floor > 0 and not self.gates:
            raise TrainingError(
                "gate_floor needs gates (loop.*_gate parameters); this model has none.", parameter="gate_floor"
            )
        if config.exit_loss > 0 and not self.model.plan.has_loop_exits:
            raise TrainingError(
                "exit_loss needs loop exits: it applies to ELR (recurrent) models; this one is prefix-looped.",
                parameter="exit_loss",
            )
        self._freeze()
        if self.fsdp:
            self._shard()
        self.optimizer = self._optimizer()
        ddp_devices = [self.device.index] if self.device.type == "cuda" else None
        self.ddp = (
            torch.nn.parallel.DistributedDataParallel(self.model, device_ids=ddp_devices, find_unused_parameters=True)
            if self.world > 1 and not self.fsdp
            else None
        )
        self.start_step = 0
        self.records: list[dict] = []
        if resuming:
            self._restore()
        elif self.rank == 0:  # the log is written live from step 0; checkpoints replace the folder
            self.output.mkdir(parents=True, exist_ok=True)
            (self.output / LOG_FILE).write_text("")

    # ------------------------------------------------------------------ setup
    def _freeze(self) -> None:
        """Optionally freeze every source layer below the looped block (and the embeddings
        when they are not tied to the trained LM head): backward then stops at the block.
        ``exit_gate_only`` freezes everything but the exit heads."""
        if self.config.exit_gate_only:
            for name, p in self.model.named_parameters():
                p.requires_grad_(name.startswith(EXIT_PREFIX))
            return
        if not self.config.freeze_below_window:
            return
        frozen = self.model.plan.frozen_layers()
        prefix = self.model.layer_graph.source.layers_path + "."
        roles = parameter_reader_roles(self.model.layer_graph.graph)
        for name, p in self.model.named_parameters():
            below = name.startswith(prefix) and int(name[len(prefix) :].split(".")[0]) in frozen
            untied_embedding = ROLE_EMBEDDING in roles.get(name, ()) and ROLE_HEAD not in roles.get(name, ())
            if below or untied_embedding:
                p.requires_grad_(False)

    def _shard(self) -> None:
        """FSDP2: one shard unit per *source* decoder layer (every application of a layer in
        every budget gathers that one unit: the budget paths call the layer module for each
        application), then the root (embeddings, head, final norm, loop.* parameters)."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(self.device.type, (self.world,))
        prefix = self.model.layer_graph.source.layers_path
        for index in range(len(self.model.layer_graph.layers)):
            fully_shard(self.model.get_submodule(f"{prefix}.{index}"), mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.model.shard_layers = True
        self.model.retarget(self.device)  # fully_shard moved the shards to the mesh's device

    def _optimizer(self) -> torch.optim.AdamW:
        return adamw(self.model, self.config.lr, self.config.new_lr, self.config.weight_decay)

    def _restore(self) -> None:
        state, self._state = self._state, None
        if self.fsdp:
            self._load_sharded_optimizer_state(state["optimizer"])
        else:
            self.optimizer.load_state_dict(state["optimizer"])
        self.start_step = state["step"]
        # checkpoints written before all RNG states were saved hold the torch ones only
        set_rng_states(state.get("rng") or {"torch": state["torch_rng"], "cuda": state.get("cuda_rng")}, self.device)
        self.records = [r for r in state["records"] if r["step"] < self.start_step]
        if self.rank == 0:  # drop log lines written after the checkpoint by the killed run
            (self.output / LOG_FILE).write_text("".join(json.dumps(r) + "\n" for r in self.records))
        log.info("resumed at step %d", self.start_step)

    def _load_sharded_optimizer_state(self, saved: dict) -> None:
        """Load the full optimizer state ``saved`` (keyed by parameter name, as
        :meth:`_optimizer_state` gathers it) into this rank's shards. A parameter the checkpoint
        holds no state for (a gate of a budget not drawn before it, so never given a gradient)
        stays without state, as ``optimizer.load_state_dict`` leaves it in one process: its
        first gradient starts its AdamW moments and step count, as in the uninterrupted run."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        # strict=False admits the missing parameters; torch gives them a state of its own first
        # (one zero-gradient step at lr 0, which counts as a step), dropped again below
        options = StateDictOptions(full_state_dict=True, strict=False)
        set_optimizer_state_dict(self.model, self.optimizer, saved, options=options)
        for name, p in self.model.named_parameters():
            if name not in saved["state"]:
                self.optimizer.state.pop(p, None)

    # ------------------------------------------------------------------ loop
    def run(self) -> dict:
        """Train to the end; returns a summary (realised budget statistics, losses)."""
        model = self.ddp or self.model
        cfg = self.config
        moe_top_k = self.model.layer_graph.source.experts_per_token
        has_router = bool(moe_top_k) and bool(self.model.router_logits_weights(self.model.budgets[-1]))
        warmup_steps = round(cfg.warmup * self.total_steps)
        num_routers = len(self.model.router_logits_weights(self.model.budgets[0])) if has_router else 0
        for step in range(self.start_step, self.total_steps):
            t0 = time.perf_counter()
            factor = lr_factor(step, self.total_steps, warmup_steps, cfg.schedule)
            for group in self.optimizer.param_groups:
                group["lr"] = group["initial_lr"] * factor
            budgets, losses, auxes, exit_stats = [], [], [], []
            for micro in range(cfg.grad_accum):
                k = self.sampler.budget(step, micro, self.rank) if step >= self.switch_step else self.sampler.shallowest
                position = ((step * cfg.grad_accum + micro) * self.world + self.rank) * cfg.batch
                ids, labels = self.data.labeled_batch(position, cfg.batch, cfg.seed)
                ids, labels = ids.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True)
                sync = micro == cfg.grad_accum - 1 or self.ddp is None
                ctx = model.no_sync() if not sync else contextlib.nullcontext()
                if self.fsdp:  # reduce-scatter gradients only on the last micro-batch
                    self.model.set_requires_gradient_sync(micro == cfg.grad_accum - 1)
                with ctx, torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
                    if self.exits:
                        k = self.exit_menu[-1]
                        out, loss, stats = self._exit_step(model, ids, labels, has_router)
                        exit_stats.append(stats)
                    else:
                        exits = cfg.exit_loss > 0 and k > 1
                        out = model(
                            ids, labels=labels, budget=k, output_router_logits=has_router, output_exit_logits=exits
                        )
                        loss = exit_weighted_loss(out, labels, cfg.exit_loss) if exits else out.loss
                    aux = None
                    if has_router and not cfg.exit_gate_only:
                        aux = balance_loss(
                            out.router_logits, self.model.router_logits_weights(k), moe_top_k, cfg.batch, num_routers
                        )
                        loss = loss + cfg.aux_coef * aux
                    if not torch.isfinite(loss):
                        raise TrainingError(
                            f"the loss became {loss.item()} at step {step} (budget {k}); stopping. The last "
                            f"checkpoint in '{self.output}' is kept; lower lr or check the data.",
                            parameter="lr",
                        )
                    (loss / cfg.grad_accum).backward()
                budgets.append(k)
                losses.append(out.loss.item())
                auxes.append(aux.item() if aux is not None else None)
            torch.nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.requires_grad], cfg.clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            if step < self.floor_steps:  # keep the loop path open: the optimizer may not close it yet
                with torch.no_grad():
                    for gate in self.gates:
                        gate.clamp_(min=cfg.gate_floor)
            record = {
                "step": step,
                "budgets": _gather(budgets, self.world),
                "loss": sum(_gather(losses, self.world), []) if self.world > 1 else losses,
                "lr": cfg.lr * factor,
                "tokens": (step + 1) * self.tokens_per_step,
                "tokens_per_s": self.tokens_per_step / (time.perf_counter() - t0),
            }
            if any(a is not None for a in auxes):
                record["aux"] = auxes
            if exit_stats:  # the exit objective's terms, averaged over the micro-batches
                record["exit"] = {k: sum(s[k] for s in exit_stats) / len(exit_stats) for k in exit_stats[0]}
            self.records.append(record)
            if self.rank == 0:
                _append_log(self.output, record)
            if self.on_step is not None:
                self.on_step(record)
            last = step == self.total_steps - 1
            if last or (cfg.save_every and (step + 1) % cfg.save_every == 0):
                self._checkpoint(step + 1)
        summary = self.summary()
        if self.world > 1:
            with torch.no_grad():
                checksum = float(sum(_full(p).double().sum() for p in self.model.parameters()))
            summary["param_checksums"] = _gather([checksum], self.world)
        return summary

    def close(self) -> None:
        """Leave the process group (DDP) once every rank is done."""
        if self.world > 1 and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()

    def summary(self) -> dict:
        """Realised budget frequencies (mixed-depth steps only) next to Eq. 3's expectation."""
        flat = [k for r in self.records for k in record_budgets(r)]
        mixed = [k for r in self.records if r["step"] >= self.switch_step for k in record_budgets(r)]
        out = {
            "steps": self.total_steps,
            "tokens_per_step": self.tokens_per_step,
            "switch_step": self.switch_step,
            "expected": self.sampler.expected(),
        }
        if self.exits:  # every depth ran at each step: no draws; the exit objective's last terms instead
            last = self.records[-1]["exit"] if self.records else {}
            out["exit"] = {"stage": "exit_gate_only" if self.config.exit_gate_only else "exit_gate"}
            out["exit"].update(depths=list(self.exit_menu), **last)
        elif mixed:
            out["realised"] = {
                "p_shallowest": sum(k == self.sampler.shallowest for k in mixed) / len(mixed),
                "mean_budget": sum(mixed) / len(mixed),
                "micro_batches": len(flat),
            }
        return out

    def _exit_step(self, model, ids: torch.Tensor, labels: torch.Tensor, has_router: bool) -> tuple:
        """One micro-batch of the exit objective over :attr:`exit_menu` (``d_1 < ... <
        d_{n+1}``): the per-token loss at every depth and the gate logits at ``d_1..d_n``, then
        :func:`expected_exit_loss` (``exit_gate``) or :func:`gate_fit_loss` (``exit_gate_only``).
        ELR: one forward at ``d_{n+1}`` reading each loop's exit through the output block (the
        exits ``budget="auto"`` takes: every loop conditioned on the deepest depth); fixed-prefix
        looping: one forward per depth (exiting after window layer ``d`` is budget ``d``).
        Returns the deepest forward's output, the loss and the objective's statistics."""
        cfg, menu = self.config, self.exit_menu
        deepest = menu[-1]
        frozen = torch.no_grad() if cfg.exit_gate_only else contextlib.nullcontext()
        router = has_router and not cfg.exit_gate_only
        elr = self.model.plan.has_loop_exits
        by_depth = {}
        if not elr:  # through the module itself: DDP wraps one forward per backward (the deepest)
            with frozen:
                by_depth = {d: self.model(ids, budget=d).logits for d in menu[:-1]}
        out = model(
            ids,
            labels=labels,
            budget=deepest,
            output_router_logits=router,
            output_exit_logits=elr,
            output_exit_gates=True,
        )
        if elr:
            by_depth = {i: logits for i, logits in enumerate(out.exit_logits, start=1)}
        by_depth[deepest] = out.logits
        gates = dict(zip([d for d in self.model.exit_gates if d < deepest], out.exit_gate_logits))
        losses = torch.stack([token_losses(by_depth[d], labels) for d in menu])
        z = torch.stack([gates[d][:, :-1] for d in menu[:-1]])
        mask = labels[:, 1:] != IGNORE
        if cfg.exit_gate_only:
            loss, stats = gate_fit_loss(losses, z, mask, cfg.exit_gamma)
        else:
            loss, stats = expected_exit_loss(losses, z, mask, cfg.exit_beta)
        return out, loss, stats

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint(self, step: int) -> None:
        """Rebuild the output directory: the model, the run's text files and, unless
        ``save_optimizer=False``, :data:`STATE_FILE` (optimizer state, step, RNG, records)."""
        save = self.config.save_optimizer
        optimizer_state = self._optimizer_state() if save else None  # collective under FSDP: every rank takes part
        state = files = None
        if self.rank == 0:
            config = dataclasses.asdict(self.config)
            state = {
                "step": step,
                "optimizer": optimizer_state,
                "rng": rng_states(self.device),
                "records": self.records,
                "config": config,
            }
            files = {
                ARGS_FILE: json.dumps(config, indent=2),
                LOG_FILE: "".join(json.dumps(r) + "\n" for r in self.records),
            }
        # FSDP: every rank gathers each sharded tensor in the same order; rank 0 writes. The
        # exit_gate_only stage froze the backbone for itself: the saved model stays trainable.
        frozen = [p for p in self.model.parameters() if not p.requires_grad] if self.config.exit_gate_only else []
        for p in frozen:
            p.requires_grad_(True)
        try:
            write_checkpoint(
                self.output, self.model, state, files or {}, materialize=_full if self.fsdp else None, save_state=save
            )
        finally:
            for p in frozen:
                p.requires_grad_(False)
        if self.world > 1:
            dist.barrier()

    def _optimizer_state(self) -> dict:
        """The optimizer state to save: as is, or under FSDP the full (unsharded) state
        gathered to every rank, which a resume with any sharding can load."""
        if not self.fsdp:
            return self.optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(
            self.model, self.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's full value: a sharded (DTensor) parameter is all-gathered (collective)."""
    full = getattr(tensor, "full_tensor", None)
    return full() if full is not None else tensor


def record_budgets(record: dict) -> list[int]:
    """The budgets of one log record, flattened over ranks (DDP logs one list per rank)."""
    budgets = record["budgets"]
    return [k for ks in budgets for k in ks] if budgets and isinstance(budgets[0], list) else list(budgets)


def _append_log(output: Path, record: dict) -> None:
    if output.exists():
        with open(output / LOG_FILE, "a") as f:
            f.write(json.dumps(record) + "\n")


def _gather(values: list, world: int):
    if world == 1:
        return values
    out: list = [None] * world
    dist.all_gather_object(out, values)
    return out


def _init_distributed() -> tuple[int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return (dist.get_rank(), dist.get_world_size()) if world > 1 else (0, 1)
