"""SGLang's reader: its per-request speculative counts (`choices[0].meta_info`, or `sglext.spec_tokens_details`).

The library's reference server writes the same fields. docs/reference/ENGINES.md names the versions.
"""

from __future__ import annotations

from occamy_mtp.engines.fields import checked_counts, count, counts, first_present, optional_object

SGLANG_META = "sglang: choices[0].meta_info"
SGLANG_SGLEXT = "sglang: sglext.spec_tokens_details"


def request_counts(response: dict) -> dict | None:
    """One response's counts where SGLang puts them, normalised (`openai.speculative_counts`); None if absent."""
    choices = response.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    meta = optional_object(choice.get("meta_info"), "choices[0].meta_info")
    if meta is not None and "spec_verify_ct" in meta:
        return _counts_at(meta, SGLANG_META, "choices[0].meta_info")
    sglext = optional_object(response.get("sglext"), "sglext")
    details = sglext.get("spec_tokens_details") if sglext else None
    if isinstance(details, list):  # one entry per choice when n > 1
        details = details[0] if details else None
    details = optional_object(details, "sglext.spec_tokens_details")
    if details is not None:
        return _counts_at(details, SGLANG_SGLEXT, "sglext.spec_tokens_details")
    return None


def _counts_at(place: dict, source: str, where: str) -> dict:
    """SGLang's `spec_*` fields (0.5.23 names; 0.5.12's aliases accepted)."""
    verify = count(place["spec_verify_ct"], f"{where}.spec_verify_ct")
    out = {"source": source, "verify_passes": verify, "accepted_tokens": None, "draft_tokens": None,
           "completion_tokens": None, "histogram": [], "draft_steps": None}
    for key, names in (("accepted_tokens", ("spec_num_correct_drafts", "spec_accepted_drafts")),
                       ("draft_tokens", ("spec_num_proposed_drafts", "spec_proposed_drafts")),
                       ("completion_tokens", ("completion_tokens",))):
        found = first_present(place, names)
        if found is not None:
            out[key] = count(found[1], f"{where}.{found[0]}")
    found = first_present(place, ("spec_correct_drafts_histogram", "spec_accept_histogram"))
    if found is not None:
        out["histogram"] = counts(found[1], f"{where}.{found[0]}")
    # SGLang counts K drafts per verify pass (num_draft_tokens - 1): K = proposed / verify passes.
    if verify and out["draft_tokens"] is not None and out["draft_tokens"] % verify == 0:
        out["draft_steps"] = out["draft_tokens"] // verify
    return checked_counts(out, where)
