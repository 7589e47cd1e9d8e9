"""Self-generated windows: each window's answer replaced by the frozen base's own continuation (greedy, or sampled).

docs/guide/SELF_GENERATED.md sets out the details.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

from occamy_mtp.errors import OccamyError
from occamy_mtp import files
from occamy_mtp.files import token_ids_sha256
from occamy_mtp.memory import MARGIN_BYTES, fitting
from occamy_mtp.base.frozen import BaseIdentity
from occamy_mtp.base.fastdecode import DEFAULT_MAX_BATCH, PREFILL_PASS_BYTES, BatchDecoder, fast_plain_decode, static_decoding
from occamy_mtp.base.generate import plain_decode, idle_decode
from occamy_mtp.model.sharding import gathered, is_sharded, share
from occamy_mtp.data.windows import Window
from occamy_mtp.sampling import GREEDY_TEXT, TextSampling

STORE_FILE = "self-generated.jsonl"
META_FILE = "self-generated.meta.json"
LOCK_FILE = "self-generated.lock"
STORE_FORMAT = 2  # 2: every line carries its store's identity digest and a digest of itself
SYNC_SECONDS = 1.0  # lines written since the last fsync at most this old: a kill loses about this much
# What the continuations are a function of: a store that differs in any is refused.
COMPARED_FIELDS = ("format", "base_config_sha256", "base_weights_sample_sha256", "vocab_size", "dtype",
                   "attn_implementation", "max_new_tokens", "stop_token_ids", "writer", "sampling", "activations")
# Fields a store holds only when they are set: a greedy store has no "sampling", as before
# sampling existed, and a base whose activations are not emulated no "activations", so that
# their identity and their lines' digests stay what they were.
OPTIONAL_FIELDS = ("sampling", "activations")
EMBEDDED = "embedded"  # the base in this process (`EmbeddedWriter`)
ENGINE = "engine"  # serving engines (`engine_generate.EngineWriter`)


class SelfGenError(OccamyError, ValueError):
    """A store that is not this run's or is damaged, or continuations that are missing; says which and why."""


def context_digest(context_ids: Sequence[int]) -> str:
    """A context's key in the store (`files.token_ids_sha256`)."""
    return token_ids_sha256(context_ids)


def compared(identity: dict) -> dict:
    """The fields of an identity that decide its continuations (COMPARED_FIELDS; an optional one only when set)."""
    return {name: identity.get(name) for name in COMPARED_FIELDS
            if name not in OPTIONAL_FIELDS or identity.get(name) is not None}


def identity_digest(identity: dict) -> str:
    """What every line of a store carries of its identity: a line written under another is found when read."""
    return hashlib.sha256(json.dumps(compared(identity), sort_keys=True).encode()).hexdigest()[:16]


def line_digest(context_sha256: str, tokens: Sequence[int], finished: bool) -> str:
    """A digest of one line's content: a line changed after it was written is found when read."""
    return hashlib.sha256(f"{context_sha256}:{int(finished)}:{token_ids_sha256(tokens)}".encode()).hexdigest()[:16]


def context_of(window: Window) -> tuple[int, ...]:
    return tuple(window.input_ids[: window.answer_start])


def sorted_contexts(windows: Sequence[Window]) -> list[tuple[int, ...]]:
    """The distinct contexts of `windows` in a store's order (by digest): its rows and its lines' order."""
    return sorted({context_of(w) for w in windows}, key=context_digest)


@dataclass(frozen=True)
class Continuation:
    tokens: tuple[int, ...]
    finished: bool
    """True when the last token is a stop token (else the budget ran out)."""


def context_uniforms(sampling: TextSampling | Sequence[TextSampling], contexts: Sequence[Sequence[int]],
                     max_new_tokens: int) -> list | None:
    """The uniform stream of each context's sampled continuation, keyed by its digest and drawn under its
    text's seed (`sampling`, or one a context); None for greedy text."""
    samplings = [sampling] * len(contexts) if isinstance(sampling, TextSampling) else list(sampling)
    if all(s.greedy for s in samplings):
        return None
    return [s.uniforms(context_digest(c), max_new_tokens) for s, c in zip(samplings, contexts, strict=True)]


def batch_key(sampling: TextSampling) -> TextSampling:
    """What the rows of one decoder batch share: a text's sampling but its seed. The texts of one configuration
    under several seeds (a heldout prompt's continuations, `eval.sampled_continuations`) differ only in their
    uniform streams, which are a row's own (`context_uniforms`), so one decoder writes them together."""
    return sampling if sampling.greedy else replace(sampling, seed=0)


def self_generate(
    base, contexts: Sequence[Sequence[int]], max_new_tokens: int, stop_token_ids: Collection[int], batch_size: int,
    sampling: TextSampling = GREEDY_TEXT, log: Callable[[str], None] = lambda message: None,
) -> list[Continuation]:
    """The base's continuations of `contexts` (greedy, or sampled with each context's own stream),
    batched (`batch_size` 0: as many as fit, `EmbeddedWriter.batch_for`): `fastdecode` where it
    runs (`static_decoding`), else `generate.plain_decode`."""
    stop = frozenset(int(t) for t in stop_token_ids)
    size = EmbeddedWriter(base, batch_size, sampling).batch_for(contexts, max_new_tokens, log)
    generate = fast_plain_decode if static_decoding(base) else plain_decode
    generated = generate(base, contexts, max_new_tokens=max_new_tokens, eos_token_ids=stop, batch_size=size,
                         sampling=sampling, uniforms=context_uniforms(sampling, contexts, max_new_tokens))
    return [Continuation(tuple(ids), bool(ids) and ids[-1] in stop) for ids in generated]


def with_continuation(window: Window, continuation: Continuation) -> Window:
    """The window's context followed by `continuation` as its answer span."""
    return replace(window, input_ids=context_of(window) + continuation.tokens)


class Writer(Protocol):
    """Who writes continuations: the base in this process, or serving engines."""

    source: str
    """EMBEDDED or ENGINE: part of the store's identity."""
    sampling: TextSampling
    """How it writes (greedy, or sampled): part of the store's identity."""
    shares_batches: bool
    """Whether the stores of one configuration's seeds are written in shared batches (`write_together`)."""

    def details(self) -> dict:
        """What identifies the writer beyond its source (the served model, the decoder)."""

    def describe(self) -> str:
        """The writer in a log line."""

    def answers(self, contexts: Sequence[tuple[int, ...]], missing: Sequence[bool], max_new_tokens: int,
                stop_token_ids: Collection[int], log: Callable[[str], None]) -> Iterator[tuple[int, Continuation]]:
        """(index, continuation) of every missing context, in any order."""


class EmbeddedWriter:
    """The base in this process, `batch_size` contexts a batch (0: as many as fit, `batch_for`),
    greedy or under `sampling`.

    On CUDA a Qwen3.5-MoE base decodes through `fastdecode.BatchDecoder` (static state,
    one CUDA graph a step); elsewhere through `generate.plain_decode`. Batches are fixed
    chunks of the sorted contexts, and a batch with any context missing is generated
    whole, so a resumed run computes every continuation in the same batch as an
    uninterrupted one. A sampled continuation draws from its context's own uniform
    stream, so it is the same in whichever batch it is written.
    """

    source = EMBEDDED

    def __init__(self, base, batch_size: int, sampling: TextSampling = GREEDY_TEXT, shares_batches: bool | None = None):
        self.base, self.batch_size, self.sampling = base, batch_size, sampling
        self.static = static_decoding(base)
        self.shares_batches = self.static if shares_batches is None else shares_batches
        """Whether the stores of one configuration's seeds are written in shared batches (`write_together`):
        on the static decoder, whose step reads the weights of the experts its rows pick (about 160 of 256
        a layer at 32 rows, 246 at 104), so that a store of 32 heldout prompts alone pays most of a full
        batch's steps. Elsewhere each store is written in batches of its own (a batch of the CPU's plain
        decoder costs by its rows)."""

    def for_text(self, sampling: TextSampling) -> "EmbeddedWriter":
        """The same base and batch writing under other sampling settings."""
        return EmbeddedWriter(self.base, self.batch_size, sampling, self.shares_batches)

    def details(self) -> dict:
        decoder = "occamy_mtp.base.fastdecode.BatchDecoder" if self.static else "occamy_mtp.base.generate.plain_decode"
        return {"decoder": decoder, "text": self.sampling.label(),
                "batch_size": self.batch_size or "sized to the memory (data.self_generate_batch_size 0)"}

    def describe(self) -> str:
        return "the base (greedy)" if self.sampling.greedy else f"the base (sampling, {self.sampling.label()})"

    def batch_for(self, contexts, max_new_tokens: int, log) -> int:
        """The batch: `batch_size` when set; else, on the GPU, as many rows of the static decoder as
        fit beside what is resident and a prefill pass (`memory.fitting`, PREFILL_PASS_BYTES kept
        free beside its margin), at most DEFAULT_MAX_BATCH; on a CPU,
        DEFAULT_MAX_BATCH. The choice and its reason are logged."""
        if self.batch_size:
            return self.batch_size
        upper = min(DEFAULT_MAX_BATCH, len(contexts))
        if not self.static:
            where = "a sharded base's" if is_sharded(self.base) else "the CPU's"
            log(f"self-generated windows: batch {upper} ({where} default; data.self_generate_batch_size sets it)")
            return upper
        positions = max(len(c) for c in contexts) + max_new_tokens - 1
        row = BatchDecoder.row_bytes(self.base.config, positions, self.base.lm_head.weight.dtype, self.sampling)
        sizing = fitting("row", row, upper, self.base.lm_head.weight.device, self.base, margin=MARGIN_BYTES + PREFILL_PASS_BYTES)
        log(f"self-generated windows: batch {sizing.count}, sized to the GPU: {sizing.reason} "
            "(data.self_generate_batch_size sets it)")
        return sizing.count

    def answers(self, contexts, missing, max_new_tokens, stop_token_ids, log, samplings: Sequence[TextSampling] | None = None):
        """The batches in order; over a base sharded over N processes, N batches at a time, one in
        each process (the k-th of a round in the k-th process; one with none decodes an idle row,
        its forwards being collective), each process then holding every batch's continuations.
        `samplings`: each context's text, when they differ in their seed alone (`batch_key`; `write_together`)."""
        if samplings is None:
            samplings = [self.sampling] * len(contexts)
        if len(samplings) != len(contexts) or any(batch_key(s) != batch_key(self.sampling) for s in samplings):
            raise ValueError("EmbeddedWriter.answers: a sampling a context, each this writer's but for its seed")
        size = self.batch_for(contexts, max_new_tokens, log)
        batches = [range(i, min(i + size, len(contexts))) for i in range(0, len(contexts), size)]
        todo = [b for b in batches if any(missing[i] for i in b)]
        decode = self._decoder(contexts, todo, max_new_tokens)
        rank, processes = share(self.base)
        started = time.perf_counter()
        for first in range(0, len(todo), processes):
            round_of = todo[first : first + processes]
            outputs = None
            if rank < len(round_of):
                prompts = [contexts[i] for i in round_of[rank]]
                outputs = decode(prompts, stop_token_ids,
                                 context_uniforms([samplings[i] for i in round_of[rank]], prompts, max_new_tokens))
            else:
                idle_decode(self.base, max_new_tokens)
            for number, (batch, written) in enumerate(zip(round_of, gathered(outputs, self.base)), start=first + 1):
                for index, ids in zip(batch, written):
                    if missing[index]:  # the others were generated again only to keep the batch whole
                        yield index, Continuation(tuple(ids), bool(ids) and ids[-1] in stop_token_ids)
                log(f"  batch {number}/{len(todo)} written ({time.perf_counter() - started:.0f} s)")

    def _decoder(self, contexts, todo, max_new_tokens):
        """prompts, stop ids, uniform streams -> continuations: one static decoder for every batch, or plain_decode."""
        if not self.static:
            return lambda prompts, stop, uniforms: plain_decode(
                self.base, prompts, max_new_tokens=max_new_tokens, eos_token_ids=frozenset(stop), batch_size=len(prompts),
                sampling=self.sampling, uniforms=uniforms)
        longest = max(len(contexts[i]) for batch in todo for i in batch)
        decoder = BatchDecoder(self.base, batch=max(len(b) for b in todo), positions=longest + max_new_tokens - 1,
                               sampling=self.sampling)
        return lambda prompts, stop, uniforms: decoder.generate(prompts, max_new_tokens=max_new_tokens, eos_token_ids=stop,
                                                                uniforms=uniforms)


def store_identity(base: BaseIdentity, max_new_tokens: int, stop_token_ids: Collection[int], writer: str = EMBEDDED,
                   sampling: TextSampling = GREEDY_TEXT) -> dict:
    """What a store's continuations are a function of (the fields of COMPARED_FIELDS): the base's
    whole identity (`base.frozen.BaseIdentity`) and the settings; `writer` is who writes them
    (EMBEDDED or ENGINE): a store is never extended by the other one; `sampling` how (greedy, or
    sampled with its settings and seed)."""
    optional = {} if sampling.greedy else {"sampling": sampling.to_dict()}
    return {
        "format": STORE_FORMAT,
        "base_config_sha256": base.config_sha256,
        "base_weights_sample_sha256": base.weights_sample_sha256,
        **base.settings(),
        "max_new_tokens": int(max_new_tokens),
        "stop_token_ids": sorted(int(t) for t in stop_token_ids),
        "writer": writer,
        **optional,
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
        """Open (or start) the store in `directory`; refuse one written under another identity,
        and any line that is not this store's as written (`_read_store`)."""
        directory = Path(directory)
        existing = _check_meta(directory, identity)
        store_path = directory / STORE_FILE
        if existing is None and store_path.exists() and store_path.stat().st_size:  # empty: a writer that wrote nothing
            raise SelfGenError(f"{directory / STORE_FILE}: has no {META_FILE} beside it, so what wrote it is unknown; remove it")
        continuations, torn = _read_store(directory / STORE_FILE, identity)
        store = cls(directory, identity, continuations, torn)
        store.writer_details = (existing or {}).get("writer_details", {})
        return store

    def written_in_place(self) -> tuple[Path, ...]:
        """The files a `generate` opens in place (appended to, locked), which must be the store's own."""
        return (self.directory / LOCK_FILE, self.directory / STORE_FILE)

    def reread(self) -> None:
        """Take in what another run (or process) sharing the directory wrote since this store was read."""
        self._continuations.update(_read_store(self.directory / STORE_FILE, self.identity)[0])

    def __contains__(self, window: Window) -> bool:
        return context_digest(context_of(window)) in self._continuations

    def missing(self, windows: Sequence[Window]) -> list[Window]:
        return [w for w in windows if w not in self]

    def generate(self, writer: Writer, windows: Sequence[Window], log: Callable[[str], None] = print) -> None:
        """Have `writer` write (and append) the continuations of every context of `windows` not yet stored.

        Lines are appended in the order of the sorted contexts, each as soon as every
        missing one before it has come back, so that a run killed and resumed writes the
        very bytes of an uninterrupted one (given the same answers). When the writer stops
        with an error (a server died), the answers that came back behind the one it never
        gave are appended too, out of that order: nothing received is asked for again.
        """
        contexts = sorted_contexts(windows)
        if not any(self._unstored(contexts)):
            return
        with self._writing(log):
            self.reread()
            missing = self._unstored(contexts)
            if any(missing):
                self._append(writer, contexts, missing, log)

    def follow(self, writer: Writer, windows: Sequence[Window]) -> None:
        """Run `writer` over what `generate` would have it write, and keep none of it: a process beside
        the main one of a sharded base, whose every forward is collective, takes its part (its share
        of the batches) in the main process's `generate` (`run.run_windows_together`)."""
        contexts = sorted_contexts(windows)
        missing = self._unstored(contexts)
        if any(missing):
            for _ in writer.answers(contexts, missing, self.identity["max_new_tokens"], self.identity["stop_token_ids"],
                                    lambda message: None):
                pass

    def _unstored(self, contexts: Sequence[tuple[int, ...]]) -> list[bool]:
        """For each context, whether its continuation is not stored (yet)."""
        return [context_digest(c) not in self._continuations for c in contexts]

    @contextlib.contextmanager
    def _writing(self, log: Callable[[str], None]) -> Iterator[None]:
        """Hold the store's lock (waiting for a run that holds it) and check, under it, that the
        meta file is still this store's: one run writes a directory at a time."""
        self.directory.mkdir(parents=True, exist_ok=True)
        with files.open_owned(self.directory / LOCK_FILE, "a+") as handle:  # never through a link
            files.lock_with_pid(handle, lambda holder: log(f"self-generated windows: {self.directory} is being written by "
                                                           f"another run (pid {holder}); waiting for it, then using its lines"))
            existing = _check_meta(self.directory, self.identity)
            if existing is not None and not self.writer_details:
                self.writer_details = existing.get("writer_details", {})
            yield  # closing the file releases the lock

    def _append(self, writer: Writer, contexts: list[tuple[int, ...]], missing: list[bool], log: Callable[[str], None]) -> None:
        with self._appending(writer, contexts, missing, log) as receive:
            for index, continuation in writer.answers(contexts, missing, self.identity["max_new_tokens"],
                                                      self.identity["stop_token_ids"], log):
                receive(index, continuation)

    @contextlib.contextmanager
    def _appending(self, writer: Writer, contexts: list[tuple[int, ...]], missing: list[bool], log: Callable[[str], None],
                   share: float = 1.0) -> Iterator[Callable[[int, "Continuation"], None]]:
        """Check that `writer` may extend the store, then yield `receive(index, continuation)`, which appends the
        continuation of `contexts[index]` (one `missing` marks) in the contexts' order; on the way out, what was
        received is on disk. `share`: the part of the time spent inside that is this store's (stores written
        together, `write_together`, split it by their rows)."""
        if writer.source != self.identity["writer"]:
            raise SelfGenError(f"{self.directory}: written by the {self.identity['writer']} writer, asked to be extended by "
                               f"the {writer.source} one; use another data.self_generated_dir")
        if writer.sampling.to_dict() != self.identity.get("sampling"):
            raise SelfGenError(f"{self.directory}: holds text written {_sampling_text(self.identity.get('sampling'))}, "
                               f"asked to be extended by a writer that writes {_sampling_text(writer.sampling.to_dict())}")
        details = writer.details()
        if self.writer_details and self.writer_details.get("model", details.get("model")) != details.get("model"):
            raise SelfGenError(f"{self.directory}: written from model {self.writer_details.get('model')!r}, and the servers now "
                               f"serve {details.get('model')!r}; use another data.self_generated_dir")
        meta_path = self.directory / META_FILE
        store_path = self.directory / STORE_FILE
        _drop_torn_tail(store_path)
        started = time.perf_counter()
        log(f"self-generated windows: {writer.describe()} writes {sum(missing)} continuation{'s' * (sum(missing) != 1)} "
            f"(<= {self.identity['max_new_tokens']} tokens each; {', '.join(f'{k} {v}' for k, v in details.items())}) "
            f"into {store_path}")
        waiting: dict[int, Continuation] = {}
        order = iter([i for i, m in enumerate(missing) if m])
        following = next(order)
        synced = time.perf_counter()
        store = identity_digest(self.identity)

        def keep(index: int, stream) -> None:
            """One continuation as a line; the meta file first, so that a store never names a writer
            that wrote nothing into it (a server that fails before its first answer leaves no store)."""
            written = waiting.pop(index)
            key = context_digest(contexts[index])
            _check_line(self.identity, written.tokens, lambda: f"{writer.describe()} wrote for context {key}")
            if not meta_path.is_file():
                files.write_json(meta_path, {**self.identity, "writer_details": details})
                self.writer_details = details
            line = {"context_sha256": key, "tokens": list(written.tokens), "finished": written.finished,
                    "store": store, "line_sha256": line_digest(key, written.tokens, written.finished)}
            stream.write(json.dumps(line, separators=(",", ":")) + "\n")
            self._continuations[key] = written
            self.generated_now += 1

        kept = "the continuations written before are kept, and the rerun writes only the rest"
        needed = sum(missing) * (self.identity["max_new_tokens"] * LINE_BYTES_PER_TOKEN + LINE_BYTES_FIXED)
        with files.appended_lines(store_path, needed, kept) as stream:

            def receive(index: int, continuation: Continuation) -> None:
                nonlocal following, synced
                waiting[index] = continuation
                # In the contexts' order, so that a run killed and resumed writes the bytes of an uninterrupted one.
                while following is not None and following in waiting:
                    keep(following, stream)
                    following = next(order, None)
                if following is None or time.perf_counter() - synced >= SYNC_SECONDS:
                    stream.flush()
                    os.fsync(stream.fileno())
                    synced = time.perf_counter()

            try:
                yield receive
            except BaseException:
                # The writer stopped (a server died, an interrupt): what came back behind the context it never
                # answered is kept too, out of order, rather than asked for again.
                with contextlib.suppress(OSError, SelfGenError):
                    for index in sorted(waiting):
                        keep(index, stream)
                    stream.flush()
                    os.fsync(stream.fileno())
                raise
        self.generation_seconds += (time.perf_counter() - started) * share

    def windows(self, windows: Sequence[Window]) -> list[Window]:
        """The self-generated twin of each window (all must be stored)."""
        missing = self.missing(windows)
        if missing:
            raise SelfGenError(
                f"{self.directory}: {len(missing)} of {len(windows)} windows have no self-generated continuation yet "
                "(the base was not loaded to write them); run `python -m occamy_mtp cache --config ...`, which writes "
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


def write_together(parts: Sequence[tuple[SelfGeneratedStore, "EmbeddedWriter", Sequence[Window]]],
                   log: Callable[[str], None] = print, keep: bool = True) -> None:
    """`SelfGeneratedStore.generate` for several stores at once, their texts one configuration under several
    seeds (`batch_key`): one decoder writes every store's missing continuations in shared batches, the rows of
    the first store's sorted contexts, then the second's, and so on, a complete store's rows among them.
    Batches are fixed chunks of those rows, and a batch with any row missing is decoded whole, so a run
    resumed (one store complete, another short of a line) decodes the batches an uninterrupted one does.
    Each store lacking a line appends its own lines in its contexts' order, under its lock (taken in the
    order given), and keeps what came back if the run stops. With `keep` False nothing is stored (a process
    beside the main one of a sharded base takes its part in the forwards, `SelfGeneratedStore.follow`)."""
    if not parts:
        return
    writer = parts[0][1]
    identities = {(store.identity["max_new_tokens"], tuple(store.identity["stop_token_ids"])) for store, _, _ in parts}
    if len(identities) > 1 or any(batch_key(w.sampling) != batch_key(writer.sampling) for _, w, _ in parts):
        raise ValueError("write_together: stores of one configuration's seeds, with one answer budget and one set of stop tokens")
    with contextlib.ExitStack() as stack:
        plan = []
        for store, text_writer, windows in parts:  # a complete store's rows too: they fix the batches
            contexts = sorted_contexts(windows)
            if keep and any(store._unstored(contexts)):
                stack.enter_context(store._writing(log))
                store.reread()
            plan.append((store, text_writer, contexts, store._unstored(contexts)))
        rows = [(part, index) for part, (_, _, contexts, _) in enumerate(plan) for index in range(len(contexts))]
        total = sum(sum(missing) for _, _, _, missing in plan)
        if not total:
            return
        receivers = [stack.enter_context(store._appending(text_writer, contexts, missing, log, share=sum(missing) / total))
                     if any(missing) else None for store, text_writer, contexts, missing in plan] if keep else None
        budget, stop = identities.pop()
        answers = writer.answers([plan[part][2][index] for part, index in rows], [plan[part][3][index] for part, index in rows],
                                 budget, list(stop), log if keep else (lambda message: None),
                                 samplings=[plan[part][1].sampling for part, _ in rows])
        for row, continuation in answers:
            if receivers is not None:
                part, index = rows[row]
                receivers[part](index, continuation)


def _sampling_text(sampling: dict | None) -> str:
    return "greedily" if sampling is None else "sampled with " + ", ".join(f"{k} {v}" for k, v in sampling.items())


def _check_meta(directory: Path, identity: dict) -> dict | None:
    """The store's meta file, refused when written under another identity; None when there is none yet."""
    meta_path = directory / META_FILE
    if not meta_path.is_file():
        return None
    try:
        existing = json.loads(meta_path.read_text())
    except (OSError, ValueError) as err:
        raise SelfGenError(f"{meta_path}: unreadable ({err}); remove the directory to generate again") from None
    existing.setdefault("writer", EMBEDDED)  # stores from before engines wrote any
    differences = [f"{name}: {existing.get(name)!r} in the store, {identity.get(name)!r} now"
                   for name in COMPARED_FIELDS if existing.get(name) != identity.get(name)]
    if differences:
        raise SelfGenError(f"{directory}: the self-generated windows there were written under other settings ("
                           + "; ".join(differences) + "); use another data.self_generated_dir, or remove it to generate again")
    return existing


def _check_line(identity: dict, tokens: Sequence[int], where: Callable[[], str]) -> None:
    """A continuation the base could have written under `identity`: ids in its vocabulary, within the budget."""
    vocab, budget = identity["vocab_size"], identity["max_new_tokens"]
    if len(tokens) > budget:
        raise SelfGenError(f"{where()}: {len(tokens)} tokens, over the budget of {budget} (data.answer_tokens)")
    outside = [(i, t) for i, t in enumerate(tokens) if not 0 <= t < vocab]
    if outside:
        position, token = outside[0]
        raise SelfGenError(f"{where()}: token id {token} at position {position} is outside the base's vocabulary "
                           f"(0..{vocab - 1}; {len(outside)} such ids)")


# The most a store line takes: a token id of up to 6 digits and its comma, and the fixed fields
# (two 64-digit digests, the store's digest, the keys). What a full disk's message says is needed.
LINE_BYTES_PER_TOKEN, LINE_BYTES_FIXED = 7, 300
LINE_FIELDS = '{"context_sha256": str, "tokens": [int, ...], "finished": bool, "store": str, "line_sha256": str}'


def _read_store(path: Path, identity: dict) -> tuple[dict[str, Continuation], int]:
    """Parse the store; a last line without its newline is torn (dropped), any other bad line an error.

    Every line must be this store's (its `store` digest is the identity's), unchanged since it
    was written (its `line_sha256`), and a continuation the base could have written
    (`_check_line`); a context may appear twice only with the same continuation.
    """
    if not path.exists():
        return {}, 0
    raw = path.read_bytes()
    good = raw.rfind(b"\n") + 1
    expected_store = identity_digest(identity)
    continuations: dict[str, Continuation] = {}
    remove = "remove the store (or the line) to generate it again"
    for number, line in enumerate(raw[:good].splitlines(), start=1):
        try:
            record = json.loads(line)
            key, tokens, finished = record["context_sha256"], record["tokens"], record["finished"]
            store, digest = record["store"], record["line_sha256"]
            ok = all(isinstance(v, str) for v in (key, store, digest)) and isinstance(finished, bool) and isinstance(
                tokens, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in tokens)
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            raise SelfGenError(f"{path}:{number}: not a line written by occamy_mtp.selfgen.store (expected {LINE_FIELDS}); "
                               "only a torn last line is repaired: remove the store to generate again")
        if store != expected_store:
            raise SelfGenError(f"{path}:{number}: a line of another store (store {store}; this store's is {expected_store}): "
                               "another base or other settings wrote it, and its lines may be another run's valid ones; "
                               "point this run at its own data.self_generated_dir rather than removing anything")
        if digest != line_digest(key, tokens, finished):
            raise SelfGenError(f"{path}:{number}: changed after it was written (its line_sha256 does not match its "
                               f"content); {remove}")
        _check_line(identity, tokens, lambda: f"{path}:{number}")
        continuation = Continuation(tuple(tokens), finished)
        if continuations.get(key, continuation) != continuation:
            raise SelfGenError(f"{path}:{number}: context {key} is stored before with another continuation; {remove}")
        continuations[key] = continuation
    return continuations, int(len(raw) > good)


def _drop_torn_tail(path: Path) -> None:
    """Cut a torn last line (a kill mid-write) so that appends start on a line of their own."""
    if not path.exists():
        return
    raw = path.read_bytes()
    good = raw.rfind(b"\n") + 1
    if good < len(raw):
        with files.open_owned(path, "r+b") as handle:
            handle.truncate(good)
