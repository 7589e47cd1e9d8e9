"""Export: the whole trained head as `mtp-trained.safetensors`, its config, metrics and TRAINING.json.

The file holds every `mtp.*` tensor in bf16, in the donor's expert layout unless
`output.expert_layout` says otherwise: the trained fp32 masters rounded to bf16, every
other tensor read back and checked bit-identical to the donor's. Donor and trained head
are measured side by side on the same heldout windows, led by what serving will see
(the decoder replay on the base's own text, per serving configuration of `eval.serving`:
greedy, or the decoder's expected counts under sampling; the greedy replay checked against
the reference decoder on `eval.decoder_check_windows` prompts). A head worse than the
donor under the selected configuration (`eval.select_serving`) is refused unless
`--allow-worse`. Outputs are written to temporaries and renamed together,
TRAINING.json last, with `.export-incomplete` beside them from the first rename to the
last: a kill in between leaves it, and every reader of the head refuses the directory
until an export completes (`checkpoint.check_export_set`, which also checks the head's
bytes against TRAINING.json). Temporaries of a killed export are removed by the next one.
"""

from __future__ import annotations

import dataclasses


import json
import time
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors import safe_open

from occamy_mtp.model import checkpoint as ckpt_io
from occamy_mtp.model.sharding import Sharding
from occamy_mtp import files
from occamy_mtp import record as rec
from occamy_mtp.config import Serving
from occamy_mtp.console import plural
from occamy_mtp.errors import OccamyError
from occamy_mtp.evaluation.decode import Runners, decodes_runners
from occamy_mtp.evaluation.served import ceiling_report, ceilings, heldout_report
from occamy_mtp.data.windows import think_close_ids
from occamy_mtp.evaluation.decoder_check import reference_decoder_check
from occamy_mtp.evaluation.report import format_served
from occamy_mtp.evaluation.plot import plot_served
from occamy_mtp.evaluation.metrics import NOISE_STANDARD_ERRORS, difference_noise
from occamy_mtp.targets.base import SharedTargets
from occamy_mtp.export.card import base_card_license, model_card, writes_root_card
from occamy_mtp.base.frozen import BaseFacts
from occamy_mtp.run import Run, check_run, log_stderr, open_run, output_lock
from occamy_mtp.settings import ExportPlan, Fingerprint, Measuring, Plan, RunDir

METRICS_FORMAT = 5  # 3: served figures per serving configuration; 4: the ceiling; 5: standard errors, figures by group
HEADLINE = (
    "served acceptance: the reference speculative decoder on the base's own continuation of each heldout prompt, "
    "written under each serving configuration (self-generated heldout windows; greedy: decoder replay; sampled: the "
    "decoder's expected counts given the text; exact)"
)
CRITERION = ("the trained head's mean accept length is not below the donor's at any served step count, under the selected "
             "serving configuration (headline figures)")


class ExportError(OccamyError, RuntimeError):
    """The trained tensors do not belong to this config, the written head failed its check, or it is worse than the donor."""


def read_trained_tensors(run_dir: RunDir, fingerprint: Fingerprint, summary: dict) -> dict[str, torch.Tensor]:
    """The trained fp32 masters, refused when another config trained them or when any is not finite."""
    path = run_dir.trained_tensors
    if not path.is_file():
        raise ExportError(f"{path}: no trained tensors; run train.py with this config first")
    with safe_open(str(path), framework="pt") as handle:
        changed = fingerprint.refusal((handle.metadata() or {}).get("config_fingerprint"),
                                      summary.get("fingerprinted_settings", {}))
        if changed is not None:
            raise ExportError(f"{path}: was trained with different model/data/train settings ({changed}); "
                              "export with the config it was trained with")
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


def compare_heads(heldout: dict, served_steps, allow_worse: bool, serving: str) -> dict:
    """Donor against trained on the headline under the serving configuration labelled `serving`:
    the mean accept length at each served step count, and whether the difference is within
    noise (`within_noise`: under NOISE_STANDARD_ERRORS standard errors of the difference)."""
    steps = {}
    for k in served_steps:
        donor, trained = (heldout[name]["serving"][serving]["served"][str(k)] for name in ("donor", "trained"))
        steps[str(k)] = {"donor": donor["mean_accept_length"], "trained": trained["mean_accept_length"],
                         "difference": trained["mean_accept_length"] - donor["mean_accept_length"],
                         **difference_noise(donor, trained)}
    not_worse = all(s["difference"] >= 0 for s in steps.values())
    return {"criterion": CRITERION, "serving": serving, "steps": steps, "trained_not_worse": not_worse,
            "allow_worse": allow_worse, "written": not_worse or allow_worse}


def _checked_windows(run: Run, measuring: Measuring) -> list:
    return run.windows.heldout.get("greedy", [])[: measuring.decoder_check_windows]


def decoder_runners(run: Run, measuring: Measuring) -> Runners | None:
    """The runners of every decoder check of an export (both heads: one module, the trained tensors
    swapped in; each served step count), so that their CUDA graphs are captured once; None where no check runs."""
    chosen = _checked_windows(run, measuring)
    if run.models.base is None or not chosen:
        return None
    return decodes_runners(run.models.base, run.models.head, [w.answer_start for w in chosen], measuring.answer_tokens,
                           max(measuring.served_steps))


def decoder_check(run: Run, measuring: Measuring, head, runners: Runners | None = None) -> dict:
    """The reference decoder on the first `eval.decoder_check_windows` heldout prompts of greedy serving,
    per served step count (the replay's counts must equal its own); `runners` from `decoder_runners`."""
    chosen = _checked_windows(run, measuring)
    out = {}
    for k in measuring.served_steps:
        check = reference_decoder_check(run.models.base, head, chosen, k, measuring.answer_tokens, run.stop_token_ids,
                                        measuring.windows_per_batch, runners)
        out[str(k)] = {
            "windows": check["windows"],
            "measured": check["measured"],
            "replayed": check["replayed"],
            "counts_equal": all(check["measured"][f] == check["replayed"][f] for f in ("proposed", "accepted", "drafted", "verify_passes")),
            "decisions": check["decisions"],
            "decisions_equal": check["decisions_equal"],
            "texts_equal_to_store": check["texts_equal"],
            "seconds": check["seconds"],
            "decode_seconds": check["decode_seconds"],
        }
    return out


def export(plan: Plan, allow_worse: bool = False, log=log_stderr, sharding: Sharding | None = None) -> dict:
    """Write the head, its config, heldout metrics, the plot and TRAINING.json into output.dir.
    The plan's models are local directories (the command line resolves Hub ids: `cli.parse`).
    `sharding`: the frozen base's placement (`model.sharding`; one process: on the card, or in
    host memory)."""
    base = check_run(plan.setup)
    with output_lock(plan.run_dir):
        return _export(plan, base, allow_worse, log, sharding)


def _export(plan: Plan, base: BaseFacts, allow_worse: bool, log, sharding: Sharding | None = None) -> dict:
    started = time.perf_counter()
    run_dir, settings = plan.run_dir, plan.export
    if not run_dir.train_summary.is_file():
        raise ExportError(f"{run_dir.train_summary}: missing; run train.py with this config first")
    summary = json.loads(run_dir.train_summary.read_text())
    masters = read_trained_tensors(run_dir, settings.fingerprint, summary)
    for path in run_dir.export_outputs():  # what a killed export left behind
        for stale in files.stale_temporaries(path):
            stale.unlink()

    run = open_run(plan.setup, torch.device("cuda" if torch.cuda.is_available() else "cpu"), base=base, log=log,
                   sharding=sharding)
    return export_run(run, settings, summary, masters, allow_worse, log, started)


def export_run(run: Run, settings: ExportPlan, summary: dict, masters: dict[str, torch.Tensor], allow_worse: bool, log,
               started: float) -> dict:
    """Measure the donor and the trained head (`masters`, train.py's tensors) on an opened run, refuse a
    head worse than the donor unless `allow_worse`, and write the export set; returns TRAINING.json's record."""
    run_dir, measuring = run.dir, settings.measuring
    run = dataclasses.replace(run, targets=SharedTargets(run.targets))  # one base pass (and p under each preset) over the texts for both heads
    head = run.models.head
    dtype = ckpt_io.DTYPES[settings.dtype]
    for param in head.parameters():  # evaluate as served: every tensor in the model dtype
        param.data = param.data.to(dtype)

    # The ceiling first (each head's breakdown sets its drafts beside it), then the donor, then the
    # same head with the trained tensors swapped in.
    eval_started = time.perf_counter()
    log("export: the ceiling, a drafter of the base's own choices, under each serving configuration")
    perfect = ceilings(run.targets, head, run.windows.heldout, measuring.servings, measuring.windows_per_batch,
                       max(measuring.served_steps), think_close_ids(run.tokenizer))
    ceiling = ceiling_report(perfect, run.windows.heldout, measuring.servings, measuring.served_steps, measuring.answer_tokens)
    runners = decoder_runners(run, measuring)
    donor_report, donor_check = _measure(run, measuring, head, "donor", log, runners, perfect)
    donor_state = {k: v.detach().to(torch.bfloat16).cpu() for k, v in head.state_dict().items()}
    max_rounding = _swap_in(head, masters, dtype)
    trained_report, trained_check = _measure(run, measuring, head, "trained", log, runners, perfect)
    eval_seconds = time.perf_counter() - eval_started

    heldout = {"donor": donor_report, "trained": trained_report}
    selected = measuring.selected.label()
    comparison = compare_heads(heldout, measuring.served_steps, allow_worse, selected)
    metrics = {
        "format": METRICS_FORMAT,
        "headline": HEADLINE,
        "serving": [{"label": s.label(), **asdict(s)} for s in measuring.servings],
        "selected_serving": selected,
        "served_steps": list(measuring.served_steps),
        "max_new_tokens": measuring.answer_tokens,
        "heldout": heldout,
        "ceiling": ceiling,
        "comparison": comparison,
        "decoder_check": {"donor": donor_check, "trained": trained_check},
    }
    if not comparison["written"]:
        raise ExportError(
            "the trained head is worse than the donor where serving runs it, so it was not written:\n"
            + format_metrics(metrics)
            + "\nchange the recipe (docs/guide/RECIPE.md), or pass --allow-worse to write it anyway"
        )

    layout = run.models.donor_layout if settings.expert_layout == "donor" else settings.expert_layout
    state = {k: v.detach().to(torch.bfloat16).cpu() for k, v in head.state_dict().items()}
    disk = ckpt_io.head_checkpoint_tensors(state, layout)
    donor_disk = _donor_disk(settings, layout, run.models.donor_layout, donor_state)
    # A fused expert tensor trained in the module is one tensor per expert on a per-expert disk.
    trained_disk = {key: disk[key] for key in ckpt_io.head_checkpoint_tensors({k: state[k] for k in masters}, layout)}
    head_config = head_config_json(run.base_facts.text_config, layout, list(trained_disk), disk)
    hash_cache = rec.load_hash_cache(run_dir.hash_cache)
    identities = {name: rec.checkpoint_identity(Path(path), hash_cache, log)
                  for name, path in (("base", settings.base), ("donor", settings.donor_head))}

    head_bytes = sum(t.numel() * t.element_size() for t in disk.values())
    root_card = writes_root_card(run_dir.card)
    if not root_card:
        log(f"export: {run_dir.card} is not a card occamy-mtp wrote, so it is left as it is; the card is "
            f"{run_dir.upload_card}")
    outputs = run_dir.export_outputs(root_card)
    run_dir.upload.mkdir(exist_ok=True)
    with files.atomic_paths(list(outputs), incomplete=run_dir.export_incomplete,
                            needed_bytes=head_bytes) as temporaries:
        tmp = dict(zip(outputs, temporaries))
        files.write_safetensors(tmp[run_dir.head], disk, metadata={"format": "pt", "producer": "occamy-mtp", "expert_layout": layout})
        check = verify_export(tmp[run_dir.head], donor_disk, trained_disk)
        tmp[run_dir.head_config].write_text(files.json_text(head_config))
        tmp[run_dir.metrics].write_text(files.json_text(metrics))
        plot_served(metrics, tmp[run_dir.plot], image_format="png")
        record = rec.training_record(
            settings.settings, identities, run.data.provenance(), summary, run.windows.self_generated, metrics,
            derived={"trainable_parameters": run.models.trainable_parameters, "head_parameters": run.models.head_parameters,
                     "trainable_tensors": sorted(trained_disk), "donor_layout": run.models.donor_layout, "export_layout": layout},
            export={**check, "replaced": sorted(trained_disk), "max_abs_rounding_error": max_rounding},
            seconds={"eval_seconds": eval_seconds, "export_seconds": time.perf_counter() - started},
            outputs={path.name: files.sha256_file(tmp[path]) for path in (run_dir.head, run_dir.head_config)},
        )
        errors = rec.validate_record(record)
        if errors:
            raise ExportError("TRAINING.json does not fit its schema:\n  " + "\n  ".join(errors))
        card = model_card(record, str(run_dir.root), base_card_license(settings.base))
        for path in (run_dir.card, run_dir.upload_card):
            if path in tmp:
                tmp[path].write_text(card)
        tmp[run_dir.record].write_text(files.json_text(record))
    for path in run_dir.published():
        files.link_beside(path, run_dir.upload / path.name)
    files.write_json(run_dir.hash_cache, hash_cache)
    return record


def _measure(run: Run, measuring: Measuring, head, name: str, log, runners: Runners | None, perfect: dict) -> tuple[dict, dict]:
    """One head's heldout report (its drafts beside the `perfect` drafter's, `served.ceilings`), and the
    reference decoder's check of it (when the base is loaded)."""
    windows, servings = run.windows, measuring.servings
    count = len(next(iter(windows.heldout.values())))
    log(f"export: measuring the {name} head on {count} heldout {plural(count, 'window')} under {len(servings)} "
        f"serving {plural(len(servings), 'configuration')}")
    report = heldout_report(run.targets, head, windows.heldout, windows.heldout_data, servings,
                            measuring.served_steps, measuring.draft_steps, measuring.answer_tokens,
                            measuring.windows_per_batch, run.data.domains, perfect, think_close_ids(run.tokenizer))
    reason = None
    if run.models.base is None:
        reason = "data.target_cache is set (no base loaded)"
    elif not measuring.decoder_check_windows:
        reason = "eval.decoder_check_windows is 0"
    elif "greedy" not in windows.heldout:
        reason = "no greedy serving configuration in eval.serving (the check compares the decoder's counts with the greedy replay)"
    if reason is not None:
        return report, {"skipped": reason}
    checked = min(count, measuring.decoder_check_windows)
    log(f"export: reference decoder on {checked} heldout {plural(checked, 'prompt')} ({name})")
    return report, decoder_check(run, measuring, head, runners)


def _swap_in(head, masters: dict[str, torch.Tensor], dtype: torch.dtype) -> float:
    """Put the trained masters, rounded to bf16 as the file stores them, into `head`; returns the largest rounding."""
    params = dict(head.named_parameters())
    for name, master in masters.items():  # every tensor checked before any is put in
        if name not in params:
            raise ExportError(f"trained-tensors.safetensors: tensor {name!r} is not a head parameter")
        if master.shape != params[name].shape:
            raise ExportError(f"trained-tensors.safetensors: tensor {name!r} has shape {tuple(master.shape)}, "
                              f"the head's is {tuple(params[name].shape)}")
    max_rounding = 0.0
    for name, master in masters.items():
        rounded = master.to(torch.bfloat16)
        max_rounding = max(max_rounding, float((rounded.float() - master.float()).abs().max()))
        params[name].data.copy_(rounded)  # in place: the decoder's captured graphs read the head's tensors where they are
    return max_rounding


def _donor_disk(settings: ExportPlan, layout: str, donor_layout: str, donor_state: dict) -> dict[str, torch.Tensor]:
    """The donor's tensors in the export's layout: its own bytes on disk when the layout is the donor's."""
    if layout == donor_layout:
        donor_ckpt = ckpt_io.SafetensorsCheckpoint(Path(settings.donor_head))
        return {k: donor_ckpt.get(k) for k in ckpt_io.head_disk_keys(donor_ckpt)}
    return ckpt_io.head_checkpoint_tensors(donor_state, layout)


def format_metrics(metrics: dict) -> str:
    """Donor beside trained (`report.format_served`), the verdict, and the reference decoder's checks."""
    servings = [Serving(**{k: v for k, v in s.items() if k != "label"}) for s in metrics["serving"]]
    lines = [format_served(metrics["heldout"], servings, metrics["served_steps"], metrics["max_new_tokens"],
                           metrics["selected_serving"], metrics["ceiling"])]
    comparison = metrics["comparison"]
    verdict = "not worse than the donor" if comparison["trained_not_worse"] else "WORSE than the donor"
    noise = [k for k, step in comparison["steps"].items() if step.get("within_noise")]
    within = (f"; within noise at {', '.join(noise)} {plural(len(noise), 'step')} (the difference is under "
              f"{NOISE_STANDARD_ERRORS:g} standard errors)") if noise else ""
    lines.append(f"trained head: {verdict} under {metrics['selected_serving']} ({comparison['criterion']}){within}")
    for name, checks in metrics["decoder_check"].items():
        if "skipped" in checks:
            lines.append(f"reference decoder check ({name}): skipped, {checks['skipped']}")
            continue
        for k, c in checks.items():
            lines.append(f"reference decoder check ({name}, {k}-step): {c['windows']} prompts, counts "
                         f"{'equal' if c['counts_equal'] else 'DIFFER'}, {c['decisions_equal']}/{c['decisions']} decisions equal, "
                         f"{c['texts_equal_to_store']}/{c['windows']} texts equal to the stored continuations")
    return "\n".join(lines)
