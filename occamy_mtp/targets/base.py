"""The frozen base as the teacher: post-norm hidden states and greedy targets (docs/reference/CONTRACT.md section 4).

For a window x_0..x_{T-1} the base yields H_t (after its final norm, transformers'
`last_hidden_state`) and its greedy next-token choice greedy_t = argmax(W @ H_t), the
base's prediction for position t+1. The head anchored at i sees H_i and x_{i+1} and is
trained towards greedy_{i+1}, the base's choice for position i+2.

The argmax is taken in chunks of positions (`base.logits.chunked_greedy`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from occamy_mtp.base.logits import chunked_greedy



@dataclass(frozen=True)
class BaseOutputs:
    """What the head needs from one base forward over a (B, T) batch."""

    hidden: torch.Tensor  # (B, T, D) post-final-norm hidden states, base dtype
    greedy: torch.Tensor  # (B, T) long, argmax(W @ hidden): the base's choice for t+1


@torch.no_grad()
def base_outputs(
    base,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    logits_chunk_tokens: int | None = None,
) -> BaseOutputs:
    """Plain transformers forward of the frozen base: the reference every fast path is checked against.

    `attention_mask` (B, T) marks real tokens; rows are right-padded, so a padded
    position never influences a real one (causal attention and left-to-right
    recurrences only look back).
    """
    hidden = base.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    return BaseOutputs(hidden=hidden, greedy=chunked_greedy(hidden, base.lm_head, logits_chunk_tokens))


class TargetSource(Protocol):
    """Where a training or evaluation step gets its targets: the base online, or the offline cache
    (`target_cache.TargetCache`), which stores exactly what `base_outputs` computes for each window."""

    def outputs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> BaseOutputs: ...

    def provenance(self) -> dict: ...


@dataclass(frozen=True)
class OnlineTargets:
    """The online path: the base runs on every batch (small runs, no cache)."""

    base: torch.nn.Module
    logits_chunk_tokens: int | None = None  # None: sized to the GPU (`chunked_greedy`)

    def outputs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> BaseOutputs:
        return base_outputs(self.base, input_ids, attention_mask, self.logits_chunk_tokens)

    def provenance(self) -> dict:
        return {"source": "online"}


# ----------------------------------------------------------------------------------
# Per window: the pass a target cache stores
# ----------------------------------------------------------------------------------


class WindowTargets(Protocol):
    """The base's outputs for one window of T tokens (`fastbase.WindowOutputs` is one)."""

    hidden: torch.Tensor  # (T, D) post-final-norm hidden states, base dtype
    greedy: torch.Tensor  # (T,) argmax(W @ hidden)


# A pass over windows: token ids of each window -> its outputs, in order. It batches as
# it likes: `plain_compute` below, or `fastbase.FastBasePass` (packed, fla kernels) as is.
ComputeOutputs = Callable[[Sequence[Sequence[int]]], Sequence[WindowTargets]]


def padded_ids(rows: Sequence[Sequence[int]], device="cpu") -> tuple[torch.Tensor, torch.Tensor | None]:
    """(input_ids (B, T) right-padded with 0, attention_mask (B, T) or None): as `loss.collate` pads."""
    lengths = torch.tensor([len(ids) for ids in rows])
    length = int(lengths.max())
    input_ids = torch.zeros(len(rows), length, dtype=torch.long)
    for row, ids in enumerate(rows):
        input_ids[row, : len(ids)] = torch.tensor(ids)
    padded = bool((lengths < length).any())
    attention_mask = (torch.arange(length)[None] < lengths[:, None]).long() if padded else None
    return input_ids.to(device), None if attention_mask is None else attention_mask.to(device)


@dataclass(frozen=True)
class _Outputs:
    hidden: torch.Tensor  # (T, D)
    greedy: torch.Tensor  # (T,)


def plain_compute(base, windows_per_batch: int = 1, logits_chunk_tokens: int | None = None) -> ComputeOutputs:
    """The reference pass: `base_outputs` on `windows_per_batch` windows at a time, right-padded.

    One window per forward (the default) gives each window's canonical targets, free of
    any dependence on batch composition.
    """
    if windows_per_batch < 1:
        raise ValueError(f"windows_per_batch must be >= 1, got {windows_per_batch}")
    device = next(base.parameters()).device

    def compute(windows: Sequence[Sequence[int]]) -> list[_Outputs]:
        out = []
        for start in range(0, len(windows), windows_per_batch):
            batch = windows[start : start + windows_per_batch]
            outputs = base_outputs(base, *padded_ids(batch, device), logits_chunk_tokens)
            out += [_Outputs(outputs.hidden[row, : len(ids)], outputs.greedy[row, : len(ids)]) for row, ids in enumerate(batch)]
        return out

    return compute


def plain_compute_name(windows_per_batch: int = 1) -> str:
    return f"target.base_outputs, {windows_per_batch} window(s) per forward"


SHARED_TARGETS_BYTES = 4 * 2**30
"""What `SharedTargets` keeps at most, in host memory."""


class SharedTargets:
    """A target source that keeps the outputs of each batch it is asked for (in host memory, up to
    `max_bytes`) and gives them again when the same batch is asked for again: the base's forward over
    the same texts is computed once for both heads and the ceiling (export, evaluate) and once for
    every selection step (the validation texts), not once a reader; so is the base's processed
    distribution under a sampled preset at the scored positions (`probs`). What it gives is what was
    computed, so every figure is the same; only time changes. Anything else is `source`'s."""

    def __init__(self, source: TargetSource, max_bytes: int = SHARED_TARGETS_BYTES):
        self.source, self.max_bytes = source, max_bytes
        self._kept: dict[tuple, BaseOutputs] = {}
        self._probs: dict[tuple, tuple] = {}
        self._bytes = 0
        self.hits = 0

    @staticmethod
    def _key(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> tuple:
        digest = hashlib.sha256(input_ids.detach().cpu().numpy().tobytes())
        if attention_mask is not None:
            digest.update(attention_mask.detach().cpu().numpy().tobytes())
        return tuple(input_ids.shape), digest.hexdigest()

    def outputs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> BaseOutputs:
        key = self._key(input_ids, attention_mask)
        kept = self._kept.get(key)
        if kept is not None:
            self.hits += 1
            device = input_ids.device
            return BaseOutputs(kept.hidden.to(device, copy=True), kept.greedy.to(device, copy=True))  # the reader's own
        out = self.source.outputs(input_ids, attention_mask)
        size = out.hidden.numel() * out.hidden.element_size() + out.greedy.numel() * out.greedy.element_size()
        if self._bytes + size <= self.max_bytes:
            self._kept[key] = BaseOutputs(out.hidden.detach().to("cpu", copy=True), out.greedy.detach().to("cpu", copy=True))
            self._bytes += size
        return out

    def probs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, what: tuple, part: slice,
              compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Rows `part` of a probability table computed from the base's outputs over the batch `input_ids` alone
        (`what` names which: the base's processed distribution at a step's scored positions under a serving
        configuration, `evaluation.offline`), which its readers compute a chunk of rows at a time. Each chunk is
        kept as its nonzero entries (a top-k or top-p distribution holds a few a row) while they fit, and rows
        asked for again are given from what is kept, the same values, however the rows are chunked this time
        (a chunk's size follows the free memory): computed once for both heads and every selection step rather
        than once a reader. `compute()` gives the rows `part` (rows, V)."""
        key = (self._key(input_ids, attention_mask), what)
        pieces = self._probs.setdefault(key, [])
        covered = sorted((piece[0], piece[1]) for piece in pieces if piece[0] < part.stop and piece[1] > part.start)
        reach = part.start
        for begin, finish in covered:
            if begin > reach:
                break
            reach = max(reach, finish)
        if pieces and reach >= part.stop:
            self.hits += 1
            device = input_ids.device
            vocab, dtype = pieces[0][2], pieces[0][3]
            out = torch.zeros((part.stop - part.start, vocab), dtype=dtype, device=device)
            for begin, finish, _, _, rows, cols, values in pieces:
                inside = (rows + begin >= part.start) & (rows + begin < part.stop)
                if inside.any():
                    out[(rows[inside] + begin - part.start).to(device, torch.long),
                        cols[inside].to(device, torch.long)] = values[inside].to(device)
            return out
        table = compute()
        nonzero = int((table != 0).sum())
        size = nonzero * (4 + 4 + table.element_size())  # int32 row and column, and the value
        if table.dim() == 2 and nonzero <= table.numel() // 8 and self._bytes + size <= self.max_bytes:
            rows, cols = table.nonzero(as_tuple=True)
            pieces.append((part.start, part.start + table.shape[0], table.shape[1], table.dtype, rows.to("cpu", torch.int32),
                           cols.to("cpu", torch.int32), table[rows, cols].to("cpu", copy=True)))
            self._bytes += size
        return table

    def provenance(self) -> dict:
        return self.source.provenance()

    def __getattr__(self, name):
        return getattr(self.source, name)


def kept_probs(targets, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, what: tuple, part: slice,
               compute: Callable[[], torch.Tensor]) -> torch.Tensor:
    """`compute()`, rows `part` of a table made from the base's outputs over the batch alone: kept and given
    again by a `SharedTargets` source (`SharedTargets.probs`), computed every time from any other."""
    if isinstance(targets, SharedTargets):
        return targets.probs(input_ids, attention_mask, what, part, compute)
    return compute()
