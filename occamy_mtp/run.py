"""A run opened from its config: the one set-up path of train, export, the cache pass and evaluate.

`open_run` reads, in this order and nowhere else: the tokenizer, the chat files into
windows and their split, the models (the frozen base, or only the two tensors the head
borrows when the targets are cached, and the donor head with fp32 masters of what
trains), the self-generated store and the run's windows (the base, or the servers of
`data.self_generate_endpoints`, write the continuations the store lacks), and the target
source (the base online, or the offline cache). `check_run`, the checks that need no data
and no weights, comes before it in the commands that write into `output.dir`.

It takes the set-up settings (`settings.Setup`), never the whole config; `settings.RunDir`
names every file a run keeps under `output.dir`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from occamy_mtp import files
from occamy_mtp.model import checkpoint as ckpt_io
from occamy_mtp.config import ConfigError, refuse_placeholders
from occamy_mtp.data.prepare import PreparedData, prepare_windows
from occamy_mtp.data.windows import Window, load_tokenizer, stop_token_ids
from occamy_mtp.model.head import MTPHead, SharedWeights, count_parameters, set_trainable
from occamy_mtp.base.frozen import BaseFacts, BaseIdentity, FrozenBase
from occamy_mtp.model.sharding import Sharding, barrier, is_sharded
from occamy_mtp.sampling import GREEDY_TEXT, TextSampling
from occamy_mtp.settings import RunDir, SelfGenSettings, Setup
from occamy_mtp.selfgen.store import (EMBEDDED, ENGINE, EmbeddedWriter, SelfGenError, SelfGeneratedStore, Writer, batch_key,
                                     store_identity, write_together)
from occamy_mtp.targets.base import OnlineTargets, TargetSource
from occamy_mtp.targets.cache import TargetCache, cache_identity

Log = Callable[[str], None]


def log_stderr(message: str) -> None:
    """Progress of the slow phases, on stderr so that stdout keeps the results."""
    print(message, file=sys.stderr, flush=True)


def quiet(message: str) -> None:
    """The log of every process but the main one, and of callers that want none."""


# ----------------------------------------------------------------------------------
# The run directory
# ----------------------------------------------------------------------------------


def measured_windows(stores: "Stores", texts: list[TextSampling], prompts: list[Window]) -> list[Window]:
    """The windows of `prompts` continued under each of `texts`, the continuations of one text after another's."""
    return [w for sampling in texts for w in stores[sampling].windows(prompts)]


# ----------------------------------------------------------------------------------
# Checks and the lock
# ----------------------------------------------------------------------------------


def refuse_inside_models(model, outputs: list[tuple[str, Path]]) -> None:
    """ConfigError for any (option, path) among `outputs` that lies in or below the base or the donor
    directory of `model` (the model settings), symlinks resolved: what a command writes never lands in a
    checkpoint it reads."""
    protected = [("model.base", Path(model.base))]
    if Path(model.donor_head).is_dir():
        protected.append(("model.donor_head", Path(model.donor_head)))
    refusal = files.inside_any(outputs, protected)
    if refusal:
        raise ConfigError(refusal)


def check_inputs(setup: Setup) -> BaseFacts:
    """The checks of what a run reads that need no data and no weights: the base and the data are
    named, the base's config reads, and a window fits its positions. Returns the base's facts."""
    refuse_placeholders([setup.unset[o] for o in ("model.base", "data.files") if o in setup.unset])
    facts = BaseFacts(setup.model.base)
    positions = getattr(facts.text_config, "max_position_embeddings", None)
    data = setup.data
    window = data.context_tokens + data.answer_tokens
    if positions is not None and window > positions:
        raise ConfigError(f"data.context_tokens + data.answer_tokens: {data.context_tokens} + {data.answer_tokens} "
                          f"= {window} positions, beyond the base's max_position_embeddings ({positions}, "
                          f"{facts.config.path}); shorten the windows")
    return facts


def check_run(setup: Setup, training: bool = False) -> BaseFacts:
    """The checks that need no data and no weights, before anything slow starts; returns the
    base's facts (its config read here, once, for the rest of the run).

    The base and donor exist and the base's config reads; no output of the run
    (output.dir, its checkpoints/, the stores, the target cache) is a file or lies inside
    the base or the donor directory (symlinks resolved: the base is never written into);
    output.dir, and its checkpoints/ when `training`, can be written (the store is checked
    once the run knows it lacks lines, `open_run`, and the target cache by the pass that
    writes it); every name in `train.trainable` is a head submodule (checked on a head
    built on the meta device).
    """
    refuse_placeholders(list(setup.unset.values()))  # every placeholder named at once
    donor = Path(setup.model.donor_head)
    facts = check_inputs(setup)
    if not donor.exists():
        raise ConfigError(f"model.donor_head: {donor}: no such file or directory")
    run_dir = setup.run_dir
    outputs = [("output.dir", run_dir.root), ("output.dir", run_dir.checkpoints)]
    outputs += [("data.self_generated_dir", setup.store_dir(sampling)) for sampling in setup.stored_texts()]
    if setup.data.target_cache:
        outputs.append(("data.target_cache", Path(setup.data.target_cache)))
    for option, path in outputs:
        if path.exists() and not path.is_dir():
            raise ConfigError(f"{option}: {path} is a file; a directory is expected there")
    refuse_inside_models(setup.model, outputs)
    for path in (run_dir.lock, run_dir.export_incomplete):
        problem = files.not_owned(path)
        if problem:
            raise files.LinkedOutput(problem)
    for path in [run_dir.root] + ([run_dir.checkpoints] if training else []):
        problem = files.unwritable(path)
        if problem:
            raise ConfigError(f"output.dir: {path} cannot be written: {problem}")
    with torch.device("meta"):
        head = MTPHead(facts.text_config)
    try:
        set_trainable(head, setup.trainable)
    except ValueError as err:
        raise ConfigError(f"train.trainable: {err}") from None
    return facts


@contextlib.contextmanager
def output_lock(run_dir: RunDir) -> Iterator[None]:
    """Hold an exclusive lock on output.dir (its `.lock` file, with the holder's pid) while a run writes there.

    Two trainings into one directory would both run and the last would silently win;
    the second one now stops at once, naming the process that holds the directory. A run
    that stops with an error takes back the lock file and the directories it made, when
    nothing else was written into them.
    """
    made = [d for d in (run_dir.root, *run_dir.root.parents) if not d.exists()]
    run_dir.root.mkdir(parents=True, exist_ok=True)
    made_lock = not os.path.lexists(run_dir.lock)
    handle = files.open_owned(run_dir.lock, "a+")  # never through a link: it could point into the base
    finished = False
    def refuse(holder: str) -> None:
        raise ConfigError(f"output.dir: {run_dir.root} is in use by another run (pid {holder}); wait for it, or use another output.dir")

    try:
        files.lock_with_pid(handle, refuse)
        yield
        finished = True
    finally:
        if not finished and made_lock:  # a run refused before it wrote anything leaves nothing behind
            run_dir.lock.unlink(missing_ok=True)
            for directory in made:  # deepest first, and only while empty
                with contextlib.suppress(OSError):
                    directory.rmdir()
        handle.close()  # releases the lock


# ----------------------------------------------------------------------------------
# Tokenizer, windows, store
# ----------------------------------------------------------------------------------


def prepare_data(setup: Setup, tokenizer, log: Log = quiet) -> PreparedData:
    files = setup.data.files
    if not files:
        raise ConfigError("data.files: no chat data files given")
    size = sum(Path(f).stat().st_size for f in files if Path(f).is_file())
    log(f"data: reading {len(files)} file(s) ({size / 2**20:.1f} MiB) into windows")
    started = time.perf_counter()
    data = prepare_windows(list(files), tokenizer, **setup.windows,
                           served_thinking={serving.thinking for serving in setup.servings})
    summary = data.summary()
    log(f"data: {summary['conversations_read']} conversations read, {summary['conversations_kept']} kept; "
        f"{summary['train_windows']} train / {summary['validation_windows']} validation / {summary['heldout_windows']} "
        f"heldout windows ({time.perf_counter() - started:.1f} s)")
    return data


TRAIN, VALIDATION, HELDOUT = "train", "validation", "heldout"
EVERY_SPLIT = (TRAIN, VALIDATION, HELDOUT)


def check_split(setup: Setup, data: PreparedData, splits=EVERY_SPLIT) -> None:
    """Refuse a split that leaves the run nothing to train, select or report on."""
    sides = [(TRAIN, data.train, "data.train_conversations"), (HELDOUT, data.heldout, "data.heldout_conversations")]
    if setup.validates:
        sides.append((VALIDATION, data.validation, "data.validation_conversations (or set train.select_every_steps=0)"))
    for side, windows, option in sides:
        if side in splits and not windows:
            raise ConfigError(
                f"data: no {side} windows were built, so the run would have nothing to "
                f"{'train on' if side == TRAIN else 'measure'}; check data.files and {option} "
                "(see `python -m occamy_mtp data`)"
            )


def open_store(setup: Setup, base: BaseFacts, stop_ids: set[int], sampling: TextSampling = GREEDY_TEXT) -> SelfGeneratedStore:
    """The run's store of continuations written under `sampling` (refused when written for another
    base, other settings or by another writer)."""
    identity = store_identity(
        BaseIdentity.of(setup.model, base),
        max_new_tokens=setup.selfgen.answer_tokens,
        stop_token_ids=stop_ids,
        writer=ENGINE if setup.selfgen.endpoints else EMBEDDED,
        sampling=sampling,
    )
    return SelfGeneratedStore.open(setup.store_dir(sampling), identity)


Stores = dict[TextSampling, SelfGeneratedStore]
"""The run's stores, one per way the base writes its text (`self_generated_needed`)."""


def open_stores(setup: Setup, base: BaseFacts, stop_ids: set[int], needed: dict[TextSampling, list[Window]]) -> Stores:
    return {sampling: open_store(setup, base, stop_ids, sampling) for sampling in needed}


def check_store_writable(stores: Stores, needed: dict[TextSampling, list[Window]]) -> None:
    """A store that lacks continuations must take them: found before the base loads, not after."""
    for sampling, windows in needed.items():
        store = stores[sampling]
        lacking = len(store.missing(windows))
        problem = files.unwritable(store.directory) if lacking else None
        if problem:
            raise ConfigError(f"data.self_generated_dir: {store.directory} lacks {lacking} of the run's {len(windows)} "
                              f"continuations and cannot be written: {problem}")
        for path in store.written_in_place() if lacking else ():
            problem = files.not_owned(path)
            if problem:
                raise files.LinkedOutput(problem)


def continuation_writer(selfgen: SelfGenSettings, tokenizer, facts: BaseFacts, stop_ids: set[int], base=None) -> Writer | None:
    """Who writes the continuations a store lacks: the servers of `data.self_generate_endpoints`
    (checked when first asked), else the base in this process when it is loaded, else nobody."""
    if selfgen.endpoints:
        from occamy_mtp.engines.completions import Request
        from occamy_mtp.selfgen.engine_writer import EngineWriter

        request = Request(selfgen.answer_tokens, frozenset(stop_ids), facts.text_config.vocab_size,
                          selfgen.timeout_seconds, selfgen.retries)
        return EngineWriter(selfgen.endpoints, selfgen.model, tokenizer, request, selfgen.concurrency)
    return EmbeddedWriter(base, selfgen.batch_size) if base is not None else None


@dataclass(frozen=True)
class RunWindows:
    """The windows of one run, by what they are for."""

    train: list[Window]
    """What the head trains on: recorded answers, self-generated ones, or both (`data.answers`)."""
    validation: list[Window]
    """Self-generated validation windows, written under the selected serving configuration: what
    checkpoint selection scores."""
    heldout: dict[str, list[Window]]
    """Self-generated heldout windows per serving configuration (its label, in `eval.serving`'s
    order), each written under that configuration's sampling: the headline figures."""
    heldout_data: list[Window]
    """The recorded heldout answers: teacher-forced agreement and NLL (approximate acceptance);
    prompts' windows, which record none, are not among them."""
    self_generated: dict
    """Provenance of the continuations, per way of writing them (`TextSampling.label`:
    `SelfGeneratedStore.provenance`)."""

    def all(self) -> list[Window]:
        """Every distinct window the run reads targets for, in a fixed order (what a target cache covers)."""
        seen: set[tuple[int, ...]] = set()
        out = []
        heldout = [w for windows in self.heldout.values() for w in windows]
        for window in [*self.train, *self.validation, *heldout, *self.heldout_data]:
            if window.input_ids not in seen:
                seen.add(window.input_ids)
                out.append(window)
        return out


def self_generated_needed(setup: Setup, data: PreparedData, splits=EVERY_SPLIT) -> dict[TextSampling, list[Window]]:
    """The windows of `splits` whose self-generated twins the run uses, by how the base writes them:
    validation under the selected serving configuration, heldout under each one, and train under
    `data.self_generate_*` unless the head trains on the recorded answers only."""
    needed: dict[TextSampling, list[Window]] = {}
    if VALIDATION in splits:
        selected = setup.selected
        for sampling in setup.texts(selected):
            needed.setdefault(sampling, []).extend(data.served_windows(VALIDATION, selected.thinking))
    if HELDOUT in splits:
        for sampling, thinking in dict.fromkeys((t, s.thinking) for s in setup.servings for t in setup.texts(s)):
            needed.setdefault(sampling, []).extend(data.served_windows(HELDOUT, thinking))
    if TRAIN in splits and setup.data.answers != "data":
        for sampling in setup.train_texts:
            needed.setdefault(sampling, []).extend(data.train)
    return needed


def run_windows_together(setup: Setup, data: PreparedData, stores: Stores | None, writer: Writer, base, main_process: bool,
                         log: Log = quiet, splits=EVERY_SPLIT) -> RunWindows:
    """`run_windows` in every process of a sharded base at once: its forwards are collective, so the
    processes decode the missing continuations together, from the same store contents (a batch
    each, `selfgen.store.EmbeddedWriter.answers`), and the main process alone writes them
    (`write_missing`); then every process reads what it wrote."""
    for store in (stores or {}).values():
        store.reread()
    barrier(base)  # every process has read the stores before the main one appends to them
    if stores is not None:
        write_missing(stores, self_generated_needed(setup, data, splits), writer, log=log if main_process else quiet,
                      keep=main_process)
    barrier(base)
    for store in (stores or {}).values():
        store.reread()
    return run_windows(setup, data, stores, None, log=log, splits=splits)


def write_missing(stores: Stores, needed: dict[TextSampling, list[Window]], writer: Writer | None, log: Log = quiet,
                  keep: bool = True) -> None:
    """`writer` (`continuation_writer`) writes the continuations of the `needed` windows
    (`self_generated_needed`) the stores lack; with `keep=False` it decodes them and nothing is
    stored (`run_windows_together`). Without a writer, a SelfGenError when any is missing. Before the
    first store, one line says how many stores and continuations are to be written in all, and each
    store's line says which of them it is."""
    lacking = {sampling: missing for sampling, windows in needed.items() if (missing := stores[sampling].missing(windows))}
    total = sum(len(missing) for missing in lacking.values())
    if lacking and writer is None:
        sampling, missing = next(iter(lacking.items()))
        raise SelfGenError(
            f"{stores[sampling].directory}: {len(missing)} of the run's {len(needed[sampling])} windows have no self-generated "
            "continuation, and the base is not loaded to write them (data.target_cache is set); run "
            "`python -m occamy_mtp cache --config CONFIG` first, which writes them with the target cache, or name "
            "servers that write them (data.self_generate_endpoints)"
        )
    if lacking and len(lacking) > 1:
        log(f"self-generated windows: {total:,} continuations to write into {len(lacking)} stores (one a way the base "
            "writes: the train text, each serving configuration's seeds)")
    # A writer that shares batches writes one configuration's seeds together (`selfgen.store.write_together`),
    # the complete stores' rows among them, so that the batches do not depend on which store lacks a line.
    shares = writer is not None and writer.shares_batches
    groups: dict = {}
    for sampling in needed:
        groups.setdefault(batch_key(sampling) if shares else sampling, []).append(sampling)
    done = number = 0
    for group in groups.values():
        short = [s for s in group if s in lacking]
        if not short:
            continue
        first, number = number + 1, number + len(short)
        if len(lacking) > 1:
            which = f"store {first}" if len(short) == 1 else f"stores {first}-{number}, in shared batches,"
            log(f"self-generated windows: {which} of {len(lacking)} ({done:,} of {total:,} continuations written)")
        if len(group) > 1:
            write_together([(stores[s], writer.for_text(s), needed[s]) for s in sorted(group, key=lambda s: s.seed)], log,
                           keep=keep)
        elif keep:
            stores[group[0]].generate(writer.for_text(group[0]), needed[group[0]], log)
        else:
            stores[group[0]].follow(writer.for_text(group[0]), needed[group[0]])
        done += sum(len(lacking[s]) for s in short)


def run_windows(setup: Setup, data: PreparedData, stores: Stores | None, writer: Writer | None = None,
                log: Log = quiet, splits=EVERY_SPLIT) -> RunWindows:
    """The windows of `splits`; `writer` (`continuation_writer`) first writes the continuations the stores lack.

    Without a writer (the targets are cached and no servers are named) every continuation
    must be in its store already: the cache pass writes them. Without stores, the
    recorded answers only (train and the teacher-forced heldout windows).
    """
    recorded_heldout = [w for w in data.heldout if w.has_answer] if HELDOUT in splits else []  # prompts have none
    if stores is None:
        return RunWindows(train=[w for w in data.train if w.has_answer] if TRAIN in splits else [], validation=[],
                          heldout={}, heldout_data=recorded_heldout, self_generated={})
    needed = self_generated_needed(setup, data, splits)
    write_missing(stores, needed, writer, log=log)
    train: list[Window] = []
    if TRAIN in splits:
        answers = setup.data.answers
        if answers == "data":
            train = list(data.train)
        else:
            # each context's continuations together, in the order of the texts (one text: the store's windows)
            written = [stores[sampling].windows(data.train) for sampling in setup.train_texts]
            generated = [w for group in zip(*written) for w in group]
            train = generated if answers == "self_generated" else [
                w for group in zip(data.train, *written) for w in group if w.has_answer]  # a prompt's recorded one is empty
    heldout = {}
    if HELDOUT in splits:
        heldout = {serving.label(): measured_windows(stores, setup.texts(serving),
                                                     data.served_windows(HELDOUT, serving.thinking))
                   for serving in setup.servings}
    selected = setup.selected
    return RunWindows(
        train=train,
        validation=(measured_windows(stores, setup.texts(selected), data.served_windows(VALIDATION, selected.thinking))
                    if VALIDATION in splits else []),
        heldout=heldout,
        heldout_data=recorded_heldout,
        self_generated={sampling.label(): stores[sampling].provenance(windows) for sampling, windows in needed.items()},
    )


# ----------------------------------------------------------------------------------
# Models and targets
# ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Models:
    base: FrozenBase | None
    """The frozen base; None when the targets come from the cache."""
    head: MTPHead
    """The donor head, trainable tensors as fp32 masters."""
    donor_layout: str
    trainable_parameters: int
    head_parameters: int


def load_models(model, trainable_names: tuple[str, ...], facts: BaseFacts, device, with_base: bool = True,
                log: Log = quiet, sharding: Sharding | None = None) -> Models:
    """The frozen base and the donor head of `model` (the model settings) on `device`, the tensors
    `trainable_names` names as fp32 masters.

    The base is opened through its one door (`base.frozen.FrozenBase.open`). Without the base (`with_base=False`, training from the target cache) only the two
    tensors the head borrows, `embed_tokens` and `lm_head`, are loaded. `sharding`: the base's
    placement (the launch's).
    """
    dtype = ckpt_io.DTYPES[model.dtype]
    started = time.perf_counter()
    if with_base:
        base = FrozenBase.open(model, device, sharding, facts, log)
        shared = SharedWeights(base.model.embed_tokens, base.lm_head)
    else:
        log(f"base: loading only embed_tokens and lm_head of {model.base} (the targets are cached)")
        base = None
        shared = ckpt_io.load_shared_weights(model.base, dtype=dtype, device=device, config=facts.config)
    head, layout = ckpt_io.load_head(
        model.donor_head,
        facts.text_config,
        shared,
        dtype=dtype,
        device=device,
        attn_implementation=model.attn_implementation,
    )
    trainable = set_trainable(head, trainable_names)
    for param in head.parameters():
        if param.requires_grad:
            param.data = param.data.float()  # fp32 master copy; the forward rounds it as serving stores it
    total, _ = count_parameters(head)
    log(f"models: loaded in {time.perf_counter() - started:.1f} s; head {total:,} parameters, {trainable:,} trainable")
    return Models(base, head, layout, trainable, total)


def open_targets(setup: Setup, facts: BaseFacts, windows: list[Window], window_settings: dict, base=None) -> TargetSource:
    """The base online, or the offline cache at `data.target_cache` checked against `windows`
    (built with `window_settings`, `PreparedData.settings`)."""
    if not setup.data.target_cache:
        if base is None:
            raise ValueError("no target cache configured, so the base itself is needed for the online path")
        return OnlineTargets(base)
    identity = cache_identity(BaseIdentity.of(setup.model, facts), windows, window_settings)
    return TargetCache.open(Path(setup.data.target_cache), identity)


# ----------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """Everything a stage reads, set up once from the set-up settings (`settings.Setup`)."""

    dir: RunDir
    base_facts: BaseFacts
    tokenizer: object
    data: PreparedData
    models: Models
    windows: RunWindows
    targets: TargetSource
    stop_token_ids: set[int]
    """Where the base's continuations end (`stop_token_ids`)."""


def open_run(setup: Setup, device, *, base: BaseFacts | None = None, log: Log = quiet, splits=EVERY_SPLIT,
             self_generated: bool = True, max_heldout: int | None = None,
             writer_first: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
             check_data: Callable[[PreparedData], None] | None = None, sharding: Sharding | None = None,
             main_process: bool = True) -> Run:
    """Tokenizer, windows of `splits`, models, the self-generated twins, targets (module docstring).

    `self_generated=False` reads the recorded answers only (no store, no generation);
    `max_heldout` keeps the first heldout windows only. `writer_first` orders the
    processes of a multi-process run around the store: the main process writes the
    missing continuations while the others wait, then they read them
    (`accelerator.main_process_first`). With `sharding` (`model.sharding`) the base's
    forwards are collective, so the processes decode the missing continuations together and
    only the main one (`main_process`) writes them (`run_windows_together`). `check_data` sees the windows before any model
    loads (a resumed run refuses data other than its checkpoint's there). `base`: the facts
    `check_run` read, else read here.
    """
    facts = base or check_inputs(setup)
    tokenizer = load_tokenizer(setup.model)
    stop_ids = stop_token_ids(tokenizer, setup.model.base)
    data = prepare_data(setup, tokenizer, log=log)
    check_split(setup, data, splits)
    if check_data is not None:
        check_data(data)
    if max_heldout is not None:
        data = dataclasses.replace(data, heldout=data.heldout[:max_heldout], served={
            mode: {**sides, HELDOUT: sides[HELDOUT][:max_heldout]} for mode, sides in data.served.items()})
    needed = self_generated_needed(setup, data, splits)
    stores = open_stores(setup, facts, stop_ids, needed) if self_generated else None
    engines = None
    if stores is not None:
        check_store_writable(stores, needed)
        if setup.selfgen.endpoints and any(stores[s].missing(w) for s, w in needed.items()):
            engines = continuation_writer(setup.selfgen, tokenizer, facts, stop_ids)
            engines.servers  # noqa: B018 - the servers are checked here, before minutes of loading the base
    models = load_models(setup.model, setup.trainable, facts, device, with_base=not setup.data.target_cache, log=log,
                         sharding=sharding)
    if engines is None and is_sharded(models.base):
        windows = run_windows_together(setup, data, stores, continuation_writer(setup.selfgen, tokenizer, facts, stop_ids,
                                                                                models.base),
                                       models.base, main_process, log=log, splits=splits)
    else:
        with writer_first():
            for store in (stores or {}).values():
                store.reread()  # what the main process (or another run) wrote meanwhile
            writer = engines or continuation_writer(setup.selfgen, tokenizer, facts, stop_ids, models.base)
            windows = run_windows(setup, data, stores, writer, log=log, splits=splits)
    targets = open_targets(setup, facts, windows.all(), data.settings, base=models.base)
    return Run(setup.run_dir, facts, tokenizer, data, models, windows, targets, stop_ids)
