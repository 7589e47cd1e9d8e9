"""The distillation losses by name (`train.loss`): adding one is a row of LOSSES.

Each loss scores the head's logits at a chunk of scored (step, anchor) pairs against what the
base does there. A loss of the base's *choice* fits its greedy token (the penalized choice
under a penalized train text), a loss of its *distribution* reads p, the base's distribution
processed as the selected serving configuration serves it, penalties included
(`sampling.base_probs`, computed by `model.loss` from the base's hidden states through the shared
lm_head): kl and tv fit p, top1-certainty and top1-margin fit the choice with pairs weighted by p. docs/developer/ADDING.md
walks a new one through.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

CHOICE = "choice"
DISTRIBUTION = "distribution"
"""A loss that reads p (the distribution losses, and top1 weighted by what p says a draft is worth)."""


@dataclass(frozen=True)
class Loss:
    name: str
    fits: str
    """CHOICE (the base's token at each pair alone) or DISTRIBUTION (its processed distribution p there too)."""
    bytes_per_logit: int
    """Bytes a logit takes at the peak of a chunk's backward (the logits recomputed, so a chunk is all
    that is ever held): `memory.logit_rows` sizes the chunks from it; tests/test_memory.py holds each
    against a measured peak."""
    summed: Callable[..., torch.Tensor]
    """(head logits (N, V) fp32, target (N,), p (N, V) or None, the serving temperature) -> the summed loss."""
    description: str


def _cross_entropy(logits: torch.Tensor, target: torch.Tensor, p, temperature: float) -> torch.Tensor:
    return F.cross_entropy(logits, target, reduction="sum")


def _certainty_weighted(logits: torch.Tensor, target: torch.Tensor, p: torch.Tensor, temperature: float) -> torch.Tensor:
    """Cross-entropy towards the base's choice, each pair weighted by p's top probability: what a right
    draft is worth there (a greedy draft of the base's choice is accepted with that probability), so
    pairs where the base is unsure, where even a perfect draft is mostly rejected, weigh little."""
    return (p.amax(dim=-1) * F.cross_entropy(logits, target, reduction="none")).sum()


def _margin_weighted(logits: torch.Tensor, target: torch.Tensor, p: torch.Tensor, temperature: float) -> torch.Tensor:
    """Cross-entropy towards the base's choice, each pair weighted by what the head's own draft loses there:
    p's top probability less p at the head's argmax (0 where the head already drafts the choice, or a
    token as likely)."""
    with torch.no_grad():
        cost = p.amax(dim=-1) - p.gather(-1, logits.argmax(dim=-1, keepdim=True)).squeeze(-1)
    return (cost * F.cross_entropy(logits, target, reduction="none")).sum()


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """q's logits: at the serving temperature (1 when serving is greedy: p is then one-hot and T only
    shapes how q approaches it)."""
    return logits.float() / (temperature if temperature > 0 else 1.0)


def _kl(logits: torch.Tensor, target, p: torch.Tensor, temperature: float) -> torch.Tensor:
    """Summed KL(p || q), 0 log 0 = 0."""
    return (torch.xlogy(p, p) - p * _scaled(logits, temperature).log_softmax(dim=-1)).sum()


def _tv(logits: torch.Tensor, target, p: torch.Tensor, temperature: float) -> torch.Tensor:
    """Summed 1 - sum_x min(p, q): one minus the expected acceptance of a draft drawn from q."""
    return (1.0 - torch.minimum(p, _scaled(logits, temperature).softmax(dim=-1)).sum(dim=-1)).sum()


# top1: the bf16 logits, their fp32 copy, cross-entropy's log-softmax and the gradients of all
# three. kl / tv: p's top-p sort beside the head's fp32 logits, q and their gradients.
LOSSES: dict[str, Loss] = {loss.name: loss for loss in (
    Loss("top1", CHOICE, 24, _cross_entropy, "cross-entropy towards the base's greedy token"),
    Loss("top1-certainty", DISTRIBUTION, 64, _certainty_weighted,
         "top1's cross-entropy, each pair weighted by the base's processed top probability"),
    Loss("top1-margin", DISTRIBUTION, 64, _margin_weighted,
         "top1's cross-entropy, each pair weighted by p(the base's choice) - p(the head's choice)"),
    Loss("kl", DISTRIBUTION, 64, _kl, "KL(p || q), q the head's softmax at the serving temperature"),
    Loss("tv", DISTRIBUTION, 64, _tv, "the total variation 1 - sum_x min(p(x), q(x)): one minus the expected acceptance"),
)}


def fits_distribution(name: str) -> bool:
    """Whether the loss called `name` fits the base's processed distribution (and needs its hidden
    states); False for a name that is not a loss (`config.check` refuses it)."""
    loss = LOSSES.get(name)
    return loss is not None and loss.fits == DISTRIBUTION
