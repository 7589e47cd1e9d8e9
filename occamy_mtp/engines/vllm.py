"""vLLM's reader: its per-request speculative counts (`metrics.speculative_decoding`, with
--per-request-spec-decode-metrics) and its Prometheus counters on `/metrics`.
"""

from __future__ import annotations

import math
import re
import time

from occamy_mtp.engines.fields import checked_counts, count, counts, malformed, optional_object
from occamy_mtp.engines.http import RequestFailed, request_bytes

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
VLLM_PER_REQUEST = "vllm: metrics.speculative_decoding"
VLLM_METRICS = "vllm: /metrics counters (after - before)"


def request_counts(response: dict) -> dict | None:
    """One response's counts where vLLM puts them, normalised (`openai.speculative_counts`); None if absent."""
    metrics = optional_object(response.get("metrics"), "metrics")
    spec = optional_object(metrics.get("speculative_decoding") if metrics else None, "metrics.speculative_decoding")
    return None if spec is None else _per_request(spec)


def _per_request(spec: dict) -> dict:
    """vLLM's `metrics.speculative_decoding` (--per-request-spec-decode-metrics, vLLM 0.32)."""
    where = "metrics.speculative_decoding"
    missing = [k for k in ("num_spec_steps", "num_accepted_draft_tokens", "num_draft_tokens") if k not in spec]
    if missing:
        raise malformed(f"{where} lacks {', '.join(missing)}")
    out = {"source": VLLM_PER_REQUEST,
           "verify_passes": count(spec["num_spec_steps"], f"{where}.num_spec_steps"),
           "accepted_tokens": count(spec["num_accepted_draft_tokens"], f"{where}.num_accepted_draft_tokens"),
           "draft_tokens": count(spec["num_draft_tokens"], f"{where}.num_draft_tokens"),
           "completion_tokens": None,
           "histogram": counts(spec.get("acceptance_histogram", []), f"{where}.acceptance_histogram"),
           "draft_steps": count(spec["num_spec_tokens"], f"{where}.num_spec_tokens") if "num_spec_tokens" in spec else None}
    return checked_counts(out, where)

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
            raise malformed(f"/metrics line {number}: {name} has value {value_text[:40]!r}") from None
        if not math.isfinite(value) or value < 0:
            raise malformed(f"/metrics line {number}: {name} is {value_text[:40]!r}, not a count")
        if base == VLLM_PER_POSITION:
            position = PROMETHEUS_POSITION.search(labels)
            if position is None:
                raise malformed(f"/metrics line {number}: {name} without a position label")
            per_position[int(position.group(1))] = per_position.get(int(position.group(1)), 0.0) + value
        else:
            totals[wanted[base]] = totals.get(wanted[base], 0.0) + value
    if not totals and not per_position:
        return None
    missing = [VLLM_COUNTERS[k] for k in VLLM_COUNTERS if k not in totals]
    if missing:
        raise malformed(f"/metrics has some speculative counters but not {', '.join(missing)}")
    steps = max(per_position) + 1 if per_position else 0
    return {**{k: int(v) for k, v in totals.items()}, "accepted_per_position": [int(per_position.get(i, 0.0)) for i in range(steps)]}

def read_spec_counters(base_url: str, timeout: float) -> dict:
    """{"counters": ...} (None: no speculative counters), or {"error": reason} when /metrics
    cannot be read (absent, HTTP error, malformed): a label of the run, never its failure."""
    try:
        status, raw = request_bytes("GET", base_url.rstrip("/") + "/metrics", None, timeout)
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

def counts_from_metrics(delta: dict | None) -> dict | None:
    """One request's counts, normalised as `request_counts`' are, from the /metrics counters read just before
    and after it (`counter_delta`): for a server that gives none per request, asked one request at a time.
    The passes that accepted exactly j drafts are those that reached position j less those that reached j + 1.
    None when the delta is missing or failed."""
    if delta is None or "error" in delta:
        return None
    reached = [delta["drafts"], *delta["accepted_per_position"]]
    histogram = [reached[j] - (reached[j + 1] if j + 1 < len(reached) else 0) for j in range(len(reached))]
    out = {"source": VLLM_METRICS, "verify_passes": delta["drafts"], "accepted_tokens": delta["accepted_tokens"],
           "draft_tokens": delta["draft_tokens"], "completion_tokens": None,
           "histogram": histogram if min(histogram, default=0) >= 0 else [],
           "draft_steps": len(delta["accepted_per_position"]) or None}
    return checked_counts(out, "/metrics (after - before)")
