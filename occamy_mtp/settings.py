"""The run's config resolved, once, into what each stage reads.

`plan_of(config)` is the one place past the commands where a `RunConfig` is read. It gives a
`Plan`: the set-up settings `run.open_run` takes (`Setup`), one settings object per stage
(`TrainPlan`, `EvalPlan`, `ExportPlan`, `CachePlan`, `SelfGenSettings`), the settings'
fingerprint and the run directory's names (`RunDir`). Every setting derived from more than one
of the config's values (the train text's sampling, each serving configuration's texts, where
their stores live, the window settings, the normalised step weights, the fingerprint) is
computed here and nowhere else; the library's functions take these objects, their own section
of the config, or plain values.

    plan = plan_of(config)
    summary = train(plan, resume=False)   # train.loop
    record = export(plan)                 # export.exporter
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from occamy_mtp.config import (
    DataSettings,
    ModelSettings,
    RunConfig,
    Serving,
    TrainSettings,
    differing_settings,
    dump_yaml,
    placeholders,
    step_loss_weights,
    window_settings,
)
from occamy_mtp.model import checkpoint as ckpt_io
from occamy_mtp.sampling import GREEDY_TEXT, TextSampling, text_sampling
from occamy_mtp.selfgen.store import STORE_FILE
from occamy_mtp.targets.cache import DEFAULT_MAX_SHARD_BYTES


@dataclass(frozen=True)
class RunDir:
    """Every file a run keeps under `output.dir` (docs/reference/OUTPUTS.md)."""

    root: Path

    @classmethod
    def of(cls, config: RunConfig) -> RunDir:
        return cls(Path(config.output.dir))

    lock = property(lambda self: self.root / ".lock")
    """Held by a running train or export (its pid inside)."""
    resolved_config = property(lambda self: self.root / "config.resolved.yaml")
    """The run's settings as resolved; evaluate and validate read its split with `--config`."""
    checkpoints = property(lambda self: self.root / "checkpoints")
    """Resumable training state, `step-NNNNNN.pt`."""
    trained_tensors = property(lambda self: self.root / "trained-tensors.safetensors")
    """fp32 masters of the trained tensors at the step selection kept (train.py)."""
    train_summary = property(lambda self: self.root / "train-summary.json")
    """Loss and selection history (train.py)."""
    self_generated = property(lambda self: self.root / "self-generated")
    """The base's continuations, unless `data.self_generated_dir` puts them elsewhere."""
    head = property(lambda self: self.root / ckpt_io.HEAD_FILE)
    """The exported head (export.py)."""
    head_config = property(lambda self: self.root / ckpt_io.HEAD_CONFIG_FILE)
    metrics = property(lambda self: self.root / "metrics.json")
    plot = property(lambda self: self.root / "acceptance.png")
    card = property(lambda self: self.root / "README.md")
    """The head's model card (`export.card`), unless the user's own README.md is there (then the card is
    in `upload` alone)."""
    upload = property(lambda self: self.root / "upload")
    """What `hf upload` publishes, and nothing else: the card as README.md and links to the files it lists."""
    record = property(lambda self: self.root / ckpt_io.EXPORT_RECORD)
    export_incomplete = property(lambda self: self.root / ckpt_io.EXPORT_INCOMPLETE)
    """There while export renames its outputs into place: readers refuse the set (`check_export_set`)."""
    hash_cache = property(lambda self: self.root / ".file-hashes.json")
    """Known sha256 of the base's and donor's files, by path, size and mtime."""

    def export_outputs(self, card: bool = True) -> tuple[Path, ...]:
        """What export writes, in the order it renames them: TRAINING.json, which records the others' hashes, last;
        the card at the root only with `card` (`card.writes_root_card`)."""
        return (self.head, self.head_config, self.metrics, self.plot, *((self.card,) if card else ()), self.upload_card,
                self.record)

    @property
    def upload_card(self) -> Path:
        return self.upload / "README.md"

    def published(self) -> tuple[Path, ...]:
        """The files the card lists, which `upload` links beside it."""
        return (self.head, self.head_config, self.metrics, self.plot, self.record)

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"step-{step:06d}.pt"

    def latest_checkpoint(self) -> Path | None:
        found = sorted(self.checkpoints.glob("step-*.pt"))
        return found[-1] if found else None


@dataclass(frozen=True)
class Fingerprint:
    """The settings that determine the trained head (`RunConfig.fingerprinted`) and their sha256:
    resume and export refuse tensors written under others."""

    value: str
    settings: dict

    def refusal(self, found: str | None, recorded: dict) -> str | None:
        """None when `found` is this fingerprint; else the settings that differ from the `recorded`
        tree, listed (`config.differing_settings`; "unknown" when it holds none)."""
        if found == self.value:
            return None
        return "; ".join(differing_settings(recorded, self.settings)) or "unknown"


@dataclass(frozen=True)
class SelfGenSettings:
    """Who writes the continuations a store lacks, and how (the `data.self_generate_*` settings, none of
    which changes the text): the base in this process, or the servers of `endpoints`."""

    answer_tokens: int
    batch_size: int
    endpoints: tuple[str, ...]
    model: str
    concurrency: int
    timeout_seconds: float
    retries: int


@dataclass(frozen=True)
class Measuring:
    """How every served figure is measured: by evaluation, by checkpoint selection and by export."""

    servings: tuple[Serving, ...]
    selected: Serving
    """The configuration selection scores and export's refusal compares (`eval.select_serving`)."""
    served_steps: tuple[int, ...]
    draft_steps: int
    answer_tokens: int
    windows_per_batch: int
    decoder_check_windows: int


@dataclass(frozen=True)
class Setup:
    """What opening a run reads (`run.open_run`): the model and data sections, and what is derived
    from them and the rest of the config once."""

    model: ModelSettings
    data: DataSettings
    windows: dict
    """`prepare_windows`' keyword settings (`config.window_settings`)."""
    run_dir: RunDir
    trainable: tuple[str, ...]
    servings: tuple[Serving, ...]
    selected: Serving
    validates: bool
    """Checkpoint selection scores validation windows (`train.select_every_steps` > 0)."""
    train_texts: tuple[TextSampling, ...]
    """How the base writes the train windows' continuations (`data.train_text`): one way a continuation of each
    train context (`data.train_continuations`), seeded by `data.self_generate_seed` + 0, 1, ..."""
    serving_texts: dict
    """Per serving configuration's label, every way the base writes its text: one for greedy serving,
    `eval.sampled_continuations` seeds under sampling (`data.self_generate_seed` + 0, 1, ...)."""
    store_root: Path
    selfgen: SelfGenSettings
    unset: dict
    """model.base, model.donor_head and data.files where they still hold the shipped configs'
    placeholder (`config.placeholders`): the checks refuse them, all at once."""
    new_store_root: Path | None = None
    """Where a store the run does not hold yet is written (`evaluate --out`'s self-generated/: an evaluation
    writes into its own directory, never into the run's); None: under `store_root` like the others."""

    def texts(self, serving: Serving) -> tuple[TextSampling, ...]:
        return self.serving_texts[serving.label()]

    def store_dir(self, sampling: TextSampling = GREEDY_TEXT) -> Path:
        """Where the continuations written under `sampling` are stored: the greedy ones in the store
        directory itself, sampled ones in a folder of it named after their settings."""
        name = "" if sampling.greedy else f"sampled-{sampling.label()}"
        held = self.store_root / name if name else self.store_root
        if self.new_store_root is None or (held / STORE_FILE).is_file():
            return held
        return self.new_store_root / name if name else self.new_store_root

    def stored_texts(self) -> list[TextSampling]:
        """Every way this run's base may write text, greedy first, each once."""
        texts = [GREEDY_TEXT, *self.train_texts, *(t for s in self.servings for t in self.texts(s))]
        return list(dict.fromkeys(texts))


@dataclass(frozen=True)
class TrainPlan:
    """What training reads beyond the run (`train.loop.train`)."""

    settings: TrainSettings
    step_weights: tuple[float, ...]
    """Per-step loss weights, normalised to sum to 1."""
    embed_text: bool
    """Chained steps embed the text's own tokens (the train text is sampled)."""
    dtype: str
    answers: str
    measuring: Measuring
    fingerprint: Fingerprint
    resolved_yaml: str
    """config.resolved.yaml's text."""
    tracked: dict
    """The settings as a flat tree, for an experiment tracker."""


@dataclass(frozen=True)
class EvalPlan:
    """What `evaluate` (the command) reads beyond the run."""

    measuring: Measuring
    dtype: str
    attn_implementation: str
    inputs: dict
    """The base, the donor and the data files, as the report names them."""
    self_generate_batch_size: int


@dataclass(frozen=True)
class ExportPlan:
    """What export reads beyond the run (`export.exporter.export`)."""

    measuring: Measuring
    dtype: str
    expert_layout: str
    base: str
    donor_head: str
    fingerprint: Fingerprint
    settings: dict
    """The whole config as a plain tree: TRAINING.json records it."""


@dataclass(frozen=True)
class CachePlan:
    """The offline cache pass's own settings (`cache.build_for_run`); the `cache` command sets the
    pass's from its flags."""

    directory: str
    """`data.target_cache`; the command's --dir replaces it."""
    windows_per_batch: int = 1
    """Windows per plain base forward (1: each window's canonical targets)."""
    fastbase_tokens: int | None = 0
    """Tokens per forward of the packed fast pass; 0: the plain pass; None: as many as fit."""
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES


@dataclass(frozen=True)
class Plan:
    """A run's config, resolved once: the set-up and each stage's settings."""

    setup: Setup
    train: TrainPlan
    evaluate: EvalPlan
    export: ExportPlan
    cache: CachePlan
    fingerprint: Fingerprint
    run_dir: RunDir


def serving_texts(config: RunConfig, serving: Serving) -> tuple[TextSampling, ...]:
    """Every way the base writes a serving configuration's text (`Setup.serving_texts`)."""
    count = 1 if serving.greedy else config.eval.sampled_continuations
    return tuple(text_sampling(serving, config.data.self_generate_seed + j) for j in range(count))


def plan_of(config: RunConfig) -> Plan:
    """`config` resolved into a `Plan`. Nothing is read from disk here."""
    data, model, evaluation = config.data, config.model, config.eval
    run_dir = RunDir.of(config)
    fingerprint = Fingerprint(config.fingerprint(), config.fingerprinted())
    measuring = Measuring(evaluation.serving, config.selected_serving, evaluation.served_steps, evaluation.draft_steps,
                          data.answer_tokens, evaluation.windows_per_batch, evaluation.decoder_check_windows)
    selfgen = SelfGenSettings(data.answer_tokens, data.self_generate_batch_size, data.self_generate_endpoints,
                              data.self_generate_model, data.self_generate_concurrency, data.self_generate_timeout_seconds,
                              data.self_generate_retries)
    train_texts = tuple(text_sampling(data.train_text, data.self_generate_seed + j) for j in range(data.train_continuations))
    setup = Setup(
        model=model, data=data, windows=window_settings(data), run_dir=run_dir, trainable=config.train.trainable,
        servings=evaluation.serving, selected=config.selected_serving, validates=config.train.select_every_steps > 0,
        train_texts=train_texts, serving_texts={s.label(): serving_texts(config, s) for s in evaluation.serving},
        store_root=Path(data.self_generated_dir) if data.self_generated_dir else run_dir.self_generated, selfgen=selfgen,
        unset=placeholders(config, "model.base", "model.donor_head", "data.files"),
    )
    tree = config.to_dict()
    train = TrainPlan(config.train, step_loss_weights(config.train), not data.train_text.greedy, model.dtype,
                      data.answers, measuring, fingerprint, dump_yaml(config), _flat(tree))
    inputs = {"base": model.base, "donor": model.donor_head, "data": list(data.files)}
    return Plan(
        setup=setup,
        train=train,
        evaluate=EvalPlan(measuring, model.dtype, model.attn_implementation, inputs, data.self_generate_batch_size),
        export=ExportPlan(measuring, model.dtype, config.output.expert_layout, model.base, model.donor_head, fingerprint, tree),
        cache=CachePlan(data.target_cache),
        fingerprint=fingerprint,
        run_dir=run_dir,
    )


def _flat(tree: dict, prefix: str = "") -> dict:
    """A nested settings tree as `section.key` pairs (lists joined), for trackers that take flat values."""
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat(value, name + "."))
        else:
            out[name] = json.dumps(value) if isinstance(value, list) else value
    return out
