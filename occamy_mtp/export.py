"""Export: the whole trained head as `mtp-trained.safetensors`, its config, metrics and TRAINING.json.

The exported file holds every `mtp.*` tensor in bf16 and in the donor's expert layout
(unless `output.expert_layout` says otherwise). The trained tensors are the fp32
masters rounded to bf16 (round-to-nearest-even, as `Tensor.to` does); every other
tensor is read back from the written file and checked to be bit-identical to the
donor's, and the check is part of the record.

What the metrics lead with. Donor and trained head are measured on the same heldout
windows with the same code, side by side. The headline is what serving will see: the
reference speculative decoder's per-step acceptance and accept length on the base's
own greedy text (the self-generated heldout windows, `occamy_mtp.selfgen`), at each of
`eval.served_steps`, computed exactly by the decoder replay
(`evaluate.served_acceptance`) and checked against the decoder itself on the first
`eval.decoder_check_windows` prompts. Teacher-forced agreement, NLL and chained
acceptance on the recorded answers follow as secondary figures; their acceptance is an
approximation, which has pointed the wrong way before (bench/RESULTS.md).

A head worse than the donor on the headline (a lower mean accept length at any served
step count) is refused: nothing is written and the exit status is non-zero, unless
`--allow-worse` is given; TRAINING.json records the comparison either way.

All outputs are written to temporaries first and renamed together at the end,
TRAINING.json last, so that a kill never leaves a half-written file, a stale plot or a
record whose hash does not match the head beside it; temporaries of a killed export
are removed when the next one starts.
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
from occamy_mtp.config import ConfigError, RunConfig, differing_settings, load_config
from occamy_mtp.evaluate import PLOT_FILE, heldout_report, reference_decoder_check
from occamy_mtp.plot import plot_acceptance
from occamy_mtp.run_setup import (
    RunWindows,
    check_run,
    check_split,
    load_tokenizer,
    log_stderr,
    open_store,
    output_lock,
    prepare_data,
    run_windows,
    stop_token_ids,
)
from occamy_mtp.selfgen import SelfGenError
from occamy_mtp.train import TRAIN_SUMMARY, TRAINED_TENSORS, build_models

HEAD_FILE = ckpt_io.HEAD_FILE
HEAD_CONFIG_FILE = "mtp_head_config.json"
METRICS_FILE = "metrics.json"
RECORD_FILE = "TRAINING.json"
HASH_CACHE_FILE = ".file-hashes.json"
METRICS_FORMAT = 2
OUTPUT_FILES = (HEAD_FILE, HEAD_CONFIG_FILE, METRICS_FILE, PLOT_FILE, RECORD_FILE)  # renamed in this order
_LOSS_WINDOW_STEPS = 16  # steps summarised at each end of the loss curve in TRAINING.json
HEADLINE = (
    "served acceptance: the reference speculative decoder on the base's own greedy continuation of each heldout "
    "prompt (self-generated heldout windows; decoder replay, exact)"
)
CRITERION = "the trained head's mean accept length is not below the donor's at any served step count (headline figures)"


class ExportError(RuntimeError):
    """The trained tensors do not belong to this config, the written head failed its check, or it is worse than the donor."""


def read_trained_tensors(output_dir: Path, config: RunConfig, summary: dict) -> dict[str, torch.Tensor]:
    """The trained fp32 masters, refused when another config trained them or when any is not finite."""
    path = output_dir / TRAINED_TENSORS
    if not path.is_file():
        raise ExportError(f"{path}: no trained tensors; run train.py with this config first")
    with safe_open(str(path), framework="pt") as handle:
        found = (handle.metadata() or {}).get("config_fingerprint")
        if found != config.fingerprint():
            changed = differing_settings(summary.get("fingerprinted_settings", {}), config.fingerprinted())
            raise ExportError(
                f"{path}: was trained with different model/data/train settings ({'; '.join(changed) or 'unknown'}); "
                "export with the config it was trained with"
            )
        tensors = {k: handle.get_tensor(k) for k in handle.keys()}
    for name, tensor in tensors.items():
        if not bool(torch.isfinite(tensor).all()):
            raise ExportError(f"{path}: tensor {name} holds {int((~torch.isfinite(tensor)).sum())} non-finite values; "
                              "nothing was exported (train again, e.g. with a lower train.lr)")
    return tensors


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


def compare_heads(heldout: dict, served_steps, allow_worse: bool) -> dict:
    """Donor against trained on the headline: the mean accept length at each served step count."""
    steps = {}
    for k in served_steps:
        donor = heldout["donor"]["served"][str(k)]["mean_accept_length"]
        trained = heldout["trained"]["served"][str(k)]["mean_accept_length"]
        steps[str(k)] = {"donor": donor, "trained": trained, "difference": trained - donor}
    not_worse = all(s["difference"] >= 0 for s in steps.values())
    return {"criterion": CRITERION, "steps": steps, "trained_not_worse": not_worse, "allow_worse": allow_worse,
            "written": not_worse or allow_worse}


def decoder_check(base, head, windows: RunWindows, config: RunConfig, stop: set[int]) -> dict:
    """The reference decoder on the first `eval.decoder_check_windows` heldout prompts, per served step count."""
    chosen = windows.heldout[: config.eval.decoder_check_windows]
    out = {}
    for k in config.eval.served_steps:
        check = reference_decoder_check(base, head, chosen, k, config.data.answer_tokens, stop, config.eval.windows_per_batch)
        out[str(k)] = {
            "windows": check["windows"],
            "measured": check["measured"],
            "replayed": check["replayed"],
            "counts_equal": all(check["measured"][f] == check["replayed"][f] for f in ("proposed", "accepted", "drafted", "verify_passes")),
            "decisions": check["decisions"],
            "decisions_equal": check["decisions_equal"],
            "texts_equal_to_store": check["texts_equal"],
            "seconds": check["seconds"],
        }
    return out


def export(config: RunConfig, allow_worse: bool = False, log=log_stderr) -> dict:
    """Write the head, its config, heldout metrics, the plot and TRAINING.json into output.dir."""
    check_run(config)
    with output_lock(config):
        return _export(config, allow_worse, log)


def _export(config: RunConfig, allow_worse: bool, log) -> dict:
    started = time.perf_counter()
    output_dir = Path(config.output.dir)
    summary_path = output_dir / TRAIN_SUMMARY
    if not summary_path.is_file():
        raise ExportError(f"{summary_path}: missing; run train.py with this config first")
    summary = json.loads(summary_path.read_text())
    masters = read_trained_tensors(output_dir, config, summary)
    for name in OUTPUT_FILES:  # what a killed export left behind
        for stale in ckpt_io.stale_temporaries(output_dir / name):
            stale.unlink()

    tokenizer = load_tokenizer(config)
    data = prepare_data(config, tokenizer, log=log)
    check_split(config, data)
    store = open_store(config, tokenizer)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cached = bool(config.data.target_cache)
    models = build_models(config, device, with_base=not cached, log=log)
    head = models.head
    windows = run_windows(config, data, store, models.base, log=log)
    # The frozen base's targets: read from the offline cache when there is one.
    targets = open_targets(config.data.target_cache, config.model.base, windows.all(), data.settings, config.model.dtype,
                           config.model.attn_implementation, base=models.base)
    dtype = ckpt_io.DTYPES[config.model.dtype]
    for param in head.parameters():  # evaluate as served: every tensor in the model dtype
        param.data = param.data.to(dtype)
    stop = stop_token_ids(config, tokenizer)

    def measure(name: str) -> tuple[dict, dict]:
        log(f"export: measuring the {name} head on {len(windows.heldout)} heldout windows")
        report = heldout_report(targets, head, windows.heldout, windows.heldout_data, config.eval.served_steps,
                                config.eval.draft_steps, config.data.answer_tokens, config.eval.windows_per_batch)
        if models.base is None or not config.eval.decoder_check_windows:
            reason = "data.target_cache is set (no base loaded)" if models.base is None else "eval.decoder_check_windows is 0"
            return report, {"skipped": reason}
        log(f"export: reference decoder on {min(len(windows.heldout), config.eval.decoder_check_windows)} heldout prompts ({name})")
        return report, decoder_check(models.base, head, windows, config, stop)

    # Donor first, then the same head with the trained tensors swapped in.
    eval_started = time.perf_counter()
    donor_report, donor_check = measure("donor")
    donor_state = {k: v.detach().to(torch.bfloat16).cpu() for k, v in head.state_dict().items()}
    params = dict(head.named_parameters())
    max_rounding = 0.0
    for name, master in masters.items():
        if name not in params:
            raise ExportError(f"{TRAINED_TENSORS}: tensor {name!r} is not a head parameter")
        rounded = master.to(torch.bfloat16)
        max_rounding = max(max_rounding, float((rounded.float() - master.float()).abs().max()))
        params[name].data = rounded.to(device=params[name].device, dtype=dtype)
    trained_report, trained_check = measure("trained")
    eval_seconds = time.perf_counter() - eval_started

    heldout = {"donor": donor_report, "trained": trained_report}
    comparison = compare_heads(heldout, config.eval.served_steps, allow_worse)
    metrics = {
        "format": METRICS_FORMAT,
        "headline": HEADLINE,
        "served_steps": list(config.eval.served_steps),
        "max_new_tokens": config.data.answer_tokens,
        "heldout": heldout,
        "comparison": comparison,
        "decoder_check": {"donor": donor_check, "trained": trained_check},
    }
    if not comparison["written"]:
        raise ExportError(
            "the trained head is worse than the donor where serving runs it, so it was not written:\n"
            + format_metrics(metrics)
            + "\nchange the recipe (see README: the recipe), or pass --allow-worse to write it anyway"
        )

    layout = models.donor_layout if config.output.expert_layout == "donor" else config.output.expert_layout
    trained_state = {k: v.detach().to(torch.bfloat16).cpu() for k, v in head.state_dict().items()}
    disk = ckpt_io.head_checkpoint_tensors(trained_state, layout)
    if layout == models.donor_layout:  # compare against the donor's own bytes on disk
        donor_ckpt = ckpt_io.SafetensorsCheckpoint(Path(config.model.donor_head))
        donor_disk = {k: donor_ckpt.get(k) for k in ckpt_io.head_disk_keys(donor_ckpt)}
    else:
        donor_disk = ckpt_io.head_checkpoint_tensors(donor_state, layout)
    trained_disk = {ckpt_io.HEAD_PREFIX + k: disk[ckpt_io.HEAD_PREFIX + k] for k in masters}
    base_text_config = ckpt_io.read_config(config.model.base).text_config
    head_config = head_config_json(base_text_config, layout, list(trained_disk), disk)
    hash_cache_path = output_dir / HASH_CACHE_FILE
    hash_cache = rec.load_hash_cache(hash_cache_path)
    identities = {
        "base": rec.checkpoint_identity(Path(config.model.base), hash_cache, log),
        "donor": rec.checkpoint_identity(Path(config.model.donor_head), hash_cache, log),
    }
    largest = max(config.eval.served_steps)

    with ckpt_io.atomic_paths([output_dir / name for name in OUTPUT_FILES]) as temporaries:
        tmp = dict(zip(OUTPUT_FILES, temporaries))
        ckpt_io.write_safetensors(tmp[HEAD_FILE], disk, metadata={"format": "pt", "producer": "occamy-mtp", "expert_layout": layout})
        check = verify_export(tmp[HEAD_FILE], donor_disk, trained_disk)
        tmp[HEAD_CONFIG_FILE].write_text(ckpt_io.json_text(head_config))
        tmp[METRICS_FILE].write_text(ckpt_io.json_text(metrics))
        plot_acceptance(
            {name: heldout[name]["served"][str(largest)] for name in heldout}, tmp[PLOT_FILE],
            title=f"served acceptance, {largest}-step drafts (self-generated heldout, exact)", image_format="png",
        )
        losses = [h["loss"] for h in summary["history"]]
        record = {
            "format": rec.RECORD_FORMAT,
            "library": rec.library_identity(),
            "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            **identities,
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
                "train_windows": summary["train_windows"],
            },
            "packages": rec.package_versions(),
            "hardware": rec.hardware(summary["processes"]),
            "timings": {
                "train_seconds": summary["train_seconds"],
                "base_forward_seconds": summary["base_forward_seconds"],
                # the continuations are usually written by train.py; export writes any it lacks
                "self_generation_seconds": summary["self_generated"]["generation_seconds"]
                + windows.self_generated["generation_seconds"],
                "eval_seconds": eval_seconds,
                "export_seconds": time.perf_counter() - started,
            },
            "training": {
                "final_loss": summary["final_loss"],
                "loss_first_steps": losses[:_LOSS_WINDOW_STEPS],
                "loss_last_steps": losses[-_LOSS_WINDOW_STEPS:],
                "selection": summary["selection"],
            },
            "self_generated": windows.self_generated,
            "metrics": metrics,
            "export": {**check, "replaced": sorted(trained_disk), "max_abs_rounding_error": max_rounding},
            "outputs": {
                HEAD_FILE: rec.sha256_file(tmp[HEAD_FILE]),
                HEAD_CONFIG_FILE: rec.sha256_file(tmp[HEAD_CONFIG_FILE]),
            },
        }
        errors = rec.validate_record(record)
        if errors:
            raise ExportError("TRAINING.json does not fit its schema:\n  " + "\n  ".join(errors))
        tmp[RECORD_FILE].write_text(ckpt_io.json_text(record))
    ckpt_io.write_json(hash_cache_path, hash_cache)
    return record


def format_metrics(metrics: dict) -> str:
    """Donor beside trained: the headline (served acceptance) first, then the secondary figures."""
    donor, trained = metrics["heldout"]["donor"], metrics["heldout"]["trained"]
    first = donor["served"][str(metrics["served_steps"][0])]
    lines = [f"headline: {metrics['headline']}", f"  {first['texts']} heldout prompts, <= {metrics['max_new_tokens']} new tokens each",
             f"  {'':<40} {'donor':>16} {'trained':>16}"]
    for k in metrics["served_steps"]:
        a, b = donor["served"][str(k)], trained["served"][str(k)]
        for j in range(k):
            label = f"{k}-step drafts: step {j + 1} acceptance"
            lines.append(f"  {label:<40} {a['acceptance'][j]:>16.2%} {b['acceptance'][j]:>16.2%}")
        for label, field in (("mean accept length", "mean_accept_length"), ("tokens per verify pass", "tokens_per_verify_pass")):
            lines.append(f"  {f'{k}-step drafts: {label}':<40} {a[field]:>16.3f} {b[field]:>16.3f}")
    verdict = "not worse than the donor" if metrics["comparison"]["trained_not_worse"] else "WORSE than the donor"
    lines.append(f"  trained head: {verdict} ({metrics['comparison']['criterion']})")
    tf_d, tf_t = donor["teacher_forced"], trained["teacher_forced"]
    sg_d, sg_t = donor["self_generated"], trained["self_generated"]
    lines.append("secondary: teacher-forced on the recorded answers (approximate), and every anchor of the self-generated text")
    rows = [
        ("target top-1 agreement (recorded)", f"{tf_d['agreement']:.2%}", f"{tf_t['agreement']:.2%}"),
        ("data-answer NLL (recorded)", f"{tf_d['data_nll']:.4f}", f"{tf_t['data_nll']:.4f}"),
        ("accept length, approximate", f"{tf_d['mean_accept_length']:.3f}", f"{tf_t['mean_accept_length']:.3f}"),
        ("accept length, every anchor", f"{sg_d['mean_accept_length']:.3f}", f"{sg_t['mean_accept_length']:.3f}"),
    ]
    lines += [f"  {name:<40} {a:>16} {b:>16}" for name, a, b in rows]
    for name, checks in metrics["decoder_check"].items():
        if "skipped" in checks:
            lines.append(f"reference decoder check ({name}): skipped, {checks['skipped']}")
            continue
        for k, c in checks.items():
            lines.append(f"reference decoder check ({name}, {k}-step): {c['windows']} prompts, counts "
                         f"{'equal' if c['counts_equal'] else 'DIFFER'}, {c['decisions_equal']}/{c['decisions']} decisions equal, "
                         f"{c['texts_equal_to_store']}/{c['windows']} texts equal to the stored continuations")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="export.py", description="Export the trained MTP head, its metrics and TRAINING.json.")
    parser.add_argument("--config", required=True, help="the YAML run config the head was trained with")
    parser.add_argument("--allow-worse", action="store_true",
                        help="write the head even when it is worse than the donor on the headline figures (recorded in TRAINING.json)")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides (the same as for training)")
    args = parser.parse_intermixed_args(argv)  # flags and overrides in any order
    from occamy_mtp.data import DataError

    try:
        config = load_config(args.config, args.overrides)
        record = export(config, allow_worse=args.allow_worse)
    except (ConfigError, ckpt_io.CheckpointError, ExportError, DataError, SelfGenError) as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    print(format_metrics(record["metrics"]))
    if not record["metrics"]["comparison"]["trained_not_worse"]:
        print("warning: the trained head is worse than the donor; written because --allow-worse was given", file=sys.stderr)
    print(f"wrote {Path(config.output.dir) / HEAD_FILE} and {RECORD_FILE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
