"""The OpenAI-compatible protocol the engines share: what a request asks, and what a response holds.

`parse_response` reads one chat or completions response (text, tokens, token ids, logprobs,
the top alternatives, the finish reason) and its speculative counts, wherever its engine put
them: each engine's reader (`sglang`, `vllm`) is tried in turn.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from occamy_mtp.engines import sglang, vllm
from occamy_mtp.engines.fields import first_present, logprob, malformed, optional_object, token_ids

CHAT = "chat"
COMPLETIONS = "completions"
ENDPOINT_PATHS = {CHAT: "/v1/chat/completions", COMPLETIONS: "/v1/completions"}
DEFAULT_MAX_TOKENS = 64
DEFAULT_TOP_LOGPROBS = 2  # the runner-up at a divergence tells a near tie from a real difference
DEFAULT_TIMEOUT_SECONDS = 300.0
TOKEN_ID = re.compile(r"^token_id:(\d+)$")


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
                raise malformed(f"{name}[{i}] is not an object with a token")
            pairs.append((entry["token"], entry.get("logprob")))
    else:
        raise malformed(f"{name} is {type(entries).__name__}, not a list")
    out = [[str(token), logprob(lp, f"{name}[{token!r}]")] for token, lp in pairs]
    return sorted(out, key=lambda pair: -pair[1])[:DEFAULT_TOP_LOGPROBS]

def parse_response(response: dict, endpoint: str, logprobs: bool = True) -> dict:
    """Text, tokens, token ids (when given), logprobs, the top alternatives, finish reason and
    speculative counts of one response; RequestFailed("malformed") names the first bad field."""
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise malformed("missing field in the response: choices[0] (an object) expected")
    choice = choices[0]
    if endpoint == CHAT:
        message = optional_object(choice.get("message"), "choices[0].message")
        text = message.get("content") if message else None
    else:
        text = choice.get("text")
    if text is not None and not isinstance(text, str):
        raise malformed(f"the response text is {type(text).__name__}, not a string")
    ids_field = first_present(choice, ("token_ids", "response_token_ids"))  # vLLM / SGLang chat
    explicit_ids = None
    if ids_field is not None and ids_field[1] is not None:
        explicit_ids = token_ids(ids_field[1], f"choices[0].{ids_field[0]}")

    tokens, values, top = None, [], []
    if logprobs:
        block = optional_object(choice.get("logprobs"), "choices[0].logprobs")
        if block is None:
            raise malformed("missing field in the response: choices[0].logprobs (logprobs were asked for)")
        if endpoint == CHAT:
            entries = block.get("content")
            if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
                raise malformed("choices[0].logprobs.content is not a list of objects")
            tokens = [e.get("token") for e in entries]
            raw_values = [e.get("logprob") for e in entries]
            raw_top = [e.get("top_logprobs") for e in entries]
        else:
            tokens, raw_values, raw_top = block.get("tokens"), block.get("token_logprobs"), block.get("top_logprobs")
            if raw_top is None and isinstance(tokens, list):
                raw_top = [None] * len(tokens)
        if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
            raise malformed("logprobs tokens are not a list of strings")
        if not isinstance(raw_values, list) or len(raw_values) != len(tokens):
            raise malformed("token logprobs are not one number per token")
        values = [logprob(v, f"token logprob {i}") for i, v in enumerate(raw_values)]
        if not isinstance(raw_top, list) or len(raw_top) != len(tokens):
            raise malformed("top logprobs are not one entry per token")
        top = [_top_alternatives(t, f"top logprobs of token {i}") for i, t in enumerate(raw_top)]
        if explicit_ids is not None and len(explicit_ids) != len(tokens):
            raise malformed(f"{len(explicit_ids)} token ids for {len(tokens)} logprob tokens")
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


READERS = (sglang.request_counts, vllm.request_counts)
"""Each engine's reader of its per-request counts, in the order they are tried."""


def speculative_counts(response: dict) -> dict | None:
    """One response's speculative counts, normalised, wherever its engine put them; None if absent.

    Normalised: source, verify_passes, accepted_tokens, draft_tokens (None where the engine
    does not say), completion_tokens, histogram (index j: verify passes that accepted
    exactly j drafts; [] if not given), draft_steps (K, where it can be told)."""
    for read in READERS:
        counts = read(response)
        if counts is not None:
            return counts
    return None
