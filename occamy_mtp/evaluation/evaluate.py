"""Offline evaluation of a head against the frozen base (docs/CONTRACT.md section 4).

docs/EVALUATION.md sets out the details.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from occamy_mtp.cli import command, parse
from occamy_mtp.cli import parser as command_line
from occamy_mtp.config import ConfigError, RunConfig
from occamy_mtp.model.loss import IGNORE, chain_batch, collate
from occamy_mtp.run import HELDOUT, RunDir, log_stderr, open_run
from occamy_mtp.evaluation.metrics import Acceptance, acceptance_from_counts, acceptance_summary, decoder_rounds, replayed_acceptance
from occamy_mtp.targets.base import DEFAULT_LOGITS_CHUNK_TOKENS, base_outputs, chunked_greedy

TEACHER_FORCED = "teacher_forced"
SELF_GENERATED = "self_generated"
EVALUATION_FILE = "evaluation.json"
PLOT_FILE = "acceptance.png"
EVALUATION_FORMAT = 2


@dataclass(frozen=True)
class Metrics:
    windows: int
    scored_positions: int
    agreement: float
    data_nll: float
    draft_steps: int
    proposed: list[int]
    accepted: list[int]
    acceptance: list[float]
    mean_accept_length: float
    accept_rate: float
    text: str
    exact: bool
    drafted: int = 0
    """Drafted tokens (step k counted wherever its predicted position is scored): the accept-rate denominator."""
    data_matches_target: float = 0.0
    """Fraction of scored positions whose data token x_{i+2} equals the base's greedy token:
    1.0 on self-generated text; where it is below 1 the acceptance figure is an approximation."""

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ChainOutcome:
    """The offline chain at every anchor i of one window (anchors are positions 0..T-1)."""

    scorable: tuple[int, ...]
    """Steps k whose predicted position i+k+1 is scored (inside the window and the answer); 0: anchor not scored."""
    accepted: tuple[int, ...]
    """Leading steps whose argmax equals the base's greedy token (<= scorable)."""


# ----------------------------------------------------------------------------------
# The offline chain
# ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _BatchChain:
    """One batch through base and head: which (step, anchor) pairs are scored and accepted."""

    scored: torch.Tensor  # (K, B, T) bool: step k at anchor i is scorable (step 1 scored, position inside the text)
    hits: torch.Tensor  # (K, B, T) bool: chained acceptance (steps 1..k all accepted)
    agree: int
    nll_sum: float
    data_matches: int
    lengths: list[int]


@torch.no_grad()
def _run_batch(base, head, windows, draft_steps: int, device) -> _BatchChain:
    batch = collate(windows, device)
    if hasattr(base, "outputs"):  # a target source (the offline cache) instead of the base
        targets = base.outputs(batch.input_ids, batch.attention_mask)
    else:
        targets = base_outputs(base, batch.input_ids, batch.attention_mask)
    chain = chain_batch(batch.input_ids, targets.greedy, batch.assistant, batch.lengths, draft_steps)
    hidden = head(chain.step_token_ids, targets.hidden)  # (K, B, T, D)

    valid = chain.labels != IGNORE  # (K, B, T)
    first = valid[0]
    h1 = hidden[0][first]  # (N, D)
    target1 = chain.labels[0][first]
    data1 = chain.data_labels[first]
    agree, nll_sum = 0, 0.0
    for start in range(0, h1.shape[0], DEFAULT_LOGITS_CHUNK_TOKENS):  # never (N x V) fp32 at once
        stop = start + DEFAULT_LOGITS_CHUNK_TOKENS
        logits = head.logits(h1[start:stop]).float()
        agree += int((logits.argmax(-1) == target1[start:stop]).sum())
        nll_sum += float(F.cross_entropy(logits, data1[start:stop], reduction="sum"))

    scored = valid & first
    hits = torch.zeros_like(scored)
    alive = first.clone()  # anchors whose chain is still accepted
    for k in range(draft_steps):
        proposing = alive & scored[k]
        if proposing.any():
            predicted = chunked_greedy(hidden[k][proposing], head.shared.lm_head)
            hits[k][proposing] = predicted == chain.labels[k][proposing]
        alive = hits[k]
    return _BatchChain(
        scored=scored,
        hits=hits,
        agree=agree,
        nll_sum=nll_sum,
        data_matches=int((data1 == target1).sum()),
        lengths=batch.lengths.tolist(),
    )


def _batches(base, head, windows, draft_steps: int, windows_per_batch: int):
    device = head.fc.weight.device
    was_training = head.training
    head.eval()
    try:
        for start in range(0, len(windows), windows_per_batch):
            yield _run_batch(base, head, windows[start : start + windows_per_batch], draft_steps, device)
    finally:
        head.train(was_training)


def evaluate_head(
    base,
    head,
    windows,
    draft_steps: int = 3,
    windows_per_batch: int = 4,
    text: str = TEACHER_FORCED,
) -> Metrics:
    """Agreement, NLL and chained acceptance of `head` on `windows` (see module docstring).

    `base` is the frozen base, or a target source with `.outputs(input_ids, attention_mask)`
    such as `target_cache.TargetCache`, whose stored targets then stand in for the base forward.
    """
    return _metrics(list(_batches(base, head, windows, draft_steps, windows_per_batch)), len(windows), draft_steps, text)


def _metrics(results: list[_BatchChain], windows: int, draft_steps: int, text: str) -> Metrics:
    scored_positions = agree = data_matches = drafted = 0
    nll_sum = 0.0
    proposed = [0] * draft_steps
    accepted = [0] * draft_steps
    for result in results:
        scored_positions += int(result.scored[0].sum())
        agree += result.agree
        nll_sum += result.nll_sum
        data_matches += result.data_matches
        drafted += int(result.scored[:draft_steps].sum())
        previous = result.scored[0]  # step 1 is proposed wherever it is scored
        for k in range(draft_steps):
            proposing = previous & result.scored[k]
            proposed[k] += int(proposing.sum())
            accepted[k] += int(result.hits[k].sum())
            previous = result.hits[k]
    acceptance, length, rate = acceptance_summary(proposed, accepted, drafted)
    return Metrics(
        windows=windows,
        scored_positions=scored_positions,
        agreement=agree / scored_positions if scored_positions else 0.0,
        data_nll=nll_sum / scored_positions if scored_positions else float("nan"),
        draft_steps=draft_steps,
        proposed=proposed,
        accepted=accepted,
        acceptance=acceptance,
        mean_accept_length=length,
        accept_rate=rate,
        text=text,
        exact=text == SELF_GENERATED,
        drafted=drafted,
        data_matches_target=data_matches / scored_positions if scored_positions else 0.0,
    )


def _outcomes(results: list[_BatchChain]) -> list[ChainOutcome]:
    outcomes = []
    for result in results:
        scorable = result.scored.sum(0)  # (B, T)
        accepted = result.hits.sum(0)
        for row, length in enumerate(result.lengths):
            outcomes.append(ChainOutcome(tuple(scorable[row, :length].tolist()), tuple(accepted[row, :length].tolist())))
    return outcomes


def chain_outcomes(base, head, windows, draft_steps: int = 3, windows_per_batch: int = 4) -> list[ChainOutcome]:
    """Per window and anchor: how many chained steps are scorable and how many were accepted.

    This is the evaluation of `evaluate_head` kept per anchor, so that it can be compared,
    decision by decision, with a decoder that drafted from some of the anchors.
    """
    return _outcomes(list(_batches(base, head, windows, draft_steps, windows_per_batch)))


def served_acceptance(base, head, windows, served_steps, max_new_tokens: int, windows_per_batch: int = 4) -> dict[int, Acceptance]:
    """What the reference speculative decoder measures at each served step count, on self-generated windows.

    One offline chain pass gives every anchor's outcome (`chain_outcomes`); the decoder's
    walk is replayed from them (`metrics.decoder_rounds`), which on the base's own
    greedy text equals decoding every window's context with
    `decode.speculative_decode` under a budget of `max_new_tokens` (the one the
    continuations were written with). On any other text the figure means nothing.
    """
    return _served(chain_outcomes(base, head, windows, max(served_steps), windows_per_batch), windows, served_steps, max_new_tokens)


def _served(outcomes: list[ChainOutcome], windows, served_steps, max_new_tokens: int) -> dict[int, Acceptance]:
    texts = [(outcome.accepted, window.answer_start) for window, outcome in zip(windows, outcomes)]
    return {k: replayed_acceptance(texts, max_new_tokens, k) for k in served_steps}


def heldout_report(targets, head, self_generated, recorded, served_steps, draft_steps: int, max_new_tokens: int,
                   windows_per_batch: int = 4) -> dict:
    """Every heldout figure of one head, from one pass over each set of windows.

    * `served`: per served step count, what the reference speculative decoder measures on
      the self-generated windows (decoder replay; exact): the headline;
    * `self_generated`: the per-anchor chain over every anchor of the same text (exact,
      but another sample than the decoder's anchors);
    * `teacher_forced`: agreement, NLL and the chain on the recorded answers (`recorded`);
      the acceptance there is an approximation, and has pointed the wrong way. None when
      no heldout window has a recorded answer (a prompt set).
    """
    steps = max(draft_steps, *served_steps)
    results = list(_batches(targets, head, self_generated, steps, windows_per_batch))
    served = _served(_outcomes(results), self_generated, served_steps, max_new_tokens)
    return {
        "served": {str(k): a.to_dict() for k, a in served.items()},
        "self_generated": _metrics(results, len(self_generated), steps, SELF_GENERATED).to_dict(),
        "teacher_forced": evaluate_head(targets, head, recorded, steps, windows_per_batch, TEACHER_FORCED).to_dict()
        if recorded else None,
    }


# ----------------------------------------------------------------------------------
# The reference decoder
# ----------------------------------------------------------------------------------


def reference_decoder_check(base, head, windows, draft_steps: int, max_new_tokens: int, stop_token_ids,
                            windows_per_batch: int = 4) -> dict:
    """Decode each window's context with the reference speculative decoder and replay it offline.

    `measured` is what the decoder counted. `replayed` is `metrics.replayed_acceptance`
    from the offline chain on the text the decoder wrote: equal to `measured` unless a
    floating-point near-tie resolved differently in the incremental and the
    full-sequence pass; `decisions_equal` of `decisions` counts the decoder's rounds
    whose accepted drafts the replay reproduces at the same anchor. `texts_equal` counts
    decoded texts identical to the given windows: where those are self-generated (a
    run's store), that checks the stored continuations against the decoder.
    `offline_all_anchors` is the per-anchor figure over every anchor of the same text:
    another sample than the decoder's, which drafts only where a verification lands.
    """
    from occamy_mtp.evaluation.decode import speculative_decode

    started = time.perf_counter()
    results = [
        speculative_decode(base, head, list(w.input_ids[: w.answer_start]), max_new_tokens, draft_steps, stop_token_ids)
        for w in windows
    ]
    decoded = [replace(w, input_ids=r.text_ids) for w, r in zip(windows, results)]
    outcomes = chain_outcomes(base, head, decoded, draft_steps, windows_per_batch)
    decisions = equal = 0
    for result, outcome in zip(results, outcomes):
        rounds, _ = decoder_rounds(outcome.accepted, len(result.prompt_ids), max_new_tokens, draft_steps)
        replayed_at = {r.anchor: r.accepted for r in rounds}
        decisions += len(result.rounds)
        equal += sum(replayed_at.get(r.anchor) == r.accepted for r in result.rounds)
    measured = acceptance_from_counts(
        draft_steps,
        len(results),
        [sum(values) for values in zip(*(r.proposed for r in results))],
        [sum(values) for values in zip(*(r.accepted for r in results))],
        sum(r.drafted for r in results),
        sum(r.base_passes for r in results),
        sum(len(r.output_ids) - 1 for r in results),
    )
    replayed = replayed_acceptance([(o.accepted, len(r.prompt_ids)) for r, o in zip(results, outcomes)], max_new_tokens, draft_steps)
    return {
        "windows": len(windows),
        "draft_steps": draft_steps,
        "max_new_tokens": max_new_tokens,
        "measured": {**measured.to_dict(), "output_tokens": sum(len(r.output_ids) for r in results)},
        "replayed": replayed.to_dict(),
        "decisions": decisions,
        "decisions_equal": equal,
        "texts_equal": sum(d.input_ids == w.input_ids for d, w in zip(decoded, windows)),
        "offline_all_anchors": evaluate_head(base, head, decoded, draft_steps, windows_per_batch, SELF_GENERATED).to_dict(),
        "seconds": time.perf_counter() - started,
    }


# ----------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------


def format_table(results: dict[str, dict]) -> str:
    """A side-by-side table of metrics dicts (`Metrics.to_dict()`), one column per head."""
    names = list(results)
    first = results[names[0]]
    rows = [
        ("target top-1 agreement", [f"{m['agreement']:.2%}" for m in results.values()]),
        ("data-answer NLL", [f"{m['data_nll']:.4f}" for m in results.values()]),
    ]
    for k in range(first["draft_steps"]):
        rows.append((
            f"acceptance step {k + 1}",
            [f"{m['acceptance'][k]:.2%} ({m['accepted'][k]}/{m['proposed'][k]})" for m in results.values()],
        ))
    rows.append(("mean accept length", [f"{m['mean_accept_length']:.3f}" for m in results.values()]))
    rows.append(("accept rate", [f"{m['accept_rate']:.2%}" for m in results.values()]))
    if first["exact"]:
        kind = "exact (the base's own greedy text)"
    else:
        kind = f"approximate (teacher-forced data; data token = greedy target at {first['data_matches_target']:.1%} of positions)"
    width = max(22, *(len(v) for _, values in rows for v in values)) + 2
    lines = [
        f"{first['windows']} windows, {first['scored_positions']} scored positions, {first['draft_steps']} chained steps",
        f"acceptance is {kind}",
        f"{'metric':<24}" + "".join(f"{name:>{width}}" for name in names),
    ]
    lines += [f"{label:<24}" + "".join(f"{v:>{width}}" for v in values) for label, values in rows]
    return "\n".join(lines)


def format_served(reports: dict[str, dict], served_steps, max_new_tokens: int) -> str:
    """The headline of `heldout_report`s side by side, one column per head: per served step
    count, each step's acceptance, the mean accept length and the tokens per verify pass."""
    names = list(reports)
    first = reports[names[0]]["served"][str(served_steps[0])]
    width = 18
    lines = [
        "served acceptance (exact): the reference speculative decoder on the base's own greedy continuation of "
        f"{first['texts']} heldout prompts (<= {max_new_tokens} new tokens each; decoder replay)",
        f"  {'':<40}" + "".join(f"{name:>{width}}" for name in names),
    ]
    for k in served_steps:
        figures = [reports[name]["served"][str(k)] for name in names]
        for j in range(k):
            lines.append(f"  {f'{k}-step drafts: step {j + 1} acceptance':<40}" + "".join(f"{f['acceptance'][j]:>{width}.2%}" for f in figures))
        for label, field in (("mean accept length", "mean_accept_length"), ("tokens per verify pass", "tokens_per_verify_pass")):
            lines.append(f"  {f'{k}-step drafts: {label}':<40}" + "".join(f"{f[field]:>{width}.3f}" for f in figures))
    def recorded(field: str, form: str):
        return lambda r: "absent" if r["teacher_forced"] is None else format(r["teacher_forced"][field], form)

    rows = [
        ("target top-1 agreement (recorded answers)", recorded("agreement", ".2%")),
        ("data-answer NLL (recorded answers)", recorded("data_nll", ".4f")),
        ("accept length, teacher-forced (approx.)", recorded("mean_accept_length", ".3f")),
        ("accept length, every self-gen. anchor", lambda r: f"{r['self_generated']['mean_accept_length']:.3f}"),
    ]
    lines.append("secondary: the recorded answers, teacher forced (acceptance approximate), and every anchor of the self-generated text")
    lines += [f"  {label:<40}" + "".join(f"{cell(reports[name]):>{width}}" for name in names) for label, cell in rows]
    return "\n".join(lines)


@command
def main(argv: list[str] | None = None) -> int:
    cli = command_line("python -m occamy_mtp.evaluate",
                       "Served acceptance (exact, on the base's own greedy text), agreement and NLL of MTP heads, side by side.",
                       config_required=False)
    cli.add_argument("--head", type=Path, help="trained head: safetensors file or checkpoint directory "
                                               "(default: the run's output.dir/mtp-trained.safetensors)")
    cli.add_argument("--out", required=True, type=Path, help="directory for evaluation.json and acceptance.png")
    cli.add_argument("--teacher-forced-only", action="store_true",
                     help="skip the base's own continuations: only the approximate figures on the recorded answers")
    cli.add_argument("--reference-decoder", action="store_true",
                     help="also decode every heldout prompt with the reference speculative decoder (batch 1, slow) at "
                          "each of eval.served_steps and check the served figures against it")
    cli.add_argument("--max-windows", type=int,
                     help="evaluate the first N heldout windows only (default: all), in the split's order: the windows "
                          "`occamy_mtp.serve.validate --prompt-source windows --prompts N` sends to a server")
    cli.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args, config = parse(cli, argv)
    if args.max_windows is not None and args.max_windows < 1:
        raise ConfigError(f"--max-windows: expected 1 or more windows, got {args.max_windows}")
    head_path = args.head or RunDir.of(config).head
    if not head_path.exists():
        raise ConfigError(f"--head {head_path}: no such file or directory (export the run first, or name a head)")
    report, printed = evaluate_run(config, head_path, args.out, torch.device(args.device), teacher_forced_only=args.teacher_forced_only,
                                   reference_decoder=args.reference_decoder, max_windows=args.max_windows)
    print(printed)
    print(f"wrote {args.out / EVALUATION_FILE} and {args.out / PLOT_FILE}")
    return 0


def evaluate_run(config: RunConfig, head_path: Path, out: Path, device: torch.device, *, teacher_forced_only: bool = False,
                 reference_decoder: bool = False, max_windows: int | None = None) -> tuple[dict, str]:
    """Donor (`model.donor_head`) and the head at `head_path` on the run's heldout windows; writes
    evaluation.json and the plot into `out`, returns the report and its printed table."""
    from occamy_mtp.model import checkpoint as ckpt_io
    from occamy_mtp.files import write_json
    from occamy_mtp.evaluation.plot import plot_acceptance

    if reference_decoder and config.data.target_cache:
        raise ConfigError("--reference-decoder decodes with the base, which data.target_cache leaves unloaded; unset it")
    ckpt_io.check_export_set(head_path)  # before the base loads (load_head checks it again)
    run = open_run(config, device, log=log_stderr, splits=(HELDOUT,), self_generated=not teacher_forced_only,
                   max_heldout=max_windows)
    dtype = ckpt_io.DTYPES[config.model.dtype]
    donor = run.models.head
    for param in donor.parameters():  # as served: every tensor in the model dtype
        param.data = param.data.to(dtype)
    text_config = ckpt_io.read_config(config.model.base).text_config
    trained = ckpt_io.load_head(head_path, text_config, donor.shared, dtype=dtype, device=device,
                                attn_implementation=config.model.attn_implementation)[0]
    heads = {"donor": donor, "trained": trained}
    steps, served_steps, budget = config.eval.draft_steps, config.eval.served_steps, config.data.answer_tokens
    per_batch = config.eval.windows_per_batch

    started = time.perf_counter()
    report = {
        "format": EVALUATION_FORMAT,
        "inputs": {"base": config.model.base, "head": str(head_path), "donor": config.model.donor_head,
                   "data": list(config.data.files), "dtype": config.model.dtype, "device": str(device)},
        "dataset": {k: v for k, v in run.data.provenance().items() if k in ("files", "windows", "settings")},
        "heldout_windows_evaluated": len(run.windows.heldout_data),
        "plot": PLOT_FILE,
    }
    out.mkdir(parents=True, exist_ok=True)
    if teacher_forced_only:
        if not run.windows.heldout_data:
            raise ConfigError("--teacher-forced-only: no heldout window has a recorded answer (the data are prompts); "
                              "evaluate without it, on the base's own answers")
        results = {name: evaluate_head(run.targets, head, run.windows.heldout_data, steps, per_batch).to_dict()
                   for name, head in heads.items()}
        report.update(text=TEACHER_FORCED, exact=False, draft_steps=steps, heads=results)
        plot_acceptance(results, out / PLOT_FILE, title="chained acceptance (teacher-forced, approximate)")
        printed = format_table(results)
    else:
        results = {name: heldout_report(run.targets, head, run.windows.heldout, run.windows.heldout_data, served_steps, steps,
                                        budget, per_batch)
                   for name, head in heads.items()}
        report.update(
            text=SELF_GENERATED, exact=True, headline="served", served_steps=list(served_steps), max_new_tokens=budget,
            heads=results,
            self_generated={**run.windows.self_generated, "max_new_tokens": budget,
                            "stop_token_ids": sorted(run.stop_token_ids), "batch_size": config.data.self_generate_batch_size},
        )
        largest = str(max(served_steps))
        plot_acceptance({name: r["served"][largest] for name, r in results.items()}, out / PLOT_FILE,
                        title=f"served acceptance, {largest}-step drafts (self-generated heldout, exact)")
        printed = format_served(results, served_steps, budget)
        if reference_decoder:
            report["reference_decoder"] = {
                name: {str(k): reference_decoder_check(run.models.base, head, run.windows.heldout, k, budget, run.stop_token_ids,
                                                       per_batch)
                       for k in served_steps}
                for name, head in heads.items()
            }
            printed += _format_decoder_checks(report["reference_decoder"])
    report["eval_seconds"] = time.perf_counter() - started
    write_json(out / EVALUATION_FILE, report)
    return report, printed


def _format_decoder_checks(checks_by_head: dict) -> str:
    lines = []
    for name, checks in checks_by_head.items():
        for k, check in checks.items():
            equal = all(check["measured"][f] == check["replayed"][f] for f in ("proposed", "accepted", "drafted", "verify_passes"))
            lines.append(f"\nreference decoder ({name}, {k}-step): accept length {check['measured']['mean_accept_length']:.3f}, "
                         f"{check['measured']['tokens_per_verify_pass']:.3f} tokens per verify pass; replayed counts "
                         f"{'equal' if equal else 'DIFFER'}; {check['decisions_equal']}/{check['decisions']} decisions equal; "
                         f"{check['texts_equal']}/{check['windows']} texts equal")
    return "".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
