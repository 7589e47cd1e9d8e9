"""Training: distil the frozen base's greedy choices into the head's trainable tensors.

`train(config)` reads top to bottom: set up (accelerate, data, models, the
self-generated windows, optimizer, schedule), resume if asked, then for each step: base
forward (no grad) -> head chain -> loss -> backward -> clip -> optimizer and lr step ->
log -> select -> checkpoint. Helpers are plain functions beside it.

Selection. Every `train.select_every_steps` steps, and before the first (the donor
itself), the head is measured where serving runs it: the decoder replay
(`evaluate.served_acceptance`) on the self-generated validation windows, at each of
`eval.served_steps`, with the trainable tensors rounded as export rounds them. The
best mean accept length is kept, and that head is what the run writes: a run never
ends with a head that validation already saw losing to an earlier one, the donor
included. The heldout windows, which the reported figures come from, are never seen.

Checkpoints hold tensors and plain values only (loadable with `weights_only=True`):
the fp32 master copies of the trainable tensors (and of the best so far), the
optimizer state, the step, the selection history and the timings. The window order is
a pure function of (seed, epoch), so a resumed run takes the same windows in the same
order and, on CPU, ends with a bit-identical head.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

from occamy_mtp import checkpoint as ckpt_io
from occamy_mtp.cache import open_targets
from occamy_mtp.config import ConfigError, RunConfig, differing_settings, dump_yaml, step_loss_weights
from occamy_mtp.data import Window
from occamy_mtp.evaluate import served_acceptance
from occamy_mtp.head import MTPHead, SharedWeights, count_parameters, set_trainable
from occamy_mtp.loss import chain_batch, chain_loss, collate
from occamy_mtp.run_setup import (
    check_run,
    check_split,
    load_tokenizer,
    log_stderr,
    open_store,
    output_lock,
    prepare_data,
    run_windows,
)
from occamy_mtp.target import TargetSource

CHECKPOINT_DIR = "checkpoints"
TRAINED_TENSORS = "trained-tensors.safetensors"
TRAIN_SUMMARY = "train-summary.json"
RESOLVED_CONFIG = "config.resolved.yaml"
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


@dataclass(frozen=True)
class Models:
    base: torch.nn.Module | None
    head: MTPHead
    donor_layout: str
    trainable_parameters: int
    head_parameters: int


# ----------------------------------------------------------------------------------
# Set-up helpers
# ----------------------------------------------------------------------------------


def _quiet(message: str) -> None:
    """The log of every process but the main one, and of callers that want none."""


def build_models(config: RunConfig, device, with_base: bool = True, log=_quiet) -> Models:
    """The frozen base and the donor head on `device`, trainable tensors as fp32 masters.

    Without the base (`with_base=False`, training from the target cache) only the two
    tensors the head borrows, `embed_tokens` and `lm_head`, are loaded.
    """
    dtype = ckpt_io.DTYPES[config.model.dtype]
    base_config = ckpt_io.read_config(config.model.base)
    started = time.perf_counter()
    files = ckpt_io.SafetensorsCheckpoint(Path(config.model.base)).files()
    size = sum(f.stat().st_size for f in files) / 2**30
    if with_base:
        log(f"base: loading {config.model.base} ({len(files)} safetensors files, {size:.1f} GiB) to {device} as {config.model.dtype}")
        base = ckpt_io.load_base(config.model.base, dtype=dtype, device=device, attn_implementation=config.model.attn_implementation)
        shared = SharedWeights(base.model.embed_tokens, base.lm_head)
    else:
        log(f"base: loading only embed_tokens and lm_head of {config.model.base} (the targets are cached)")
        base = None
        shared = ckpt_io.load_shared_weights(config.model.base, dtype=dtype, device=device)
    head, layout = ckpt_io.load_head(
        config.model.donor_head,
        base_config.text_config,
        shared,
        dtype=dtype,
        device=device,
        attn_implementation=config.model.attn_implementation,
    )
    trainable = set_trainable(head, config.train.trainable)
    for name, param in head.named_parameters():
        if param.requires_grad:
            param.data = param.data.float()  # fp32 master copy; the forward rounds it as serving stores it
    total, _ = count_parameters(head)
    log(f"models: loaded in {time.perf_counter() - started:.1f} s; head {total:,} parameters, {trainable:,} trainable")
    return Models(base, head, layout, trainable, total)


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
    """What selection maximises: the mean over the served step counts of the replayed mean accept length."""
    return sum(a.mean_accept_length for a in served.values()) / len(served)


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


def save_checkpoint(output_dir: Path, state: TrainState, head: MTPHead, optimizer, config: RunConfig, keep: int,
                    best: dict[str, torch.Tensor] | None) -> Path:
    directory = output_dir / CHECKPOINT_DIR
    path = directory / f"step-{state.step:06d}.pt"
    payload = {
        "format": 2,
        "config_fingerprint": config.fingerprint(),
        "settings": config.fingerprinted(),
        "state": dataclasses.asdict(state),
        "trainable": trainable_tensors(head),
        "best_trainable": best or {},
        "optimizer": optimizer.state_dict(),
    }
    with ckpt_io.atomic_path(path) as tmp:
        torch.save(payload, tmp)
    for old in sorted(directory.glob("step-*.pt"))[:-keep]:
        old.unlink()
    return path


def latest_checkpoint(output_dir: Path) -> Path | None:
    found = sorted((output_dir / CHECKPOINT_DIR).glob("step-*.pt"))
    return found[-1] if found else None


def load_checkpoint(path: Path, config: RunConfig, head: MTPHead, optimizer) -> tuple[TrainState, dict[str, torch.Tensor]]:
    """Put the head and optimizer back to a checkpoint; returns its state and the best tensors so far."""
    payload = torch.load(path, map_location="cpu", weights_only=True)
    if payload.get("format") != 2:
        raise ConfigError(f"{path}: checkpoint format {payload.get('format')!r}, this version reads 2; use a new output.dir")
    if payload.get("config_fingerprint") != config.fingerprint():
        changed = differing_settings(payload.get("settings", {}), config.fingerprinted())
        raise ConfigError(
            f"{path}: written by a run with other settings ({'; '.join(changed) or 'unknown'}); "
            "resume with the same config, or use a new output.dir"
        )
    params = dict(head.named_parameters())
    for name, tensor in payload["trainable"].items():
        if name not in params or not params[name].requires_grad:
            raise ConfigError(f"{path}: holds trainable tensor {name!r}, which this config does not train")
        params[name].data.copy_(tensor.to(params[name].device))
    optimizer.load_state_dict(payload["optimizer"])
    return TrainState(**payload["state"]), dict(payload["best_trainable"])


# ----------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------


def train(config: RunConfig, resume: bool = False) -> dict:
    """Train the head's trainable tensors; returns the train summary written to the run dir."""
    output_dir = Path(config.output.dir)
    check_run(config)  # paths, outputs outside the base, train.trainable: before anything slow
    accelerator = Accelerator(
        # Without a GPU, say so: accelerate then runs several processes over gloo (MULTI_CPU).
        cpu=not torch.cuda.is_available(),
        log_with=None if config.train.tracker == "none" else config.train.tracker,
        project_dir=str(output_dir),
    )
    # One run at a time writes into output.dir (the main process holds its lock).
    with output_lock(config) if accelerator.is_main_process else contextlib.nullcontext():
        set_seed(config.train.seed)
        device = accelerator.device
        world = accelerator.num_processes
        if config.train.windows_per_step % world:
            raise ConfigError(
                f"train.windows_per_step: {config.train.windows_per_step} windows cannot be split evenly "
                f"over {world} processes; use a multiple of {world}"
            )
        fingerprint = config.fingerprint()
        existing = latest_checkpoint(output_dir)
        if existing is not None and not resume:
            raise ConfigError(f"{output_dir} already holds checkpoints ({existing.name}); pass --resume or use a new output.dir")

        # Data: windows from the chat files, split into train, validation and heldout.
        tokenizer = load_tokenizer(config)
        log = log_stderr if accelerator.is_main_process else _quiet  # progress of the slow phases, once
        data = prepare_data(config, tokenizer, log=log)
        check_split(config, data)
        store = open_store(config, tokenizer)

        # Models: frozen base (unless its targets come from the cache), donor head with
        # fp32 master copies of what trains.
        cached = bool(config.data.target_cache)
        models = build_models(config, device, with_base=not cached, log=log)
        head = models.head
        # The base writes the continuations the store lacks: the main process, while the others wait.
        with accelerator.main_process_first():
            if not accelerator.is_main_process:
                store = open_store(config, tokenizer)  # read what the main process wrote
            windows = run_windows(config, data, store, models.base, log=log)
        targets_source: TargetSource = open_targets(
            config.data.target_cache, config.model.base, windows.all(), data.settings, config.model.dtype,
            config.model.attn_implementation, base=models.base,
        )
        trainable = [p for p in head.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(
            trainable,
            lr=config.train.lr,
            betas=(config.train.adam_beta1, config.train.adam_beta2),
            eps=config.train.adam_eps,
            weight_decay=config.train.weight_decay,
        )
        head, optimizer = accelerator.prepare(head, optimizer)
        raw_head: MTPHead = accelerator.unwrap_model(head)
        act_dtype = ckpt_io.DTYPES[config.model.dtype]

        per_epoch = steps_per_epoch(len(windows.train), config.train.windows_per_step)
        total_steps = config.train.epochs * per_epoch
        weights = step_loss_weights(config.train)
        state, best = TrainState(), None
        if resume and existing is not None:
            state, best = load_checkpoint(existing, config, raw_head, optimizer)
            log(f"resumed from {existing} at step {state.step}/{total_steps}")

        if accelerator.is_main_process:
            output_dir.mkdir(parents=True, exist_ok=True)
            with ckpt_io.atomic_path(output_dir / RESOLVED_CONFIG) as tmp:
                tmp.write_text(dump_yaml(config))
        if config.train.tracker != "none":
            accelerator.init_trackers("occamy-mtp", config=_flat(config.to_dict()))

        def select() -> None:
            """Measure the head on the validation windows as served; keep it when it is the best so far.

            Every process measures the same windows with the same head, so all agree on the choice.
            """
            nonlocal best
            started = time.perf_counter()
            with as_served(raw_head, act_dtype), head_autocast(raw_head, device, act_dtype):
                served = served_acceptance(targets_source, raw_head, windows.validation, config.eval.served_steps,
                                           config.data.answer_tokens, config.eval.windows_per_batch)
            score = selection_score(served)
            state.selection.append({"step": state.step, "score": score,
                                    **{f"accept_length_k{k}": a.mean_accept_length for k, a in served.items()}})
            if state.best_score is None or score > state.best_score:
                state.best_step, state.best_score, best = state.step, score, trainable_tensors(raw_head)
            state.selection_seconds += time.perf_counter() - started
            log(f"select: step {state.step}: {score:.4f} (best: step {state.best_step}, {state.best_score:.4f})")

        select_every = config.train.select_every_steps
        progress = _progress(accelerator, total_steps, state.step)
        head.train()
        started = time.perf_counter() - state.elapsed_seconds
        if select_every and not state.selection:
            select()  # step 0: the donor itself
        while state.step < total_steps:
            lr = lr_at(state.step, total_steps, config.train.lr, config.train.lr_warmup_steps, config.train.lr_min_ratio)
            for group in optimizer.param_groups:
                group["lr"] = lr

            # This process's share of the step's windows.
            step_batch = step_windows(windows.train, state.step, config.train.windows_per_step, config.train.seed)
            batch = collate(step_batch[accelerator.process_index :: world], device)

            # Frozen base (or its cache): post-norm hidden states and greedy targets, no gradients.
            base_started = time.perf_counter()
            targets = targets_source.outputs(batch.input_ids, batch.attention_mask)
            state.base_forward_seconds += time.perf_counter() - base_started

            chain = chain_batch(batch.input_ids, targets.greedy, batch.assistant, batch.lengths, config.train.draft_steps)
            with head_autocast(raw_head, device, act_dtype):
                head_hidden = head(chain.step_token_ids, targets.hidden, detach_chain=config.train.detach_chain)
                loss, stats = chain_loss(raw_head, head_hidden, chain.labels, weights)
            if not torch.isfinite(loss.detach()):
                _stop(output_dir, state.step + 1, f"the loss is {float(loss.detach()):g}", lr)
            accelerator.backward(loss)
            grad_norm = None
            if config.train.grad_clip_norm > 0:
                grad_norm = accelerator.clip_grad_norm_(trainable, config.train.grad_clip_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            broken = [n for n, p in raw_head.named_parameters() if p.requires_grad and not bool(torch.isfinite(p).all())]
            if broken:  # caught before a checkpoint could keep it
                _stop(output_dir, state.step + 1, f"the update made {', '.join(broken)} non-finite", lr)
            state.step += 1
            state.elapsed_seconds = time.perf_counter() - started

            record = _step_record(accelerator, state, lr, loss, stats, grad_norm)
            state.history.append(record)
            if state.step % config.train.log_every_steps == 0 or state.step == total_steps:
                accelerator.log(record, step=state.step)
                progress.set_postfix(loss=f"{record['loss']:.4f}", agree=f"{record['agreement_step1']:.3f}")
            progress.update(1)

            if select_every and (state.step % select_every == 0 or state.step == total_steps):
                select()
                state.elapsed_seconds = time.perf_counter() - started
            if state.step % config.train.checkpoint_every_steps == 0 or state.step == total_steps:
                accelerator.wait_for_everyone()
                if accelerator.is_main_process:
                    save_checkpoint(output_dir, state, raw_head, optimizer, config, config.train.keep_checkpoints, best)
        progress.close()

        accelerator.wait_for_everyone()
        summary = {
            "steps": total_steps,
            "steps_per_epoch": per_epoch,
            "processes": world,
            "device": str(device),
            "train_seconds": state.elapsed_seconds,
            "base_forward_seconds": state.base_forward_seconds,
            "trainable_parameters": models.trainable_parameters,
            "head_parameters": models.head_parameters,
            "donor_layout": models.donor_layout,
            "config_fingerprint": fingerprint,
            "fingerprinted_settings": config.fingerprinted(),
            "final_loss": state.history[-1]["loss"] if state.history else None,
            "history": state.history,
            "selection": _selection_summary(config, state, len(windows.validation)),
            "data": data.provenance(),
            "answers": config.data.answers,
            "train_windows": len(windows.train),
            "self_generated": windows.self_generated,
            "targets": targets_source.provenance(),
        }
        if accelerator.is_main_process:
            written = best if select_every else trainable_tensors(raw_head)
            tensors = {n: t.float() for n, t in written.items()}
            ckpt_io.save_safetensors(output_dir / TRAINED_TENSORS, tensors, metadata={"format": "pt", "config_fingerprint": fingerprint})
            ckpt_io.write_json(output_dir / TRAIN_SUMMARY, summary)
        accelerator.end_training()
        return summary


class TrainingError(RuntimeError):
    """Training cannot go on (a non-finite loss or update); says where and what is kept."""


def _stop(output_dir: Path, step: int, what: str, lr: float) -> None:
    last = latest_checkpoint(output_dir)
    kept = f"the last good checkpoint, {last}, is kept" if last is not None else "no checkpoint had been written yet"
    raise TrainingError(
        f"step {step}: {what}; training stopped and nothing of this step was kept ({kept}). "
        f"The learning rate was {lr:g}: try a lower train.lr, in a new output.dir"
    )


def _selection_summary(config: RunConfig, state: TrainState, validation_windows: int) -> dict:
    """What selection measured and chose: the step whose tensors the run writes."""
    if not config.train.select_every_steps:
        return {"enabled": False, "written_step": state.step}
    return {
        "enabled": True,
        "every_steps": config.train.select_every_steps,
        "metric": "mean over eval.served_steps of the decoder-replay mean accept length on the self-generated validation windows",
        "served_steps": list(config.eval.served_steps),
        "validation_windows": validation_windows,
        "history": state.selection,
        "donor_score": state.selection[0]["score"] if state.selection else None,
        "best_step": state.best_step,
        "best_score": state.best_score,
        "written_step": state.best_step,
        "seconds": state.selection_seconds,
    }


def _step_record(accelerator, state: TrainState, lr: float, loss, stats, grad_norm) -> dict:
    """One step's log line, summed over processes."""
    local = torch.tensor(
        [float(loss.detach())] + [v for s in stats for v in (s.scored, s.agree)],
        dtype=torch.float64,
        device=accelerator.device,
    )
    summed = accelerator.reduce(local, reduction="sum").cpu().tolist()
    record = {"step": state.step, "lr": lr, "loss": summed[0] / accelerator.num_processes}
    for k in range(len(stats)):
        scored, agree = summed[1 + 2 * k], summed[2 + 2 * k]
        record[f"scored_step{k + 1}"] = int(scored)
        record[f"agreement_step{k + 1}"] = agree / scored if scored else 0.0
    if grad_norm is not None:
        record["grad_norm"] = float(grad_norm)
    record["elapsed_seconds"] = state.elapsed_seconds
    return record


def _progress(accelerator, total: int, initial: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, disable=not accelerator.is_local_main_process, desc="train", unit="step")


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat(value, name + "."))
        else:
            out[name] = json.dumps(value) if isinstance(value, list) else value
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="train.py",
        description="Train the MTP head's fc and pre-fc norms against the frozen base (run with accelerate launch).",
    )
    parser.add_argument("--config", required=True, help="YAML run config, e.g. configs/512step.yaml")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in output.dir")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. train.lr=3e-4")
    args = parser.parse_intermixed_args(argv)  # flags and overrides in any order
    from occamy_mtp.config import load_config
    from occamy_mtp.data import DataError
    from occamy_mtp.selfgen import SelfGenError

    try:
        config = load_config(args.config, args.overrides)
        train(config, resume=args.resume)
    except (ConfigError, ckpt_io.CheckpointError, DataError, SelfGenError, TrainingError) as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
