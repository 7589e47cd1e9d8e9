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

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from occamy_mtp.config import ConfigError, RunConfig
from occamy_mtp.data import PreparedData, Window, prepare_windows
from occamy_mtp.selfgen import SelfGenError, SelfGeneratedStore, store_identity

SELF_GENERATED_DIR = "self-generated"  # under output.dir unless data.self_generated_dir says otherwise


def tokenizer_path(config: RunConfig) -> str:
    return config.model.tokenizer or config.model.base


def load_tokenizer(config: RunConfig):
    from transformers import AutoTokenizer

    path = tokenizer_path(config)
    if not Path(path).is_dir():
        raise ConfigError(f"model.tokenizer: {path} is not a directory (tokenizer files with a chat template expected)")
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def prepare_data(config: RunConfig, tokenizer) -> PreparedData:
    if not config.data.files:
        raise ConfigError("data.files: no chat data files given")
    return prepare_windows(
        list(config.data.files),
        tokenizer,
        context_tokens=config.data.context_tokens,
        answer_tokens=config.data.answer_tokens,
        turns=config.data.turns,
        train_conversations=config.data.train_conversations,
        heldout_conversations=config.data.heldout_conversations,
        validation_conversations=config.data.validation_conversations,
        split_seed=config.data.split_seed,
        skip_bad_records=config.data.skip_bad_records,
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
