"""Self-generated windows: each window's answer replaced by the frozen base's own greedy continuation.

docs/SELF_GENERATED.md sets out the details.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

from occamy_mtp.errors import OccamyError
from occamy_mtp.model import checkpoint as ckpt_io
from occamy_mtp import files
from occamy_mtp.files import token_ids_sha256
from occamy_mtp.selfgen.fastdecode import BatchDecoder, fast_greedy_generate, static_decoding
from occamy_mtp.selfgen.greedy import greedy_generate
from occamy_mtp.data.windows import Window

STORE_FILE = "self-generated.jsonl"
META_FILE = "self-generated.meta.json"
STORE_FORMAT = 1
SYNC_SECONDS = 1.0  # lines written since the last fsync at most this old: a kill loses about this much
# What the continuations are a function of: a store that differs in any is refused.
COMPARED_FIELDS = ("format", "base_config_sha256", "base_weights_sample_sha256", "dtype", "attn_implementation",
                   "max_new_tokens", "stop_token_ids", "writer")
EMBEDDED = "embedded"  # the base in this process (`EmbeddedWriter`)
ENGINE = "engine"  # serving engines (`engine_generate.EngineWriter`)


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
    """The base's greedy continuations of `contexts`, batched: `fastdecode` where it runs
    (`static_decoding`), else `greedy.greedy_generate`."""
    stop = frozenset(int(t) for t in stop_token_ids)
    generate = fast_greedy_generate if static_decoding(base) else greedy_generate
    generated = generate(base, contexts, max_new_tokens=max_new_tokens, eos_token_ids=stop, batch_size=batch_size)
    return [Continuation(tuple(ids), bool(ids) and ids[-1] in stop) for ids in generated]


def with_continuation(window: Window, continuation: Continuation) -> Window:
    """The window's context followed by `continuation` as its answer span."""
    return replace(window, input_ids=context_of(window) + continuation.tokens)


class Writer(Protocol):
    """Who writes continuations: the base in this process, or serving engines."""

    source: str
    """EMBEDDED or ENGINE: part of the store's identity."""

    def details(self) -> dict:
        """What identifies the writer beyond its source (the served model, the decoder)."""

    def describe(self) -> str:
        """The writer in a log line."""

    def answers(self, contexts: Sequence[tuple[int, ...]], missing: Sequence[bool], max_new_tokens: int,
                stop_token_ids: Collection[int], log: Callable[[str], None]) -> Iterator[tuple[int, Continuation]]:
        """(index, continuation) of every missing context, in any order."""


class EmbeddedWriter:
    """The base in this process, `batch_size` contexts a batch.

    On CUDA a Qwen3.5-MoE base decodes through `fastdecode.BatchDecoder` (static state,
    one CUDA graph a step); elsewhere through `greedy.greedy_generate`. Batches are fixed
    chunks of the sorted contexts, and a batch with any context missing is generated
    whole, so a resumed run computes every continuation in the same batch as an
    uninterrupted one.
    """

    source = EMBEDDED

    def __init__(self, base, batch_size: int):
        self.base, self.batch_size = base, batch_size
        self.static = static_decoding(base)

    def details(self) -> dict:
        decoder = "occamy_mtp.selfgen.fastdecode.BatchDecoder" if self.static else "occamy_mtp.selfgen.greedy.greedy_generate"
        return {"decoder": decoder, "batch_size": self.batch_size}

    def describe(self) -> str:
        return "the base"

    def answers(self, contexts, missing, max_new_tokens, stop_token_ids, log):
        batches = [range(i, min(i + self.batch_size, len(contexts))) for i in range(0, len(contexts), self.batch_size)]
        todo = [b for b in batches if any(missing[i] for i in b)]
        decode = self._decoder(contexts, todo, max_new_tokens)
        started = time.perf_counter()
        for number, batch in enumerate(todo, start=1):
            outputs = decode([contexts[i] for i in batch], stop_token_ids)
            for index, ids in zip(batch, outputs):
                if missing[index]:  # the others were generated again only to keep the batch whole
                    yield index, Continuation(tuple(ids), bool(ids) and ids[-1] in stop_token_ids)
            log(f"  batch {number}/{len(todo)} written ({time.perf_counter() - started:.0f} s)")

    def _decoder(self, contexts, todo, max_new_tokens):
        """prompts, stop ids -> continuations: one static decoder for every batch, or greedy_generate."""
        if not self.static:
            return lambda prompts, stop: greedy_generate(self.base, prompts, max_new_tokens=max_new_tokens,
                                                         eos_token_ids=frozenset(stop), batch_size=self.batch_size)
        longest = max(len(contexts[i]) for batch in todo for i in batch)
        decoder = BatchDecoder(self.base, batch=max(len(b) for b in todo), positions=longest + max_new_tokens - 1)
        return lambda prompts, stop: decoder.generate(prompts, max_new_tokens=max_new_tokens, eos_token_ids=stop)


def store_identity(base_dir: str | Path, dtype: str, attn_implementation: str, max_new_tokens: int, stop_token_ids: Collection[int],
                   writer: str = EMBEDDED) -> dict:
    """What a store's continuations are a function of (the fields of COMPARED_FIELDS); `writer`
    is who writes them (EMBEDDED or ENGINE): a store is never extended by the other one."""
    base = ckpt_io.checkpoint_fingerprint(base_dir)
    return {
        "format": STORE_FORMAT,
        "base_config_sha256": base["config_sha256"],
        "base_weights_sample_sha256": base["weights_sample_sha256"],
        "dtype": dtype,
        "attn_implementation": attn_implementation,
        "max_new_tokens": int(max_new_tokens),
        "stop_token_ids": sorted(int(t) for t in stop_token_ids),
        "writer": writer,
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
        self.writer_details: dict = {}
        """Who wrote the continuations (`Writer.details`): kept in the meta file by the first writer."""

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
            existing.setdefault("writer", EMBEDDED)  # stores from before engines wrote any
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
        store = cls(directory, identity, continuations, torn)
        store.writer_details = existing.get("writer_details", {}) if meta_path.is_file() else {}
        return store

    def __contains__(self, window: Window) -> bool:
        return context_digest(context_of(window)) in self._continuations

    def missing(self, windows: Sequence[Window]) -> list[Window]:
        return [w for w in windows if w not in self]

    def generate(self, writer: Writer, windows: Sequence[Window], log: Callable[[str], None] = print) -> None:
        """Have `writer` write (and append) the continuations of every context of `windows` not yet stored.

        Lines are appended in the order of the sorted contexts, each as soon as every
        missing one before it has come back, so that a run killed and resumed writes the
        very bytes of an uninterrupted one (given the same answers).
        """
        contexts = sorted({context_of(w) for w in windows}, key=context_digest)
        missing = [context_digest(c) not in self._continuations for c in contexts]
        if not any(missing):
            return
        if writer.source != self.identity["writer"]:
            raise SelfGenError(f"{self.directory}: written by the {self.identity['writer']} writer, asked to be extended by "
                               f"the {writer.source} one; use another data.self_generated_dir")
        details = writer.details()
        if self.writer_details and self.writer_details.get("model", details.get("model")) != details.get("model"):
            raise SelfGenError(f"{self.directory}: written from model {self.writer_details.get('model')!r}, and the servers now "
                               f"serve {details.get('model')!r}; use another data.self_generated_dir")
        self.directory.mkdir(parents=True, exist_ok=True)
        meta_path = self.directory / META_FILE
        if not meta_path.is_file():
            files.write_json(meta_path, {**self.identity, "writer_details": details})
            self.writer_details = details
        store_path = self.directory / STORE_FILE
        _drop_torn_tail(store_path)
        started = time.perf_counter()
        log(f"self-generated windows: {writer.describe()} writes {sum(missing)} continuations "
            f"(<= {self.identity['max_new_tokens']} tokens each; {', '.join(f'{k} {v}' for k, v in details.items())}) "
            f"into {store_path}")
        waiting: dict[int, Continuation] = {}
        order = iter([i for i, m in enumerate(missing) if m])
        following = next(order)
        synced = time.perf_counter()
        with open(store_path, "a", encoding="utf-8") as stream:
            for index, continuation in writer.answers(contexts, missing, self.identity["max_new_tokens"],
                                                      self.identity["stop_token_ids"], log):
                waiting[index] = continuation
                while following is not None and following in waiting:
                    written = waiting.pop(following)
                    key = context_digest(contexts[following])
                    line = {"context_sha256": key, "tokens": list(written.tokens), "finished": written.finished}
                    stream.write(json.dumps(line, separators=(",", ":")) + "\n")
                    self._continuations[key] = written
                    self.generated_now += 1
                    following = next(order, None)
                if following is None or time.perf_counter() - synced >= SYNC_SECONDS:
                    stream.flush()
                    os.fsync(stream.fileno())
                    synced = time.perf_counter()
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
            "writer": self.identity["writer"],
            "writer_details": self.writer_details,
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
                f"{path}:{number}: not a line written by occamy_mtp.selfgen.store "
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
