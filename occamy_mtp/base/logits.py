"""The base's greedy choice from its hidden states, a chunk of positions at a time.

The logits for a whole (window x vocabulary) batch are never materialised: at real size
one 128x512 batch of full bf16 logits is 15 GiB. A chunk is at most
`DEFAULT_LOGITS_CHUNK_TOKENS` positions, fewer where the GPU has less free
(`memory.logit_rows`).
"""

from __future__ import annotations

import torch

from occamy_mtp import memory
from occamy_mtp.model.head import DEFAULT_LOGITS_CHUNK_TOKENS
from occamy_mtp.sampling import top_probability


# Beyond the logits in lm_head's dtype, a chunk holds argmax's output and its reduction's
# staging: far below a byte a logit where measured (`pytest -m gpu`, test_memory.py), rounded up to an eighth.
ARGMAX_BYTES_PER_LOGIT = 0.125


def greedy_bytes_per_logit(lm_head: torch.nn.Module) -> float:
    """Bytes a logit of `chunked_greedy`'s chunk takes at its peak."""
    return lm_head.weight.element_size() + ARGMAX_BYTES_PER_LOGIT


def greedy_chunk_tokens(lm_head: torch.nn.Module) -> int:
    """Positions of `chunked_greedy`'s chunk that fit on the GPU now (`memory.logit_rows`)."""
    weight = lm_head.weight
    return memory.logit_rows(weight.device, weight.shape[0], greedy_bytes_per_logit(lm_head), DEFAULT_LOGITS_CHUNK_TOKENS)


@torch.no_grad()
def chunked_top(hidden: torch.Tensor, lm_head: torch.nn.Module, chunk_tokens: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(argmax, its softmax probability) over the vocabulary of lm_head(hidden), `chunk_tokens` positions at a
    time as `chunked_greedy`: the token a greedy draft proposes and the head's own confidence in it."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    weight = lm_head.weight
    # beside chunked_greedy's: the logits' fp32 copy and logsumexp's exponentials
    chunk_tokens = chunk_tokens or memory.logit_rows(weight.device, weight.shape[0], greedy_bytes_per_logit(lm_head) + 8,
                                                     DEFAULT_LOGITS_CHUNK_TOKENS)
    tokens = torch.empty(flat.shape[0], dtype=torch.long, device=hidden.device)
    top = torch.empty(flat.shape[0], dtype=torch.float32, device=hidden.device)
    for start in range(0, flat.shape[0], chunk_tokens):
        stop = start + chunk_tokens
        logits = lm_head(flat[start:stop].to(lm_head.weight.dtype)).float()
        tokens[start:stop] = logits.argmax(dim=-1)  # chunked_greedy's token: bf16 -> fp32 keeps the order
        top[start:stop] = top_probability(logits)
    return tokens.view(hidden.shape[:-1]), top.view(hidden.shape[:-1])


@torch.no_grad()
def chunked_greedy(hidden: torch.Tensor, lm_head: torch.nn.Module, chunk_tokens: int | None = None) -> torch.Tensor:
    """argmax over the vocabulary of lm_head(hidden), `chunk_tokens` positions at a time (None:
    as many as fit, `greedy_chunk_tokens`)."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    chunk_tokens = chunk_tokens or greedy_chunk_tokens(lm_head)
    out = torch.empty(flat.shape[0], dtype=torch.long, device=hidden.device)
    for start in range(0, flat.shape[0], chunk_tokens):
        stop = start + chunk_tokens
        out[start:stop] = lm_head(flat[start:stop].to(lm_head.weight.dtype)).argmax(dim=-1)
    return out.view(hidden.shape[:-1])
