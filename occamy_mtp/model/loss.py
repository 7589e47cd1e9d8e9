"""Chain inputs, labels and the distillation loss.

Alignment (docs/CONTRACT.md sections 2 and 4), for a window x_0..x_{L-1} with the base's greedy
choices greedy_t = argmax(W @ H_t) (the base's prediction for position t+1):

* step 1 at anchor i embeds x_{i+1} and is trained towards greedy_{i+1} (position i+2);
* step k >= 2 at anchor i embeds t_k = greedy_{i+k-1}, the token step k-1 drafts when it
  is accepted, and is trained towards greedy_{i+k} (position i+k+1).

A (step, anchor) pair is scored only when its predicted position lies inside the
window and inside the assistant span.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from occamy_mtp.model.head import DEFAULT_LOGITS_CHUNK_TOKENS

IGNORE = -100  # label of an unscored (step, anchor) pair


@dataclass(frozen=True)
class WindowBatch:
    """Windows as one right-padded batch: what the base (or its cache) and `chain_batch` take."""

    input_ids: torch.Tensor  # (B, T) right-padded with 0
    assistant: torch.Tensor  # (B, T) bool
    lengths: torch.Tensor  # (B,)
    attention_mask: torch.Tensor | None  # (B, T), None when no row is padded


def collate(windows, device) -> WindowBatch:
    """Pad `data.Window`s into a batch (training and evaluation batch the same way)."""
    length = max(len(w.input_ids) for w in windows)
    input_ids = torch.zeros(len(windows), length, dtype=torch.long)
    assistant = torch.zeros(len(windows), length, dtype=torch.bool)
    lengths = torch.tensor([len(w.input_ids) for w in windows])
    for row, window in enumerate(windows):
        input_ids[row, : len(window.input_ids)] = torch.tensor(window.input_ids)
        assistant[row, window.answer_start : len(window.input_ids)] = True
    padded = bool((lengths < length).any())
    attention_mask = (torch.arange(length)[None] < lengths[:, None]).long() if padded else None
    return WindowBatch(
        input_ids.to(device),
        assistant.to(device),
        lengths.to(device),
        None if attention_mask is None else attention_mask.to(device),
    )


@dataclass(frozen=True)
class ChainBatch:
    """Everything the head and the loss need for one padded (B, T) batch."""

    step_token_ids: torch.Tensor  # (K, B, T) tokens each step embeds
    labels: torch.Tensor  # (K, B, T) greedy targets, IGNORE where unscored
    data_labels: torch.Tensor  # (B, T) x_{i+2} where step 1 is scored (for the data NLL), else IGNORE


def chain_batch(
    input_ids: torch.Tensor, greedy: torch.Tensor, assistant: torch.Tensor, lengths: torch.Tensor, steps: int
) -> ChainBatch:
    """Build step inputs and labels.

    Args:
        input_ids: (B, T) window tokens, right-padded.
        greedy: (B, T) the base's greedy choice at each position.
        assistant: (B, T) bool, True on assistant-span positions.
        lengths: (B,) real length of each row.
        steps: K, the chained steps.
    """
    batch, length = input_ids.shape
    device = input_ids.device
    positions = torch.arange(length, device=device).expand(batch, -1)

    def shifted(values: torch.Tensor, offset: int, fill: int) -> torch.Tensor:
        """values[:, i + offset], `fill` past the end of the row."""
        out = torch.full_like(values, fill)
        if offset < length:
            out[:, : length - offset] = values[:, offset:]
        return out

    real = positions < lengths[:, None]
    step_tokens, labels = [], []
    for k in range(1, steps + 1):
        embedded = shifted(input_ids, 1, 0) if k == 1 else shifted(greedy, k - 1, 0)
        predicted_position = positions + k + 1
        scored = (predicted_position < lengths[:, None]) & shifted(assistant & real, k + 1, 0).bool()
        target = shifted(greedy, k, IGNORE)
        step_tokens.append(embedded)
        labels.append(torch.where(scored, target, IGNORE))
    data_scored = labels[0] != IGNORE
    data_labels = torch.where(data_scored, shifted(input_ids, 2, IGNORE), IGNORE)
    return ChainBatch(torch.stack(step_tokens), torch.stack(labels), data_labels)


@dataclass(frozen=True)
class StepStats:
    """Sums over the scored pairs of one step (add across batches, then divide)."""

    scored: int
    loss_sum: float
    agree: int


def _chunk_loss_sum(head, hidden: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy and argmax hits of one chunk of scored pairs: (N, D) -> scalars."""
    logits = head.logits(hidden).float()  # (N, V)
    return F.cross_entropy(logits, target, reduction="sum"), (logits.argmax(-1) == target).sum()


def chain_loss(
    head,
    head_hidden: torch.Tensor,
    labels: torch.Tensor,
    weights: tuple[float, ...],
    chunk_tokens: int = DEFAULT_LOGITS_CHUNK_TOKENS,
) -> tuple[torch.Tensor, list[StepStats]]:
    """Weighted mean over steps of the per-step mean cross-entropy against the greedy targets.

    Logits are computed only at scored pairs, `chunk_tokens` pairs at a time, and each
    chunk's logits are recomputed in the backward pass instead of kept: at real size
    (vocabulary 248,320) the fp32 logits of one 4x510-token, 3-step batch would be 6 GiB.
    `head_hidden` is (K, B, T, D) from `MTPHead.forward`; `labels` is (K, B, T).
    """
    # Zero that still depends on the head, so a batch without scored pairs yields a
    # gradient of zeros (all data-parallel processes must run the same backward).
    total = head_hidden.float().sum() * 0.0
    stats = []
    for k, weight in enumerate(weights):
        scored = labels[k] != IGNORE
        count = int(scored.sum())
        if count == 0:
            stats.append(StepStats(0, 0.0, 0))
            continue
        hidden, target = head_hidden[k][scored], labels[k][scored]
        loss_sum = head_hidden.new_zeros((), dtype=torch.float32)
        agree = 0
        for start in range(0, count, chunk_tokens):
            chunk = slice(start, start + chunk_tokens)
            if torch.is_grad_enabled():
                part, hits = checkpoint(_chunk_loss_sum, head, hidden[chunk], target[chunk], use_reentrant=False)
            else:
                part, hits = _chunk_loss_sum(head, hidden[chunk], target[chunk])
            loss_sum = loss_sum + part
            agree += int(hits)
        loss = loss_sum / count
        total = total + weight * loss
        stats.append(StepStats(count, float(loss.detach()) * count, agree))
    return total, stats
