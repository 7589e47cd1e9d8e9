"""Endpoint validation: does turning MTP on change what the server says?

The original validation protocol, against two OpenAI-compatible servers (MTP off as the
reference, MTP on as the candidate; or one server, restarted between the two runs):

* a fixed prompt set: authored prompts (`AUTHORED_PROMPTS`) plus heldout prefixes (the
  messages before each heldout window's assistant turn), `--prompts` in all (20);
* greedy (`temperature: 0`), thinking disabled (`chat_template_kwargs:
  {"enable_thinking": false}`, which SGLang and vLLM pass to the template), token
  logprobs on, a bounded `max_tokens`;
* the first `--cold-warm` prompts (4) are sent twice to each server: a cold request,
  then the same request warm (the engine's prefix cache now holds it);
* output tokens and token logprobs are compared exactly: tokens must be identical (ids
  when the server returns them, `return_tokens_as_token_ids` as vLLM spells it, else the
  token strings) and logprobs within `--logprob-tolerance` (0: bit-equal as JSON
  numbers); the maximum logprob difference is reported either way. The original run
  counted 4/4 cold/warm and 20/20 fixed exact matches;
* speculative acceptance is read from the response metadata where the server reports
  it (SGLang: `meta_info.spec_verify_ct`, from which accept length = completion tokens /
  verify passes, and `spec_accept_rate` / accepted and drafted token counts where
  present; also looked for under `sglext`, `metadata` and `usage`).

Every request is sent one at a time with a timeout; a transport failure, an HTTP error
or a malformed response is recorded against its prompt (and fails the run), and after
`--max-consecutive-errors` transport failures the server is taken for dead and its
remaining requests are skipped. Writes `validation.json` (the report),
`responses-reference.json` and `responses-candidate.json` (every request and parsed
response; either can be passed back as `--reference FILE` to compare against a server
restarted since), and prints a summary. Exit status: 0 pass, 1 fail, 2 bad arguments.

    python -m occamy_mtp.validate --reference http://127.0.0.1:30000 \
        --candidate http://127.0.0.1:30001 --data heldout.jsonl --tokenizer DIR --out runs/validate
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import re
import socket
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

CHAT = "chat"
COMPLETIONS = "completions"
ENDPOINT_PATHS = {CHAT: "/v1/chat/completions", COMPLETIONS: "/v1/completions"}
DEFAULT_PROMPTS = 20
DEFAULT_COLD_WARM = 4
DEFAULT_MAX_TOKENS = 64
DEFAULT_TIMEOUT_SECONDS = 300.0
DEFAULT_MAX_CONSECUTIVE_ERRORS = 3
REPORT_FILE = "validation.json"
RESPONSES_FILE = "responses-{role}.json"
RESPONSES_FORMAT = 1
TOKEN_ID = re.compile(r"^token_id:(\d+)$")
# Where engines put per-request speculative counts, and what they call them. Read from
# SGLang's discussions: `meta_info.spec_verify_ct` (accept length = completion_tokens /
# spec_verify_ct) and the per-request `spec_accept_rate` / `spec_accept_length`. The other
# spellings and places are unverified guesses, looked for only because they are harmless.
METADATA_KEYS = ("meta_info", "sglext", "metadata", "usage")
VERIFY_COUNT_KEYS = ("spec_verify_ct", "spec_verify_count", "num_verify_steps")
ACCEPTED_KEYS = ("spec_accepted_tokens", "spec_accept_token_num", "num_accepted_tokens")
DRAFTED_KEYS = ("spec_draft_tokens", "spec_draft_token_num", "num_draft_tokens")

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


class ValidationError(ValueError):
    """Bad arguments or inputs: names the option or file."""


@dataclass(frozen=True)
class ValidationPrompt:
    name: str
    source: str  # "authored" or "heldout"
    messages: tuple[dict, ...]


# ----------------------------------------------------------------------------------
# The prompt set
# ----------------------------------------------------------------------------------


def heldout_prefixes(paths, tokenizer, **split) -> list[ValidationPrompt]:
    """The messages before each heldout window's assistant turn, in split order.

    The heldout split is `occamy_mtp.data.prepare_windows`' (pass the settings training
    used, e.g. train_conversations=..., heldout_conversations=..., split_seed=...).
    """
    from occamy_mtp import data as D

    prepared = D.prepare_windows(paths, tokenizer, **split)
    wanted = {(w.conversation_hash, w.turn_index) for w in prepared.heldout}
    conversations = {}
    for path in paths:
        for location, record in D.read_records(Path(path)):
            try:
                conversation = D.normalise_record(record, location)
            except D.DataError:
                continue  # prepare_windows raised or counted it already
            if isinstance(conversation, D.Conversation):
                conversations.setdefault(conversation.content_hash, conversation)
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


# ----------------------------------------------------------------------------------
# Talking to a server (urllib only)
# ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestSettings:
    endpoint: str = CHAT
    max_tokens: int = DEFAULT_MAX_TOKENS
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS
    model: str | None = None
    """The `model` field; None asks GET /v1/models and takes the first id."""
    token_ids: bool = True
    """Send `return_tokens_as_token_ids` (vLLM; others ignore it) to compare ids, not strings."""
    extra_body: dict = field(default_factory=dict)


class RequestFailed(Exception):
    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind  # "transport", "http" or "malformed"


def _post(url: str, body: dict, timeout: float) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode("utf-8"), headers={"Content-Type": "application/json"}, method="POST")
    return _read_json(request, timeout)


def _read_json(request, timeout: float) -> dict:
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw = response.read()
    except urllib.error.HTTPError as err:
        detail = err.read()[:300].decode("utf-8", "replace")
        raise RequestFailed("http", f"HTTP {err.code}: {detail}") from None
    except (urllib.error.URLError, http.client.HTTPException, ConnectionError, socket.timeout, TimeoutError, OSError) as err:
        reason = getattr(err, "reason", err)
        raise RequestFailed("transport", f"{type(err).__name__}: {reason}") from None
    try:
        parsed = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise RequestFailed("malformed", f"response is not JSON ({err}); first bytes {raw[:80]!r}") from None
    if not isinstance(parsed, dict):
        raise RequestFailed("malformed", f"response is a JSON {type(parsed).__name__}, not an object")
    return parsed


def server_model_name(base_url: str, timeout: float) -> str:
    listing = _read_json(urllib.request.Request(base_url.rstrip("/") + "/v1/models"), timeout)
    try:
        return listing["data"][0]["id"]
    except (KeyError, IndexError, TypeError):
        raise RequestFailed("malformed", "GET /v1/models: no data[0].id") from None


def request_body(prompt: ValidationPrompt, settings: RequestSettings, model: str, tokenizer=None) -> dict:
    body = {"model": model, "max_tokens": settings.max_tokens, "temperature": 0}
    if settings.endpoint == CHAT:
        body.update(messages=list(prompt.messages), logprobs=True, top_logprobs=0,
                    chat_template_kwargs={"enable_thinking": False})
    else:
        if tokenizer is None:
            raise ValidationError("--endpoint completions needs --tokenizer to render the chat template")
        text = tokenizer.apply_chat_template(list(prompt.messages), add_generation_prompt=True, tokenize=False, enable_thinking=False)
        body.update(prompt=text, logprobs=1)
    if settings.token_ids:
        body["return_tokens_as_token_ids"] = True
    body.update(settings.extra_body)
    return body


def parse_response(response: dict, endpoint: str) -> dict:
    """tokens, token ids (when given), logprobs, text, finish reason and speculative counts."""
    try:
        choice = response["choices"][0]
        logprobs = choice["logprobs"]
        if endpoint == CHAT:
            text = choice["message"]["content"]
            entries = logprobs["content"]
            tokens = [entry["token"] for entry in entries]
            values = [entry["logprob"] for entry in entries]
        else:
            text = choice["text"]
            tokens, values = logprobs["tokens"], logprobs["token_logprobs"]
    except (KeyError, IndexError, TypeError) as err:
        raise RequestFailed("malformed", f"missing field in the response: {err!r} (choices[0] with text and logprobs expected)") from None
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise RequestFailed("malformed", "logprobs tokens are not a list of strings")
    if len(values) != len(tokens) or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        raise RequestFailed("malformed", "token logprobs are not one number per token")
    ids = [TOKEN_ID.match(t) for t in tokens]
    return {
        "text": text if isinstance(text, str) else "",
        "tokens": tokens,
        "token_ids": [int(m.group(1)) for m in ids] if tokens and all(ids) else None,
        "logprobs": [float(v) for v in values],
        "finish_reason": choice.get("finish_reason"),
        "speculative": speculative_counts(response, len(tokens)),
    }


def _first(mapping: dict, keys) -> float | None:
    for key in keys:
        value = mapping.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value
    return None


def speculative_counts(response: dict, completion_tokens: int) -> dict | None:
    """Speculative counts of one response, wherever the engine put them; None if absent."""
    places = [response.get(key) for key in METADATA_KEYS]
    choices = response.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        places += [choices[0].get(key) for key in METADATA_KEYS]
    for place in places:
        if not isinstance(place, dict):
            continue
        verify = _first(place, VERIFY_COUNT_KEYS)
        if verify is None:
            continue
        out = {"verify_passes": int(verify), "completion_tokens": int(place.get("completion_tokens", completion_tokens))}
        accepted, drafted = _first(place, ACCEPTED_KEYS), _first(place, DRAFTED_KEYS)
        if accepted is not None and drafted is not None:
            out.update(accepted_tokens=int(accepted), draft_tokens=int(drafted))
        for key in ("spec_accept_rate", "spec_accept_length", "spec_accepted_per_step", "spec_proposed_per_step"):
            if key in place:
                out[key] = place[key]
        return out
    return None


def collect(base_url: str, prompts: list[ValidationPrompt], cold_warm: int, settings: RequestSettings,
            tokenizer=None, max_consecutive_errors: int = DEFAULT_MAX_CONSECUTIVE_ERRORS, log=None) -> dict:
    """Send every prompt (the first `cold_warm` twice) to one server, one at a time."""
    url = base_url.rstrip("/") + ENDPOINT_PATHS[settings.endpoint]
    run = {"format": RESPONSES_FORMAT, "server": base_url, "endpoint": settings.endpoint, "settings": asdict(settings),
           "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "model": settings.model,
           "cold_warm": cold_warm, "prompts": [asdict(p) for p in prompts], "requests": []}
    consecutive, dead = 0, None
    try:
        model = settings.model or server_model_name(base_url, settings.timeout_seconds)
    except RequestFailed as err:
        run["model_error"] = {"kind": err.kind, "message": str(err)}
        model = "default"  # a server without /v1/models may still serve completions
        if err.kind == "transport":
            dead = f"server unreachable (GET /v1/models: {err})"
    run["model"] = model
    for index, prompt in enumerate(prompts):
        for attempt in ("cold", "warm") if index < cold_warm else ("cold",):
            entry = {"prompt": prompt.name, "source": prompt.source, "attempt": attempt}
            if dead is not None:
                entry["error"] = {"kind": "skipped", "message": f"not sent: {dead}"}
                run["requests"].append(entry)
                continue
            started = time.perf_counter()
            try:
                response = _post(url, request_body(prompt, settings, model, tokenizer), settings.timeout_seconds)
                entry["response"] = parse_response(response, settings.endpoint)
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
    return run


# ----------------------------------------------------------------------------------
# Comparing
# ----------------------------------------------------------------------------------


def compare_responses(reference: dict, candidate: dict, tolerance: float) -> dict:
    """Token identity (ids when both give them) and the largest logprob difference."""
    by_ids = reference["token_ids"] is not None and candidate["token_ids"] is not None
    a = reference["token_ids"] if by_ids else reference["tokens"]
    b = candidate["token_ids"] if by_ids else candidate["tokens"]
    first_difference = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if first_difference is None and len(a) != len(b):
        first_difference = min(len(a), len(b))
    same_length = min(len(reference["logprobs"]), len(candidate["logprobs"]))
    diffs = [abs(x - y) for x, y in zip(reference["logprobs"][:same_length], candidate["logprobs"][:same_length])]
    max_diff = max(diffs, default=0.0)
    worst = diffs.index(max_diff) if diffs and max_diff > 0 else None
    tokens_match = first_difference is None
    return {
        "compared_by": "token_ids" if by_ids else "token_strings",
        "tokens_match": tokens_match,
        "first_token_difference": first_difference,
        "tokens": [len(a), len(b)],
        "max_logprob_diff": max_diff if not math.isnan(max_diff) else float("inf"),
        "max_logprob_diff_at": worst,
        "logprobs_match": tokens_match and max_diff <= tolerance,
        "exact": tokens_match and max_diff <= tolerance and reference["text"] == candidate["text"],
        "difference": None if tokens_match else {
            "position": first_difference,
            "reference": a[first_difference] if first_difference < len(a) else None,
            "candidate": b[first_difference] if first_difference < len(b) else None,
        },
    }


def _responses(run: dict) -> dict[str, dict[str, dict]]:
    """prompt -> attempt -> request entry."""
    out: dict[str, dict[str, dict]] = {}
    for entry in run["requests"]:
        out.setdefault(entry["prompt"], {})[entry["attempt"]] = entry
    return out


def acceptance_from_metadata(run: dict) -> dict | None:
    counted = [e["response"]["speculative"] for e in run["requests"] if "response" in e and e["response"]["speculative"]]
    if not counted:
        return None
    tokens = sum(c["completion_tokens"] for c in counted)
    verify = sum(c["verify_passes"] for c in counted)
    out = {"responses": len(counted), "completion_tokens": tokens, "verify_passes": verify,
           "accept_length": tokens / verify if verify else None}
    with_counts = [c for c in counted if "accepted_tokens" in c]
    if with_counts:
        accepted = sum(c["accepted_tokens"] for c in with_counts)
        drafted = sum(c["draft_tokens"] for c in with_counts)
        out.update(accepted_tokens=accepted, draft_tokens=drafted, accept_rate=accepted / drafted if drafted else None)
    rates = [c["spec_accept_rate"] for c in counted if isinstance(c.get("spec_accept_rate"), (int, float))]
    if rates:  # SGLang's per-request figure; without token counts only its mean can be given
        out["mean_request_accept_rate"] = sum(rates) / len(rates)
    per_step = [c for c in counted if "spec_accepted_per_step" in c and "spec_proposed_per_step" in c]
    if per_step:
        steps = max(len(c["spec_accepted_per_step"]) for c in per_step)
        accepted_k = [sum(c["spec_accepted_per_step"][k] for c in per_step if k < len(c["spec_accepted_per_step"])) for k in range(steps)]
        proposed_k = [sum(c["spec_proposed_per_step"][k] for c in per_step if k < len(c["spec_proposed_per_step"])) for k in range(steps)]
        out["per_step"] = {"accepted": accepted_k, "proposed": proposed_k,
                           "acceptance": [a / p if p else None for a, p in zip(accepted_k, proposed_k)]}
    return out


def compare_runs(reference: dict, candidate: dict, cold_warm_prompts: list[str], tolerance: float) -> dict:
    """The report: cold/warm per server, fixed-set matches across servers, errors, acceptance."""
    ref, cand = _responses(reference), _responses(candidate)
    errors = [
        {"server": role, "prompt": e["prompt"], "attempt": e["attempt"], **e["error"]}
        for role, run in (("reference", reference), ("candidate", candidate)) for e in run["requests"] if "error" in e
    ]
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
    passed = (
        not errors
        and fixed_exact == len(prompts) > 0
        and all(r["exact"] == r["of"] for r in cold_warm_report.values())
    )
    return {
        "passed": passed,
        "fixed": {"exact": fixed_exact, "of": len(prompts)},
        "cold_warm": cold_warm_report,
        "max_logprob_diff": max_diff,
        "logprob_tolerance": tolerance,
        "token_differences": [p["prompt"] for p in prompts if "comparisons" in p and not all(c["tokens_match"] for c in p["comparisons"].values())],
        "logprob_differences": [p["prompt"] for p in prompts if "comparisons" in p and all(c["tokens_match"] for c in p["comparisons"].values())
                                and not all(c["logprobs_match"] for c in p["comparisons"].values())],
        "errors": errors,
        "acceptance": {"reference": acceptance_from_metadata(reference), "candidate": acceptance_from_metadata(candidate)},
        "prompts": prompts,
    }


def format_summary(report: dict) -> str:
    lines = [f"validation: reference {report['reference']} vs candidate {report['candidate']} ({report['endpoint']}, "
             f"max_tokens {report['max_tokens']}, greedy, thinking disabled)"]
    fixed = report["fixed"]
    lines.append(f"fixed prompts: {fixed['exact']}/{fixed['of']} exact matches (tokens, and logprobs within "
                 f"{report['logprob_tolerance']:g}); max |logprob difference| {report['max_logprob_diff']:.3e}")
    cw = report["cold_warm"]
    lines.append(f"cold/warm: reference {cw['reference']['exact']}/{cw['reference']['of']}, candidate {cw['candidate']['exact']}/{cw['candidate']['of']}")
    for name in report["token_differences"]:
        row = next(p for p in report["prompts"] if p["prompt"] == name)
        diff = next(c["difference"] for c in row["comparisons"].values() if not c["tokens_match"])
        lines.append(f"  token difference: {name} at output token {diff['position']}: {diff['reference']!r} vs {diff['candidate']!r}")
    for name in report["logprob_differences"]:
        row = next(p for p in report["prompts"] if p["prompt"] == name)
        lines.append(f"  logprob difference: {name}: max {row['max_logprob_diff']:.3e} (tokens identical)")
    for error in report["errors"]:
        lines.append(f"  error ({error['kind']}): {error['server']} {error['prompt']} {error['attempt']}: {error['message']}")
    for role in ("reference", "candidate"):
        acceptance = report["acceptance"][role]
        if acceptance is None:
            lines.append(f"acceptance ({role}): not reported by the server")
            continue
        text = f"acceptance ({role}, from response metadata): accept length {acceptance['accept_length']:.3f} " \
               f"({acceptance['completion_tokens']} tokens / {acceptance['verify_passes']} verify passes, {acceptance['responses']} responses)"
        if acceptance.get("accept_rate") is not None:
            text += f", accept rate {acceptance['accept_rate']:.2%} ({acceptance['accepted_tokens']}/{acceptance['draft_tokens']})"
        elif "mean_request_accept_rate" in acceptance:
            text += f", mean per-request accept rate {acceptance['mean_request_accept_rate']:.2%}"
        lines.append(text)
        if "per_step" in acceptance:
            steps = ", ".join(f"step {k + 1} {a}/{p}" for k, (a, p) in enumerate(zip(acceptance["per_step"]["accepted"], acceptance["per_step"]["proposed"])))
            lines.append(f"  per step: {steps}")
    lines.append(f"RESULT: {'PASS' if report['passed'] else 'FAIL'}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------


def _is_url(text: str) -> bool:
    return text.startswith("http://") or text.startswith("https://")


def load_run(path: Path) -> dict:
    try:
        run = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValidationError(f"{path}: cannot read recorded responses ({err})") from None
    if not isinstance(run, dict) or run.get("format") != RESPONSES_FORMAT or not {"requests", "prompts", "settings"} <= set(run):
        raise ValidationError(f"{path}: not a responses file written by occamy_mtp.validate")
    return run


def validate(reference: str, candidate: str | None, prompts: list[ValidationPrompt], out_dir: Path, settings: RequestSettings,
             cold_warm: int = DEFAULT_COLD_WARM, tolerance: float = 0.0, tokenizer=None,
             max_consecutive_errors: int = DEFAULT_MAX_CONSECUTIVE_ERRORS, log=None) -> dict | None:
    """Collect (or load) both runs, compare, write the files; None when only recording the reference.

    A recorded reference (a responses file) brings its own prompts, cold/warm count and
    request settings; `prompts`, `cold_warm` and `settings` (but its timeout) are then unused.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = {}
    if not _is_url(reference):
        # A recorded reference fixes the protocol: its prompts, cold/warm count and request settings.
        runs["reference"] = load_run(Path(reference))
        prompts = [ValidationPrompt(p["name"], p["source"], tuple(p["messages"])) for p in runs["reference"]["prompts"]]
        cold_warm = runs["reference"]["cold_warm"]
        settings = RequestSettings(**{**runs["reference"]["settings"], "timeout_seconds": settings.timeout_seconds})
    for role, source in (("reference", reference), ("candidate", candidate)):
        if source is None or role in runs:
            continue
        if _is_url(source):
            runs[role] = collect(source, prompts, cold_warm, settings, tokenizer, max_consecutive_errors, log)
            (out_dir / RESPONSES_FILE.format(role=role)).write_text(json.dumps(runs[role], indent=1) + "\n")
        else:
            runs[role] = load_run(Path(source))
    if candidate is None:
        return None
    recorded = [e["prompt"] for e in runs["reference"]["requests"] if e["attempt"] == "warm"]
    report = compare_runs(runs["reference"], runs["candidate"], recorded, tolerance)
    report = {
        "format": RESPONSES_FORMAT,
        "reference": reference,
        "candidate": candidate,
        "endpoint": runs["reference"]["endpoint"],
        "max_tokens": runs["reference"]["settings"]["max_tokens"],
        "prompt_set": [{"name": p.name, "source": p.source} for p in prompts],
        **report,
    }
    (out_dir / REPORT_FILE).write_text(json.dumps(report, indent=1) + "\n")
    return report


def main(argv: list[str] | None = None) -> int:
    from occamy_mtp import data as D

    parser = argparse.ArgumentParser(prog="python -m occamy_mtp.validate", description="Compare two OpenAI-compatible servers (MTP off vs on) token for token.")
    parser.add_argument("--reference", required=True, help="URL of the MTP-off server, or a responses-reference.json recorded earlier")
    parser.add_argument("--candidate", help="URL of the MTP-on server (or a recorded responses file); omit to record the reference only")
    parser.add_argument("--data", nargs="*", type=Path, default=[], help="chat data files: heldout prefixes join the authored prompts")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer directory (needed with --data and --endpoint completions)")
    parser.add_argument("--train-conversations", type=int, default=D.DEFAULT_TRAIN_CONVERSATIONS, help="as in training, so the heldout split is the same")
    parser.add_argument("--heldout-conversations", type=int, default=D.DEFAULT_HELDOUT_CONVERSATIONS)
    parser.add_argument("--split-seed", type=int, default=0)
    parser.add_argument("--prompts", type=int, default=DEFAULT_PROMPTS, help="size of the fixed prompt set")
    parser.add_argument("--cold-warm", type=int, default=DEFAULT_COLD_WARM, help="prompts sent twice (cold, then warm)")
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    parser.add_argument("--endpoint", choices=(CHAT, COMPLETIONS), default=CHAT)
    parser.add_argument("--model", help="the request's model field (default: the server's first /v1/models id)")
    parser.add_argument("--no-token-ids", action="store_true", help="do not ask for token ids (compare token strings)")
    parser.add_argument("--extra-body", default="{}", help="JSON object merged into every request body")
    parser.add_argument("--logprob-tolerance", type=float, default=0.0, help="largest |logprob difference| still counted as exact")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_SECONDS, help="seconds per request")
    parser.add_argument("--max-consecutive-errors", type=int, default=DEFAULT_MAX_CONSECUTIVE_ERRORS)
    parser.add_argument("--out", required=True, type=Path, help="directory for validation.json and the responses files")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)

    try:
        extra = json.loads(args.extra_body)
        if not isinstance(extra, dict):
            raise ValueError
    except ValueError:
        print(f"error: --extra-body must be a JSON object, got {args.extra_body!r}", file=sys.stderr)
        return 2
    if min(args.prompts, args.max_tokens, args.max_consecutive_errors) < 1 or args.cold_warm < 0 or args.timeout <= 0:
        print("error: --prompts, --max-tokens, --max-consecutive-errors must be >= 1, --cold-warm >= 0, --timeout > 0", file=sys.stderr)
        return 2
    for flag, value in (("--reference", args.reference), ("--candidate", args.candidate)):
        if value is not None and not _is_url(value) and not Path(value).is_file():
            print(f"error: {flag} {value}: neither an http(s) URL nor a responses file", file=sys.stderr)
            return 2
    tokenizer = None
    if args.data or args.endpoint == COMPLETIONS:
        if args.tokenizer is None or not args.tokenizer.is_dir():
            print("error: --tokenizer DIR is needed with --data or --endpoint completions", file=sys.stderr)
            return 2
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(args.tokenizer), local_files_only=True)
    try:
        heldout = heldout_prefixes(args.data, tokenizer, train_conversations=args.train_conversations,
                                   heldout_conversations=args.heldout_conversations, split_seed=args.split_seed) if args.data else []
        prompts = prompt_set(args.prompts, heldout)
        settings = RequestSettings(args.endpoint, args.max_tokens, args.timeout, args.model, not args.no_token_ids, extra)
        log = None if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
        report = validate(args.reference, args.candidate, prompts, args.out, settings, min(args.cold_warm, len(prompts)),
                          args.logprob_tolerance, tokenizer, args.max_consecutive_errors, log)
    except (ValidationError, D.DataError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if report is None:
        print(f"recorded {len(prompts)} prompts from {args.reference} into {args.out / RESPONSES_FILE.format(role='reference')}")
        return 0
    print(format_summary(report))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
