"""Endpoint validation: does turning MTP on change what the server says, and does it draft?

The original validation protocol, against two OpenAI-compatible servers (MTP off as the
reference, MTP on as the candidate; or one server, restarted between the two runs):

* a fixed prompt set: authored prompts (`AUTHORED_PROMPTS`) plus heldout prefixes (the
  messages before each heldout window's assistant turn), `--prompts` in all (20);
* greedy (`temperature: 0`), thinking disabled (`chat_template_kwargs:
  {"enable_thinking": false}`, which SGLang and vLLM pass to the template), token
  logprobs on (with the top `--top-logprobs` alternatives, used only to diagnose a
  divergence), a bounded `max_tokens`;
* the first `--cold-warm` prompts (4) are sent twice to each server: a cold request,
  then the same request warm (the engine's prefix cache now holds it);
* output tokens and token logprobs are compared exactly: tokens must be identical (ids
  when the server returns them, else the token strings) and logprobs within
  `--logprob-tolerance` (0: bit-equal as JSON numbers); the maximum logprob difference
  is reported either way. Where tokens differ, the report gives the number of prompts,
  the first differing output token of each, and the reference's margin between its top
  two candidates there (a near tie points at rounding, see docs/ENGINES.md). The
  original run counted 4/4 cold/warm and 20/20 fixed exact matches;
* speculative acceptance is read the way each engine reports it (docs/ENGINES.md):
  - SGLang, per request: the body asks for it (`return_meta_info: true`; newer builds
    also `return_spec_tokens_details: true`), and it comes back in
    `choices[0].meta_info` (`spec_verify_ct`, `spec_num_correct_drafts`,
    `spec_num_proposed_drafts`, `spec_correct_drafts_histogram`; 0.5.12 also spells them
    `spec_accepted_drafts`, `spec_proposed_drafts`, `spec_accept_histogram`) or in
    `sglext.spec_tokens_details`;
  - vLLM, per request only when the server was started with
    `--per-request-spec-decode-metrics summary|detailed`: `metrics.speculative_decoding`;
  - vLLM, always: the Prometheus counters on `/metrics` (`vllm:spec_decode_num_drafts`,
    `..._num_draft_tokens`, `..._num_accepted_tokens`, `..._num_accepted_tokens_per_pos`),
    read before and after the run; the difference is this run's, provided nobody else
    uses the server meanwhile.
  Per-request figures are preferred; the report names the engine (from `/v1/models`'
  `owned_by` and the engine's version endpoint) and the source it used. Per-position
  (chained) acceptance comes from the histogram or from the per-position counters.
  The candidate must draft: a candidate that reports no speculative counts at all, or
  drafted nothing, fails (`--allow-no-drafts` compares two servers without MTP);
* an engine that does not speculate on requests asking for logprobs (older vLLM) shows
  zero drafts for the logprob run; with `--acceptance-pass auto` (the default) the
  prompts are then sent once more without logprobs (when the candidate must draft),
  acceptance is read from that pass, and its tokens (ids with `return_token_ids`, else
  text) are compared with the reference too. `always` runs that pass anyway, `never`
  never.

Every request is sent one at a time, and `--timeout` bounds each whole request by the
wall clock (connect, send, and the whole response, however slowly it trickles in).
A transport failure, an HTTP error or a malformed response (not JSON, a missing or
mistyped field, a non-finite number, nesting too deep, a body over `MAX_RESPONSE_BYTES`)
is recorded against its prompt with the reason (and fails the run); after
`--max-consecutive-errors` transport failures the server is taken for dead and its
remaining requests are skipped. Writes `validation.json` (the report),
`responses-reference.json` and `responses-candidate.json` (every request and parsed
response; either can be passed back as `--reference FILE` to compare against a server
restarted since; `responses-candidate-acceptance.json` for the acceptance pass), and
prints a summary. Exit status: 0 pass, 1 fail, 2 bad arguments.

    python -m occamy_mtp.validate --reference http://127.0.0.1:30000 \
        --candidate http://127.0.0.1:30001 --data heldout.jsonl --tokenizer DIR --out runs/validate
"""

from __future__ import annotations

import argparse
import json
import math
import re
import socket
import ssl
import sys
import time
import urllib.parse
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from occamy_mtp.errors import OccamyError

CHAT = "chat"
COMPLETIONS = "completions"
ENDPOINT_PATHS = {CHAT: "/v1/chat/completions", COMPLETIONS: "/v1/completions"}
DEFAULT_PROMPTS = 20
DEFAULT_COLD_WARM = 4
DEFAULT_MAX_TOKENS = 64
DEFAULT_TOP_LOGPROBS = 2  # the runner-up at a divergence tells a near tie from a real difference
DEFAULT_TIMEOUT_SECONDS = 300.0
DEFAULT_MAX_CONSECUTIVE_ERRORS = 3
ACCEPTANCE_PASS_MODES = ("auto", "always", "never")
REPORT_FILE = "validation.json"
RESPONSES_FILE = "responses-{role}.json"
RESPONSES_FORMAT = 2
MAX_RESPONSE_BYTES = 64 << 20  # a completion of a few thousand tokens with logprobs is well under 1 MiB
MAX_HISTOGRAM_LENGTH = 1024  # draft steps + 1; engines draft a handful
MAX_COUNT = 2**53  # counts beyond this are not counts (and lose precision as JSON doubles)
RECV_BYTES = 1 << 16
TOKEN_ID = re.compile(r"^token_id:(\d+)$")
# /metrics: vLLM's counters are updated by its output loop, possibly just after the last
# response went out; read until two reads agree (at most this many, this far apart).
METRICS_SETTLE_READS = 6
METRICS_SETTLE_SECONDS = 0.5
VLLM_COUNTERS = {
    "drafts": "vllm:spec_decode_num_drafts",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
}
VLLM_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"
PROMETHEUS_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)(\s+\S+)?$")
PROMETHEUS_POSITION = re.compile(r'position="(\d+)"')
SGLANG_META = "sglang: choices[0].meta_info"
SGLANG_SGLEXT = "sglang: sglext.spec_tokens_details"
VLLM_PER_REQUEST = "vllm: metrics.speculative_decoding"
VLLM_METRICS = "vllm: /metrics counters (after - before)"

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


def heldout_window_contexts(paths, tokenizer, **split) -> list[ValidationPrompt]:
    """Each heldout window's context (the <= context_tokens tokens before its answer, ending
    with the assistant header), as token ids: the prompts `occamy_mtp.evaluate
    --reference-decoder` decodes, so that the engine's acceptance and the library's are
    measured on the same prompts, token for token. Pass the window and split settings of
    training (context_tokens=..., answer_tokens=..., train_conversations=..., ...)."""
    from occamy_mtp import data as D

    prepared = D.prepare_windows(paths, tokenizer, **split)
    return [ValidationPrompt(f"window-{w.conversation_hash[:12]}-{w.turn_index}", "window", (), tuple(w.input_ids[: w.answer_start]))
            for w in prepared.heldout]


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
# Talking to a server (stdlib sockets: one deadline for the whole request)
# ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestSettings:
    endpoint: str = CHAT
    max_tokens: int = DEFAULT_MAX_TOKENS
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS
    """Wall-clock limit of one whole request (connect, send, receive)."""
    model: str | None = None
    """The `model` field; None asks GET /v1/models and takes the first id."""
    token_ids: bool = True
    """Ask for output token ids (`return_token_ids`; vLLM's `return_tokens_as_token_ids`) to compare ids, not strings."""
    logprobs: bool = True
    """Ask for token logprobs (the acceptance pass of an engine that does not speculate with them turns this off)."""
    top_logprobs: int = DEFAULT_TOP_LOGPROBS
    """Alternatives per output token, kept to diagnose a divergence (never compared)."""
    engine_fields: bool = True
    """Ask for SGLang's per-request speculative counts (`return_meta_info`, `return_spec_tokens_details`)."""
    extra_body: dict = field(default_factory=dict)


class RequestFailed(Exception):
    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind  # "transport", "http" or "malformed"


class _Deadline:
    """Seconds left of one request; raises a transport failure once they are spent."""

    def __init__(self, seconds: float, what: str):
        self.seconds, self.what = seconds, what
        self.end = time.monotonic() + seconds

    def left(self, received: int = 0) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            raise self.expired(received)
        return left

    def expired(self, received: int) -> RequestFailed:
        return RequestFailed("transport", f"{self.what}: no complete response within the {self.seconds:g} s timeout "
                                          f"(whole request, {received} bytes received)")


def _http(method: str, url: str, body: bytes | None, timeout_seconds: float) -> tuple[int, bytes]:
    """One HTTP/1.1 request (Connection: close); (status, body). The timeout bounds the whole
    exchange: every socket operation waits at most for what is left of it."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise RequestFailed("transport", f"not an http(s) URL: {url!r}")
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    deadline = _Deadline(timeout_seconds, f"{method} {target}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    head = [f"{method} {target} HTTP/1.1", f"Host: {parts.netloc}", "Connection: close", "Accept: application/json, text/plain"]
    if body is not None:
        head += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    payload = ("\r\n".join(head) + "\r\n\r\n").encode("ascii") + (body or b"")
    received = bytearray()
    try:
        sock = socket.create_connection((parts.hostname, port), timeout=deadline.left())
        try:
            if parts.scheme == "https":
                sock = ssl.create_default_context().wrap_socket(sock, server_hostname=parts.hostname)
            sock.settimeout(deadline.left())
            sock.sendall(payload)
            expected = None  # header bytes + Content-Length, once the headers are in
            while expected is None or len(received) < expected:
                sock.settimeout(deadline.left(len(received)))
                chunk = sock.recv(RECV_BYTES)
                if not chunk:
                    break
                received += chunk
                if len(received) > MAX_RESPONSE_BYTES:
                    raise RequestFailed("malformed", f"{method} {target}: response larger than {MAX_RESPONSE_BYTES} bytes")
                if expected is None and b"\r\n\r\n" in received:
                    expected = _expected_length(bytes(received))
        finally:
            sock.close()
    except (socket.timeout, TimeoutError):  # a socket wait ran into the deadline
        raise deadline.expired(len(received)) from None
    except (ConnectionError, ssl.SSLError, OSError) as err:
        raise RequestFailed("transport", f"{method} {target}: {type(err).__name__}: {err}") from None
    return _parse_http(bytes(received), f"{method} {target}")


def _split_head(raw: bytes) -> tuple[list[str], bytes]:
    head, _, rest = raw.partition(b"\r\n\r\n")
    return head.decode("iso-8859-1").split("\r\n"), rest


def _headers(lines: list[str]) -> dict[str, str]:
    out = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        out[name.strip().lower()] = value.strip()
    return out


def _expected_length(raw: bytes) -> int | None:
    """Total bytes of the response when it declares a Content-Length (else read to EOF)."""
    lines, _ = _split_head(raw)
    length = _headers(lines).get("content-length")
    if length is None or not length.isdigit():
        return None
    return raw.index(b"\r\n\r\n") + 4 + int(length)


def _parse_http(raw: bytes, what: str) -> tuple[int, bytes]:
    if b"\r\n\r\n" not in raw:
        raise RequestFailed("transport", f"{what}: connection closed before a complete HTTP header ({len(raw)} bytes)")
    lines, body = _split_head(raw)
    status = lines[0].split(" ", 2)
    if len(status) < 2 or not status[0].startswith("HTTP/") or not status[1].isdigit():
        raise RequestFailed("malformed", f"{what}: not an HTTP status line: {lines[0][:80]!r}")
    headers = _headers(lines)
    if "chunked" in headers.get("transfer-encoding", "").lower():
        body = _dechunk(body, what)
    elif headers.get("content-length", "").isdigit() and len(body) < int(headers["content-length"]):
        raise RequestFailed("transport", f"{what}: connection closed after {len(body)} of {headers['content-length']} body bytes")
    return int(status[1]), body


def _dechunk(body: bytes, what: str) -> bytes:
    out, at = bytearray(), 0
    while True:
        end = body.find(b"\r\n", at)
        size_text = body[at:end].split(b";")[0].strip() if end >= 0 else b""
        try:
            size = int(size_text, 16)
        except ValueError:
            raise RequestFailed("malformed", f"{what}: bad chunked encoding") from None
        if size == 0:
            return bytes(out)
        if end + 2 + size > len(body):
            raise RequestFailed("transport", f"{what}: connection closed inside a chunk")
        out += body[end + 2 : end + 2 + size]
        at = end + 2 + size + 2


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _json(raw: bytes, what: str):
    """Parse a JSON body; NaN/Infinity literals, bad UTF-8 and nesting too deep to parse are malformed."""
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except RecursionError:
        raise RequestFailed("malformed", f"{what}: JSON nested too deeply to parse") from None
    except (ValueError, UnicodeDecodeError) as err:  # JSONDecodeError is a ValueError
        raise RequestFailed("malformed", f"{what}: response is not JSON ({err}); first bytes {raw[:80]!r}") from None


def _request_json(method: str, url: str, body: dict | None, timeout: float) -> dict:
    status, raw = _http(method, url, None if body is None else json.dumps(body).encode("utf-8"), timeout)
    what = f"{method} {urllib.parse.urlsplit(url).path}"
    if not 200 <= status < 300:
        raise RequestFailed("http", f"HTTP {status}: {raw[:300].decode('utf-8', 'replace')}")
    parsed = _json(raw, what)
    if not isinstance(parsed, dict):
        raise RequestFailed("malformed", f"{what}: response is a JSON {type(parsed).__name__}, not an object")
    return parsed


def _post(url: str, body: dict, timeout: float) -> dict:
    return _request_json("POST", url, body, timeout)


def _get(url: str, timeout: float) -> dict:
    return _request_json("GET", url, None, timeout)


def server_identity(base_url: str, timeout: float) -> dict:
    """{"model": first /v1/models id, "engine": owned_by ("vllm", "sglang", ...), "version": ...}.

    vLLM's and SGLang's model cards name the engine in `owned_by`; the version comes
    from vLLM's GET /version or SGLang's GET /server_info (absent: None)."""
    listing = _get(base_url.rstrip("/") + "/v1/models", timeout)
    data = listing.get("data")
    card = data[0] if isinstance(data, list) and data and isinstance(data[0], dict) else None
    if card is None or not isinstance(card.get("id"), str):
        raise RequestFailed("malformed", "GET /v1/models: no data[0].id")
    engine = card.get("owned_by") if isinstance(card.get("owned_by"), str) else None
    version = None
    path = {"vllm": "/version", "sglang": "/server_info"}.get(engine)
    if path is not None:
        try:
            version = _get(base_url.rstrip("/") + path, timeout).get("version")
        except RequestFailed:
            pass  # the version is a label only
    return {"model": card["id"], "engine": engine, "version": version if isinstance(version, str) else None}


def server_model_name(base_url: str, timeout: float) -> str:
    return server_identity(base_url, timeout)["model"]


def request_body(prompt: ValidationPrompt, settings: RequestSettings, model: str, tokenizer=None) -> dict:
    body = {"model": model, "max_tokens": settings.max_tokens, "temperature": 0}
    if settings.endpoint == CHAT:
        if prompt.prompt_ids is not None:
            raise ValidationError(f"{prompt.name}: a token-id prompt needs --endpoint completions")
        body.update(messages=list(prompt.messages), chat_template_kwargs={"enable_thinking": False})
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
                                                           tokenize=False, enable_thinking=False)
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
# Reading a response: tokens, logprobs, speculative counts (every field checked)
# ----------------------------------------------------------------------------------


def _malformed(message: str) -> RequestFailed:
    return RequestFailed("malformed", message)


def _brief(value) -> str:
    """A value for an error message: scalars shown (cut short), containers by type only."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)[:40]
    return f"a JSON {'array' if isinstance(value, list) else 'object'}"


def _count(value, name: str) -> int:
    """A non-negative integer count (an integral finite float such as 12.0 is accepted)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _malformed(f"{name} is {_brief(value)}, not a count")
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        raise _malformed(f"{name} is {_brief(value)}, not a finite whole number")
    if not 0 <= value <= MAX_COUNT:
        raise _malformed(f"{name} is {_brief(value)}, outside 0..2^53")
    return int(value)


def _counts(value, name: str) -> list[int]:
    if not isinstance(value, list):
        raise _malformed(f"{name} is {type(value).__name__}, not a list of counts")
    if len(value) > MAX_HISTOGRAM_LENGTH:
        raise _malformed(f"{name} has {len(value)} entries (at most {MAX_HISTOGRAM_LENGTH})")
    return [_count(v, f"{name}[{i}]") for i, v in enumerate(value)]


def _logprob(value, name: str) -> float:
    if not isinstance(value, bool) and isinstance(value, (int, float)):
        try:
            number = float(value)  # an int beyond float range raises
        except OverflowError:
            number = math.inf
        if math.isfinite(number):
            return number
    raise _malformed(f"{name} is {_brief(value)}, not a finite number")


def _object(value, name: str) -> dict | None:
    """An optional JSON object: absent/null -> None, an object -> itself, anything else is malformed."""
    if value is None or isinstance(value, dict):
        return value
    raise _malformed(f"{name} is {type(value).__name__}, not an object")


def _first_present(place: dict, names: tuple[str, ...]) -> tuple[str, object] | None:
    for name in names:
        if name in place:
            return name, place[name]
    return None


def _top_alternatives(entries, name: str) -> list[list]:
    """[[token, logprob], ...] best first, from a chat `top_logprobs` list or a completions dict."""
    if entries is None:
        return []
    if isinstance(entries, dict):
        pairs = list(entries.items())
    elif isinstance(entries, list):
        pairs = []
        for i, entry in enumerate(entries):
            if not isinstance(entry, dict) or not isinstance(entry.get("token"), str):
                raise _malformed(f"{name}[{i}] is not an object with a token")
            pairs.append((entry["token"], entry.get("logprob")))
    else:
        raise _malformed(f"{name} is {type(entries).__name__}, not a list")
    out = [[str(token), _logprob(lp, f"{name}[{token!r}]")] for token, lp in pairs]
    return sorted(out, key=lambda pair: -pair[1])[:DEFAULT_TOP_LOGPROBS]


def parse_response(response: dict, endpoint: str, logprobs: bool = True) -> dict:
    """Text, tokens, token ids (when given), logprobs, the top alternatives, finish reason and
    speculative counts of one response; RequestFailed("malformed") names the first bad field."""
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise _malformed("missing field in the response: choices[0] (an object) expected")
    choice = choices[0]
    if endpoint == CHAT:
        message = _object(choice.get("message"), "choices[0].message")
        text = message.get("content") if message else None
    else:
        text = choice.get("text")
    if text is not None and not isinstance(text, str):
        raise _malformed(f"the response text is {type(text).__name__}, not a string")
    ids_field = _first_present(choice, ("token_ids", "response_token_ids"))  # vLLM / SGLang chat
    explicit_ids = None
    if ids_field is not None and ids_field[1] is not None:
        explicit_ids = _counts_unbounded(ids_field[1], f"choices[0].{ids_field[0]}")

    tokens, values, top = None, [], []
    if logprobs:
        block = _object(choice.get("logprobs"), "choices[0].logprobs")
        if block is None:
            raise _malformed("missing field in the response: choices[0].logprobs (logprobs were asked for)")
        if endpoint == CHAT:
            entries = block.get("content")
            if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
                raise _malformed("choices[0].logprobs.content is not a list of objects")
            tokens = [e.get("token") for e in entries]
            raw_values = [e.get("logprob") for e in entries]
            raw_top = [e.get("top_logprobs") for e in entries]
        else:
            tokens, raw_values, raw_top = block.get("tokens"), block.get("token_logprobs"), block.get("top_logprobs")
            if raw_top is None and isinstance(tokens, list):
                raw_top = [None] * len(tokens)
        if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
            raise _malformed("logprobs tokens are not a list of strings")
        if not isinstance(raw_values, list) or len(raw_values) != len(tokens):
            raise _malformed("token logprobs are not one number per token")
        values = [_logprob(v, f"token logprob {i}") for i, v in enumerate(raw_values)]
        if not isinstance(raw_top, list) or len(raw_top) != len(tokens):
            raise _malformed("top logprobs are not one entry per token")
        top = [_top_alternatives(t, f"top logprobs of token {i}") for i, t in enumerate(raw_top)]
        if explicit_ids is not None and len(explicit_ids) != len(tokens):
            raise _malformed(f"{len(explicit_ids)} token ids for {len(tokens)} logprob tokens")
    ids = explicit_ids
    if ids is None and tokens:
        matches = [TOKEN_ID.match(t) for t in tokens]
        ids = [int(m.group(1)) for m in matches] if all(matches) else None
    finish = choice.get("finish_reason")
    return {
        "text": text or "",
        "tokens": tokens,
        "token_ids": ids,
        "logprobs": values,
        "top_logprobs": top,
        "finish_reason": finish if isinstance(finish, str) else None,
        "speculative": speculative_counts(response),
    }


def _counts_unbounded(value, name: str) -> list[int]:
    """Token ids: a list of non-negative integers of any length (the body size bounds it)."""
    if not isinstance(value, list):
        raise _malformed(f"{name} is {type(value).__name__}, not a list")
    return [_count(v, f"{name}[{i}]") for i, v in enumerate(value)]


def speculative_counts(response: dict) -> dict | None:
    """One response's speculative counts, normalised, wherever its engine put them; None if absent.

    Normalised: source, verify_passes, accepted_tokens, draft_tokens (None where the engine
    does not say), completion_tokens, histogram (index j: verify passes that accepted
    exactly j drafts; [] if not given), draft_steps (K, where it can be told)."""
    choices = response.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    meta = _object(choice.get("meta_info"), "choices[0].meta_info")
    if meta is not None and "spec_verify_ct" in meta:
        return _sglang_counts(meta, SGLANG_META, "choices[0].meta_info")
    sglext = _object(response.get("sglext"), "sglext")
    details = sglext.get("spec_tokens_details") if sglext else None
    if isinstance(details, list):  # one entry per choice when n > 1
        details = details[0] if details else None
    details = _object(details, "sglext.spec_tokens_details")
    if details is not None:
        return _sglang_counts(details, SGLANG_SGLEXT, "sglext.spec_tokens_details")
    metrics = _object(response.get("metrics"), "metrics")
    spec = _object(metrics.get("speculative_decoding") if metrics else None, "metrics.speculative_decoding")
    if spec is not None:
        return _vllm_request_counts(spec)
    return None


def _sglang_counts(place: dict, source: str, where: str) -> dict:
    """SGLang's `spec_*` fields (0.5.23 names; 0.5.12's aliases accepted)."""
    verify = _count(place["spec_verify_ct"], f"{where}.spec_verify_ct")
    out = {"source": source, "verify_passes": verify, "accepted_tokens": None, "draft_tokens": None,
           "completion_tokens": None, "histogram": [], "draft_steps": None}
    for key, names in (("accepted_tokens", ("spec_num_correct_drafts", "spec_accepted_drafts")),
                       ("draft_tokens", ("spec_num_proposed_drafts", "spec_proposed_drafts")),
                       ("completion_tokens", ("completion_tokens",))):
        found = _first_present(place, names)
        if found is not None:
            out[key] = _count(found[1], f"{where}.{found[0]}")
    found = _first_present(place, ("spec_correct_drafts_histogram", "spec_accept_histogram"))
    if found is not None:
        out["histogram"] = _counts(found[1], f"{where}.{found[0]}")
    # SGLang counts K drafts per verify pass (num_draft_tokens - 1): K = proposed / verify passes.
    if verify and out["draft_tokens"] is not None and out["draft_tokens"] % verify == 0:
        out["draft_steps"] = out["draft_tokens"] // verify
    return _check_counts(out, where)


def _vllm_request_counts(spec: dict) -> dict:
    """vLLM's `metrics.speculative_decoding` (--per-request-spec-decode-metrics, vLLM 0.32)."""
    where = "metrics.speculative_decoding"
    missing = [k for k in ("num_spec_steps", "num_accepted_draft_tokens", "num_draft_tokens") if k not in spec]
    if missing:
        raise _malformed(f"{where} lacks {', '.join(missing)}")
    out = {"source": VLLM_PER_REQUEST,
           "verify_passes": _count(spec["num_spec_steps"], f"{where}.num_spec_steps"),
           "accepted_tokens": _count(spec["num_accepted_draft_tokens"], f"{where}.num_accepted_draft_tokens"),
           "draft_tokens": _count(spec["num_draft_tokens"], f"{where}.num_draft_tokens"),
           "completion_tokens": None,
           "histogram": _counts(spec.get("acceptance_histogram", []), f"{where}.acceptance_histogram"),
           "draft_steps": _count(spec["num_spec_tokens"], f"{where}.num_spec_tokens") if "num_spec_tokens" in spec else None}
    return _check_counts(out, where)


def _check_counts(out: dict, where: str) -> dict:
    accepted, drafted = out["accepted_tokens"], out["draft_tokens"]
    if accepted is not None and drafted is not None and accepted > drafted:
        raise _malformed(f"{where}: {accepted} accepted drafts of {drafted} drafted")
    # Index j counts verify passes that accepted j drafts: it must add up to the passes and to
    # the accepted drafts. A histogram that does not is kept but not used for per-position figures.
    histogram = out["histogram"]
    out["histogram_consistent"] = bool(histogram) and sum(histogram) == out["verify_passes"] and (
        accepted is None or sum(j * n for j, n in enumerate(histogram)) == accepted)
    return out


# ----------------------------------------------------------------------------------
# vLLM's Prometheus counters
# ----------------------------------------------------------------------------------


def parse_spec_counters(text: str) -> dict | None:
    """vLLM's speculative-decoding counters in a Prometheus text exposition, summed over
    engines and models; None when the server exposes none (speculation off, or not vLLM).

    prometheus_client writes a counter `name` as `name_total` (and `name_created`, a
    timestamp, which is skipped); both `name` and `name_total` are read."""
    wanted = {name: key for key, name in VLLM_COUNTERS.items()}
    totals: dict[str, float] = {}
    per_position: dict[int, float] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = PROMETHEUS_SAMPLE.match(line)
        if match is None:
            continue  # another exposition's syntax we do not need
        name, labels, value_text = match.group(1), match.group(2) or "", match.group(3)
        base = name[: -len("_total")] if name.endswith("_total") else name
        if base not in wanted and base != VLLM_PER_POSITION:
            continue
        try:
            value = float(value_text)
        except ValueError:
            raise _malformed(f"/metrics line {number}: {name} has value {value_text[:40]!r}") from None
        if not math.isfinite(value) or value < 0:
            raise _malformed(f"/metrics line {number}: {name} is {value_text[:40]!r}, not a count")
        if base == VLLM_PER_POSITION:
            position = PROMETHEUS_POSITION.search(labels)
            if position is None:
                raise _malformed(f"/metrics line {number}: {name} without a position label")
            per_position[int(position.group(1))] = per_position.get(int(position.group(1)), 0.0) + value
        else:
            totals[wanted[base]] = totals.get(wanted[base], 0.0) + value
    if not totals and not per_position:
        return None
    missing = [VLLM_COUNTERS[k] for k in VLLM_COUNTERS if k not in totals]
    if missing:
        raise _malformed(f"/metrics has some speculative counters but not {', '.join(missing)}")
    steps = max(per_position) + 1 if per_position else 0
    return {**{k: int(v) for k, v in totals.items()}, "accepted_per_position": [int(per_position.get(i, 0.0)) for i in range(steps)]}


def read_spec_counters(base_url: str, timeout: float) -> dict:
    """{"counters": ...} (None: no speculative counters), or {"error": reason} when /metrics
    cannot be read (absent, HTTP error, malformed): a label of the run, never its failure."""
    try:
        status, raw = _http("GET", base_url.rstrip("/") + "/metrics", None, timeout)
        if status != 200:
            return {"error": f"GET /metrics: HTTP {status}"}
        return {"counters": parse_spec_counters(raw.decode("utf-8", "replace"))}
    except RequestFailed as err:
        return {"error": str(err)}


def settled_spec_counters(base_url: str, timeout: float) -> dict:
    """The counters once two reads in a row agree (vLLM may count the last step just after
    answering), at most `METRICS_SETTLE_READS` reads."""
    reading = read_spec_counters(base_url, timeout)
    for _ in range(METRICS_SETTLE_READS - 1):
        if "error" in reading:
            return reading
        time.sleep(METRICS_SETTLE_SECONDS)
        again = read_spec_counters(base_url, timeout)
        if again == reading:
            return reading
        reading = again
    return reading


def counter_delta(before: dict, after: dict) -> dict | None:
    """The run's counts: after - before (None when either read failed or found no counters)."""
    old, new = before.get("counters"), after.get("counters")
    if old is None or new is None:
        return None
    per_position = [n - (old["accepted_per_position"][i] if i < len(old["accepted_per_position"]) else 0)
                    for i, n in enumerate(new["accepted_per_position"])]
    delta = {k: new[k] - old[k] for k in VLLM_COUNTERS}
    if min(delta.values(), default=0) < 0 or min(per_position, default=0) < 0:
        return {"error": "the counters went down during the run (the server restarted?)"}
    return {**delta, "accepted_per_position": per_position}


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
                response = _post(url, request_body(prompt, settings, model, tokenizer), settings.timeout_seconds)
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
             f"max_tokens {report['max_tokens']}, greedy, thinking disabled)"]
    fixed = report["fixed"]
    lines.append(f"fixed prompts: {fixed['exact']}/{fixed['of']} exact matches (tokens, and logprobs within "
                 f"{report['logprob_tolerance']:g}); max |logprob difference| {report['max_logprob_diff']:.3e}")
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


def _is_url(text: str) -> bool:
    return text.startswith("http://") or text.startswith("https://")


def load_run(path: Path) -> dict:
    try:
        run = json.loads(Path(path).read_text())
    except (OSError, ValueError, RecursionError) as err:
        raise ValidationError(f"{path}: cannot read recorded responses ({err})") from None
    if not isinstance(run, dict) or not {"requests", "prompts", "settings"} <= set(run):
        raise ValidationError(f"{path}: not a responses file written by occamy_mtp.validate")
    if run.get("format") != RESPONSES_FORMAT:
        raise ValidationError(f"{path}: responses format {run.get('format')!r}, this version reads {RESPONSES_FORMAT}: record the reference again")
    return run


def validate(reference: str, candidate: str | None, prompts: list[ValidationPrompt], out_dir: Path, settings: RequestSettings,
             cold_warm: int = DEFAULT_COLD_WARM, tolerance: float = 0.0, tokenizer=None,
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
    if not _is_url(reference):
        # A recorded reference fixes the protocol: its prompts, cold/warm count and request settings.
        runs["reference"] = load_run(Path(reference))
        prompts = [ValidationPrompt(p["name"], p["source"], tuple(p["messages"]),
                                    None if p.get("prompt_ids") is None else tuple(p["prompt_ids"])) for p in runs["reference"]["prompts"]]
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
    acceptance_run = None
    first = acceptance(runs["candidate"])
    drafted_nothing = first is None or not first.get("source") or first["drafted_nothing"]
    wants_pass = acceptance_pass == "always" or (acceptance_pass == "auto" and require_drafts and drafted_nothing)
    if _is_url(candidate) and wants_pass and settings.logprobs:
        if log is not None:
            log(f"  {candidate}: acceptance pass without logprobs ({'asked for' if acceptance_pass == 'always' else 'the logprob run drafted nothing'})")
        acceptance_run = collect(candidate, prompts, 0, replace(settings, logprobs=False), tokenizer, max_consecutive_errors, log)
        (out_dir / RESPONSES_FILE.format(role="candidate-acceptance")).write_text(json.dumps(acceptance_run, indent=1) + "\n")
    recorded = [e["prompt"] for e in runs["reference"]["requests"] if e["attempt"] == "warm"]
    report = compare_runs(runs["reference"], runs["candidate"], recorded, tolerance, require_drafts, acceptance_run)
    report = {
        "format": RESPONSES_FORMAT,
        "reference": reference,
        "candidate": candidate,
        "endpoint": runs["reference"]["endpoint"],
        "max_tokens": runs["reference"]["settings"]["max_tokens"],
        "require_drafts": require_drafts,
        "prompt_set": [{"name": p.name, "source": p.source} for p in prompts],
        **report,
    }
    (out_dir / REPORT_FILE).write_text(json.dumps(report, indent=1) + "\n")
    return report


def main(argv: list[str] | None = None) -> int:
    from occamy_mtp.config import ConfigError, add_split_arguments, split_from_arguments

    parser = argparse.ArgumentParser(prog="python -m occamy_mtp.validate", description="Compare two OpenAI-compatible servers (MTP off vs on) token for token, and read the MTP-on server's acceptance.")
    parser.add_argument("--reference", required=True, help="URL of the MTP-off server, or a responses-reference.json recorded earlier")
    parser.add_argument("--candidate", help="URL of the MTP-on server (or a recorded responses file); omit to record the reference only")
    parser.add_argument("--data", nargs="*", type=Path, default=None,
                        help="chat data files: heldout prefixes join the authored prompts (default: --config's data.files)")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer directory (needed with --data and --endpoint completions; "
                                                       "default: --config's model.tokenizer or model.base)")
    parser.add_argument("--prompt-source", choices=("mixed", "windows"), default="mixed",
                        help="mixed: authored prompts + heldout prefixes (chat); windows: the heldout windows' contexts as "
                             "token ids, the prompts of `occamy_mtp.evaluate --reference-decoder` (needs --data, --endpoint completions)")
    parser.add_argument("--prompts", type=int, default=DEFAULT_PROMPTS, help="size of the fixed prompt set")
    parser.add_argument("--cold-warm", type=int, default=DEFAULT_COLD_WARM, help="prompts sent twice (cold, then warm)")
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    parser.add_argument("--endpoint", choices=(CHAT, COMPLETIONS), default=CHAT)
    parser.add_argument("--model", help="the request's model field (default: the server's first /v1/models id)")
    parser.add_argument("--no-token-ids", action="store_true", help="do not ask for token ids (compare token strings)")
    parser.add_argument("--top-logprobs", type=int, default=DEFAULT_TOP_LOGPROBS, help="alternatives per token, to diagnose a divergence")
    parser.add_argument("--no-engine-fields", action="store_true", help="do not ask for SGLang's per-request speculative counts")
    parser.add_argument("--extra-body", default="{}", help="JSON object merged into every request body")
    parser.add_argument("--logprob-tolerance", type=float, default=0.0, help="largest |logprob difference| still counted as exact")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_SECONDS, help="wall-clock seconds for each whole request")
    parser.add_argument("--max-consecutive-errors", type=int, default=DEFAULT_MAX_CONSECUTIVE_ERRORS)
    parser.add_argument("--allow-no-drafts", action="store_true", help="the candidate need not speculate (two servers without MTP)")
    parser.add_argument("--acceptance-pass", choices=ACCEPTANCE_PASS_MODES, default="auto",
                        help="send the prompts once more without logprobs: auto (when the logprob run drafted nothing), always, never")
    parser.add_argument("--out", required=True, type=Path, help="directory for validation.json and the responses files")
    parser.add_argument("--quiet", action="store_true")
    add_split_arguments(parser)
    args = parser.parse_args(argv)

    try:
        config, split = split_from_arguments(args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if config is not None:  # the run's data and tokenizer, unless a flag names others
        args.data = args.data if args.data is not None else [Path(f) for f in config.data.files]
        args.tokenizer = args.tokenizer or Path(config.model.tokenizer or config.model.base)
    args.data = args.data or []

    try:
        extra = json.loads(args.extra_body)
        if not isinstance(extra, dict):
            raise ValueError
    except (ValueError, RecursionError):
        print(f"error: --extra-body must be a JSON object, got {args.extra_body!r}", file=sys.stderr)
        return 2
    if min(args.prompts, args.max_tokens, args.max_consecutive_errors) < 1 or min(args.cold_warm, args.top_logprobs) < 0 \
            or not args.timeout > 0 or not math.isfinite(args.timeout) or not args.logprob_tolerance >= 0:
        print("error: --prompts, --max-tokens, --max-consecutive-errors must be >= 1, --cold-warm and --top-logprobs >= 0, "
              "--timeout a finite number > 0, --logprob-tolerance >= 0", file=sys.stderr)
        return 2
    for flag, value in (("--reference", args.reference), ("--candidate", args.candidate)):
        if value is not None and not _is_url(value) and not Path(value).is_file():
            print(f"error: {flag} {value}: neither an http(s) URL nor a responses file", file=sys.stderr)
            return 2
    if args.prompt_source == "windows" and (not args.data or args.endpoint != COMPLETIONS):
        print("error: --prompt-source windows needs --data, --tokenizer and --endpoint completions", file=sys.stderr)
        return 2
    tokenizer = None
    if args.data or args.endpoint == COMPLETIONS:
        if args.tokenizer is None or not args.tokenizer.is_dir():
            print("error: --tokenizer DIR is needed with --data or --endpoint completions", file=sys.stderr)
            return 2
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(args.tokenizer), local_files_only=True)
    from occamy_mtp.data import DataError

    try:
        if args.prompt_source == "windows":
            prompts = heldout_window_contexts(args.data, tokenizer, **split)[: args.prompts]
        else:
            prompts = prompt_set(args.prompts, heldout_prefixes(args.data, tokenizer, **split) if args.data else [])
        settings = RequestSettings(args.endpoint, args.max_tokens, args.timeout, args.model, not args.no_token_ids,
                                   True, args.top_logprobs, not args.no_engine_fields, extra)
        log = None if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
        report = validate(args.reference, args.candidate, prompts, args.out, settings, min(args.cold_warm, len(prompts)),
                          args.logprob_tolerance, tokenizer, args.max_consecutive_errors, log,
                          require_drafts=not args.allow_no_drafts, acceptance_pass=args.acceptance_pass)
    except (ValidationError, DataError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if report is None:
        print(f"recorded {len(prompts)} prompts from {args.reference} into {args.out / RESPONSES_FILE.format(role='reference')}")
        return 0
    print(format_summary(report))
    if not report["passed"]:
        print(f"validation failed: {'; '.join(report['failures'])}", file=sys.stderr)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
