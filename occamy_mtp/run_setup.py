"""What every entry point of a run sets up from its config: tokenizer, windows, self-generated windows.

train.py, export.py and the cache pass all read the same chat files into the same
windows (`prepare_data`) and, from them, the same `RunWindows`: the windows the head
trains on (`data.answers`), the self-generated validation windows that checkpoint
selection scores, the self-generated heldout windows that the headline figures are
measured on, and the recorded heldout answers that the secondary, teacher-forced
figures are measured on. The continuations come from the run's `selfgen` store; the
base writes the missing ones when it is loaded (online runs and the cache pass).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from occamy_mtp import checkpoint as ckpt_io
from occamy_mtp.config import ConfigError, RunConfig, window_settings
from occamy_mtp.data import PreparedData, Window, prepare_windows
from occamy_mtp.head import MTPHead, set_trainable
from occamy_mtp.selfgen import SelfGenError, SelfGeneratedStore, store_identity

SELF_GENERATED_DIR = "self-generated"  # under output.dir unless data.self_generated_dir says otherwise
LOCK_FILE = ".lock"


def log_stderr(message: str) -> None:
    """Progress of the slow phases, on stderr so that stdout keeps the results."""
    print(message, file=sys.stderr, flush=True)


def _inside(path: Path, directory: Path) -> bool:
    path, directory = path.resolve(), directory.resolve()
    return path == directory or directory in path.parents


def check_run(config: RunConfig) -> None:
    """The checks that need no data and no weights, before anything slow starts.

    The base and donor exist and the base's config reads; no output of the run
    (output.dir, the store, the target cache) is a file or lies inside the base or the
    donor directory (symlinks resolved: the base is never written into); every name in
    `train.trainable` is a head submodule (checked on a head built on the meta device).
    """
    base, donor = Path(config.model.base), Path(config.model.donor_head)
    base_config = ckpt_io.read_config(base)
    if not donor.exists():
        raise ConfigError(f"model.donor_head: {donor}: no such file or directory")
    protected = [("model.base", base)] + ([("model.donor_head", donor)] if donor.is_dir() else [])
    outputs = [("output.dir", Path(config.output.dir)), ("data.self_generated_dir", self_generated_dir(config))]
    if config.data.target_cache:
        outputs.append(("data.target_cache", Path(config.data.target_cache)))
    for option, path in outputs:
        if path.exists() and not path.is_dir():
            raise ConfigError(f"{option}: {path} is a file; a directory is expected there")
        for source, directory in protected:
            if _inside(path, directory):
                raise ConfigError(
                    f"{option}: {path} is inside {source} ({directory}), which is only ever read; choose a directory outside it"
                )
    with torch.device("meta"):
        head = MTPHead(base_config.text_config)
    try:
        set_trainable(head, config.train.trainable)
    except ValueError as err:
        raise ConfigError(f"train.trainable: {err}") from None


@contextlib.contextmanager
def output_lock(config: RunConfig) -> Iterator[None]:
    """Hold an exclusive lock on output.dir (its `.lock` file, with the holder's pid) while a run writes there.

    Two trainings into one directory would both run and the last would silently win;
    the second one now stops at once, naming the process that holds the directory.
    """
    directory = Path(config.output.dir)
    directory.mkdir(parents=True, exist_ok=True)
    handle = open(directory / LOCK_FILE, "a+")
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            raise ConfigError(
                f"output.dir: {directory} is in use by another run (pid {holder}); wait for it, or use another output.dir"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        yield
    finally:
        handle.close()  # releases the lock


def tokenizer_path(config: RunConfig) -> str:
    return config.model.tokenizer or config.model.base


def load_tokenizer(config: RunConfig):
    from transformers import AutoTokenizer

    path = tokenizer_path(config)
    if not Path(path).is_dir():
        raise ConfigError(f"model.tokenizer: {path} is not a directory (tokenizer files with a chat template expected)")
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def prepare_data(config: RunConfig, tokenizer, log: Callable[[str], None] | None = None) -> PreparedData:
    if not config.data.files:
        raise ConfigError("data.files: no chat data files given")
    if log is not None:
        size = sum(Path(f).stat().st_size for f in config.data.files if Path(f).is_file())
        log(f"data: reading {len(config.data.files)} file(s) ({size / 2**20:.1f} MiB) into windows")
    started = time.perf_counter()
    data = prepare_windows(list(config.data.files), tokenizer, **window_settings(config.data))
    if log is not None:
        summary = data.summary()
        log(f"data: {summary['conversations_read']} conversations read, {summary['conversations_kept']} kept; "
            f"{summary['train_windows']} train / {summary['validation_windows']} validation / {summary['heldout_windows']} "
            f"heldout windows ({time.perf_counter() - started:.1f} s)")
    return data


def check_split(config: RunConfig, data: PreparedData) -> None:
    """Refuse a split that leaves the run nothing to train, select or report on."""
    sides = [("train", data.train, "data.train_conversations"), ("heldout", data.heldout, "data.heldout_conversations")]
    if config.train.select_every_steps:
        sides.append(("validation", data.validation, "data.validation_conversations (or set train.select_every_steps=0)"))
    for side, windows, option in sides:
        if not windows:
            raise ConfigError(
                f"data: no {side} windows were built, so the run would have nothing to "
                f"{'train on' if side == 'train' else 'measure'}; check data.files and {option} "
                "(see `python -m occamy_mtp.data`)"
            )


def stop_token_ids(config: RunConfig, tokenizer) -> set[int]:
    """Where the base's continuations end: eos, the template's end of turn, generation_config's eos."""
    from occamy_mtp.generate import default_eos_token_ids

    return default_eos_token_ids(tokenizer, config.model.base)


def self_generated_dir(config: RunConfig) -> Path:
    return Path(config.data.self_generated_dir or Path(config.output.dir) / SELF_GENERATED_DIR)


def open_store(config: RunConfig, tokenizer) -> SelfGeneratedStore:
    """The run's store of continuations (refused when written for another base or settings)."""
    identity = store_identity(
        config.model.base,
        config.model.dtype,
        config.model.attn_implementation,
        max_new_tokens=config.data.answer_tokens,
        stop_token_ids=stop_token_ids(config, tokenizer),
    )
    return SelfGeneratedStore.open(self_generated_dir(config), identity)


@dataclass(frozen=True)
class RunWindows:
    """The windows of one run, by what they are for."""

    train: list[Window]
    """What the head trains on: recorded answers, self-generated ones, or both (`data.answers`)."""
    validation: list[Window]
    """Self-generated validation windows: what checkpoint selection scores."""
    heldout: list[Window]
    """Self-generated heldout windows: the headline figures (exact; the decoder replay)."""
    heldout_data: list[Window]
    """The recorded heldout answers: teacher-forced agreement and NLL (approximate acceptance)."""
    self_generated: dict
    """Provenance of the continuations (`SelfGeneratedStore.provenance`)."""

    def all(self) -> list[Window]:
        """Every distinct window the run reads targets for, in a fixed order (what a target cache covers)."""
        seen: set[tuple[int, ...]] = set()
        out = []
        for window in [*self.train, *self.validation, *self.heldout, *self.heldout_data]:
            if window.input_ids not in seen:
                seen.add(window.input_ids)
                out.append(window)
        return out


def self_generated_needed(config: RunConfig, data: PreparedData) -> list[Window]:
    """The windows whose self-generated twins the run uses: validation, heldout, and train
    unless the head trains on the recorded answers only."""
    return [*data.validation, *data.heldout, *(data.train if config.data.answers != "data" else [])]


def run_windows(config: RunConfig, data: PreparedData, store: SelfGeneratedStore, base=None,
                log: Callable[[str], None] = print) -> RunWindows:
    """The run's windows; the base (when given) writes the continuations the store lacks first.

    Without the base (a run reading the target cache) every continuation must be in the
    store already: the cache pass writes them.
    """
    answers = config.data.answers
    needed = self_generated_needed(config, data)
    missing = store.missing(needed)
    if missing:
        if base is None:
            raise SelfGenError(
                f"{store.directory}: {len(missing)} of the run's {len(needed)} windows have no self-generated continuation, "
                "and the base is not loaded to write them (data.target_cache is set); run "
                "`python -m occamy_mtp.cache --config CONFIG` first, which writes them with the target cache"
            )
        store.generate(base, needed, config.data.self_generate_batch_size, log)
    if answers == "data":
        train = list(data.train)
    else:
        generated = store.windows(data.train)
        train = generated if answers == "self_generated" else [w for pair in zip(data.train, generated) for w in pair]
    return RunWindows(
        train=train,
        validation=store.windows(data.validation),
        heldout=store.windows(data.heldout),
        heldout_data=list(data.heldout),
        self_generated=store.provenance(needed),
    )
