"""GPU memory: what this process may still allocate, and how many rows of a batch fit in it.

The batches whose memory grows with their size (self-generation's decoder state, the cache
pass's tokens per forward) are sized from what is free when they start, unless the user
sets them; so are the chunks of positions whose vocabulary-wide logits are worked on at
once (the greedy targets, evaluation's figures and odds, the loss: `logit_rows`).
count = (available - margin) // bytes per row, at most the batch's own upper bound.
`available` is the device's free memory once torch's allocator has handed back its cached
blocks (the logits' chunks, with expandable segments, count those blocks as free instead),
within the process's cap when one is set (`torch.cuda.set_per_process_memory_fraction`);
`MARGIN_BYTES` is kept for what the per-row figures do not count (the CUDA graphs' pools,
cuBLAS and Triton workspaces, the allocator's fragmentation). The per-row figures are the
callers' (`fastdecode.BatchDecoder.row_bytes`, `fastbase.token_bytes`, the `*_BYTES_PER_LOGIT`
figures beside each chunked loop), each checked against a measured peak (bench/results/recipe.md,
tests/test_memory.py).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from occamy_mtp.errors import OccamyError
from occamy_mtp.files import size_text

GIB = 2**30
MARGIN_BYTES = 2 * GIB


class NotEnoughMemory(OccamyError, RuntimeError):
    """Not even one row of a batch fits: says what the model holds, what the card has and what a row needs."""


def available_bytes(device: torch.device, hand_back: bool = True) -> int:
    """Bytes this process may still allocate on `device`: the card's free memory, within the
    process's cap less what torch's allocator holds.

    With `hand_back`, the allocator's cached blocks are handed back to the card first: counted
    as free while cached, they can be too fragmented for one large tensor (a decoder's state has
    run out that way, bench/results/recipe.md). Without it they count as available, as
    they are with expandable segments, where the allocator unmaps whatever cached pages an
    allocation needs (`expandable_segments`)."""
    if device.index is None:  # the cap's query needs the index: the current device's
        device = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_initialized() else 0)
    if hand_back:
        torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    held = reserved if hand_back else torch.cuda.memory_allocated(device)  # what counts against a cap
    available = free + reserved - held  # without a hand-back, the cached blocks count as free
    fraction = torch.cuda.get_per_process_memory_fraction(device) if hasattr(torch.cuda, "get_per_process_memory_fraction") else 1.0
    if fraction < 1.0:  # the allocator refuses to hold more than the cap
        available = min(available, int(fraction * total) - held)
    return max(0, available)


def expandable_segments() -> bool:
    """Whether torch's CUDA allocator runs on expandable segments, as the library asks unless the
    user set its options (`occamy_mtp/__init__.py`): PYTORCH_CUDA_ALLOC_CONF where set, otherwise
    PYTORCH_ALLOC_CONF, the last mention winning, as torch reads them."""
    options = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF", "")
    expandable = False
    for option in options.split(","):
        key, _, value = option.partition(":")
        if key.strip() == "expandable_segments":
            expandable = value.strip() == "True"
    return expandable


def held_bytes(model: torch.nn.Module) -> int:
    """The bytes `model`'s parameters and buffers hold, each storage once (the layers of an FP8 base
    kept in FP8 share one buffer of weights, `model.fp8_weights`)."""
    storages = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        storage = tensor.untyped_storage()
        storages[(storage.device, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


@dataclass(frozen=True)
class Sizing:
    """A batch sized to the card, and why."""

    count: int
    reason: str


def fitting(what: str, row_bytes: int, upper: int, device: torch.device, model: torch.nn.Module | None = None,
            margin: int = MARGIN_BYTES, hand_back: bool = True) -> Sizing:
    """The most `what`s (rows of `row_bytes` each, at most `upper`) that fit beside what is already
    allocated (`available_bytes`, with `hand_back`); NotEnoughMemory, naming `model`'s size (where
    given) and the card's, when not even one does."""
    available = available_bytes(device, hand_back)
    count = min(upper, (available - margin) // row_bytes)
    total = torch.cuda.mem_get_info(device)[1]
    if count < 1:
        held = ""
        if model is not None:
            held = f"the model holds {size_text(held_bytes(model))} of weights, "
        raise NotEnoughMemory(
            f"not enough GPU memory for one {what}: {held}this process has "
            f"{size_text(torch.cuda.memory_allocated(device))} allocated and may allocate {size_text(available)} more "
            f"of the card's {size_text(total)}; a {what} needs {size_text(row_bytes)} beside a margin of "
            f"{size_text(margin)}. Use a GPU with more memory (or free the one in use)"
        )
    bound = "its upper bound" if count == upper else "what fits"
    return Sizing(int(count), f"{count} {what}s ({bound}): {size_text(available)} free for this process, "
                              f"{size_text(row_bytes)} a {what}, {size_text(margin)} kept free")


def logit_rows(device: torch.device, vocab_size: int, bytes_per_logit: float, upper: int) -> int:
    """Positions whose (positions x `vocab_size`) logits work, `bytes_per_logit` a logit at its
    peak, fits beside what is allocated: at most `upper`, which is also the answer off CUDA
    (where nothing is sized, so results there never depend on the free memory).

    Sized at every chunked loop (each training step's loss, each replayed check), so the cache is
    handed back only where it would otherwise be miscounted: with expandable segments it is
    counted as available instead, and the allocator keeps its pages mapped between chunks. The
    batch sizings (`fitting`'s other callers) always hand it back: a CUDA graph captured right
    after cannot make the allocator release its cache."""
    if device.type != "cuda":
        return upper
    return fitting("position's logits", math.ceil(vocab_size * bytes_per_logit), upper, device,
                   hand_back=not expandable_segments()).count
