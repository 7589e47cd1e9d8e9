"""Training: distil the frozen base's greedy choices (or its processed distribution) into the head's trainable tensors.

`train(plan)` (`settings.plan_of`) reads top to bottom: open the run (`run.open_run`: data, models, the
self-generated windows, targets), the optimizer, resume if asked, then per step
`train_step` (base targets, no grad -> head chain -> loss -> backward -> clip ->
update), log, select, checkpoint. Selection scores the head where serving runs it (the
decoder replay, or its expectation under sampling, on the validation windows the base
wrote under the selected serving configuration, trainable tensors rounded as export
rounds them) before the first step and every `train.select_every_steps`; the best step
is what the run writes. Checkpoints hold tensors and plain values only; the window
order is a pure function of (seed, epoch), so a resumed run ends, on CPU, with a
bit-identical head.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

from occamy_mtp.model import checkpoint as ckpt_io
from occamy_mtp import files
from occamy_mtp import record as rec
from occamy_mtp.console import Progress
from occamy_mtp.config import ConfigError, TrainSettings
from occamy_mtp.data.prepare import PreparedData
from occamy_mtp.data.windows import Window
from occamy_mtp.errors import OccamyError
from occamy_mtp.evaluation.served import served_with_contexts
from occamy_mtp.evaluation.metrics import paired_difference_se, within_noise
from occamy_mtp.model.head import MTPHead
from occamy_mtp.model.sharding import Sharding
from occamy_mtp.model.loss import IGNORE, Objective, Share, StepStats, Texts, chain_batch, chain_loss, collate, served_choice
from occamy_mtp.run import Run, check_run, log_stderr, open_run, output_lock, quiet
from occamy_mtp.settings import Fingerprint, Measuring, Plan, RunDir, TrainPlan
from occamy_mtp.targets.base import SharedTargets, TargetSource

# Head submodules whose fp32 master weights the forward can use directly: the norms
# compute in fp32 anyway, and `MTPHead.project` rounds fc's weight to the activation
# dtype. Training anything else runs the head under autocast.
_DIRECT_FP32 = ("fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")


@dataclass
class TrainState:
    """Everything that changes during training; checkpointed as plain values + tensors."""

    step: int = 0
    elapsed_seconds: float = 0.0
    base_forward_seconds: float = 0.0
    history: list[dict] = field(default_factory=list)
    selection: list[dict] = field(default_factory=list)
    """One entry per selection measurement: step, score and accept length per served step count."""
    best_step: int | None = None
    best_score: float | None = None
    selection_seconds: float = 0.0


# ----------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------


def train(plan: Plan, resume: bool = False, sharding: Sharding | None = None) -> dict:
    """Train the head's trainable tensors; returns the train summary written to the run dir.
    The plan's models are local directories (the command line resolves Hub ids: `cli.parse`).
    `sharding`: the frozen base's placement over the launch's processes (`model.sharding`)."""
    run_dir, train_plan = plan.run_dir, plan.train
    settings = train_plan.settings
    base = check_run(plan.setup, training=True)  # paths, outputs, train.trainable: before anything slow
    with head_only():
        accelerator = Accelerator(
            # Without a GPU, say so: accelerate then runs several processes over gloo (MULTI_CPU).
            cpu=not torch.cuda.is_available(),
            log_with=None if settings.tracker == "none" else settings.tracker,
            project_dir=str(run_dir.root),
        )
    # One run at a time writes into output.dir (the main process holds its lock).
    with output_lock(run_dir) if accelerator.is_main_process else contextlib.nullcontext():
        set_seed(settings.seed)
        world = accelerator.num_processes
        if settings.windows_per_step % world:
            raise ConfigError(
                f"train.windows_per_step: {settings.windows_per_step} windows cannot be split evenly "
                f"over {world} processes; use a multiple of {world}"
            )
        existing = run_dir.latest_checkpoint()
        if existing is not None and not resume:
            raise ConfigError(f"{run_dir.root} already holds checkpoints ({existing.name}); pass --resume or use a new output.dir")
        log = log_stderr if accelerator.is_main_process else quiet  # progress of the slow phases, once
        if resume and existing is None:
            log(f"--resume: {run_dir.checkpoints} holds no checkpoint, so training starts from step 0")
        resumed = read_checkpoint(existing, train_plan.fingerprint) if resume and existing is not None else None
        check_data = None if resumed is None else lambda data: same_data(existing, resumed["data"], data)  # noqa: E731
        # The base writes the continuations the store lacks: the main process while the others wait, or, the
        # base sharded, all of them together.
        run = open_run(plan.setup, accelerator.device, base=base, log=log, writer_first=accelerator.main_process_first,
                       check_data=check_data, sharding=sharding, main_process=accelerator.is_main_process)
        return fit(run, train_plan, accelerator, log, resumed, existing)


@contextlib.contextmanager
def head_only():
    """accelerate for the head alone, whatever the launch: an FSDP or DeepSpeed launch shards the
    frozen base (`model.sharding`, read by the command from the same environment), while the head
    (8.4M trainable parameters) stays whole under DDP, so that its checkpoints are plain tensors
    that load without FSDP or DeepSpeed. accelerate reads ACCELERATE_USE_FSDP and
    ACCELERATE_USE_DEEPSPEED when its state is first made, so they are hidden for that moment."""
    hidden = {name: os.environ.pop(name) for name in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED")
              if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(hidden)


def fit(run: Run, train_plan: TrainPlan, accelerator, log=quiet, resumed: dict | None = None,
        existing: Path | None = None) -> dict:
    """The loop over an opened run (`train` opens it): the optimizer, the checkpoint `resumed` from
    (`read_checkpoint`'s payload of the file `existing`), then per step `train_step`, log, select,
    checkpoint; the selected tensors and the summary written last. Returns the summary."""
    run_dir, settings = run.dir, train_plan.settings
    world = accelerator.num_processes
    trainable = [p for p in run.models.head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=settings.lr, betas=(settings.adam_beta1, settings.adam_beta2),
                                  eps=settings.adam_eps, weight_decay=settings.weight_decay)
    model, optimizer = accelerator.prepare(run.models.head, optimizer)
    # The head itself: DDP wraps the module it is given. (accelerate's unwrap_model would import DeepSpeed
    # wherever it is installed, and DeepSpeed warns about the accelerator on import, in runs that do not use it.)
    head: MTPHead = run.models.head
    if getattr(model, "module", model) is not head:
        raise RuntimeError("accelerate.prepare wrapped a copy of the head, not the head")
    act_dtype = ckpt_io.DTYPES[train_plan.dtype]
    total_steps = settings.epochs * steps_per_epoch(len(run.windows.train), settings.windows_per_step)
    weights = train_plan.step_weights
    objective = build_objective(train_plan)
    state, best = TrainState(), None
    if resumed is not None:
        state, best = restore_checkpoint(resumed, existing, head, optimizer)
        log(f"resumed from {existing} at step {state.step}/{total_steps}")
    if accelerator.is_main_process:
        with files.atomic_path(run_dir.resolved_config) as tmp:
            tmp.write_text(train_plan.resolved_yaml)
    if settings.tracker != "none":
        accelerator.init_trackers("occamy-mtp", config=train_plan.tracked)

    validation = SharedTargets(run.targets)  # the validation texts' base pass and p, computed at the first selection only

    def select() -> None:
        """Score the head as served; keep it when it is the best so far (every process agrees)."""
        nonlocal best
        if selection_step(state, head, dataclasses.replace(run, targets=validation), train_plan.measuring, act_dtype, log):
            best = trainable_tensors(head)

    select_every = settings.select_every_steps
    log_every = settings.log_every_steps
    progress = Progress(total_steps, "train", "step", state.step, enabled=accelerator.is_local_main_process,
                        every=log_every)
    since_log: list[dict] = []  # the steps since the last progress line, whose mean it shows
    model.train()
    started = time.perf_counter() - state.elapsed_seconds
    if select_every and not state.selection:
        select()  # step 0: the donor itself
    while state.step < total_steps:
        lr = lr_at(state.step, total_steps, settings.lr, settings.lr_warmup_steps, settings.lr_min_ratio)
        for group in optimizer.param_groups:
            group["lr"] = lr
        # This process's share of the step's windows.
        windows = step_windows(run.windows.train, state.step, settings.windows_per_step, settings.seed)
        try:
            step = train_step(model, head, run.targets, process_share(windows, accelerator.process_index, world), optimizer,
                              settings, weights, act_dtype, backward=accelerator.backward,
                              clip_grad_norm=accelerator.clip_grad_norm_, objective=objective, processes=world,
                              summed=lambda tensor: accelerator.reduce(tensor, reduction="sum"))
        except NonFiniteStep as err:
            _stop(run_dir, state.step + 1, str(err), lr)
        state.step += 1
        state.base_forward_seconds += step.base_seconds
        state.elapsed_seconds = time.perf_counter() - started

        line = _log_line(accelerator, state, lr, step.loss, step.stats, step.grad_norm)
        state.history.append(line)
        since_log.append(line)
        if state.step % log_every == 0 or state.step == total_steps:
            accelerator.log(line, step=state.step)
            progress.set_postfix(**running_means(since_log))
            since_log.clear()
        progress.update(1)
        if select_every and (state.step % select_every == 0 or state.step == total_steps):
            select()
            state.elapsed_seconds = time.perf_counter() - started
        if state.step % settings.checkpoint_every_steps == 0 or state.step == total_steps:
            accelerator.wait_for_everyone()
            if accelerator.is_main_process:
                try:
                    save_checkpoint(run_dir, state, head, optimizer, train_plan.fingerprint, settings.keep_checkpoints, best,
                                    run.data)
                except files.DiskFull as err:  # the tensors are still here: train on, and keep the older checkpoints
                    log(f"warning: step {state.step}'s checkpoint was not written: {err}; training goes on, "
                        f"and the older checkpoints are kept")
    progress.close()

    accelerator.wait_for_everyone()
    summary = _summary(run, train_plan, state, total_steps, world, accelerator.device)
    if accelerator.is_main_process:
        written = best if select_every else trainable_tensors(head)
        metadata = {"format": "pt", "config_fingerprint": summary["config_fingerprint"]}
        try:
            files.save_safetensors(run_dir.trained_tensors, {n: t.float() for n, t in written.items()}, metadata=metadata)
            files.write_json(run_dir.train_summary, summary)
        except files.DiskFull as err:
            raise files.DiskFull(f"{err}. {_how_to_recover(run_dir, state.step)}") from None
    accelerator.end_training()
    _leave_process_group(accelerator)
    return summary


def _leave_process_group(accelerator) -> None:
    """Every process leaves the process group together, explicitly. Left to the interpreter's exit, a
    process whose peer had already gone sometimes waited forever in gloo's teardown (outputs written,
    one rank exited, the other blocked on a futex)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        accelerator.wait_for_everyone()
        torch.distributed.destroy_process_group()


# ----------------------------------------------------------------------------------
# One step, and selection
# ----------------------------------------------------------------------------------


class NonFiniteStep(OccamyError, ArithmeticError):
    """A step's loss or update is not finite: nothing of the step is kept."""


@dataclass(frozen=True)
class StepOutput:
    loss: torch.Tensor
    """The step's loss on this process (detached)."""
    stats: list[StepStats]
    grad_norm: float | None
    base_seconds: float
    """Time spent getting the base's targets (the forward, or the cache read)."""


def build_objective(train_plan: TrainPlan) -> Objective:
    """What the head is fitted to: `train.loss` under the selected serving configuration, the chain
    fed the text's tokens when the base sampled the train text."""
    return Objective(train_plan.settings.loss, train_plan.measuring.selected, embed_text=train_plan.embed_text)


def train_step(model, head: MTPHead, targets: TargetSource, windows: list[Window], optimizer, settings: TrainSettings,
               loss_weights: tuple[float, ...], act_dtype: torch.dtype, *, backward=None, clip_grad_norm=None,
               objective: Objective = Objective(), processes: int = 1, summed=None) -> StepOutput:
    """One optimizer step on `windows`: the base's targets (no grad), the head's chain, the loss, the update.

    `model` is `head` as the caller runs it (wrapped by accelerate for several
    processes, or `head` itself); `backward` and `clip_grad_norm` default to torch's. Over several
    `processes`, `windows` is this process's share of the step and `summed` sums a tensor over the
    processes: the loss is then the step's mean over every process's scored pairs (`chain_loss`'s share).
    Raises NonFiniteStep, before anything is kept, on a non-finite loss or update.
    """
    device = head.fc.weight.device
    batch = collate(windows, device)
    started = time.perf_counter()
    base = targets.outputs(batch.input_ids, batch.attention_mask)
    base_seconds = time.perf_counter() - started

    choice = served_choice(head, base.hidden, base.greedy, batch, objective.serving)  # the base's own, as served
    chain = chain_batch(batch.input_ids, choice, batch.assistant, batch.lengths, settings.draft_steps, objective.embed_text)
    share = None
    if processes > 1:
        scored = summed((chain.labels != IGNORE).flatten(1).sum(dim=1).to(torch.float64))  # (K,) every process's
        share = Share(tuple(int(n) for n in scored.tolist()), processes)
    with head_autocast(head, device, act_dtype):
        hidden = model(chain.step_token_ids, base.hidden, detach_chain=settings.detach_chain)  # (K, B, T, D)
        loss, stats = chain_loss(head, hidden, chain.labels, loss_weights, objective=objective, base_hidden=base.hidden,
                                 texts=Texts.of(batch), share=share)
    if not torch.isfinite(loss.detach()):
        raise NonFiniteStep(f"the loss is {float(loss.detach()):g}")
    (backward or torch.Tensor.backward)(loss)
    trainable = [p for p in head.parameters() if p.requires_grad]
    grad_norm = None
    if settings.grad_clip_norm > 0:
        grad_norm = float((clip_grad_norm or torch.nn.utils.clip_grad_norm_)(trainable, settings.grad_clip_norm))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    broken = [n for n, p in head.named_parameters() if p.requires_grad and not bool(torch.isfinite(p).all())]
    if broken:  # caught before a checkpoint could keep it
        raise NonFiniteStep(f"the update made {', '.join(broken)} non-finite")
    return StepOutput(loss.detach(), stats, grad_norm, base_seconds)


def selection_step(state: TrainState, head: MTPHead, run: Run, measuring: Measuring, act_dtype: torch.dtype,
                   log=quiet) -> bool:
    """Measure the head on the validation windows as served, record it in `state`; True when it is the best so far."""
    started = time.perf_counter()
    device = head.fc.weight.device
    with as_served(head, act_dtype), head_autocast(head, device, act_dtype):
        served = served_with_contexts(run.targets, head, run.windows.validation, measuring.served_steps,
                                      measuring.answer_tokens, measuring.windows_per_batch, measuring.selected)
    score, score_se = selection_score(served), selection_score_se(served)
    entry = {"step": state.step, "score": score, "score_se": score_se,
             **{f"accept_length_k{k}": a["mean_accept_length"] for k, a in served.items()}}
    if not state.selection:  # the donor: what every later step is compared with, context by context
        entry["per_context"] = {str(k): a["per_context"] for k, a in served.items()}
    else:
        donor = state.selection[0].get("per_context")
        if donor is not None:  # the paired standard error of the score's difference from the donor's
            entry["vs_donor_se"] = sum(paired_difference_se(donor[str(k)], a["per_context"]) for k, a in served.items()) / len(served)
    state.selection.append(entry)
    is_best = state.best_score is None or score > state.best_score
    if is_best:
        state.best_step, state.best_score = state.step, score
    state.selection_seconds += time.perf_counter() - started
    counts = [str(k) for k in served]
    steps = ", ".join(counts[:-1]) + " and " + counts[-1] if len(counts) > 1 else counts[0]
    log(f"select: step {state.step}: mean accept length at {steps} drafts under {measuring.selected.label()} "
        f"{score:.4f}" + (f" ± {score_se:.4f}" if score_se else "") + f" (best: step {state.best_step}, {state.best_score:.4f})")
    return is_best


# ----------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------


def head_autocast(head: MTPHead, device: torch.device, dtype: torch.dtype):
    """Autocast only when a trainable fp32 tensor feeds a matmul other than fc."""
    needs = any(
        p.requires_grad and not any(n == m or n.startswith(m + ".") for m in _DIRECT_FP32)
        for n, p in head.named_parameters()
    )
    return torch.autocast(device.type, dtype=dtype, enabled=needs and dtype != torch.float32)


@contextlib.contextmanager
def as_served(head: MTPHead, dtype: torch.dtype):
    """For the duration, every trainable fp32 master holds its value rounded to `dtype`, as
    export writes it (and serving loads it); the masters are put back after."""
    masters = {}
    for name, param in head.named_parameters():
        if param.requires_grad and param.dtype != dtype:
            masters[name] = param.data
            param.data = param.data.to(dtype).to(param.dtype)
    try:
        yield
    finally:
        for name, param in head.named_parameters():
            if name in masters:
                param.data = masters[name]


def selection_score(served: dict) -> float:
    """What selection maximises: the mean over the served step counts of the replayed mean accept length
    (`served_with_contexts`' figures)."""
    return sum(a["mean_accept_length"] for a in served.values()) / len(served)


def selection_score_se(served: dict) -> float:
    """A standard error of `selection_score`: the mean of the step counts' standard errors, which bounds
    that of their mean from above (the step counts are measured on the same texts)."""
    return sum(a["mean_accept_length_se"] for a in served.values()) / len(served)


def lr_at(step: int, total_steps: int, peak: float, warmup_steps: int, min_ratio: float) -> float:
    """Linear warmup to `peak`, then cosine down to `peak * min_ratio` at the last step."""
    if warmup_steps > 0 and step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps - 1)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def window_order(num_windows: int, seed: int, epoch: int) -> list[int]:
    """The order of the train windows in `epoch`: a pure function of (seed, epoch)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_windows, generator=generator).tolist()


def steps_per_epoch(num_windows: int, windows_per_step: int) -> int:
    return math.ceil(num_windows / windows_per_step)


def process_share(windows: list[Window], rank: int, processes: int) -> list[Window]:
    """Process `rank`'s windows of a step: every `processes`-th from its own. A process the step leaves
    without one (an epoch's last step holds what remains) takes the step's first window with nothing
    scored: it runs the base and the head as the others do (their collectives, the gradients' mean)
    and adds nothing to the loss."""
    share = windows[rank::processes]
    if share or not windows:
        return share
    return [dataclasses.replace(windows[0], answer_start=len(windows[0].input_ids))]


def step_windows(windows: list[Window], step: int, windows_per_step: int, seed: int) -> list[Window]:
    """The windows of global `step` (all processes together)."""
    per_epoch = steps_per_epoch(len(windows), windows_per_step)
    epoch, within = divmod(step, per_epoch)
    order = window_order(len(windows), seed, epoch)
    return [windows[i] for i in order[within * windows_per_step : (within + 1) * windows_per_step]]


# ----------------------------------------------------------------------------------
# Checkpoints
# ----------------------------------------------------------------------------------


def trainable_tensors(head: MTPHead) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone().cpu() for n, p in head.named_parameters() if p.requires_grad}


CHECKPOINT_FORMAT = 3  # 3: the data's files and split members ("data"), which resume checks


def save_checkpoint(run_dir: RunDir, state: TrainState, head: MTPHead, optimizer, fingerprint: Fingerprint, keep: int,
                    best: dict[str, torch.Tensor] | None, data: PreparedData) -> Path:
    path = run_dir.checkpoint(state.step)
    payload = {
        "format": CHECKPOINT_FORMAT,
        "config_fingerprint": fingerprint.value,
        "settings": fingerprint.settings,
        "data": data.members(),
        "state": dataclasses.asdict(state),
        "trainable": trainable_tensors(head),
        "best_trainable": best or {},
        "optimizer": optimizer.state_dict(),
    }
    with files.atomic_path(path, needed_bytes=_tensor_bytes(payload)) as tmp:
        torch.save(payload, tmp)
    for old in sorted(run_dir.checkpoints.glob("step-*.pt"))[:-keep]:
        old.unlink()
    return path


def _tensor_bytes(tree) -> int:
    """The bytes of every tensor in a checkpoint's payload: about what torch.save writes."""
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(_tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_tensor_bytes(v) for v in tree)
    return 0


def _how_to_recover(run_dir: RunDir, step: int) -> str:
    """What a run whose results could not be written keeps, and the command that gets them back."""
    last = run_dir.latest_checkpoint()
    if last is None:
        return "No checkpoint was written, so the training is lost: free the space and train again"
    kept = int(last.stem.split("-")[1])
    then = "writes the tensors at once" if kept == step else f"trains steps {kept + 1}..{step} again and ends with the same tensors"
    return (f"The newest checkpoint, {last}, holds step {kept}: once space is free, `train.py --config "
            f"{run_dir.resolved_config} --resume` {then}")


def read_checkpoint(path: Path, fingerprint: Fingerprint) -> dict:
    """A checkpoint to resume from, read once: its data (`PreparedData.members`), checked before any
    model loads (`same_data`), then its tensors (`restore_checkpoint`). Refused when it is of another
    format or was written under other settings."""
    payload = torch.load(path, map_location="cpu", weights_only=True)
    if payload.get("format") != CHECKPOINT_FORMAT:
        raise ConfigError(f"{path}: checkpoint format {payload.get('format')!r}, this version reads {CHECKPOINT_FORMAT}; "
                          "use a new output.dir")
    changed = fingerprint.refusal(payload.get("config_fingerprint"), payload.get("settings", {}))
    if changed is not None:
        raise ConfigError(f"{path}: written by a run with other settings ({changed}); resume with the same config, or use a new output.dir")
    return payload


def same_data(path: Path, recorded: dict, data: PreparedData) -> None:
    """Refuse to resume from the checkpoint at `path` on data other than its own, naming what changed."""
    changes = data.members_changed(recorded)
    if changes:
        raise ConfigError(f"{path}: was trained on other data ({'; '.join(changes)}); resume with the data it was "
                          "trained on, or start again in a new output.dir")


def restore_checkpoint(payload: dict, path: Path, head: MTPHead, optimizer) -> tuple[TrainState, dict[str, torch.Tensor]]:
    """Put the head and optimizer back to a checkpoint (`read_checkpoint`'s payload of the file at
    `path`); returns its state and the best tensors so far."""
    params = dict(head.named_parameters())
    for name, tensor in payload["trainable"].items():
        if name not in params or not params[name].requires_grad:
            raise ConfigError(f"{path}: holds trainable tensor {name!r}, which this config does not train")
        params[name].data.copy_(tensor.to(params[name].device))
    optimizer.load_state_dict(payload["optimizer"])
    return TrainState(**payload["state"]), dict(payload["best_trainable"])


class TrainingError(OccamyError, RuntimeError):
    """Training cannot go on (a non-finite loss or update); says where and what is kept."""


def _stop(run_dir: RunDir, step: int, what: str, lr: float) -> None:
    last = run_dir.latest_checkpoint()
    kept = f"the last good checkpoint, {last}, is kept" if last is not None else "no checkpoint had been written yet"
    raise TrainingError(
        f"step {step}: {what}; training stopped and nothing of this step was kept ({kept}). "
        f"The learning rate was {lr:g}: try a lower train.lr, in a new output.dir"
    )


def _summary(run: Run, train_plan: TrainPlan, state: TrainState, total_steps: int, processes: int, device) -> dict:
    """train-summary.json: what export needs of training, and its history."""
    return {
        "steps": total_steps,
        "steps_per_epoch": steps_per_epoch(len(run.windows.train), train_plan.settings.windows_per_step),
        "processes": processes,
        "device": str(device),
        "base_placement": run.models.base.placement.to_dict() if run.models.base is not None else None,
        "train_seconds": state.elapsed_seconds,
        "base_forward_seconds": state.base_forward_seconds,
        "trainable_parameters": run.models.trainable_parameters,
        "head_parameters": run.models.head_parameters,
        "donor_layout": run.models.donor_layout,
        "config_fingerprint": train_plan.fingerprint.value,
        "fingerprinted_settings": train_plan.fingerprint.settings,
        "final_loss": state.history[-1]["loss"] if state.history else None,
        "history": state.history,
        "selection": _selection_summary(train_plan, state, len(run.windows.validation)),
        "data": run.data.provenance(),
        "answers": train_plan.answers,
        "train_windows": len(run.windows.train),
        "self_generated": run.windows.self_generated,
        "targets": run.targets.provenance(),
        "arithmetic": rec.arithmetic(device, processes),
    }


def _selection_summary(train_plan: TrainPlan, state: TrainState, validation_windows: int) -> dict:
    """What selection measured and chose: the step whose tensors the run writes."""
    if not train_plan.settings.select_every_steps:
        return {"enabled": False, "written_step": state.step}
    return {
        "enabled": True,
        "every_steps": train_plan.settings.select_every_steps,
        "metric": "mean over eval.served_steps of the decoder's mean accept length (replayed, or expected under sampling) on "
                  "the validation windows the base wrote under the selected serving configuration",
        "serving": train_plan.measuring.selected.label(),
        "served_steps": list(train_plan.measuring.served_steps),
        "validation_windows": validation_windows,
        "history": state.selection,
        "donor_score": state.selection[0]["score"] if state.selection else None,
        "best_step": state.best_step,
        "best_score": state.best_score,
        **_selection_noise(state),
        "written_step": state.best_step,
        "seconds": state.selection_seconds,
    }


def _selection_noise(state: TrainState) -> dict:
    """Whether the chosen step beats the donor (step 0's score) by more than noise (`metrics.within_noise`),
    the difference's standard error paired context by context (`vs_donor_se`;
    for runs from before it, sqrt(se_best^2 + se_donor^2), which over-states it)."""
    if not state.selection or state.best_step is None:
        return {}
    donor = state.selection[0]
    best = next(entry for entry in state.selection if entry["step"] == state.best_step)
    if best is donor:
        return {"best_minus_donor": 0.0, "difference_se": 0.0, "within_noise": True}
    se = best.get("vs_donor_se", math.hypot(donor.get("score_se", 0.0), best.get("score_se", 0.0)))
    return {"best_minus_donor": best["score"] - donor["score"], "difference_se": se,
            "within_noise": within_noise(best["score"] - donor["score"], se)}


def _log_line(accelerator, state: TrainState, lr: float, loss, stats, grad_norm) -> dict:
    """One step's log line (loss, lr, agreement per step), summed over processes."""
    local = torch.tensor(
        [float(loss.detach())] + [v for s in stats for v in (s.scored, s.agree)],
        dtype=torch.float64,
        device=accelerator.device,
    )
    summed = accelerator.reduce(local, reduction="sum").cpu().tolist()
    line = {"step": state.step, "lr": lr, "loss": summed[0] / accelerator.num_processes}
    for k in range(len(stats)):
        scored, agree = summed[1 + 2 * k], summed[2 + 2 * k]
        line[f"scored_step{k + 1}"] = int(scored)
        line[f"agreement_step{k + 1}"] = agree / scored if scored else 0.0
    if grad_norm is not None:
        line["grad_norm"] = float(grad_norm)
    line["elapsed_seconds"] = state.elapsed_seconds
    return line


def running_means(lines: list[dict]) -> dict[str, str]:
    """The progress line's figures: the loss and step-1 agreement averaged over `lines` (the steps
    since the last line, each the mean over its windows), labelled with the steps they cover."""
    first, last = lines[0]["step"], lines[-1]["step"]
    steps = f"step {last}" if first == last else f"steps {first}-{last}"
    loss = sum(line["loss"] for line in lines) / len(lines)
    scored = sum(line["scored_step1"] for line in lines)
    agree = sum(line["agreement_step1"] * line["scored_step1"] for line in lines) / scored if scored else 0.0
    return {f"mean loss of {steps}": f"{loss:.4f}", "step-1 agreement": f"{agree:.3f}"}
