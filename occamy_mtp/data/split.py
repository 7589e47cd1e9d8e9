"""The train / validation / heldout split: by each conversation's content and the seed alone,
and windows kept apart across sides (docs/guide/DATA.md).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from occamy_mtp.data.reader import BEYOND_SPLIT_SIZE
from occamy_mtp.data.windows import Window

TRAIN = "train"
VALIDATION = "validation"
HELDOUT = "heldout"
HASH_KEY_BITS = 64


def split_key(conversation_hash: str, seed: int) -> float:
    """A uniform number in [0, 1) that depends only on the conversation and the seed."""
    digest = hashlib.sha256(f"{seed}:{conversation_hash}".encode("ascii")).digest()
    return int.from_bytes(digest[: HASH_KEY_BITS // 8], "big") / 2**HASH_KEY_BITS


def default_fractions(train_conversations: int, heldout_conversations: int, validation_conversations: int = 0) -> tuple[float, float]:
    """(heldout_fraction, validation_fraction): each side's share of the conversations asked for."""
    total = train_conversations + heldout_conversations + validation_conversations
    return heldout_conversations / total, validation_conversations / total


def assign_split(
    conversation_hashes: Iterable[str],
    *,
    train_conversations: int,
    heldout_conversations: int,
    seed: int,
    heldout_fraction: float | None = None,
    validation_conversations: int = 0,
    validation_fraction: float | None = None,
) -> dict[str, str]:
    """hash -> "train", "validation", "heldout" or BEYOND_SPLIT_SIZE.

    A conversation's side is heldout iff its split key is below `heldout_fraction`,
    validation iff it is below `heldout_fraction + validation_fraction`, train otherwise
    (default fractions: each side's share of the sizes asked for; without validation
    conversations the split is heldout / (train + heldout) as it always was); each side
    then keeps the conversations with the lowest keys, up to its size. Guarantee,
    exactly: a conversation's side depends on its own content, the seed and the
    fractions only, so adding conversations never moves another one between sides.
    Adding one conversation changes at most one other assignment: when the new one's
    side is full and its key is below that side's largest kept key, that largest one
    becomes BEYOND_SPLIT_SIZE. While a side has room, adding data changes nothing else
    at all. The input order never matters. The price: a side can come out smaller than
    asked for when the data is just big enough (the report shows the sizes reached).
    """
    default_heldout, default_validation = default_fractions(train_conversations, heldout_conversations, validation_conversations)
    heldout_fraction = default_heldout if heldout_fraction is None else heldout_fraction
    validation_fraction = default_validation if validation_fraction is None else validation_fraction
    if not 0.0 <= heldout_fraction <= 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1], got {heldout_fraction}")
    if not 0.0 <= validation_fraction <= 1.0 - heldout_fraction:
        raise ValueError(f"validation_fraction must be in [0, 1 - heldout_fraction], got {validation_fraction}")
    keyed = sorted((split_key(h, seed), h) for h in set(conversation_hashes))
    assignment: dict[str, str] = {}
    kept = {TRAIN: 0, VALIDATION: 0, HELDOUT: 0}
    capacity = {TRAIN: train_conversations, VALIDATION: validation_conversations, HELDOUT: heldout_conversations}
    for key, conversation_hash in keyed:
        if key < heldout_fraction:
            side = HELDOUT
        elif key < heldout_fraction + validation_fraction:
            side = VALIDATION
        else:
            side = TRAIN
        if kept[side] < capacity[side]:
            assignment[conversation_hash] = side
            kept[side] += 1
        else:
            assignment[conversation_hash] = BEYOND_SPLIT_SIZE
    return assignment


def keep_apart(sides: dict[str, list[Window]]) -> dict[str, int]:
    """Drop, in place, the validation windows that share a context or an answer with a heldout
    window, then the train windows that share one with a heldout or validation window.

    The split assigns whole conversations, but two conversations can share a prompt (the
    same question answered twice) or an answer span (answers that differ only past the
    window): with self-generated answers a window is its context and the base's
    continuation of it, so a shared context is a shared window, and the teacher-forced
    figures read the recorded answers in every recipe. Heldout is never changed (every
    reported figure is measured on it). Returns how many windows each side lost.
    """
    def keys(window: Window) -> tuple[tuple, ...]:
        context = ("context",) + window.input_ids[: window.answer_start]
        return (context, ("answer",) + window.input_ids[window.answer_start :]) if window.has_answer else (context,)

    taken = {key for w in sides[HELDOUT] for key in keys(w)}
    dropped = {}
    for side in (VALIDATION, TRAIN):
        kept = [w for w in sides[side] if not taken.intersection(keys(w))]
        dropped[f"{side}_windows_dropped"] = len(sides[side]) - len(kept)
        sides[side][:] = kept
        taken.update(key for w in kept for key in keys(w))
    return dropped
