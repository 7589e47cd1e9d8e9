"""Offline evaluation of a head against the frozen base (SPEC section 4).

Per heldout window: the base runs once (post-norm hidden states, greedy choices), the
head runs the engine's K-step chain, and the metrics are:

* target top-1 agreement: step-1 argmax == the base's greedy choice for position i+2;
* data-answer NLL: mean -log p_head(x_{i+2}) over the same positions;
* chained acceptance: step k counts only where steps 1..k-1 were accepted;
  acc_k = accepted_k / proposed_k; mean accept length = 1 + sum_k prod_{j<=k} acc_j
  (bonus token included, as SGLang reports it); accept rate = accepted draft tokens /
  drafted tokens.

Step k >= 2 embeds the greedy token of the step before it. Where the chain is still
accepted that is exactly the token the engine drafted, and once a step is rejected
nothing later is counted, so the chain is the engine's. On teacher-forced data the
hidden states come from the recorded answer rather than from the base's own greedy
continuation, so the acceptance figure is exact only on text the base generated
greedily (`text="self_generated"`); it is reported as an approximation otherwise.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from occamy_mtp.loss import IGNORE, chain_batch
from occamy_mtp.target import base_outputs

TEACHER_FORCED = "teacher_forced"
SELF_GENERATED = "self_generated"


@dataclass(frozen=True)
class Metrics:
    windows: int
    scored_positions: int
    agreement: float
    data_nll: float
    draft_steps: int
    proposed: list[int]
    accepted: list[int]
    acceptance: list[float]
    mean_accept_length: float
    accept_rate: float
    text: str
    exact: bool

    def to_dict(self) -> dict:
        return asdict(self)


def acceptance_summary(proposed: list[int], accepted: list[int], drafted: int) -> tuple[list[float], float, float]:
    """(acc_k per step, mean accept length with the bonus token, accept rate)."""
    acceptance = [a / p if p else 0.0 for a, p in zip(accepted, proposed)]
    length, running = 1.0, 1.0
    for acc in acceptance:
        running *= acc
        length += running
    rate = sum(accepted) / drafted if drafted else 0.0
    return acceptance, length, rate


@torch.no_grad()
def evaluate_head(
    base,
    head,
    windows,
    draft_steps: int = 3,
    windows_per_batch: int = 4,
    text: str = TEACHER_FORCED,
) -> Metrics:
    """Agreement, NLL and chained acceptance of `head` on `windows` (see module docstring)."""
    from occamy_mtp.train import collate  # the same batching as training

    device = next(base.parameters()).device
    was_training = head.training
    head.eval()
    scored = agree = 0
    nll_sum = 0.0
    proposed = [0] * draft_steps
    accepted = [0] * draft_steps
    drafted = 0
    for start in range(0, len(windows), windows_per_batch):
        batch = collate(windows[start : start + windows_per_batch], device)
        targets = base_outputs(base, batch.input_ids, batch.attention_mask)
        chain = chain_batch(batch.input_ids, targets.greedy, batch.assistant, batch.lengths, draft_steps)
        hidden = head(chain.step_token_ids, targets.hidden)  # (K, B, T, D)

        valid = chain.labels != IGNORE  # (K, B, T)
        first = valid[0]
        logits1 = head.logits(hidden[0][first]).float()
        scored += int(first.sum())
        agree += int((logits1.argmax(-1) == chain.labels[0][first]).sum())
        nll_sum += float(F.cross_entropy(logits1, chain.data_labels[first], reduction="sum"))

        alive = first.clone()  # anchors whose chain is still accepted
        for k in range(draft_steps):
            step_valid = valid[k]
            drafted += int((step_valid & first).sum())
            proposing = alive & step_valid
            hits = torch.zeros_like(proposing)
            if proposing.any():
                predicted = head.logits(hidden[k][proposing]).argmax(-1)
                hits[proposing] = predicted == chain.labels[k][proposing]
            proposed[k] += int(proposing.sum())
            accepted[k] += int(hits.sum())
            alive = hits
    head.train(was_training)
    acceptance, length, rate = acceptance_summary(proposed, accepted, drafted)
    return Metrics(
        windows=len(windows),
        scored_positions=scored,
        agreement=agree / scored if scored else 0.0,
        data_nll=nll_sum / scored if scored else float("nan"),
        draft_steps=draft_steps,
        proposed=proposed,
        accepted=accepted,
        acceptance=acceptance,
        mean_accept_length=length,
        accept_rate=rate,
        text=text,
        exact=text == SELF_GENERATED,
    )
