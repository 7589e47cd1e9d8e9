"""Self-generated windows: each window's answer replaced by the frozen base's own greedy continuation.

docs/SELF_GENERATED.md sets out the details.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from occamy_mtp.errors import OccamyError
from occamy_mtp import checkpoint as ckpt_io
from occamy_mtp import files
from occamy_mtp.files import token_ids_sha256
from occamy_mtp.data import Window

STORE_FILE = "self-generated.jsonl"
META_FILE = "self-generated.meta.json"
STORE_FORMAT = 1
# What the continuations are a function of: a store that differs in any is refused.
COMPARED_FIELDS = ("format", "base_config_sha256", "base_weights_sample_sha256", "dtype", "attn_implementation",
                   "max_new_tokens", "stop_token_ids")


class SelfGenError(OccamyError, ValueError):
    """A store that is not this run's or is damaged, or continuations that are missing; says which and why."""


def context_digest(context_ids: Sequence[int]) -> str:
    """A context's key in the store (`files.token_ids_sha256`)."""
    return token_ids_sha256(context_ids)


def context_of(window: Window) -> tuple[int, ...]:
    return tuple(window.input_ids[: window.answer_start])


@dataclass(frozen=True)
class Continuation:
    tokens: tuple[int, ...]
    finished: bool
    """True when the last token is a stop token (else the budget ran out)."""


def self_generate(
    base, contexts: Sequence[Sequence[int]], max_new_tokens: int, stop_token_ids: Collection[int], batch_size: int
) -> list[Continuation]:
    """The base's greedy continuations of `contexts` (`greedy.greedy_generate`, batched)."""
    from occamy_mtp.greedy import greedy_generate

    stop = frozenset(int(t) for t in stop_token_ids)
    generated = greedy_generate(base, contexts, max_new_tokens=max_new_tokens, eos_token_ids=stop, batch_size=batch_size)
    return [Continuation(tuple(ids), bool(ids) and ids[-1] in stop) for ids in generated]


def with_continuation(window: Window, continuation: Continuation) -> Window:
    """The window's context followed by `continuation` as its answer span."""
    return replace(window, input_ids=context_of(window) + continuation.tokens)


def store_identity(base_dir: str | Path, dtype: str, attn_implementation: str, max_new_tokens: int, stop_token_ids: Collection[int]) -> dict:
    """What a store's continuations are a function of (the fields of COMPARED_FIELDS)."""
    base = ckpt_io.checkpoint_fingerprint(base_dir)
    return {
        "format": STORE_FORMAT,
        "base_config_sha256": base["config_sha256"],
        "base_weights_sample_sha256": base["weights_sample_sha256"],
        "dtype": dtype,
        "attn_implementation": attn_implementation,
        "max_new_tokens": int(max_new_tokens),
        "stop_token_ids": sorted(int(t) for t in stop_token_ids),
    }


class SelfGeneratedStore:
    """The continuations of one base under one set of settings, on disk (module docstring)."""

    def __init__(self, directory: Path, identity: dict, continuations: dict[str, Continuation], torn_lines_dropped: int):
        self.directory = directory
        self.identity = identity
        self._continuations = continuations
        self.torn_lines_dropped = torn_lines_dropped
        self.generated_now = 0
        self.generation_seconds = 0.0

    @classmethod
    def open(cls, directory: str | Path, identity: dict) -> "SelfGeneratedStore":
        """Open (or start) the store in `directory`; refuse one written under another identity."""
        directory = Path(directory)
        meta_path, store_path = directory / META_FILE, directory / STORE_FILE
        if meta_path.is_file():
            try:
                existing = json.loads(meta_path.read_text())
            except (OSError, ValueError) as err:
                raise SelfGenError(f"{meta_path}: unreadable ({err}); remove the directory to generate again") from None
            differences = [
                f"{name}: {existing.get(name)!r} in the store, {identity[name]!r} now"
                for name in COMPARED_FIELDS
                if existing.get(name) != identity[name]
            ]
            if differences:
                raise SelfGenError(
                    f"{directory}: the self-generated windows there were written under other settings ("
                    + "; ".join(differences)
                    + "); use another data.self_generated_dir, or remove it to generate again"
                )
        elif store_path.exists():
            raise SelfGenError(f"{store_path}: has no {META_FILE} beside it, so what wrote it is unknown; remove it")
        continuations, torn = _read_store(store_path)
        return cls(directory, identity, continuations, torn)

    def __contains__(self, window: Window) -> bool:
        return context_digest(context_of(window)) in self._continuations

    def missing(self, windows: Sequence[Window]) -> list[Window]:
        return [w for w in windows if w not in self]

    def generate(self, base, windows: Sequence[Window], batch_size: int, log: Callable[[str], None] = print) -> None:
        """Generate (and append) the continuations of every context of `windows` not yet stored."""
        contexts = sorted({context_of(w) for w in windows}, key=context_digest)
        batches = [contexts[i : i + batch_size] for i in range(0, len(contexts), batch_size)]
        todo = [b for b in batches if any(context_digest(c) not in self._continuations for c in b)]
        if not todo:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        meta_path = self.directory / META_FILE
        if not meta_path.is_file():
            files.write_json(meta_path, self.identity)
        store_path = self.directory / STORE_FILE
        _drop_torn_tail(store_path)
        started = time.perf_counter()
        missing_total = sum(context_digest(c) not in self._continuations for b in todo for c in b)
        log(f"self-generated windows: the base writes {missing_total} continuations "
            f"(<= {self.identity['max_new_tokens']} tokens each, {len(todo)} batches of <= {batch_size}) into {store_path}")
        with open(store_path, "a", encoding="utf-8") as stream:
            for number, batch in enumerate(todo, start=1):
                outputs = self_generate(base, batch, self.identity["max_new_tokens"], self.identity["stop_token_ids"], batch_size)
                for context, continuation in zip(batch, outputs):
                    key = context_digest(context)
                    if key in self._continuations:
                        continue  # generated again only to keep the batch whole
                    line = {"context_sha256": key, "tokens": list(continuation.tokens), "finished": continuation.finished}
                    stream.write(json.dumps(line, separators=(",", ":")) + "\n")
                    self._continuations[key] = continuation
                    self.generated_now += 1
                stream.flush()
                os.fsync(stream.fileno())
                elapsed = time.perf_counter() - started
                log(f"  batch {number}/{len(todo)} written ({elapsed:.0f} s)")
        self.generation_seconds += time.perf_counter() - started

    def windows(self, windows: Sequence[Window]) -> list[Window]:
        """The self-generated twin of each window (all must be stored)."""
        missing = self.missing(windows)
        if missing:
            raise SelfGenError(
                f"{self.directory}: {len(missing)} of {len(windows)} windows have no self-generated continuation yet "
                "(the base was not loaded to write them); run `python -m occamy_mtp.cache --config ...`, which writes "
                "them with the target cache, or train without data.target_cache"
            )
        return [with_continuation(w, self._continuations[context_digest(context_of(w))]) for w in windows]

    def provenance(self, windows: Sequence[Window]) -> dict:
        """JSON-able record of the store and of the continuations of `windows`."""
        stored = [self._continuations[context_digest(context_of(w))] for w in windows if w in self]
        return {
            "directory": str(self.directory),
            "identity": dict(self.identity),
            "windows": len(windows),
            "finished": sum(c.finished for c in stored),
            "generated_tokens": sum(len(c.tokens) for c in stored),
            "generated_now": self.generated_now,
            "generation_seconds": self.generation_seconds,
            "torn_lines_dropped": self.torn_lines_dropped,
            "decoder": "occamy_mtp.greedy.greedy_generate",
        }


def _read_store(path: Path) -> tuple[dict[str, Continuation], int]:
    """Parse the store; a last line without its newline is torn (dropped), any other bad line an error."""
    if not path.exists():
        return {}, 0
    raw = path.read_bytes()
    good = raw.rfind(b"\n") + 1
    continuations: dict[str, Continuation] = {}
    for number, line in enumerate(raw[:good].splitlines(), start=1):
        try:
            record = json.loads(line)
            key, tokens, finished = record["context_sha256"], record["tokens"], record["finished"]
            ok = isinstance(key, str) and isinstance(finished, bool) and isinstance(tokens, list) and all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens
            )
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            raise SelfGenError(
                f"{path}:{number}: not a line written by occamy_mtp.selfgen "
                '(expected {"context_sha256": str, "tokens": [int, ...], "finished": bool}); '
                "only a torn last line is repaired: remove the store to generate again"
            )
        continuations[key] = Continuation(tuple(tokens), finished)
    return continuations, int(len(raw) > good)


def _drop_torn_tail(path: Path) -> None:
    """Cut a torn last line (a kill mid-write) so that appends start on a line of their own."""
    if not path.exists():
        return
    raw = path.read_bytes()
    good = raw.rfind(b"\n") + 1
    if good < len(raw):
        with open(path, "r+b") as handle:
            handle.truncate(good)
