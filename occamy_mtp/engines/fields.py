"""Checked reading of the fields an engine returns: counts, token ids, logprobs, optional objects.

A field that is not what it should be is a `RequestFailed("malformed")` naming it.
"""

from __future__ import annotations

import math

from occamy_mtp.engines.http import RequestFailed

MAX_HISTOGRAM_LENGTH = 1024  # draft steps + 1; engines draft a handful
MAX_COUNT = 2**53  # counts beyond this are not counts (and lose precision as JSON doubles)


def malformed(message: str) -> RequestFailed:
    return RequestFailed("malformed", message)

def brief(value) -> str:
    """A value for an error message: scalars shown (cut short), containers by type only."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)[:40]
    return f"a JSON {'array' if isinstance(value, list) else 'object'}"

def count(value, name: str) -> int:
    """A non-negative integer count (an integral finite float such as 12.0 is accepted)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise malformed(f"{name} is {brief(value)}, not a count")
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        raise malformed(f"{name} is {brief(value)}, not a finite whole number")
    if not 0 <= value <= MAX_COUNT:
        raise malformed(f"{name} is {brief(value)}, outside 0..2^53")
    return int(value)

def counts(value, name: str) -> list[int]:
    if not isinstance(value, list):
        raise malformed(f"{name} is {type(value).__name__}, not a list of counts")
    if len(value) > MAX_HISTOGRAM_LENGTH:
        raise malformed(f"{name} has {len(value)} entries (at most {MAX_HISTOGRAM_LENGTH})")
    return [count(v, f"{name}[{i}]") for i, v in enumerate(value)]

def token_ids(value, name: str) -> list[int]:
    """Token ids: a list of non-negative integers of any length (the body size bounds it)."""
    if not isinstance(value, list):
        raise malformed(f"{name} is {type(value).__name__}, not a list")
    return [count(v, f"{name}[{i}]") for i, v in enumerate(value)]

def logprob(value, name: str) -> float:
    if not isinstance(value, bool) and isinstance(value, (int, float)):
        try:
            number = float(value)  # an int beyond float range raises
        except OverflowError:
            number = math.inf
        if math.isfinite(number):
            return number
    raise malformed(f"{name} is {brief(value)}, not a finite number")

def optional_object(value, name: str) -> dict | None:
    """An optional JSON object: absent/null -> None, an object -> itself, anything else is malformed."""
    if value is None or isinstance(value, dict):
        return value
    raise malformed(f"{name} is {type(value).__name__}, not an object")

def first_present(place: dict, names: tuple[str, ...]) -> tuple[str, object] | None:
    for name in names:
        if name in place:
            return name, place[name]
    return None

def checked_counts(out: dict, where: str) -> dict:
    accepted, drafted = out["accepted_tokens"], out["draft_tokens"]
    if accepted is not None and drafted is not None and accepted > drafted:
        raise malformed(f"{where}: {accepted} accepted drafts of {drafted} drafted")
    # Index j counts verify passes that accepted j drafts: it must add up to the passes and to
    # the accepted drafts. A histogram that does not is kept but not used for per-position figures.
    histogram = out["histogram"]
    out["histogram_consistent"] = bool(histogram) and sum(histogram) == out["verify_passes"] and (
        accepted is None or sum(j * n for j, n in enumerate(histogram)) == accepted)
    return out
