"""Talking to an OpenAI-compatible server (SGLang, vLLM, the reference server) and reading what it returns.

One HTTP/1.1 request at a time over the standard library's sockets, with one deadline for
the whole exchange; every field of a response is checked (token ids, token logprobs, the
engines' speculative counts per request and vLLM's `/metrics` counters) and a malformed
answer is a `RequestFailed` that says what was wrong. docs/ENGINES.md sets out where each
engine reports what.
"""

from __future__ import annotations

import json
import math
import re
import socket
import ssl
import time
import urllib.parse
from dataclasses import dataclass, field

CHAT = "chat"
COMPLETIONS = "completions"
ENDPOINT_PATHS = {CHAT: "/v1/chat/completions", COMPLETIONS: "/v1/completions"}
DEFAULT_MAX_TOKENS = 64
DEFAULT_TOP_LOGPROBS = 2  # the runner-up at a divergence tells a near tie from a real difference
DEFAULT_TIMEOUT_SECONDS = 300.0
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
    thinking: bool = False
    """Render the chat prompts with the template's enable_thinking on (chat: `chat_template_kwargs`)."""


class RequestFailed(Exception):
    def __init__(self, kind: str, message: str, status: int | None = None):
        super().__init__(message)
        self.kind = kind  # "transport", "http" or "malformed"
        self.status = status  # the HTTP status of an "http" failure
        self.tries = 1  # how many times the request was sent (`engines._completion` counts its retries)


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
        raise RequestFailed("http", f"{what}: HTTP {status}: {raw[:300].decode('utf-8', 'replace')}", status)
    parsed = _json(raw, what)
    if not isinstance(parsed, dict):
        raise RequestFailed("malformed", f"{what}: response is a JSON {type(parsed).__name__}, not an object")
    return parsed


def post_json(url: str, body: dict, timeout: float) -> dict:
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
