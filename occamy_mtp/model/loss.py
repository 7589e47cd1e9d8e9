"""Chain inputs, labels and the distillation loss.

Alignment (docs/reference/CONTRACT.md sections 2 and 4), for a window x_0..x_{L-1} with the base's greedy
choices greedy_t = argmax(W @ H_t) (the base's prediction for position t+1):

* step 1 at anchor i embeds x_{i+1} and is trained towards greedy_{i+1} (position i+2);
* step k >= 2 at anchor i embeds t_k = greedy_{i+k-1}, the token step k-1 drafts when it
  is accepted under greedy serving, and is trained towards greedy_{i+k} (position i+k+1).
  Under sampled serving the token accepted at step k-1 is the one the text holds there
  (the emitted token is the accepted draft), so a chain on sampled text embeds
  t_k = x_{i+k} (`embed_text`).

A (step, anchor) pair is scored only when its predicted position lies inside the
window and inside the assistant span.

The losses that read p (`train.loss` kl, tv, top1-certainty, top1-margin) take the base's
processed distribution at each scored pair (`occamy_mtp.sampling`), computed from the base's
hidden state H_{i+k} through the shared lm_head, exactly, one chunk at a time. Under penalties p
is penalized over the answer before the predicted token (the text's tokens: the accepted drafts
and what the request generated before them), as `served_choice` penalizes the choice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from occamy_mtp import sampling
from occamy_mtp import memory
from occamy_mtp.config import Serving
from occamy_mtp.losses import LOSSES, fits_distribution
from occamy_mtp.model.head import DEFAULT_LOGITS_CHUNK_TOKENS

IGNORE = -100  # label of an unscored (step, anchor) pair
# Scored pairs per chunk of a distribution loss: the base's p (and top-p's sort of it), the
# head's logits and q are each (pairs x V) of 4 to 12 bytes; 1024 pairs at V = 248,320 are
# 1 to 3 GiB each.
SOFT_CHUNK_TOKENS = 1024
# The base's choice under penalties: its logits in fp32, penalized (a copy, the answer's counts, the
# tokens seen), and the argmax.
CHOICE_BYTES_PER_LOGIT = 16


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


@torch.no_grad()
def served_choice(head, hidden: torch.Tensor, greedy: torch.Tensor, batch: WindowBatch, serving: Serving) -> torch.Tensor:
    """(B, T) the base's own choice for the next position as `serving` processes its logits: `greedy`
    (the argmax of W @ H_t, which temperature, top-k and top-p leave in place) unless penalties apply,
    then, inside each answer, the argmax of the penalized logits over the answer so far and the prompt
    (`sampling.penalized`): the token a perfect drafter drafts there, and what top-1 training fits."""
    if not serving.penalized:
        return greedy
    texts = Texts.of(batch)
    starts = texts.answer_starts
    positions = torch.arange(greedy.shape[1], device=greedy.device)[None]
    # greedy_t predicts x_{t+1}: the penalties read the answer up to x_t; from the token before the answer
    wanted = (positions >= (starts[:, None] - 1)) & (positions < (batch.lengths[:, None] - 1))
    rows, at = wanted.nonzero(as_tuple=True)
    out = greedy.clone()
    chunk = memory.logit_rows(hidden.device, head.vocab_size, CHOICE_BYTES_PER_LOGIT, DEFAULT_LOGITS_CHUNK_TOKENS)
    for start in range(0, len(rows), chunk):
        part = slice(start, start + chunk)
        history = texts.histories(rows[part], at[part] + 1)
        logits = sampling.penalized(head.logits(hidden[rows[part], at[part]]), history, serving.presence_penalty,
                                    serving.frequency_penalty, serving.repetition_penalty)
        out[rows[part], at[part]] = logits.argmax(dim=-1)
    return out


@dataclass(frozen=True)
class ChainBatch:
    """Everything the head and the loss need for one padded (B, T) batch."""

    step_token_ids: torch.Tensor  # (K, B, T) tokens each step embeds
    labels: torch.Tensor  # (K, B, T) greedy targets, IGNORE where unscored
    data_labels: torch.Tensor  # (B, T) x_{i+2} where step 1 is scored (for the data NLL), else IGNORE


def chain_batch(
    input_ids: torch.Tensor, greedy: torch.Tensor, assistant: torch.Tensor, lengths: torch.Tensor, steps: int,
    embed_text: bool = False,
) -> ChainBatch:
    """Build step inputs and labels.

    Args:
        input_ids: (B, T) window tokens, right-padded.
        greedy: (B, T) the base's greedy choice at each position.
        assistant: (B, T) bool, True on assistant-span positions.
        lengths: (B,) real length of each row.
        steps: K, the chained steps.
        embed_text: steps k >= 2 embed the text's token x_{i+k} (sampled serving) instead of
            the base's greedy greedy_{i+k-1} (module docstring).
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
        embedded = shifted(input_ids, k, 0) if k == 1 or embed_text else shifted(greedy, k - 1, 0)
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


@dataclass(frozen=True)
class Objective:
    """What the head is fitted to (`train.loss`), and how its chain is fed."""

    loss: str = "top1"
    """A name of `losses.LOSSES`: top1 (cross-entropy towards the base's greedy token), kl, tv."""
    serving: Serving = Serving()
    """Whose processed distribution p a kl or tv loss fits, and at whose temperature q is taken."""
    embed_text: bool = False
    """Steps k >= 2 embed the text's tokens (the train text was sampled; `chain_batch`)."""


@dataclass(frozen=True)
class Share:
    """One process's part of a step over several: the step's scored pairs per draft step, every process
    together, and how many processes there are (`chain_loss`)."""

    scored: tuple[int, ...]
    processes: int


@dataclass(frozen=True)
class Texts:
    """What the penalties of a penalized p read: the batch's tokens and where each row's answer starts."""

    input_ids: torch.Tensor  # (B, T)
    answer_starts: torch.Tensor  # (B,)

    @staticmethod
    def of(batch: WindowBatch) -> Texts:
        return Texts(batch.input_ids, batch.assistant.to(torch.int8).argmax(dim=1))

    def histories(self, rows: torch.Tensor, positions: torch.Tensor) -> sampling.History:
        """The penalties' history of the token at `positions[n]` of row `rows[n]`."""
        return sampling.answer_histories(self.input_ids, self.answer_starts, rows, positions)


def _chunk_loss_sum(head, hidden: torch.Tensor, target: torch.Tensor, base_hidden: torch.Tensor | None = None,
                    objective: Objective = Objective(), history: sampling.History | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed loss and argmax hits (against the greedy target) of one chunk of scored pairs: (N, D) -> scalars.

    For a loss that reads p, `base_hidden` (N, D) are the base's hidden states whose logits
    give p at the same pairs (the head's logits function is the base's lm_head), penalized over
    `history` when the serving configuration has penalties."""
    logits = head.logits(hidden).float()  # (N, V)
    hits = (logits.argmax(-1) == target).sum()
    p = None
    if fits_distribution(objective.loss):
        with torch.no_grad():
            p = sampling.base_probs(head.logits(base_hidden), objective.serving, history)
    return LOSSES[objective.loss].summed(logits, target, p, objective.serving.temperature), hits


def chain_loss(
    head,
    head_hidden: torch.Tensor,
    labels: torch.Tensor,
    weights: tuple[float, ...],
    chunk_tokens: int | None = None,
    objective: Objective = Objective(),
    base_hidden: torch.Tensor | None = None,
    texts: Texts | None = None,
    share: Share | None = None,
) -> tuple[torch.Tensor, list[StepStats]]:
    """Weighted mean over steps of the per-step mean loss: cross-entropy against the greedy
    targets, or a distribution loss against the base's processed distribution (`objective`).

    Logits are computed only at scored pairs, `chunk_tokens` pairs at a time (None: as many as
    fit on the GPU, up to `DEFAULT_LOGITS_CHUNK_TOKENS`; at most `SOFT_CHUNK_TOKENS` for a
    distribution loss), and each chunk's logits are recomputed in
    the backward pass instead of kept: at real size (vocabulary 248,320) the fp32 logits of
    one 4x510-token, 3-step batch would be 6 GiB. `head_hidden` is (K, B, T, D) from
    `MTPHead.forward`; `labels` is (K, B, T); `base_hidden` (B, T, D), the base's post-norm
    hidden states, is needed by a loss that reads p: step k at anchor i fits p from H_{i+k},
    whose argmax is its greedy label; under penalties p is penalized over the answer before
    x_{i+k+1} (before the round, x_{i+2}, under SGLang's rule: `sampling.verified_history_ends`), read from `texts`.

    With `share` (this process's part of a step over several processes), step k's loss is this
    process's summed loss over the step's scored pairs on every process, times the processes: the
    gradients' mean over processes (DDP's) is then the gradient of the step's mean over all its pairs,
    what one process computes, however unevenly the windows and their pairs fall.
    """
    soft = fits_distribution(objective.loss)
    if soft and base_hidden is None:
        raise ValueError(f"a {objective.loss} loss needs the base's hidden states (base_hidden)")
    penalized = soft and objective.serving.penalized
    if penalized and texts is None:
        raise ValueError(f"a {objective.loss} loss under {objective.serving.label()}'s penalties needs the texts they read (texts)")
    if chunk_tokens is None:
        chunk_tokens = memory.logit_rows(head_hidden.device, head.vocab_size, LOSSES[objective.loss].bytes_per_logit,
                                         DEFAULT_LOGITS_CHUNK_TOKENS)
    if soft:
        chunk_tokens = min(chunk_tokens, SOFT_CHUNK_TOKENS)
    # Zero that still depends on the head, so a batch without scored pairs yields a
    # gradient of zeros (all data-parallel processes must run the same backward).
    total = head_hidden.float().sum() * 0.0
    stats = []
    for k, weight in enumerate(weights):
        scored = labels[k] != IGNORE
        count = int(scored.sum())
        mean_over = count if share is None else share.scored[k] / share.processes
        if count == 0:
            stats.append(StepStats(0, 0.0, 0))
            continue
        hidden, target = head_hidden[k][scored], labels[k][scored]
        parents = rows = anchors = None
        if soft:
            rows, anchors = scored.nonzero(as_tuple=True)
            parents = base_hidden[rows, anchors + k + 1]  # (N, D): step k + 1 predicts x_{i+k+2}, from H_{i+k+1}
        loss_sum = head_hidden.new_zeros((), dtype=torch.float32)
        agree = 0
        for start in range(0, count, chunk_tokens):
            chunk = slice(start, start + chunk_tokens)
            history = texts.histories(rows[chunk], sampling.verified_history_ends(objective.serving, anchors[chunk], k)) \
                if penalized else None
            inputs = (head, hidden[chunk], target[chunk], None if parents is None else parents[chunk], objective, history)
            if torch.is_grad_enabled():
                part, hits = checkpoint(_chunk_loss_sum, *inputs, use_reentrant=False)
            else:
                part, hits = _chunk_loss_sum(*inputs)
            loss_sum = loss_sum + part
            agree += int(hits)
        loss = loss_sum / count
        total = total + weight * (loss if share is None else loss_sum / mean_over)
        stats.append(StepStats(count, float(loss.detach()) * count, agree))
    return total, stats
