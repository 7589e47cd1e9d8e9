"""Validation under a sampled serving configuration (`validate --serving PRESET`).

Under sampling two servers cannot be compared token for token, so three questions stand in
for the greedy protocol's one (docs/guide/VALIDATE.md, "Sampled serving"):

* Is each server's text a sample of what was asked? Of its tokens, the share that the
  processed distribution (the preset's temperature, top-k, top-p and penalties) excludes:
  none for a sampler that honours the settings, up to bf16 rounding at the nucleus' edge.
* Does turning MTP on change the text's distribution? Speculative sampling must not. Per
  prompt, the mean log-probability a token of the server's text has under the base's
  unprocessed softmax (defined for every token, inside the processed support or not),
  averaged over the prompt's samples; the MTP-on minus MTP-off differences over the prompts
  have mean 0 when both servers sample the same distribution.
* Does the candidate accept what the library says it should? Given the text the candidate
  wrote, its per-request acceptance counts are random with an expectation the library
  computes exactly (`decoder_check.sampled_decoder_check`); their differences have mean 0.

Each is a z-score; beyond Z_LIMIT the run fails. `bench/engine_sampled.py` runs the third
question against one server; both read an answer here (`ask`, `measured_texts`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import torch

from occamy_mtp import sampling
from occamy_mtp.config import ModelSettings, Serving
from occamy_mtp.data.windows import Window
from occamy_mtp.evaluation.decoder_check import MeasuredText, sampled_decoder_check
from occamy_mtp.evaluation.metrics import z_score
from occamy_mtp.sampling import seed_of
from occamy_mtp.engines.http import post_json, RequestFailed
from occamy_mtp.engines.openai import speculative_counts
from occamy_mtp.engines.completions import read_answer, Request, request_body
from occamy_mtp.engines.vllm import counter_delta, counts_from_metrics, read_spec_counters, settled_spec_counters

Z_LIMIT = 4.5
"""|z| beyond which a difference of mean 0 is taken for a disagreement (a chance of 7e-6 when they agree)."""
OUTSIDE_SUPPORT_LIMIT = 0.01
"""The share of a server's tokens the processed distribution may exclude (bf16 rounding at the nucleus' edge)."""


def sampled_request(base_dir, tokenizer, serving: Serving, seed: int, max_tokens: int, timeout: float) -> Request:
    """The completions request of a sampled check: `serving`'s text sampling seeded with `seed`, the
    stop tokens and vocabulary of the base at `base_dir`, no retries (a failure is a finding)."""
    from occamy_mtp.data.windows import stop_token_ids
    from occamy_mtp.model import checkpoint as ckpt_io

    vocab = ckpt_io.read_config(base_dir).text_config.vocab_size
    return Request(max_tokens, frozenset(stop_token_ids(tokenizer, base_dir)), vocab, timeout, 0,
                   sampling.text_sampling(serving, seed))


def expectation_models(model: ModelSettings, head_path, device: torch.device):
    """(base, head or None) the library's expectation is computed with: the base of `model` (the model
    settings, every one honoured: `base.frozen.FrozenBase.open`), and the head at `head_path` (None: none)
    on the base's embedding and lm_head, in `model.dtype`."""
    from occamy_mtp.base.frozen import FrozenBase
    from occamy_mtp.model import checkpoint as ckpt_io
    from occamy_mtp.model.head import SharedWeights

    base = FrozenBase.open(model, device)
    if head_path is None:
        return base, None
    dtype = ckpt_io.DTYPES[model.dtype]
    shared = SharedWeights(base.model.embed_tokens, base.lm_head)
    drafter = ckpt_io.load_head(head_path, base.facts.text_config, shared, dtype=dtype, device=device,
                                attn_implementation=model.attn_implementation)[0]
    return base, drafter.to(dtype).eval()


def sample_request(request: Request, sample: int) -> Request:
    """The request of a prompt's `sample`-th draw: its own seed, derived from the run's and the draw's number
    (each prompt's seed derives from that and the prompt, `engines.request_body`)."""
    if sample == 0:
        return request
    drawn = dataclasses.replace(request.sampling, seed=seed_of(request.sampling.seed, f"sample-{sample}", bits=31))
    return dataclasses.replace(request, sampling=drawn)


def ask(url: str, model: str, prompts: Sequence, request: Request, tokenizer, samples: int = 1,
        log: Callable[[str], None] | None = None) -> list[dict]:
    """Every prompt (`prompt_ids`, `name`) `samples` times to one server, one request at a time, on
    /v1/completions: per request its tokens, whether it finished, and the server's per-request
    speculative counts; where a response carries none (vLLM without --per-request-spec-decode-metrics),
    the difference of its /metrics counters across the request (`vllm.counts_from_metrics`: exact
    while nothing else is served meanwhile), else None. A failed request is kept with its error."""
    answers = []
    counters = read_spec_counters(url, request.timeout_seconds)  # before the first request
    by_metrics = counters.get("counters") is not None  # until a response says its own counts
    for prompt in prompts:
        for sample in range(samples):
            drawn = sample_request(request, sample)
            entry = {"prompt": prompt.name, "sample": sample, "prompt_ids": list(prompt.prompt_ids)}
            body = request_body(model, prompt.prompt_ids, drawn)
            body["return_spec_tokens_details"] = True  # SGLang's per-request counts (vLLM ignores it)
            started = time.perf_counter()
            try:
                response = post_json(url.rstrip("/") + "/v1/completions", body, request.timeout_seconds)
                answer = read_answer(response, tokenizer, drawn)
                counts = speculative_counts(response)
                by_metrics = by_metrics and counts is None
                if by_metrics:
                    after = settled_spec_counters(url, request.timeout_seconds)
                    counts, counters = counts_from_metrics(counter_delta(counters, after)), after
                entry.update(output_ids=list(answer.tokens), finished=answer.finished, counts=counts)
            except RequestFailed as err:
                entry["error"] = {"kind": err.kind, "message": str(err)}
                if by_metrics:  # what the failed request counted is no later request's
                    counters = settled_spec_counters(url, request.timeout_seconds)
            entry["seconds"] = time.perf_counter() - started
            answers.append(entry)
            if log is not None:
                log(f"  {url} {prompt.name} sample {sample}: {'error: ' + entry['error']['message'] if 'error' in entry else 'ok'}")
    return answers


def per_step(histogram: Sequence[int], steps: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(accepted, proposed) per step from a histogram of verify passes by accepted drafts: step k is
    proposed in passes that accepted k - 1 or more, accepted in those that accepted k or more."""
    accepted = tuple(sum(histogram[k:]) for k in range(1, steps + 1))
    proposed = tuple(sum(histogram[k - 1 :]) for k in range(1, steps + 1))
    return accepted, proposed


def answer_window(answer: dict) -> Window:
    """The prompt followed by the server's answer, as a window whose answer is what the server wrote."""
    return Window("engine", 0, tuple(answer["prompt_ids"]) + tuple(answer["output_ids"]), len(answer["prompt_ids"]))


def measured_texts(answers: Sequence[dict], steps: int, url: str) -> list[MeasuredText]:
    """The answers as the decoder check reads them: each text with its per-step counts. An answer
    without a consistent per-request histogram is refused (its server does not say what it accepted)."""
    measured = []
    for answer in answers:
        counts = answer["counts"]
        if counts is None or not counts.get("histogram_consistent"):
            raise ValueError(f"{url}: the answer to {answer['prompt']} carries no consistent per-request acceptance histogram, "
                             "and the server's /metrics gave none across it (serve vLLM with --per-request-spec-decode-metrics "
                             "summary; SGLang gives it by default)")
        accepted, proposed = per_step(counts["histogram"], steps)
        measured.append(MeasuredText(answer_window(answer), accepted, proposed, counts["draft_tokens"], counts["verify_passes"]))
    return measured


@torch.no_grad()
def text_statistics(base, answers: Sequence[dict], serving: Serving) -> list[dict]:
    """Per answer: its tokens, how many of them the processed distribution p excludes (penalties
    included, over the answer before each token, as the engine applies them), the summed log p of
    the others, and the summed log-probability of all under the unprocessed softmax."""
    out = []
    device = base.lm_head.weight.device
    for answer in answers:
        window = answer_window(answer)
        ids, start = window.input_ids, window.answer_start
        if len(ids) == start:
            out.append({"tokens": 0, "outside": 0, "log_p": 0.0, "log_raw": 0.0})
            continue
        logits = base(torch.tensor([ids], device=device)).logits[0, start - 1 : len(ids) - 1].float()  # each predicts the next
        tokens = torch.tensor(ids[start:], device=device)
        history = None
        if serving.penalized:
            positions = torch.arange(start, len(ids), device=device)
            history = sampling.answer_histories(torch.tensor([ids], device=device), torch.tensor([start], device=device),
                                                torch.zeros_like(positions), positions)
        p = sampling.base_probs(logits, serving, history).gather(-1, tokens[:, None])[:, 0]
        out.append({"tokens": len(tokens), "outside": int((p <= 0).sum()), "log_p": float(p[p > 0].log().sum()),
                    "log_raw": float(logits.log_softmax(-1).gather(-1, tokens[:, None]).sum())})
    return out


def fidelity(statistics: Sequence[dict]) -> dict:
    """Whether a server's text is a sample of what was asked: its tokens, those outside the processed
    support, and the mean log-probability of a token under p (where inside) and unprocessed."""
    tokens = sum(s["tokens"] for s in statistics)
    outside = sum(s["outside"] for s in statistics)
    return {"tokens": tokens, "outside_the_processed_support": outside,
            "outside_share": outside / max(1, tokens),
            "mean_log_p_processed_where_inside": sum(s["log_p"] for s in statistics) / max(1, tokens - outside),
            "mean_log_p_unprocessed": sum(s["log_raw"] for s in statistics) / max(1, tokens)}


def per_prompt_log_p(answers: Sequence[dict], statistics: Sequence[dict]) -> dict[str, float]:
    """Per prompt, the mean over its samples of a token's mean log-probability under the unprocessed softmax."""
    values: dict[str, list[float]] = {}
    for answer, stats in zip(answers, statistics):
        if stats["tokens"]:
            values.setdefault(answer["prompt"], []).append(stats["log_raw"] / stats["tokens"])
    return {prompt: sum(v) / len(v) for prompt, v in values.items()}


def distribution_shift(reference: dict[str, float], candidate: dict[str, float]) -> dict:
    """MTP on against off: the per-prompt differences of `per_prompt_log_p`, their mean and its z-score."""
    shared = [prompt for prompt in reference if prompt in candidate]
    differences = [candidate[p] - reference[p] for p in shared]
    if not differences:
        return {"prompts": 0, "mean_difference": None, "z": None}
    return {"prompts": len(shared), "mean_difference": sum(differences) / len(differences),
            "reference_mean": sum(reference[p] for p in shared) / len(shared),
            "candidate_mean": sum(candidate[p] for p in shared) / len(shared),
            "z": z_score(differences) if len(differences) > 1 else None}


def compare_sampled(reference: Sequence[dict] | None, candidate: Sequence[dict], base, head, serving: Serving,
                    draft_steps: int, max_tokens: int, url: str, windows_per_batch: int = 4, require_drafts: bool = True) -> dict:
    """The report of a sampled validation: each server's fidelity, the MTP-on/off shift of the text's
    distribution (with a reference), the candidate's acceptance against the library's expectation
    (with `head`; without it, only whether it drafted, unless `require_drafts` is off), and the
    reasons the run fails (empty: it passes)."""
    failures = []
    runs = {"candidate": candidate, **({"reference": reference} if reference is not None else {})}
    errors = [{"server": role, "prompt": a["prompt"], "sample": a["sample"], **a["error"]}
              for role, answers in runs.items() for a in answers if "error" in a]
    if errors:
        failures.append(f"{len(errors)} request(s) failed (see errors)")
    answered = {role: [a for a in answers if "error" not in a] for role, answers in runs.items()}
    statistics = {role: text_statistics(base, answers, serving) for role, answers in answered.items()}
    fidelities = {role: fidelity(stats) for role, stats in statistics.items()}
    for role, report in fidelities.items():
        if report["outside_share"] > OUTSIDE_SUPPORT_LIMIT:
            failures.append(f"{role}: {report['outside_the_processed_support']} of {report['tokens']} tokens lie outside the "
                            f"processed distribution's support (more than {OUTSIDE_SUPPORT_LIMIT:.0%}): not a sample of what was asked")
    shift = None
    if reference is not None:
        shift = distribution_shift(per_prompt_log_p(answered["reference"], statistics["reference"]),
                                   per_prompt_log_p(answered["candidate"], statistics["candidate"]))
        if shift["z"] is not None and abs(shift["z"]) > Z_LIMIT:
            failures.append(f"MTP on changes the text's distribution: a token's mean log-probability differs by {shift['mean_difference']:+.3f} "
                            f"(z {shift['z']:+.1f}, beyond {Z_LIMIT})")
    check = None
    drafted = sum((a.get("counts") or {}).get("draft_tokens") or 0 for a in answered["candidate"])
    if require_drafts and head is None and answered["candidate"] and not drafted:
        failures.append("candidate: drafted nothing, or reports no speculative counts (--allow-no-drafts compares two "
                        "servers without MTP)")
    if head is not None and answered["candidate"]:
        try:
            measured = measured_texts(answered["candidate"], draft_steps, url)
        except ValueError as err:
            failures.append(str(err))
        else:
            check = sampled_decoder_check(base, head, measured, draft_steps, max_tokens, serving, windows_per_batch,
                                          engine_counts=True, names=[a["prompt"] for a in answered["candidate"]])
            if check["measured"]["verify_passes"] == 0 or sum(check["measured"]["accepted"]) == 0:
                failures.append("candidate: accepted no drafts (is MTP on, at the K asked?)")
            else:
                for name, words in (("accepted", "accepted drafts"), ("verify_passes", "verify passes")):
                    if abs(check["z"][name]) > Z_LIMIT:
                        failures.append(f"candidate: {words} z {check['z'][name]:+.1f} against the library's expectation "
                                        f"(beyond {Z_LIMIT}): the engine does not accept what the contract says it should")
    return {"passed": not failures, "failures": failures, "errors": errors, "fidelity": fidelities,
            "distribution_shift": shift, "acceptance_check": check, "z_limit": Z_LIMIT}


def format_sampled_summary(report: dict) -> str:
    """The report in a few lines."""
    lines = [f"sampled validation ({report['serving']}, {report['samples']} samples a prompt, {len(report['prompt_set'])} prompts): "
             f"{'PASSED' if report['passed'] else 'FAILED'}"]
    for role, fid in report["fidelity"].items():
        lines.append(f"  {role}: {fid['outside_the_processed_support']} of {fid['tokens']} tokens outside the processed support; "
                     f"mean log p {fid['mean_log_p_processed_where_inside']:.3f}")
    shift = report["distribution_shift"]
    if shift is not None and shift["z"] is not None:
        lines.append(f"  MTP on vs off: a token's mean log-probability {shift['candidate_mean']:.3f} vs {shift['reference_mean']:.3f} over "
                     f"{shift['prompts']} prompts (z {shift['z']:+.2f})")
    check = report["acceptance_check"]
    if check is None:
        lines.append("  candidate's acceptance: not set against the library's expectation (give --head and --draft-steps)")
    else:
        served, expected = check["measured"], check["expected"]
        lines.append(f"  candidate K={check['draft_steps']}: accept length {1 + sum(served['accepted']) / served['verify_passes']:.3f} "
                     f"served, {1 + sum(expected['accepted']) / expected['verify_passes']:.3f} expected on its text "
                     f"(z accepted {check['z']['accepted']:+.2f}, z verify passes {check['z']['verify_passes']:+.2f})")
        by_prompt = check.get("per_prompt")
        if by_prompt and by_prompt["prompts"]:
            rows = {row["prompt"]: row for row in by_prompt["prompts"]}
            furthest = ", ".join(f"{name} {rows[name]['measured_accept_length']:.3f} vs {rows[name]['expected_accept_length']:.3f}"
                                 for name in by_prompt["furthest"])
            lines.append(f"  per prompt ({len(rows)}): measured - expected accept length {by_prompt['mean_difference']:+.3f} "
                         f"on average, spread {by_prompt['spread']:.3f}; furthest apart: {furthest}")
    lines += [f"  failure: {f}" for f in report["failures"]]
    return "\n".join(lines)
