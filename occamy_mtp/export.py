"""Export: the whole trained head as `mtp-trained.safetensors`, its config, metrics and TRAINING.json.

The exported file holds every `mtp.*` tensor in bf16 and in the donor's expert layout
(unless `output.expert_layout` says otherwise). The trained tensors are the fp32
masters rounded to bf16 (round-to-nearest-even, as `Tensor.to` does); every other
tensor is read back from the written file and checked to be bit-identical to the
donor's, and the check is part of the record. Donor and trained head are evaluated on
the heldout windows with the same code, side by side.
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from safetensors import safe_open

from occamy_mtp import checkpoint as ckpt_io
from occamy_mtp import record as rec
from occamy_mtp.cache import open_targets
from occamy_mtp.config import ConfigError, RunConfig, load_config
from occamy_mtp.evaluate import PLOT_FILE, TEACHER_FORCED, evaluate_head
from occamy_mtp.plot import plot_acceptance
from occamy_mtp.train import (
    DTYPES,
    TRAIN_SUMMARY,
    TRAINED_TENSORS,
    build_models,
    load_tokenizer,
    prepare_data,
)

HEAD_FILE = "mtp-trained.safetensors"
HEAD_CONFIG_FILE = "mtp_head_config.json"
METRICS_FILE = "metrics.json"
RECORD_FILE = "TRAINING.json"
HASH_CACHE_FILE = ".file-hashes.json"
_LOSS_WINDOW_STEPS = 16  # steps summarised at each end of the loss curve in TRAINING.json


class ExportError(RuntimeError):
    """The trained tensors do not belong to this config, or the written head failed its check."""


def read_trained_tensors(output_dir: Path, fingerprint: str) -> dict[str, torch.Tensor]:
    path = output_dir / TRAINED_TENSORS
    if not path.is_file():
        raise ExportError(f"{path}: no trained tensors; run train.py with this config first")
    with safe_open(str(path), framework="pt") as handle:
        found = (handle.metadata() or {}).get("config_fingerprint")
        if found != fingerprint:
            raise ExportError(
                f"{path}: was trained with different model/data/train settings (fingerprint {found}, "
                f"this config {fingerprint}); export with the config it was trained with"
            )
        return {k: handle.get_tensor(k) for k in handle.keys()}


def head_config_json(text_config, layout: str, trained: list[str], tensors: dict[str, torch.Tensor]) -> dict:
    """What a reader needs to rebuild the head: the text config, layout and tensor table."""
    return {
        "format": 1,
        "model_type": text_config.model_type,
        "text_config": {k: v for k, v in text_config.to_dict().items() if k not in ("transformers_version", "_name_or_path")},
        "expert_layout": layout,
        "dtype": "bfloat16",
        "prefix": ckpt_io.HEAD_PREFIX,
        "shares_with_base": ["model.embed_tokens.weight", "lm_head.weight"],
        "trained_tensors": sorted(trained),
        "tensors": {k: list(v.shape) for k, v in sorted(tensors.items())},
    }


def verify_export(path: Path, donor: dict[str, torch.Tensor], trained_disk: dict[str, torch.Tensor]) -> dict:
    """Re-read the written head: trained tensors equal the rounded masters, the rest equal the donor's bits."""
    with safe_open(str(path), framework="pt") as handle:
        written = {k: handle.get_tensor(k) for k in handle.keys()}
    if set(written) != set(donor):
        missing, extra = sorted(set(donor) - set(written)), sorted(set(written) - set(donor))
        raise ExportError(f"{path}: tensor set differs from the donor's (missing {missing[:3]}, extra {extra[:3]})")
    identical = 0
    for key, tensor in written.items():
        if tensor.dtype != torch.bfloat16:
            raise ExportError(f"{path}: {key} is {tensor.dtype}, expected bfloat16")
        if key in trained_disk:
            if not torch.equal(tensor, trained_disk[key]):
                raise ExportError(f"{path}: trained tensor {key} was not written as computed")
        elif torch.equal(tensor.view(torch.int16), donor[key].to(torch.bfloat16).view(torch.int16)):
            identical += 1
        else:
            raise ExportError(f"{path}: {key} is not trained but differs from the donor")
    return {"tensors": len(written), "bit_identical_to_donor": identical}


def export(config: RunConfig) -> dict:
    """Write the head, its config, heldout metrics and TRAINING.json into output.dir."""
    started = time.perf_counter()
    output_dir = Path(config.output.dir)
    summary_path = output_dir / TRAIN_SUMMARY
    if not summary_path.is_file():
        raise ExportError(f"{summary_path}: missing; run train.py with this config first")
    summary = json.loads(summary_path.read_text())
    fingerprint = config.fingerprint()
    masters = read_trained_tensors(output_dir, fingerprint)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cached = bool(config.data.target_cache)
    models = build_models(config, device, with_base=not cached)
    head = models.head
    data = prepare_data(config, load_tokenizer(config))
    if not data.heldout:
        raise ExportError(
            "data: no heldout windows were built, so the head cannot be measured; "
            "check data.files and data.heldout_conversations (see `python -m occamy_mtp.data`)"
        )
    # The frozen base's targets: read from the offline cache when there is one.
    base = (
        open_targets(config.data.target_cache, config.model.base, data, config.model.dtype, config.model.attn_implementation)
        if cached
        else models.base
    )
    dtype = DTYPES[config.model.dtype]
    for param in head.parameters():  # evaluate as served: every tensor in the model dtype
        param.data = param.data.to(dtype)

    # Donor first, then the same head with the trained tensors swapped in.
    eval_started = time.perf_counter()
    donor_metrics = evaluate_head(base, head, data.heldout, config.eval.draft_steps, config.eval.windows_per_batch, TEACHER_FORCED)
    donor_state = {k: v.detach().to(torch.bfloat16).cpu() for k, v in head.state_dict().items()}
    params = dict(head.named_parameters())
    max_rounding = 0.0
    for name, master in masters.items():
        if name not in params:
            raise ExportError(f"{TRAINED_TENSORS}: tensor {name!r} is not a head parameter")
        rounded = master.to(torch.bfloat16)
        max_rounding = max(max_rounding, float((rounded.float() - master.float()).abs().max()))
        params[name].data = rounded.to(device=params[name].device, dtype=dtype)
    trained_metrics = evaluate_head(base, head, data.heldout, config.eval.draft_steps, config.eval.windows_per_batch, TEACHER_FORCED)
    eval_seconds = time.perf_counter() - eval_started

    layout = models.donor_layout if config.output.expert_layout == "donor" else config.output.expert_layout
    trained_state = {k: v.detach().to(torch.bfloat16).cpu() for k, v in head.state_dict().items()}
    disk = ckpt_io.head_checkpoint_tensors(trained_state, layout)
    if layout == models.donor_layout:  # compare against the donor's own bytes on disk
        donor_ckpt = ckpt_io.SafetensorsCheckpoint(Path(config.model.donor_head))
        donor_disk = {k: donor_ckpt.get(k) for k in ckpt_io.head_disk_keys(donor_ckpt)}
    else:
        donor_disk = ckpt_io.head_checkpoint_tensors(donor_state, layout)
    trained_disk = {ckpt_io.HEAD_PREFIX + k: disk[ckpt_io.HEAD_PREFIX + k] for k in masters}
    head_path = output_dir / HEAD_FILE
    ckpt_io.save_safetensors(head_path, disk, metadata={"format": "pt", "producer": "occamy-mtp", "expert_layout": layout})
    check = verify_export(head_path, donor_disk, trained_disk)
    base_text_config = ckpt_io.read_config(config.model.base).text_config
    ckpt_io.write_json(output_dir / HEAD_CONFIG_FILE, head_config_json(base_text_config, layout, list(trained_disk), disk))

    metrics = {"heldout": {"donor": donor_metrics.to_dict(), "trained": trained_metrics.to_dict()}}
    ckpt_io.write_json(output_dir / METRICS_FILE, metrics)
    plot_acceptance(metrics["heldout"], output_dir / PLOT_FILE, title="heldout chained acceptance (teacher-forced, approximate)")

    hash_cache_path = output_dir / HASH_CACHE_FILE
    hash_cache = rec.load_hash_cache(hash_cache_path)
    losses = [h["loss"] for h in summary["history"]]
    record = {
        "format": rec.RECORD_FORMAT,
        "library": rec.library_identity(),
        "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "base": rec.checkpoint_identity(Path(config.model.base), hash_cache),
        "donor": rec.checkpoint_identity(Path(config.model.donor_head), hash_cache),
        "dataset": data.provenance(),
        "settings": config.to_dict(),
        "derived": {
            "total_steps": summary["steps"],
            "steps_per_epoch": summary["steps_per_epoch"],
            "trainable_parameters": models.trainable_parameters,
            "head_parameters": models.head_parameters,
            "trainable_tensors": sorted(trained_disk),
            "donor_layout": models.donor_layout,
            "export_layout": layout,
        },
        "packages": rec.package_versions(),
        "hardware": rec.hardware(summary["processes"]),
        "timings": {
            "train_seconds": summary["train_seconds"],
            "base_forward_seconds": summary["base_forward_seconds"],
            "eval_seconds": eval_seconds,
            "export_seconds": time.perf_counter() - started,
        },
        "training": {
            "final_loss": summary["final_loss"],
            "loss_first_steps": losses[:_LOSS_WINDOW_STEPS],
            "loss_last_steps": losses[-_LOSS_WINDOW_STEPS:],
        },
        "metrics": metrics,
        "export": {**check, "replaced": sorted(trained_disk), "max_abs_rounding_error": max_rounding},
        "outputs": {
            HEAD_FILE: rec.sha256_file(head_path),
            HEAD_CONFIG_FILE: rec.sha256_file(output_dir / HEAD_CONFIG_FILE),
        },
    }
    errors = rec.validate_record(record)
    if errors:
        raise ExportError("TRAINING.json does not fit its schema:\n  " + "\n  ".join(errors))
    ckpt_io.write_json(output_dir / RECORD_FILE, record)
    ckpt_io.write_json(hash_cache_path, hash_cache)
    return record


def format_metrics(metrics: dict) -> str:
    """A small side-by-side table of donor vs trained heldout metrics."""
    donor, trained = metrics["heldout"]["donor"], metrics["heldout"]["trained"]
    rows = [
        ("target top-1 agreement", f"{donor['agreement']:.2%}", f"{trained['agreement']:.2%}"),
        ("data-answer NLL", f"{donor['data_nll']:.4f}", f"{trained['data_nll']:.4f}"),
    ]
    for k in range(donor["draft_steps"]):
        rows.append((f"chained acceptance step {k + 1}", f"{donor['acceptance'][k]:.2%}", f"{trained['acceptance'][k]:.2%}"))
    rows.append(("mean accept length", f"{donor['mean_accept_length']:.3f}", f"{trained['mean_accept_length']:.3f}"))
    rows.append(("accept rate", f"{donor['accept_rate']:.2%}", f"{trained['accept_rate']:.2%}"))
    kind = "exact" if donor["exact"] else "approximate (teacher-forced data)"
    lines = [f"heldout: {donor['windows']} windows, {donor['scored_positions']} scored positions; acceptance is {kind}"]
    lines.append(f"{'metric':<28} {'donor':>10} {'trained':>10}")
    lines += [f"{name:<28} {a:>10} {b:>10}" for name, a, b in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="export.py", description="Export the trained MTP head, its metrics and TRAINING.json.")
    parser.add_argument("--config", required=True, help="the YAML run config the head was trained with")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides (the same as for training)")
    args = parser.parse_args(argv)
    from occamy_mtp.data import DataError

    try:
        config = load_config(args.config, args.overrides)
        record = export(config)
    except (ConfigError, ckpt_io.CheckpointError, ExportError, DataError) as err:
        print(f"error: {err}", flush=True)
        return 2
    print(format_metrics(record["metrics"]))
    print(f"wrote {Path(config.output.dir) / HEAD_FILE} and {RECORD_FILE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
