"""Endpoint validation: does turning MTP on change what the server says, and does it draft?

docs/guide/VALIDATE.md sets out the details.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from occamy_mtp import files
from occamy_mtp.config import ENGINES
from occamy_mtp.engines.http import post_json, RequestFailed, server_identity
from occamy_mtp.engines.openai import CHAT, ENDPOINT_PATHS, parse_response, RequestSettings
from occamy_mtp.engines.vllm import counter_delta, read_spec_counters, settled_spec_counters, VLLM_METRICS
from occamy_mtp.errors import OccamyError

DEFAULT_PROMPTS = 20
DEFAULT_SAMPLES = 4  # draws a prompt under a sampled --serving
DEFAULT_COLD_WARM = 4
DEFAULT_MAX_CONSECUTIVE_ERRORS = 3
ACCEPTANCE_PASS_MODES = ("auto", "always", "never")
REPORT_FILE = "validation.json"
RESPONSES_FILE = "responses-{role}.json"
RESPONSES_FORMAT = 2
SAMPLED_FORMAT = 1  # a sampled run's responses file (`validate_sampled`)

# Authored prompts: short, varied, answerable without context (thinking disabled).
AUTHORED_PROMPTS = (
    "Explain what a Python context manager is, with a short example.",
    "Write a haiku about a lighthouse in winter.",
    "What is the difference between a list and a tuple in Python?",
    "Summarise the water cycle in three sentences.",
    "Give me five names for a grey cat.",
    "How do I reverse a string in Python?",
    "Translate 'good morning, how are you?' into French and German.",
    "What does HTTP status code 404 mean?",
    "List the planets of the solar system in order from the sun.",
    "Write a SQL query that counts rows per customer in an orders table.",
    "Why is the sky blue? Answer for a ten-year-old.",
    "Convert 100 degrees Fahrenheit to Celsius and show the formula.",
)


class ValidationError(OccamyError, ValueError):
    """Bad arguments or inputs: names the option or file."""


@dataclass(frozen=True)
class ValidationPrompt:
    name: str
    source: str  # "authored", "heldout" (messages) or "window" (token ids)
    messages: tuple[dict, ...]
    prompt_ids: tuple[int, ...] | None = None
    """A heldout window's context as token ids (sent to /v1/completions as they are)."""


# ----------------------------------------------------------------------------------
# The prompt set
# ----------------------------------------------------------------------------------


def heldout_prefixes(paths, tokenizer, **split) -> list[ValidationPrompt]:
    """The messages before each heldout window's assistant turn, in split order.

    The heldout split is `occamy_mtp.data.prepare.prepare_windows`' (pass the settings training
    used, e.g. train_conversations=..., heldout_conversations=..., split_seed=...).
    The files are read twice, through the one reader: the split is known only once every
    conversation has been read, and the second pass keeps the heldout conversations' messages
    alone, where one pass would hold every conversation's text until the split.
    """
    from occamy_mtp.data.prepare import prepare_windows
    from occamy_mtp.data.reader import DEFAULT_EXCLUSIONS, ChatReader

    prepared = prepare_windows(paths, tokenizer, **split)
    wanted = {(w.conversation_hash, w.turn_index) for w in prepared.heldout}
    hashes = {conversation_hash for conversation_hash, _ in wanted}
    read = ChatReader(paths, exclude=split.get("exclude", DEFAULT_EXCLUSIONS), skip_bad_records=True,  # refused or counted above
                      max_record_bytes=prepared.max_record_bytes)
    conversations = {c.content_hash: c for c in read if c.content_hash in hashes}
    prompts = []
    for window in prepared.heldout:
        key = (window.conversation_hash, window.turn_index)
        if key not in wanted:
            continue
        wanted.discard(key)
        conversation = conversations[window.conversation_hash]
        messages = tuple({"role": m.role, "content": m.content} for m in conversation.messages[: window.turn_index])
        prompts.append(ValidationPrompt(f"heldout-{window.conversation_hash[:12]}-{window.turn_index}", "heldout", messages))
    return prompts


def heldout_window_contexts(paths, tokenizer, served_thinking: bool | None = None, **split) -> list[ValidationPrompt]:
    """Each heldout window's context (the <= context_tokens tokens before its answer, ending
    with the template's generation prompt), as token ids: the prompts `occamy_mtp.evaluation.evaluate
    --reference-decoder` decodes, so that the engine's acceptance and the library's are
    measured on the same prompts, token for token. Pass the window and split settings of
    training (context_tokens=..., answer_tokens=..., train_conversations=..., ...). With
    `served_thinking` (a serving configuration's mode), the prompts are rendered in that mode, as
    evaluation renders that configuration's (`PreparedData.served_windows`)."""
    from occamy_mtp.data.prepare import prepare_windows

    if served_thinking is None:
        windows = prepare_windows(paths, tokenizer, **split).heldout
    else:
        windows = prepare_windows(paths, tokenizer, served_thinking=(served_thinking,), **split).served_windows(
            "heldout", served_thinking)
    return [ValidationPrompt(f"window-{w.conversation_hash[:12]}-{w.turn_index}", "window", (), tuple(w.input_ids[: w.answer_start]))
            for w in windows]


def prompt_set(total: int, heldout: list[ValidationPrompt]) -> list[ValidationPrompt]:
    """Authored prompts first (up to half the set when heldout prefixes are given), then
    heldout prefixes, then the remaining authored ones, `total` in all (or fewer)."""
    authored = [
        ValidationPrompt(f"authored-{n + 1:02d}", "authored", ({"role": "user", "content": text},))
        for n, text in enumerate(AUTHORED_PROMPTS)
    ]
    first = min(len(authored), total if not heldout else max(1, total // 2))
    chosen = authored[:first] + heldout[: total - first]
    chosen += authored[first : first + total - len(chosen)]
    return chosen[:total]


def request_body(prompt: ValidationPrompt, settings: RequestSettings, model: str, tokenizer=None) -> dict:
    body = {"model": model, "max_tokens": settings.max_tokens, "temperature": 0}
    if settings.endpoint == CHAT:
        if prompt.prompt_ids is not None:
            raise ValidationError(f"{prompt.name}: a token-id prompt needs --endpoint completions")
        body.update(messages=list(prompt.messages), chat_template_kwargs={"enable_thinking": settings.thinking})
        if settings.logprobs:
            body.update(logprobs=True, top_logprobs=settings.top_logprobs)
        if settings.engine_fields:
            body["return_meta_info"] = True  # SGLang: choices[i].meta_info (chat only)
    else:
        if prompt.prompt_ids is not None:
            body["prompt"] = list(prompt.prompt_ids)  # token ids: no template, no tokenizer on either side
        elif tokenizer is None:
            raise ValidationError("--endpoint completions needs --tokenizer to render the chat template")
        else:
            body["prompt"] = tokenizer.apply_chat_template(list(prompt.messages), add_generation_prompt=True,
                                                           tokenize=False, enable_thinking=settings.thinking)
        if settings.logprobs:
            body["logprobs"] = max(1, settings.top_logprobs)  # completions: the count includes the chosen token
    if settings.engine_fields:
        body["return_spec_tokens_details"] = True  # SGLang >= the sglext builds: sglext.spec_tokens_details
    if settings.token_ids:
        body["return_token_ids"] = True  # vLLM: choices[i].token_ids; SGLang: response_token_ids (chat), token_ids
        if settings.logprobs:
            body["return_tokens_as_token_ids"] = True  # vLLM: logprob tokens as "token_id:N"
    body.update(settings.extra_body)
    return body


# ----------------------------------------------------------------------------------
# One run against one server
# ----------------------------------------------------------------------------------


def collect(base_url: str, prompts: list[ValidationPrompt], cold_warm: int, settings: RequestSettings,
            tokenizer=None, max_consecutive_errors: int = DEFAULT_MAX_CONSECUTIVE_ERRORS, log=None) -> dict:
    """Send every prompt (the first `cold_warm` twice) to one server, one at a time; read its
    speculative counters on /metrics before and after."""
    url = base_url.rstrip("/") + ENDPOINT_PATHS[settings.endpoint]
    run = {"format": RESPONSES_FORMAT, "server": base_url, "endpoint": settings.endpoint, "settings": asdict(settings),
           "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "model": settings.model,
           "engine": None, "engine_version": None,
           "cold_warm": cold_warm, "prompts": [asdict(p) for p in prompts], "requests": []}
    consecutive, dead = 0, None
    try:
        identity = server_identity(base_url, settings.timeout_seconds)
        run.update(engine=identity["engine"], engine_version=identity["version"])
        model = settings.model or identity["model"]
    except RequestFailed as err:
        run["model_error"] = {"kind": err.kind, "message": str(err)}
        model = settings.model or "default"  # a server without /v1/models may still serve completions
        if err.kind == "transport":
            dead = f"server unreachable (GET /v1/models: {err})"
    run["model"] = model
    metrics_before = read_spec_counters(base_url, settings.timeout_seconds) if dead is None else {"error": dead}
    for index, prompt in enumerate(prompts):
        for attempt in ("cold", "warm") if index < cold_warm else ("cold",):
            entry = {"prompt": prompt.name, "source": prompt.source, "attempt": attempt}
            if dead is not None:
                entry["error"] = {"kind": "skipped", "message": f"not sent: {dead}"}
                run["requests"].append(entry)
                continue
            started = time.perf_counter()
            try:
                response = post_json(url, request_body(prompt, settings, model, tokenizer), settings.timeout_seconds)
                entry["response"] = parse_response(response, settings.endpoint, settings.logprobs)
                consecutive = 0
            except RequestFailed as err:
                entry["error"] = {"kind": err.kind, "message": str(err)}
                consecutive = consecutive + 1 if err.kind == "transport" else 0
                if consecutive >= max_consecutive_errors:
                    dead = f"{consecutive} transport failures in a row (last: {err})"
            entry["seconds"] = time.perf_counter() - started
            run["requests"].append(entry)
            if log is not None:
                log(f"  {base_url} {prompt.name} {attempt}: {'error: ' + entry['error']['message'] if 'error' in entry else 'ok'}")
    metrics_after = settled_spec_counters(base_url, settings.timeout_seconds) if dead is None else {"error": dead}
    run["metrics"] = {"before": metrics_before, "after": metrics_after}
    return run


# ----------------------------------------------------------------------------------
# Comparing
# ----------------------------------------------------------------------------------


def _sequence(response: dict, by_ids: bool):
    if by_ids:
        return response["token_ids"]
    return response["tokens"]


DEFAULT_LOGPROB_TOLERANCE = math.inf
"""`validate --logprob-tolerance`'s default: tokens decide, logprobs are reported. A verify pass over 1 + K
positions rounds otherwise than a one-token step, so an MTP server's logprobs differ from the plain one's
in their last bits (2e-6 in float32 against the library's own reference server) with every token the same."""


def compare_responses(reference: dict, candidate: dict, tolerance: float) -> dict:
    """Token identity (ids when both give them, else token strings, else the text) and the
    largest logprob difference (over the tokens both have logprobs for, before the first
    differing token)."""
    by_ids = reference["token_ids"] is not None and candidate["token_ids"] is not None
    by_tokens = not by_ids and reference["tokens"] is not None and candidate["tokens"] is not None
    compared_tokens = by_ids or by_tokens
    if compared_tokens:
        a, b = _sequence(reference, by_ids), _sequence(candidate, by_ids)
    else:
        a, b = reference["text"], candidate["text"]  # characters: the position is a character index
    first_difference = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if first_difference is None and len(a) != len(b):
        first_difference = min(len(a), len(b))
    # Logprobs are compared up to the first differing token: after it they belong to other texts.
    same_length = min(len(reference["logprobs"]), len(candidate["logprobs"]))
    if first_difference is not None and compared_tokens:
        same_length = min(same_length, first_difference)
    diffs = [abs(x - y) for x, y in zip(reference["logprobs"][:same_length], candidate["logprobs"][:same_length])]
    max_diff = max(diffs, default=0.0)
    worst = diffs.index(max_diff) if diffs and max_diff > 0 else None
    tokens_match = first_difference is None
    compared_logprobs = bool(reference["logprobs"]) and bool(candidate["logprobs"])
    return {
        "compared_by": "token_ids" if by_ids else "token_strings" if by_tokens else "text",
        "tokens_match": tokens_match,
        "first_token_difference": first_difference,
        "tokens": [len(a), len(b)],
        "max_logprob_diff": max_diff,
        "max_logprob_diff_at": worst,
        "logprobs_compared": compared_logprobs,
        "logprobs_match": tokens_match and max_diff <= tolerance,
        "exact": tokens_match and max_diff <= tolerance and reference["text"] == candidate["text"],
        "difference": None if tokens_match else _difference(reference, candidate, a, b, first_difference),
    }


def _difference(reference: dict, candidate: dict, a, b, position: int) -> dict:
    """The first differing token, with each side's top two there: a candidate that took the
    reference's runner-up where the reference's margin is tiny points at rounding."""
    out = {"position": position,
           "reference": a[position] if position < len(a) else None,
           "candidate": b[position] if position < len(b) else None}
    for role, response in (("reference", reference), ("candidate", candidate)):
        top = response.get("top_logprobs") or []
        if position < len(top) and len(top[position]) >= 2:
            out[f"{role}_top2"] = top[position]
            out[f"{role}_margin"] = top[position][0][1] - top[position][1][1]
    ref_top = out.get("reference_top2")
    cand_tokens = candidate.get("tokens") or []
    if ref_top is not None and position < len(cand_tokens):
        out["candidate_took_reference_runner_up"] = cand_tokens[position] == ref_top[1][0]
    return out


def _responses(run: dict) -> dict[str, dict[str, dict]]:
    """prompt -> attempt -> request entry."""
    out: dict[str, dict[str, dict]] = {}
    for entry in run["requests"]:
        out.setdefault(entry["prompt"], {})[entry["attempt"]] = entry
    return out


def _per_position_from_histogram(histogram: list[int], steps: int) -> dict:
    """Chained per-step counts from "verify passes that accepted exactly j drafts": step k
    was proposed in the passes that accepted >= k-1 drafts and accepted in those with >= k."""
    counts = list(histogram) + [0] * max(0, steps + 1 - len(histogram))
    proposed = [sum(counts[k - 1 :]) for k in range(1, steps + 1)]
    accepted = [sum(counts[k:]) for k in range(1, steps + 1)]
    return _per_position(proposed, accepted)


def _per_position(proposed: list[int], accepted: list[int]) -> dict:
    return {"proposed": proposed, "accepted": accepted,
            "acceptance": [a / p if p else None for a, p in zip(accepted, proposed)]}


def _figures(verify_passes: int, accepted: int | None, drafted: int | None) -> dict:
    """Accept rate and the contract's mean accept length, 1 + accepted drafts / verify passes
    (= 1 + sum_k prod_{j<=k} acc_j: every pass proposes step 1)."""
    return {"verify_passes": verify_passes, "accepted_tokens": accepted, "draft_tokens": drafted,
            "accept_rate": accepted / drafted if accepted is not None and drafted else None,
            "accept_length": 1 + accepted / verify_passes if accepted is not None and verify_passes else None}


def acceptance_from_responses(run: dict) -> dict | None:
    """Summed per-request counts (SGLang meta_info/sglext, vLLM metrics.speculative_decoding); None if none."""
    counted = [e["response"]["speculative"] for e in run["requests"] if "response" in e and e["response"]["speculative"]]
    if not counted:
        return None
    verify = sum(c["verify_passes"] for c in counted)
    accepted = sum(c["accepted_tokens"] for c in counted) if all(c["accepted_tokens"] is not None for c in counted) else None
    drafted = sum(c["draft_tokens"] for c in counted) if all(c["draft_tokens"] is not None for c in counted) else None
    out = {"source": ", ".join(sorted({c["source"] for c in counted})), "responses": len(counted), **_figures(verify, accepted, drafted)}
    if all(c["completion_tokens"] is not None for c in counted) and verify:
        tokens = sum(c["completion_tokens"] for c in counted)
        out.update(completion_tokens=tokens, tokens_per_verify_pass=tokens / verify)  # SGLang's spec_accept_length
    steps = max((c["draft_steps"] or max(len(c["histogram"]) - 1, 0) for c in counted), default=0)
    if steps and all(c["histogram_consistent"] for c in counted):
        summed = [sum(c["histogram"][j] if j < len(c["histogram"]) else 0 for c in counted) for j in range(steps + 1)]
        out["histogram"] = summed
        out["per_position"] = _per_position_from_histogram(summed, steps)
    return out


def acceptance_from_metrics(run: dict) -> dict | None:
    """The run's share of vLLM's /metrics counters; None if the server has none; {"error"} if unreadable."""
    metrics = run.get("metrics") or {}
    before, after = metrics.get("before", {}), metrics.get("after", {})
    if "error" in before or "error" in after:
        return {"source": VLLM_METRICS, "error": before.get("error") or after.get("error")}
    delta = counter_delta(before, after)
    if delta is None or "error" in delta:
        return None if delta is None else {"source": VLLM_METRICS, **delta}
    out = {"source": VLLM_METRICS, "drafts": delta["drafts"], **_figures(delta["drafts"], delta["accepted_tokens"], delta["draft_tokens"])}
    per_pos = delta["accepted_per_position"]
    if per_pos:  # step 1 is proposed in every draft, step k in the drafts that accepted k-1
        out["per_position"] = _per_position([delta["drafts"]] + per_pos[:-1], per_pos)
    return out


def acceptance(run: dict) -> dict | None:
    """What the run measured: per-request counts where the engine gave them, else its /metrics
    counters; both are kept (`per_request`, `metrics`) so that they can be cross-checked."""
    per_request, metrics = acceptance_from_responses(run), acceptance_from_metrics(run)
    usable_metrics = metrics if metrics is not None and "error" not in metrics else None
    chosen = per_request or usable_metrics
    if chosen is None and metrics is None:
        return None
    out = {"engine": run.get("engine"), "engine_version": run.get("engine_version"), **(chosen or {"source": None})}
    out["drafted_nothing"] = None if chosen is None else not (chosen.get("draft_tokens") or chosen.get("verify_passes"))
    if metrics is not None:
        out["metrics"] = metrics
    if per_request is not None and chosen is not per_request:
        out["per_request"] = per_request
    return out


def speculation_verdict(candidate_acceptance: dict | None, acceptance_pass: dict | None, required: bool) -> str | None:
    """Why the candidate fails the "it speculated" check, or None when it passes."""
    if not required:
        return None
    measured = [a for a in (candidate_acceptance, acceptance_pass) if a is not None and a.get("source")]
    if any(not a["drafted_nothing"] for a in measured):
        return None
    if not measured:
        unreadable = [a["metrics"]["error"] for a in (candidate_acceptance, acceptance_pass)
                      if a is not None and "error" in a.get("metrics", {})]
        return ("the candidate reported no speculative counts (no SGLang meta_info / sglext spec fields, no vLLM "
                "metrics.speculative_decoding, no vllm:spec_decode_* counters on /metrics"
                + (f"; /metrics: {unreadable[0]}" if unreadable else "")
                + "): nothing shows that MTP ran; --allow-no-drafts compares two servers without MTP")
    requests = sum(a.get("responses", 0) for a in measured)
    sources = ", ".join(sorted({a["source"] for a in measured}))
    return (f"the candidate drafted nothing (0 draft tokens; {sources}"
            + (f", {requests} responses" if requests else "")
            + "): MTP is off, or the draft head was not loaded")


def compare_runs(reference: dict, candidate: dict, cold_warm_prompts: list[str], tolerance: float,
                 require_drafts: bool = True, acceptance_run: dict | None = None) -> dict:
    """The report: cold/warm per server, fixed-set matches across servers, errors, acceptance,
    divergences, and the list of reasons the run fails (empty: it passes)."""
    ref, cand = _responses(reference), _responses(candidate)
    runs = [("reference", reference), ("candidate", candidate)] + ([("acceptance pass", acceptance_run)] if acceptance_run else [])
    errors = [{"server": role, "prompt": e["prompt"], "attempt": e["attempt"], **e["error"]}
              for role, run in runs for e in run["requests"] if "error" in e]
    prompts, max_diff = [], 0.0
    for name, attempts in ref.items():
        row = {"prompt": name, "source": attempts["cold"]["source"]}
        other = cand.get(name, {})
        problems = [f"{role} {attempt}: {e['error']['message']}" for role, group in (("reference", attempts), ("candidate", other))
                    for attempt, e in group.items() if "error" in e]
        if "cold" not in other:
            problems.append("candidate: prompt missing")
        if problems:
            row.update(exact=False, error="; ".join(problems))
        else:
            comparisons = {attempt: compare_responses(attempts["cold"]["response"], e["response"], tolerance) for attempt, e in other.items()}
            row["comparisons"] = comparisons
            row["exact"] = all(c["exact"] for c in comparisons.values())
            row["max_logprob_diff"] = max(c["max_logprob_diff"] for c in comparisons.values())
            max_diff = max(max_diff, row["max_logprob_diff"])
        prompts.append(row)

    def cold_warm(responses: dict) -> dict:
        matched, checked, details = 0, 0, []
        for name in cold_warm_prompts:
            attempts = responses.get(name, {})
            ok = all(a in attempts and "response" in attempts[a] for a in ("cold", "warm"))
            checked += 1
            same = ok and compare_responses(attempts["cold"]["response"], attempts["warm"]["response"], tolerance)["exact"]
            matched += bool(same)
            details.append({"prompt": name, "exact": bool(same), "error": None if ok else "a cold or warm response is missing"})
        return {"exact": matched, "of": checked, "prompts": details}

    fixed_exact = sum(p["exact"] for p in prompts)
    cold_warm_report = {"reference": cold_warm(ref), "candidate": cold_warm(cand)}
    token_differences = [p["prompt"] for p in prompts if "comparisons" in p and not all(c["tokens_match"] for c in p["comparisons"].values())]
    accepted = {"reference": acceptance(reference), "candidate": acceptance(candidate)}
    pass_report = None
    if acceptance_run is not None:
        pass_report = _acceptance_pass_report(ref, acceptance_run)
        accepted["acceptance_pass"] = acceptance(acceptance_run)
    failures = []
    if errors:
        failures.append(f"{len(errors)} request(s) failed (see errors)")
    if fixed_exact != len(prompts) or not prompts:
        failures.append(f"fixed prompts: {fixed_exact}/{len(prompts)} exact")
    for role, report in cold_warm_report.items():
        if report["exact"] != report["of"]:
            failures.append(f"cold/warm ({role}): {report['exact']}/{report['of']} exact")
    if pass_report is not None and pass_report["differences"]:
        failures.append(f"acceptance pass: {len(pass_report['differences'])}/{pass_report['of']} prompts differ from the reference")
    verdict = speculation_verdict(accepted["candidate"], accepted.get("acceptance_pass"), require_drafts)
    if verdict is not None:
        failures.append(verdict)
    return {
        "passed": not failures,
        "failures": failures,
        "fixed": {"exact": fixed_exact, "of": len(prompts)},
        "cold_warm": cold_warm_report,
        "max_logprob_diff": max_diff,
        "logprob_tolerance": tolerance,
        "token_differences": token_differences,
        "divergence": _divergence(prompts, token_differences),
        "logprob_differences": [p["prompt"] for p in prompts if "comparisons" in p and all(c["tokens_match"] for c in p["comparisons"].values())
                                and not all(c["logprobs_match"] for c in p["comparisons"].values())],
        "errors": errors,
        "acceptance": accepted,
        "acceptance_pass": pass_report,
        "prompts": prompts,
    }


def _divergence(prompts: list[dict], names: list[str]) -> dict:
    """How many prompts' tokens differ, and where each first differs (its cold request, else warm)."""
    rows = []
    for row in prompts:
        if row["prompt"] not in names:
            continue
        comparison = next(c for c in row["comparisons"].values() if not c["tokens_match"])
        rows.append({"prompt": row["prompt"], **comparison["difference"]})
    return {"prompts": len(rows), "of": sum("comparisons" in p for p in prompts),
            "first_token_index": {r["prompt"]: r["position"] for r in rows}, "details": rows}


def _acceptance_pass_report(reference: dict[str, dict[str, dict]], run: dict) -> dict:
    """Tokens of the pass without logprobs against the reference's cold responses."""
    differences, compared, by = [], 0, set()
    for entry in run["requests"]:
        cold = reference.get(entry["prompt"], {}).get("cold")
        if "response" not in entry or cold is None or "response" not in cold:
            continue
        comparison = compare_responses(cold["response"], entry["response"], math.inf)
        compared += 1
        by.add(comparison["compared_by"])
        if not comparison["tokens_match"]:
            differences.append({"prompt": entry["prompt"], **comparison["difference"]})
    return {"of": compared, "compared_by": sorted(by), "differences": differences}


def _acceptance_line(role: str, acceptance: dict | None) -> list[str]:
    if acceptance is None or not acceptance.get("source"):
        reason = (acceptance or {}).get("metrics", {}).get("error")
        return [f"acceptance ({role}): not reported by the server" + (f" (/metrics: {reason})" if reason else "")]
    engine = " ".join(x for x in (acceptance.get("engine"), acceptance.get("engine_version")) if x) or "engine unknown"
    text = f"acceptance ({role}; {engine}; from {acceptance['source']}): "
    if acceptance["drafted_nothing"]:
        text += f"nothing drafted ({acceptance['verify_passes']} verify passes)"
    else:
        length = acceptance["accept_length"]
        text += f"accept length {length:.3f}" if length is not None else "accept length unknown"
        text += f" over {acceptance['verify_passes']} verify passes"
        if acceptance.get("accept_rate") is not None:
            text += f", accept rate {acceptance['accept_rate']:.2%} ({acceptance['accepted_tokens']}/{acceptance['draft_tokens']})"
        if acceptance.get("tokens_per_verify_pass") is not None:
            text += f", {acceptance['tokens_per_verify_pass']:.3f} completion tokens per verify pass"
    lines = [text]
    if "per_position" in acceptance:
        steps = acceptance["per_position"]
        lines.append("  per step (chained): " + ", ".join(
            f"step {k + 1} {a}/{p}" + (f" ({a / p:.2%})" if p else "") for k, (a, p) in enumerate(zip(steps["accepted"], steps["proposed"]))))
    metrics = acceptance.get("metrics")
    if metrics is not None and metrics is not acceptance and acceptance["source"] != VLLM_METRICS:
        if "error" in metrics:
            lines.append(f"  /metrics: {metrics['error']}")
        else:
            lines.append(f"  cross-check, {VLLM_METRICS}: {metrics['accepted_tokens']}/{metrics['draft_tokens']} accepted over {metrics['drafts']} drafts")
    return lines


def format_summary(report: dict) -> str:
    lines = [f"validation: reference {report['reference']} vs candidate {report['candidate']} ({report['endpoint']}, "
             f"max_tokens {report['max_tokens']}, greedy, thinking {'on' if report.get('thinking') else 'off'})"]
    fixed = report["fixed"]
    tolerance = report["logprob_tolerance"]  # inf (null once written as JSON): not judged
    judged = ("tokens; logprobs not judged" if tolerance is None or math.isinf(tolerance)
              else f"tokens, and logprobs within {report['logprob_tolerance']:g}")
    lines.append(f"fixed prompts: {fixed['exact']}/{fixed['of']} exact matches ({judged}); max |logprob difference| "
                 f"{report['max_logprob_diff']:.3e}")
    cw = report["cold_warm"]
    lines.append(f"cold/warm: reference {cw['reference']['exact']}/{cw['reference']['of']}, candidate {cw['candidate']['exact']}/{cw['candidate']['of']}")
    divergence = report["divergence"]
    if divergence["prompts"]:
        lines.append(f"token differences: {divergence['prompts']}/{divergence['of']} prompts, first differing output token at "
                     + ", ".join(str(d["position"]) for d in divergence["details"]))
    for detail in divergence["details"]:
        text = f"  {detail['prompt']} at output token {detail['position']}: {detail['reference']!r} vs {detail['candidate']!r}"
        if "reference_margin" in detail:
            margin = detail["reference_margin"]
            text += f"; reference top-2 margin {margin:.4g}" + (" (a tie)" if margin == 0 else "")
            if detail.get("candidate_took_reference_runner_up"):
                text += " (the candidate took the reference's runner-up)"
        lines.append(text)
    for name in report["logprob_differences"]:
        row = next(p for p in report["prompts"] if p["prompt"] == name)
        lines.append(f"  logprob difference: {name}: max {row['max_logprob_diff']:.3e} (tokens identical)")
    for error in report["errors"]:
        lines.append(f"  error ({error['kind']}): {error['server']} {error['prompt']} {error['attempt']}: {error['message']}")
    for role in ("reference", "candidate", "acceptance_pass"):
        if role in report["acceptance"]:
            lines += _acceptance_line(role.replace("_", " "), report["acceptance"][role])
    pass_report = report.get("acceptance_pass")
    if pass_report is not None:
        lines.append(f"acceptance pass (no logprobs, compared by {'/'.join(pass_report['compared_by']) or 'nothing'}): "
                     f"{pass_report['of'] - len(pass_report['differences'])}/{pass_report['of']} prompts identical to the reference")
        for d in pass_report["differences"]:
            lines.append(f"  {d['prompt']} at output token {d['position']}: {d['reference']!r} vs {d['candidate']!r}")
    for reason in report["failures"]:
        lines.append(f"FAIL: {reason}")
    lines.append(f"RESULT: {'PASS' if report['passed'] else 'FAIL'}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------


def is_url(text: str) -> bool:
    return text.startswith("http://") or text.startswith("https://")


def load_run(path: Path) -> dict:
    run = files.read_json_object(path, ValidationError, "recorded responses")
    if not {"requests", "prompts", "settings"} <= set(run):
        raise ValidationError(f"{path}: not a responses file written by occamy_mtp.serve.validate")
    if run.get("format") != RESPONSES_FORMAT:
        raise ValidationError(f"{path}: responses format {run.get('format')!r}, this version reads {RESPONSES_FORMAT}: record the reference again")
    return run


def _gather(sources: dict[str, str | None], runs: dict, out_dir: Path, collect_one, load_one) -> dict:
    """Each role's run, beside those in `runs`: collected from its server (`collect_one(url)`, then written
    to its responses file) or read from one recorded earlier (`load_one(path)`)."""
    for role, source in sources.items():
        if source is None or role in runs:
            continue
        if is_url(source):
            runs[role] = collect_one(source)
            files.write_json(out_dir / RESPONSES_FILE.format(role=role), runs[role])
        else:
            runs[role] = load_one(Path(source))
    return runs


def validate(reference: str, candidate: str | None, prompts: list[ValidationPrompt], out_dir: Path, settings: RequestSettings,
             cold_warm: int = DEFAULT_COLD_WARM, tolerance: float = DEFAULT_LOGPROB_TOLERANCE, tokenizer=None,
             max_consecutive_errors: int = DEFAULT_MAX_CONSECUTIVE_ERRORS, log=None,
             require_drafts: bool = True, acceptance_pass: str = "auto") -> dict | None:
    """Collect (or load) both runs, compare, write the files; None when only recording the reference.

    A recorded reference (a responses file) brings its own prompts, cold/warm count and
    request settings; `prompts`, `cold_warm` and `settings` (but its timeout) are then unused.
    `acceptance_pass` ("auto", "always", "never"): send the prompts to a candidate server once
    more without logprobs (auto: when the candidate must draft and the logprob run drafted nothing).
    """
    if acceptance_pass not in ACCEPTANCE_PASS_MODES:
        raise ValidationError(f"acceptance_pass must be one of {ACCEPTANCE_PASS_MODES}, got {acceptance_pass!r}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = {}
    if not is_url(reference):
        # A recorded reference fixes the protocol: its prompts, cold/warm count and request settings.
        runs["reference"] = load_run(Path(reference))
        prompts = [ValidationPrompt(p["name"], p["source"], tuple(p["messages"]),
                                    None if p.get("prompt_ids") is None else tuple(p["prompt_ids"])) for p in runs["reference"]["prompts"]]
        cold_warm = runs["reference"]["cold_warm"]
        settings = RequestSettings(**{**runs["reference"]["settings"], "timeout_seconds": settings.timeout_seconds})
    _gather({"reference": reference, "candidate": candidate}, runs, out_dir,
            lambda url: collect(url, prompts, cold_warm, settings, tokenizer, max_consecutive_errors, log), load_run)
    if candidate is None:
        return None
    acceptance_run = None
    first = acceptance(runs["candidate"])
    drafted_nothing = first is None or not first.get("source") or first["drafted_nothing"]
    wants_pass = acceptance_pass == "always" or (acceptance_pass == "auto" and require_drafts and drafted_nothing)
    if is_url(candidate) and wants_pass and settings.logprobs:
        if log is not None:
            log(f"  {candidate}: acceptance pass without logprobs ({'asked for' if acceptance_pass == 'always' else 'the logprob run drafted nothing'})")
        acceptance_run = collect(candidate, prompts, 0, replace(settings, logprobs=False), tokenizer, max_consecutive_errors, log)
        files.write_json(out_dir / RESPONSES_FILE.format(role="candidate-acceptance"), acceptance_run)
    recorded = [e["prompt"] for e in runs["reference"]["requests"] if e["attempt"] == "warm"]
    report = compare_runs(runs["reference"], runs["candidate"], recorded, tolerance, require_drafts, acceptance_run)
    report = {
        "format": RESPONSES_FORMAT,
        "reference": reference,
        "candidate": candidate,
        "endpoint": runs["reference"]["endpoint"],
        "thinking": bool(runs["reference"]["settings"].get("thinking", False)),
        "max_tokens": runs["reference"]["settings"]["max_tokens"],
        "require_drafts": require_drafts,
        "prompt_set": [{"name": p.name, "source": p.source} for p in prompts],
        **report,
    }
    files.write_json(out_dir / REPORT_FILE, report)
    return report


def load_sampled_run(path: Path) -> dict:
    """A sampled run recorded earlier (`validate_sampled` writes it); ValidationError naming the file otherwise."""
    run = files.read_json_object(path, ValidationError, "recorded responses")
    if run.get("sampled") is not True or not isinstance(run.get("answers"), list):
        raise ValidationError(f"{path}: not a sampled run's responses file written by occamy_mtp.serve.validate --serving")
    if run.get("format") != SAMPLED_FORMAT:
        raise ValidationError(f"{path}: sampled responses format {run.get('format')!r}, this version reads {SAMPLED_FORMAT}")
    return run


def collect_sampled(base_url: str, prompts: list[ValidationPrompt], samples: int, request, tokenizer, serving, log=None) -> dict:
    """Every prompt `samples` times to one server under `request`'s sampling (`sampled.ask`), with the server's identity."""
    from occamy_mtp.serve.sampled import ask

    run = {"format": SAMPLED_FORMAT, "sampled": True, "server": base_url, "serving": serving.label(), "samples": samples,
           "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "engine": None, "engine_version": None,
           "prompts": [{"name": p.name, "source": p.source} for p in prompts]}
    try:
        identity = server_identity(base_url, request.timeout_seconds)
    except RequestFailed as err:
        raise ValidationError(f"{base_url}: GET /v1/models failed ({err}): a sampled run needs the served model's name") from None
    run.update(model=identity["model"], engine=identity["engine"], engine_version=identity["version"])
    run["answers"] = ask(base_url, identity["model"], prompts, request, tokenizer, samples, log)
    return run


def validate_sampled(reference: str, candidate: str | None, prompts: list[ValidationPrompt], out_dir: Path, model, serving,
                     samples: int, max_tokens: int, timeout: float, seed: int, head: str | None, draft_steps: int, tokenizer,
                     log=None, require_drafts: bool = True, windows_per_batch: int = 4) -> dict | None:
    """The sampled protocol (`occamy_mtp.serve.sampled`): each server's answers (or a recorded run),
    then fidelity, the MTP-on/off shift and the candidate's acceptance against the library's
    expectation at `draft_steps`, with the base of `model` (the model settings; and `head`: a file,
    or "donor"), `windows_per_batch` texts a forward; None when only recording the reference."""
    import torch

    from occamy_mtp.serve.sampled import compare_sampled, expectation_models, sampled_request

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    request = sampled_request(model.base, tokenizer, serving, seed, max_tokens, timeout)

    def recorded(path: Path) -> dict:
        run = load_sampled_run(path)
        if run["serving"] != serving.label():
            raise ValidationError(f"{path}: recorded under {run['serving']}, not {serving.label()}")
        return run

    if candidate is not None and is_url(candidate):  # before any request is sent: nothing to collect again
        try:
            _check_engine(serving, server_identity(candidate, timeout)["engine"], candidate)
        except RequestFailed:
            pass  # collecting names the failure
    runs = _gather({"reference": reference, "candidate": candidate}, {}, out_dir,
                   lambda url: collect_sampled(url, prompts, samples, request, tokenizer, serving, log), recorded)
    if candidate is None:
        return None
    if not is_url(candidate):  # a recorded run: its server's engine as recorded (a URL's was checked above)
        _check_engine(serving, runs["candidate"].get("engine"), candidate)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    head_path = None if head is None else model.donor_head if head == "donor" else head
    base, drafter = expectation_models(model, head_path, device)
    report = compare_sampled(runs["reference"]["answers"], runs["candidate"]["answers"], base, drafter, serving, draft_steps,
                             max_tokens, candidate, windows_per_batch, require_drafts)
    report = {"format": SAMPLED_FORMAT, "sampled": True, "reference": reference, "candidate": candidate,
              "serving": serving.label(), "thinking": serving.thinking, "samples": samples, "max_tokens": max_tokens,
              "head": head, "draft_steps": draft_steps,
              "engines": {role: {"engine": run["engine"], "engine_version": run["engine_version"], "model": run["model"]}
                          for role, run in runs.items()},
              "prompt_set": runs["reference"]["prompts"], **report}
    files.write_json(out_dir / REPORT_FILE, report)
    return report


def _check_engine(serving, served_by: str | None, candidate: str) -> None:
    """Refuse a penalized `serving` whose engine rule (`Serving.engine`) is not that of the engine serving the
    candidate (`served_by`, its /v1/models owner; unknown: not refused)."""
    if serving.penalized and served_by in ENGINES and served_by != serving.engine:
        raise ValidationError(f"{candidate}: served by {served_by}, whose penalties differ from {serving.engine}'s at draft "
                              f"steps 2 and later, and --serving {serving.label()} follows {serving.engine}'s rule: give "
                              f"--serving {replace(serving, engine=served_by).label()}")


def rendered_prompts(prompts: list[ValidationPrompt], tokenizer, thinking: bool) -> list[ValidationPrompt]:
    """The prompts as token ids: a chat prompt rendered by the tokenizer's template in the thinking mode
    asked (what a server renders), a window's context as it is."""
    out = []
    for prompt in prompts:
        if prompt.prompt_ids is None:
            text = tokenizer.apply_chat_template(list(prompt.messages), add_generation_prompt=True, tokenize=False,
                                                 enable_thinking=thinking)
            prompt = replace(prompt, prompt_ids=tuple(tokenizer(text, add_special_tokens=False)["input_ids"]))
        out.append(prompt)
    return out
