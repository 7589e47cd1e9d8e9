"""The evaluate stage: donor and trained head on a run's heldout windows, written to evaluation.json.

    python -m occamy_mtp evaluate --config RUN.yaml --head runs/x/mtp-trained.safetensors

It opens the run (`run.open_run`), measures both heads (`evaluation.served`, `evaluation.offline`,
optionally `evaluation.decoder_check`), prints `evaluation.report`'s tables and writes the
report and its plot (docs/guide/EVALUATION.md).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import asdict
from pathlib import Path

from occamy_mtp.targets.base import SharedTargets

import torch

from occamy_mtp.console import plural
from occamy_mtp.config import ConfigError, Serving
from occamy_mtp.evaluation.decode import Runners, decodes_runners
from occamy_mtp.model.sharding import Sharding
from occamy_mtp.run import HELDOUT, check_inputs, log_stderr, open_run, refuse_inside_models
from occamy_mtp.settings import EvalPlan, Measuring, Plan
from occamy_mtp.evaluation.offline import SELF_GENERATED, TEACHER_FORCED, evaluate_head
from occamy_mtp.data.windows import think_close_ids
from occamy_mtp.evaluation.served import ceiling_report, ceilings, distinct_contexts, heldout_report
from occamy_mtp.evaluation.decoder_check import reference_decoder_check, sampled_decoder_check, sampled_decodes
from occamy_mtp.evaluation.report import format_decoder_checks, format_served, format_table


EVALUATION_FILE = "evaluation.json"


PLOT_FILE = "acceptance.png"


EVALUATION_FORMAT = 3  # 3: served figures per serving configuration


def evaluate_run(plan: Plan, head_path: Path, out: Path, device: torch.device, *, teacher_forced_only: bool = False,
                 reference_decoder: bool = False, max_windows: int | None = None, decoder_seeds: int = 4,
                 sharding: Sharding | None = None) -> tuple[dict, str]:
    """Donor (`model.donor_head`) and the head at `head_path` on the run's heldout windows; writes
    evaluation.json and the plot into `out`, returns the report and its printed table. `sharding`:
    the frozen base's placement (`model.sharding`)."""
    from occamy_mtp.model import checkpoint as ckpt_io

    setup, settings = plan.setup, plan.evaluate
    measuring = settings.measuring
    if reference_decoder and setup.data.target_cache:
        raise ConfigError("--reference-decoder decodes with the base, which data.target_cache leaves unloaded; unset it")
    penalized = [s.label() for s in measuring.servings if s.penalized]
    if reference_decoder and penalized:
        raise ConfigError(f"--reference-decoder samples without penalties, and eval.serving's {', '.join(penalized)} "
                          "set some; leave those out of eval.serving for the decoder check")
    if not setup.data.self_generated_dir:  # a text the run has not written goes under --out, not into the run
        setup = dataclasses.replace(setup, new_store_root=Path(out) / "self-generated")
    facts = check_inputs(setup)
    refuse_inside_models(setup.model, [("--out", out)])
    ckpt_io.check_head(head_path, facts.text_config)  # before the base loads (load_head checks it again)
    run = open_run(setup, device, base=facts, log=log_stderr, splits=(HELDOUT,), self_generated=not teacher_forced_only,
                   max_heldout=max_windows, sharding=sharding)
    run = dataclasses.replace(run, targets=SharedTargets(run.targets))  # one base pass (and p under each preset) over the texts for both heads
    return evaluate(run, settings, head_path, out, device, teacher_forced_only=teacher_forced_only,
                    reference_decoder=reference_decoder, decoder_seeds=decoder_seeds)


def evaluate(run, settings: EvalPlan, head_path: Path, out: Path, device: torch.device, *, teacher_forced_only: bool = False,
             reference_decoder: bool = False, decoder_seeds: int = 4) -> tuple[dict, str]:
    """Donor and the head at `head_path` on an opened run's heldout windows (`evaluate_run` opens it);
    writes evaluation.json and the plot into `out`, returns the report and its printed table."""
    from occamy_mtp.model import checkpoint as ckpt_io
    from occamy_mtp.files import write_json
    from occamy_mtp.evaluation.plot import plot_acceptance, plot_served

    measuring = settings.measuring
    dtype = ckpt_io.DTYPES[settings.dtype]
    donor = run.models.head
    for param in donor.parameters():  # as served: every tensor in the model dtype
        param.data = param.data.to(dtype)
    trained = ckpt_io.load_head(head_path, run.base_facts.text_config, donor.shared, dtype=dtype, device=device,
                                attn_implementation=settings.attn_implementation)[0]
    heads = {"donor": donor, "trained": trained}
    steps, served_steps, budget = measuring.draft_steps, measuring.served_steps, measuring.answer_tokens
    per_batch = measuring.windows_per_batch

    started = time.perf_counter()
    report = {
        "format": EVALUATION_FORMAT,
        "inputs": {"base": settings.inputs["base"], "head": str(head_path), "donor": settings.inputs["donor"],
                   "data": settings.inputs["data"], "dtype": settings.dtype, "device": str(device)},
        "dataset": {k: v for k, v in run.data.provenance().items() if k in ("files", "windows", "settings")},
        "heldout_windows_evaluated": len(run.windows.heldout_data),
        "plot": PLOT_FILE,
    }
    out.mkdir(parents=True, exist_ok=True)
    if teacher_forced_only:
        if not run.windows.heldout_data:
            raise ConfigError("--teacher-forced-only: no heldout window has a recorded answer (the data are prompts); "
                              "evaluate without it, on the base's own answers")
        results = {}
        for name, head in heads.items():
            log_stderr(f"evaluate: teacher-forced chains of the {name} head on {len(run.windows.heldout_data)} heldout "
                       f"{plural(len(run.windows.heldout_data), 'window')}")
            results[name] = evaluate_head(run.targets, head, run.windows.heldout_data, steps, per_batch).to_dict()
        report.update(text=TEACHER_FORCED, exact=False, draft_steps=steps, heads=results)
        plot_acceptance(results, out / PLOT_FILE, title="Drafts accepted at each step, on the recorded answers (teacher-forced, approximate)")
        printed = format_table(results)
    else:
        servings, selected = measuring.servings, measuring.selected.label()
        results = {}
        log_stderr("evaluate: the ceiling, a drafter of the base's own choices, under each serving configuration")
        perfect = ceilings(run.targets, donor, run.windows.heldout, servings, per_batch, max(served_steps),
                           think_close_ids(run.tokenizer))
        ceiling = ceiling_report(perfect, run.windows.heldout, servings, served_steps, budget)
        count = len(next(iter(run.windows.heldout.values())))
        for name, head in heads.items():
            log_stderr(f"evaluate: measuring the {name} head on {count} heldout {plural(count, 'window')} under "
                       f"{len(servings)} serving {plural(len(servings), 'configuration')}")
            results[name] = heldout_report(run.targets, head, run.windows.heldout, run.windows.heldout_data, servings,
                                           served_steps, steps, budget, per_batch, run.data.domains, perfect,
                                           think_close_ids(run.tokenizer))
        report.update(
            text=SELF_GENERATED, exact=True, headline="served", serving=[{"label": s.label(), **asdict(s)} for s in servings],
            selected_serving=selected, served_steps=list(served_steps), max_new_tokens=budget, heads=results, ceiling=ceiling,
            self_generated={"stores": run.windows.self_generated, "max_new_tokens": budget,
                            "stop_token_ids": sorted(run.stop_token_ids), "batch_size": settings.self_generate_batch_size},
        )
        plot_served({"serving": report["serving"], "served_steps": list(served_steps), "selected_serving": selected,
                     "heldout": results, "ceiling": ceiling}, out / PLOT_FILE)
        printed = format_served(results, servings, served_steps, budget, selected, ceiling)
        if reference_decoder:
            shared = decodes_runners(run.models.base, next(iter(heads.values())),
                                     [w.answer_start for s in servings for w in run.windows.heldout[s.label()]], budget, max(served_steps))
            runners = {name: shared.with_head(head) for name, head in heads.items()}  # one base runner, a head runner each
            report["reference_decoder"] = {
                name: {serving.label(): {str(k): _decoder_check(run, measuring, head, name, serving, k, range(decoder_seeds), runners[name])
                                         for k in served_steps}
                       for serving in servings}
                for name, head in heads.items()
            }
            printed += format_decoder_checks(report["reference_decoder"])
    report["eval_seconds"] = time.perf_counter() - started
    write_json(out / EVALUATION_FILE, report)
    return report, printed


def _decoder_check(run, measuring: Measuring, head, name: str, serving: Serving, draft_steps: int, seeds,
                   runners: Runners) -> dict:
    """The reference decoder on the run's heldout prompts under one serving configuration; under sampled
    serving, `name`d head's decodes draw from streams of their own (`sampled_decodes`)."""
    windows = distinct_contexts(run.windows.heldout[serving.label()])
    decodes = len(windows) * (1 if serving.greedy else len(seeds))
    log_stderr(f"evaluate: reference decoder, {serving.label()}, {draft_steps}-step drafts: {decodes} "
               f"{plural(decodes, 'decode')}")
    if serving.greedy:
        return reference_decoder_check(run.models.base, head, windows, draft_steps, measuring.answer_tokens,
                                       run.stop_token_ids, measuring.windows_per_batch, runners)
    started = time.perf_counter()
    decodes = sampled_decodes(run.models.base, head, windows, draft_steps, measuring.answer_tokens, run.stop_token_ids,
                              serving, seeds, runners, stream=f"{name}:{serving.label()}:{draft_steps}")
    check = sampled_decoder_check(run.models.base, head, decodes, draft_steps, measuring.answer_tokens, serving,
                                  measuring.windows_per_batch)
    return {**check, "windows": len(windows), "seeds": len(seeds), "seconds": time.perf_counter() - started}
