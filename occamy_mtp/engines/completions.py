"""A completion of token ids from a serving engine: the request (`/v1/completions`, greedy or
sampled with the text's settings, a seed per context) and the continuation read from its answer.

The prompt goes as token ids (no template is rendered again), at most the answer's budget,
stopping at the base's stop tokens, with `return_token_ids` (vLLM and SGLang return
`choices[0].token_ids`, docs/reference/ENGINES.md). A sampled request's seed derives from the run's
seed and the context's digest (`TextSampling.request_seed`, `files.token_ids_sha256`: the
self-generated store's key), so that the engine's own generator draws the same text for
the same context. Where a server returns only text, the text is tokenized and whether it
decodes back is said. Self-generation (`selfgen.engine_writer`) and sampled validation
(`serve.sampled`) ask through it.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from occamy_mtp.engines.http import RequestFailed
from occamy_mtp.engines.openai import COMPLETIONS, parse_response
from occamy_mtp.files import token_ids_sha256
from occamy_mtp.sampling import GREEDY_TEXT, TextSampling


@dataclass(frozen=True)
class Answer:
    """One continuation as a server gave it, and how its tokens were read."""

    tokens: tuple[int, ...]
    finished: bool
    source: str
    """"token_ids" (as returned), "text" (tokenized, decodes back to the text) or "text_lossy" (does not)."""

@dataclass(frozen=True)
class Request:
    """What every request asks: the budget, the stop tokens, how long to wait and how often to try."""

    max_new_tokens: int
    stop_token_ids: frozenset[int]
    vocab_size: int
    timeout_seconds: float
    retries: int
    sampling: TextSampling = GREEDY_TEXT

def request_body(model: str, prompt_ids: Sequence[int], request: Request, max_tokens: int | None = None,
                 greedy: bool = False) -> dict:
    """The completions request of one context (`greedy` forces temperature 0: the probe)."""
    sampling = GREEDY_TEXT if greedy else request.sampling
    body = {
        "model": model,
        "prompt": list(prompt_ids),
        "max_tokens": max_tokens or request.max_new_tokens,
        "temperature": sampling.temperature,
        "n": 1,
        "stop_token_ids": sorted(request.stop_token_ids),
        "skip_special_tokens": False,
        "return_token_ids": True,
    }
    if not sampling.greedy:
        body.update(top_p=sampling.top_p, top_k=sampling.top_k or -1, seed=sampling.request_seed(token_ids_sha256(prompt_ids)))
        penalties = {"presence_penalty": sampling.presence_penalty, "frequency_penalty": sampling.frequency_penalty,
                     "repetition_penalty": sampling.repetition_penalty}
        body.update({k: v for k, v in penalties.items() if v != (1.0 if k == "repetition_penalty" else 0.0)})
    return body

def read_answer(response: dict, tokenizer, request: Request, max_tokens: int | None = None) -> Answer:
    """The continuation in `response`; RequestFailed("malformed") when it cannot be one."""
    parsed = parse_response(response, COMPLETIONS, logprobs=False)
    budget = max_tokens or request.max_new_tokens
    stop = request.stop_token_ids
    ids, source = parsed["token_ids"], "token_ids"
    if ids is None:
        text = parsed["text"]
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        source = "text" if tokenizer.decode(ids) == text else "text_lossy"
    ids = list(ids)
    cut = next((i for i, t in enumerate(ids) if t in stop), None)
    if cut is not None:
        ids = ids[: cut + 1]  # the embedded generator stops at the first stop token, inclusive
    elif parsed["finish_reason"] == "stop":
        hidden = _stop_token(response["choices"][0], stop, tokenizer)
        if hidden is None:
            raise RequestFailed("malformed", "finish_reason is stop, but neither the token ids nor stop_reason / matched_stop "
                                             "name a stop token of the base")
        ids.append(hidden)
    if len(ids) > budget:
        raise RequestFailed("malformed", f"{len(ids)} new tokens, more than the {budget} asked for")
    if any(t >= request.vocab_size for t in ids):
        raise RequestFailed("malformed", f"token id {max(ids)} is outside the base's vocabulary ({request.vocab_size})")
    finished = bool(ids) and ids[-1] in stop
    if not finished and len(ids) < budget and parsed["finish_reason"] != "length":
        raise RequestFailed("malformed", f"{len(ids)} of {budget} tokens, no stop token, and finish_reason "
                                         f"{parsed['finish_reason']!r}: the continuation is cut short")
    return Answer(tuple(ids), finished, source)

def _stop_token(choice: dict, stop: Collection[int], tokenizer) -> int | None:
    """The stop token a server left out of its answer: vLLM's `stop_reason` or SGLang's
    `matched_stop` (a token id), or the eos when vLLM says None (it stopped at the eos)."""
    for name in ("stop_reason", "matched_stop"):
        value = choice.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value in stop:
            return value
    if "stop_reason" in choice and choice["stop_reason"] is None and tokenizer.eos_token_id in stop:
        return int(tokenizer.eos_token_id)
    return None
