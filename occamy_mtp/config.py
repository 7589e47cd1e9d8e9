"""Run configuration: a tree of typed, frozen dataclasses loaded from YAML.

Precedence: the dataclass defaults (the only place defaults live), then the YAML file,
then `section.key=value` command-line overrides, which go through the same loader.
An unknown key anywhere is an error naming its dotted path; a value of the wrong type
is an error naming the path, the expected type and the value.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from occamy_mtp.errors import OccamyError
from occamy_mtp.losses import LOSSES, fits_distribution


class ConfigError(OccamyError, ValueError):
    """A config file or override that does not fit the schema."""


class OneProcessOnly(ConfigError):
    """A one-process command launched as several: every process refuses, the first alone says so (`cli.command`)."""


UNSET = "REPLACE_ME"
"""What the defaults and the shipped configs hold where a path must be given: never a Hub id."""


@dataclass(frozen=True)
class ModelSettings:
    base: str = f"{UNSET}/occamy-base"
    """Checkpoint directory of the frozen, fine-tuned base (config.json + safetensors)."""
    donor_head: str = f"{UNSET}/donor"
    """Where the donor `mtp.*` tensors are: a checkpoint directory or one safetensors file."""
    tokenizer: str = ""
    """Tokenizer directory with the chat template; empty means the base directory."""
    dtype: str = "bfloat16"
    """Dtype of every frozen weight and of activations (trainable tensors keep fp32 masters)."""
    attn_implementation: str = "sdpa"
    """transformers attention backend for the base and the head: sdpa or eager."""
    fp8_weights: str = "auto"
    """How a block-wise FP8 base holds its decoder layers' weights: fp8 (as stored, one byte a weight,
    each layer's written in `dtype` into one shared buffer just before it runs: about half the
    memory, the same results bit for bit), dequantized (in `dtype`, as they load) or auto (fp8 on a
    CUDA device, dequantized elsewhere). Other bases ignore it; a sharded base is read dequantized."""
    fp8_activations: str = "bf16"
    """What a block-wise FP8 base's linear layers take as input: bf16 (the activations as computed:
    W8A16, the fast paths on) or fp8 (each input quantized per token, per 128 features, as an FP8
    engine's W8A8 path quantizes it: the served base's arithmetic; transformers' forward, slower).
    Other bases ignore it."""


DRAFT_RULES = ("greedy", "sampled")


ENGINES = ("vllm", "sglang")
"""Whose arithmetic a served figure follows where the engines differ (`Serving.engine`)."""
DEFAULT_ENGINE = ENGINES[0]


@dataclass(frozen=True)
class Serving:
    """How an engine serves: how it samples the base and draws and accepts drafts (`occamy_mtp.sampling`)."""

    temperature: float = 0.0
    """The requests' temperature; 0 is greedy decoding (a draft is accepted when it is the base's argmax)."""
    top_p: float = 1.0
    """The requests' top_p: the most probable tokens are kept while the tokens before them hold less
    than this share of the mass (1: every token)."""
    top_k: int = 0
    """The requests' top_k: the k largest logits are kept (0: every token)."""
    draft: str = "greedy"
    """How the engine draws a draft token: greedy (the head's argmax, accepted with probability p(d):
    SGLang's NEXTN with --speculative-eagle-topk 1, and vLLM's default draft_sample_method) or
    sampled (drawn from the head's softmax at the temperature and accepted with probability
    min(1, p/q): vLLM's draft_sample_method=probabilistic)."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token the answer already holds (OpenAI's and vLLM's
    definition), before the temperature; in verification over the answer so far and the drafts
    before the verified position (docs/reference/CONTRACT.md section 4c)."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once for every time the answer already holds it."""
    repetition_penalty: float = 1.0
    """Divides the positive logits (multiplies the negative ones) of every token of the prompt or
    the answer so far (1: none)."""
    min_p: float = 0.0
    """Refused above 0: vLLM refuses min_p with speculative decoding (docs/reference/CONTRACT.md section 4c)."""
    thinking: bool = False
    """Thinking mode: the heldout prompts are rendered with the chat template's enable_thinking, so
    that the base's continuations open with its reasoning (the model card's thinking presets)."""
    engine: str = "vllm"
    """The engine whose verification arithmetic the figures follow (`ENGINES`); they differ only under
    penalties at draft steps 2 and later (docs/reference/CONTRACT.md section 4c): vllm penalizes the
    j-th drafted position over the output so far and drafts 1..j-1, sglang every position of a round
    alike over the output committed before it. A preset's name with `-sglang` (thinking-general-sglang)
    is the preset under SGLang's rule."""
    relaxed_top_k: int = 0
    """Opt-in, lossy: the engines' relaxed acceptance of thinking tokens (TensorRT-LLM's relaxed thinking
    acceptance, SGLang #7702) with this many of the target's top tokens as candidates (0: exact
    acceptance). Inside the think span a draft among the candidates whose probability is at least
    `relaxed_ratio` of the top one's is accepted outright; elsewhere the exact rule holds. Served text is
    then no longer the base's distribution (docs/reference/CONTRACT.md section 4d). Thinking mode only."""
    relaxed_ratio: float = 0.0
    """The relaxed rule's threshold: a candidate's probability over the top token's, in [0, 1]."""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether any penalty changes the base's logits."""
        return any_penalty(self.presence_penalty, self.frequency_penalty, self.repetition_penalty)

    def label(self) -> str:
        """The configuration's name in reports and directory names: a preset's name (instruct-general), or
        its settings: greedy, t0.7-p0.8, t1-p0.95-k20-pp1.5, t0.6-k20-sampled-drafts, greedy-thinking;
        under SGLang's arithmetic the same with `-sglang` (thinking-general-sglang)."""
        suffix = ("" if self.engine == DEFAULT_ENGINE else f"-{self.engine}") + (
            f"-relaxed-k{self.relaxed_top_k}-r{self.relaxed_ratio:g}" if self.relaxed else "")
        plain = dataclasses.replace(self, engine=DEFAULT_ENGINE, relaxed_top_k=0, relaxed_ratio=0.0)
        for name, preset in PRESETS.items():
            if preset == plain:
                return name + suffix
        sampled_drafts = not self.greedy and self.draft == "sampled"
        return (sampling_label(self.temperature, self.top_p, self.top_k, self.presence_penalty, self.frequency_penalty,
                               self.repetition_penalty) + ("-sampled-drafts" if sampled_drafts else "")
                + ("-thinking" if self.thinking else "") + suffix)

    @property
    def relaxed(self) -> bool:
        """Whether thinking tokens are accepted under the lossy relaxed rule (`relaxed_top_k`)."""
        return self.relaxed_top_k > 0

    @property
    def round_start_penalties(self) -> bool:
        """Whether a round's drafted positions are all penalized over the output committed before it
        (SGLang's rule), rather than each over the drafts before it too (vLLM's)."""
        return self.engine == "sglang" and self.penalized


# The Qwen3.5/3.6 model card's serving presets (docs/reference/CONTRACT.md section 4c): `eval.serving` takes
# their names beside explicit settings.
PRESETS: dict[str, Serving] = {
    "thinking-general": Serving(temperature=1.0, top_p=0.95, top_k=20, presence_penalty=1.5, thinking=True),
    "thinking-coding": Serving(temperature=0.6, top_p=0.95, top_k=20, thinking=True),
    "instruct-general": Serving(temperature=0.7, top_p=0.8, top_k=20, presence_penalty=1.5),
    "instruct-reasoning": Serving(temperature=1.0, top_p=1.0, top_k=40, presence_penalty=2.0),
}


GREEDY = "greedy"
"""The name of greedy serving (`Serving()`, whose label it is) wherever a preset's name is taken."""


_PRESET_NAME = re.compile(r"^(?P<stem>.+?)(?:-(?P<engine>sglang))?(?:-relaxed-k(?P<top_k>\d+)-r(?P<ratio>[0-9.]+))?$")


def serving_preset(name: str, where: str = "eval.serving") -> Serving:
    """The preset called `name`, or greedy serving by its label, either with `-sglang` for SGLang's arithmetic
    (`Serving.engine`) and then `-relaxed-kK-rR` for the relaxed rule (`Serving.relaxed_top_k`); ConfigError
    listing the names otherwise."""
    match = _PRESET_NAME.match(name)
    stem = match["stem"] if match else name
    if stem != GREEDY and stem not in PRESETS:
        raise ConfigError(f"{where}: unknown serving preset {name!r}; expected {GREEDY} or one of {', '.join(PRESETS)} "
                          f"(each also with -sglang: SGLang's arithmetic), or settings such as {{temperature: 0.7, top_p: 0.8}}")
    preset = Serving() if stem == GREEDY else PRESETS[stem]
    try:
        ratio = float(match["ratio"]) if match["ratio"] else 0.0
    except ValueError:
        raise ConfigError(f"{where}: {name!r}: the relaxed rule's ratio {match['ratio']!r} is not a number") from None
    return dataclasses.replace(preset, engine=match["engine"] or DEFAULT_ENGINE,
                               relaxed_top_k=int(match["top_k"] or 0), relaxed_ratio=ratio)


def any_penalty(presence: float, frequency: float, repetition: float) -> bool:
    """Whether penalties of these values change a logit (repetition 1 and the others 0 do not)."""
    return bool(presence or frequency or repetition != 1.0)


def sampling_label(temperature: float, top_p: float, top_k: int, presence_penalty: float = 0.0,
                   frequency_penalty: float = 0.0, repetition_penalty: float = 1.0) -> str:
    """A way of sampling in reports and directory names: greedy, or e.g. t0.7-p0.8, t0.6-k20, t1-p0.95-k20-pp1.5."""
    if temperature == 0:
        return "greedy"
    parts = [f"t{temperature:g}"] + ([f"p{top_p:g}"] if top_p < 1 else []) + ([f"k{top_k}"] if top_k else [])
    parts += [f"pp{presence_penalty:g}"] if presence_penalty else []
    parts += [f"fp{frequency_penalty:g}"] if frequency_penalty else []
    parts += [f"rp{repetition_penalty:g}"] if repetition_penalty != 1.0 else []
    return "-".join(parts)




@dataclass(frozen=True)
class DataSettings:
    files: tuple[str, ...] = ()
    """Chat data: JSONL/JSON/parquet files of OpenAI-style or ShareGPT-style conversations."""
    context_tokens: int = 128
    """Tokens kept before each answer (they include the template's assistant header)."""
    answer_tokens: int = 382
    """Answer tokens kept per window; loss and metrics count only these."""
    turns: str = "last"
    """Which assistant turns become windows: last, first or every."""
    thinking: str = "auto"
    """How the windows' turns are rendered (the chat template's enable_thinking): on (thinking mode:
    the prompt opens the think block and the answer span holds the reasoning, then the answer;
    the base writes its continuations so), off (the empty think block; a turn's recorded reasoning
    is left out and counted) or auto (on for a turn that records reasoning, `reasoning_content` or
    an inline `<think>` block, off otherwise). The served windows are rendered as each
    `eval.serving` configuration's `thinking` says."""
    train_conversations: int = 256
    """Conversations in the train split (surplus conversations are counted, not used)."""
    heldout_conversations: int = 32
    """Conversations in the heldout split that every metric is measured on."""
    validation_conversations: int = 32
    """Conversations in the validation split that checkpoint selection (`train.select_every_steps`)
    is measured on, so that the choice never sees the heldout split; 0 for none."""
    answers: str = "self_generated"
    """What the head trains on: self_generated (each train window's context continued greedily by
    the base itself: the text serving drafts on), data (the recorded answers, teacher forced:
    the original recipe) or mixed (both, each window twice)."""
    self_generated_dir: str = ""
    """Where the base's continuations are stored (`occamy_mtp.selfgen.store`); empty means
    output.dir/self-generated. Runs with the same base and window settings may share it."""
    self_generate_batch_size: int = 0
    """Contexts per batch when the base in this process writes the continuations; 0: as many as
    fit on the GPU (`occamy_mtp.memory`: the free memory, less its margin and one prefill pass,
    over the decoder's bytes a row, `fastdecode.BatchDecoder.row_bytes`), at most 160, the batch
    measured fastest a window (`fastdecode.DEFAULT_MAX_BATCH`, bench/results/decode.md); 160 on a CPU.
    The console names the batch chosen and why. A set value is used as it is."""
    self_generate_endpoints: tuple[str, ...] = ()
    """OpenAI-compatible servers serving the base (vLLM's `vllm serve`, SGLang's `launch_server`)
    that write the continuations, e.g. [http://10.0.0.5:8000, http://10.0.0.6:8000]; empty: the
    base in this process writes them. The work is spread over every server."""
    self_generate_model: str = ""
    """The model id the servers must serve (their /v1/models); empty: the one they serve, recorded."""
    self_generate_concurrency: int = 64
    """Requests in flight per server."""
    self_generate_timeout_seconds: float = 600.0
    """Wall-clock bound of one request to a server (a continuation of up to data.answer_tokens tokens)."""
    self_generate_retries: int = 4
    """Tries after a failed request (connection error, timeout, HTTP 5xx, malformed answer), waiting
    1, 2, 4... s between them, before the run stops with the server's URL and the last error."""
    split_seed: int = 0
    """Seed of the content hash that assigns conversations to train or heldout."""
    skip_bad_records: bool = False
    """Skip (and count) malformed records instead of failing on the first one."""
    max_record_bytes: int = 8 * 2**20
    """A conversation with more text than this (UTF-8 bytes) is excluded and counted
    (record_too_large) before it is tokenized. Qwen3.5's longest context, 262,144 tokens,
    holds about 1 MiB of text: a record eight times that is not a conversation the base was
    served (a concatenated corpus, a log dump)."""
    target_cache: str = ""
    """Directory of the offline target cache (`python -m occamy_mtp cache`); empty runs the base online."""
    train_text: Serving = Serving()
    """How the base writes the train windows' continuations: a serving configuration of the same kind as
    `eval.serving`'s entries, a preset by name (`train_text: thinking-general`) or settings
    (`{temperature: 0.7, top_p: 0.8}`); greedy (the default) or sampled, each token drawn from the base's
    distribution processed with its temperature, top-p, top-k and penalties (`occamy_mtp.sampling`), from
    a uniform stream seeded by `self_generate_seed` and the context, so that a continuation is the same
    in any batch and after a resume. The prompts are rendered as `thinking` says (a preset that writes in
    thinking mode is refused beside `thinking: off`). The heldout and validation windows are written
    under each `eval.serving` configuration."""
    self_generate_seed: int = 0
    """Seed of every sampled continuation (train, validation and heldout)."""
    train_continuations: int = 1
    """Continuations the base writes of each train context under a sampled `train_text`, each from its own
    seed (`self_generate_seed` + 0, 1, ...; a store each), every one a train window: more of the text
    serving drafts on from the same prompts (an epoch then has this many times the steps). Greedy text
    has one."""


TURN_CHOICES = ("last", "first", "every")
THINKING_CHOICES = ("auto", "on", "off")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")  # model.attn_implementation
FP8_WEIGHTS_CHOICES = ("auto", "fp8", "dequantized")  # model.fp8_weights (`model.fp8_weights.keeps_fp8`)
FP8_ACTIVATIONS_CHOICES = ("bf16", "fp8")  # model.fp8_activations (`model.quantized.emulate_fp8_activations`)
# Settings spelled on / off / auto: YAML 1.1 reads a bare on or off as a boolean, taken here as meant.
_SWITCHES = ("data.thinking",)

# The data settings that decide which windows a run builds and how they are split; the
# keyword arguments of `occamy_mtp.data.prepare.prepare_windows`, under the same names.
WINDOW_SETTINGS = (
    "context_tokens", "answer_tokens", "turns", "thinking", "train_conversations", "validation_conversations",
    "heldout_conversations", "split_seed", "skip_bad_records", "max_record_bytes",
)


def window_settings(data: DataSettings) -> dict:
    """`prepare_windows` keyword arguments of a run's data settings (its split, exactly): and
    `prompts`, whether records without an answer are used (the base writes the answers)."""
    return {**{name: getattr(data, name) for name in WINDOW_SETTINGS}, "prompts": data.answers != "data"}


@dataclass(frozen=True)
class TrainSettings:
    epochs: int = 2
    """Passes over the train windows. 2 epochs x 256 windows at 1 window/step = 512 steps."""
    windows_per_step: int = 1
    """Windows per optimizer step, summed over all processes."""
    lr: float = 5e-4
    """Peak learning rate of AdamW."""
    lr_warmup_steps: int = 32
    """Linear warmup from 0 to `lr` over this many steps, then cosine decay."""
    lr_min_ratio: float = 0.1
    """The cosine decays to lr * lr_min_ratio at the last step."""
    weight_decay: float = 0.0
    """AdamW weight decay. 0 keeps the donor's norms and fc from shrinking towards 0."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip_norm: float = 1.0
    """Clip the global gradient norm of the trainable tensors to this (0 disables)."""
    seed: int = 0
    """Seed of the window order (and of anything else random in training)."""
    trainable: tuple[str, ...] = ("fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden")
    """Head submodules to train; everything else stays the donor's."""
    draft_steps: int = 1
    """Chained MTP steps trained per anchor (1 = the original recipe; 3 = MTP-3 serving)."""
    step_loss_weights: tuple[float, ...] = ()
    """Loss weight of each step 1..draft_steps; empty means equal weights."""
    detach_chain: bool = False
    """Stop gradients between chained steps (cheaper; the default trains the full unroll)."""
    loss: str = "top1"
    """What the head is fitted to at each scored position, a name of `occamy_mtp.losses.LOSSES`: top1
    (cross-entropy towards the base's greedy token), top1-certainty (top1, each position weighted by
    p's top probability), top1-margin (top1, weighted by p at the base's choice less p at the head's),
    kl (KL(p || q)) or tv (the total variation 1 - sum_x min(p(x), q(x)), one minus the expected
    acceptance of a draft drawn from q). p is the base's distribution processed as the selected
    serving configuration serves it (the one `eval.select_serving` names: penalties over the answer so
    far, temperature, top_p, top_k), computed exactly from the base's hidden state; q is the head's
    softmax at that temperature. A loss that reads p needs a sampled configuration selected."""
    checkpoint_every_steps: int = 64
    """Write a resumable checkpoint every this many steps (and at the end)."""
    keep_checkpoints: int = 2
    """How many periodic checkpoints to keep on disk."""
    log_every_steps: int = 8
    """Log loss, lr and throughput every this many steps."""
    select_every_steps: int = 64
    """Measure the head on the self-generated validation windows every this many steps (and
    before the first, which is the donor) and keep the best (`eval.served_steps`, decoder
    replay); 0 keeps the last step's head."""
    tracker: str = "none"
    """Experiment tracker for accelerate: none, wandb, tensorboard (no network by default)."""


@dataclass(frozen=True)
class EvalSettings:
    draft_steps: int = 3
    """Chained steps measured by the offline acceptance evaluation."""
    served_steps: tuple[int, ...] = (1, 2, 3)
    """Draft step counts serving may run (SGLang's `--speculative-num-steps`, vLLM's
    `num_speculative_tokens`): 1, 2 (vLLM's recipe for Qwen3.5/3.6) and 3 (SGLang's) by default, any up to
    `draft_steps`. The decoder replay is reported for each, export refuses a head worse than the donor at
    any, and checkpoint selection scores their mean accept length."""
    decoder_check_windows: int = 1
    """Heldout prompts decoded with the reference speculative decoder at export, for each head
    and served step count, to check the replayed figures against it; 0 skips the check. It
    decodes at batch 1, seconds a prompt at real size (bench/results/decode.md), so the default checks one prompt."""
    windows_per_batch: int = 4
    """Heldout windows per evaluation forward."""
    serving: tuple[Serving, ...] = (Serving(), *PRESETS.values())
    """The serving configurations every served figure is measured for: presets by name (`PRESETS`,
    the Qwen3.5/3.6 model card's) or settings, e.g. [{temperature: 0}, instruct-general,
    {temperature: 0.7, top_p: 0.8}]. By default greedy and the card's four presets. For each, the
    heldout prompts are rendered in its thinking mode and the base writes its own continuation of
    every heldout context under that sampling (seeded: `data.self_generate_seed`) and the decoder's
    acceptance is the exact expectation over its draws given that text (docs/reference/CONTRACT.md sections 4a-4c)."""
    sampled_continuations: int = 4
    """Continuations the base writes of each heldout (and validation) context under a sampled serving
    configuration, each from its own seed (`data.self_generate_seed` + 0, 1, ...; a store each).
    A sampled figure is exact given its texts, but each text is one draw: the figures average
    over all of them, and their standard error (over contexts, `metrics.jackknife_se`) covers
    both draws. 4 brings the demo's sampled 3-step figures to a standard error of at most 0.02
    (bench/results/recipes-compared.md)."""
    select_serving: str = ""
    """The configuration of `serving` that checkpoint selection scores, export's refusal compares and a
    kl or tv loss (`train.loss`) fits, by its label: a preset's name (thinking-general) or the label the
    reports give settings (greedy, t0.7-p0.8); empty: the first of `serving`."""


@dataclass(frozen=True)
class OutputSettings:
    dir: str = "runs/default"
    """Run directory: checkpoints, the trained tensors, exported files, TRAINING.json."""
    expert_layout: str = "donor"
    """Expert layout of the exported head: donor (as read), fused or per_expert."""
    base_model_id: str = ""
    """The base's Hub id (org/name) for the card's `base_model`; empty: read from a Hub snapshot's path,
    else left out of the card's metadata (the Hub refuses a local directory's name there)."""


@dataclass(frozen=True)
class RunConfig:
    model: ModelSettings = field(default_factory=ModelSettings)
    data: DataSettings = field(default_factory=DataSettings)
    train: TrainSettings = field(default_factory=TrainSettings)
    eval: EvalSettings = field(default_factory=EvalSettings)
    output: OutputSettings = field(default_factory=OutputSettings)

    def to_dict(self) -> dict:
        return _plain(dataclasses.asdict(self))

    def fingerprint(self, sections: tuple[str, ...] = ("model", "data", "train")) -> str:
        """sha256 of the settings that determine the trained head (resume refuses a change)."""
        return hashlib.sha256(json.dumps(self.fingerprinted(sections), sort_keys=True).encode()).hexdigest()

    def fingerprinted(self, sections: tuple[str, ...] = ("model", "data", "train")) -> dict:
        """The settings `fingerprint` hashes, as a plain tree (kept in checkpoints, so that a
        refused resume can name what changed)."""
        d = self.to_dict()
        # The train text in the spelling runs were fingerprinted with before data.train_text (its
        # sampling; its thinking mode is data.thinking's), so that they resume as they were.
        d["data"].update(_fingerprinted_text(d["data"].pop("train_text")))
        # Where the targets and the continuations are read from does not change them (the
        # cache and the store hold exactly what the base computes), so a run may move them.
        d["data"].pop("target_cache", None)
        # Nor how an FP8 base's weights are held: the weights computed are the same, bit for bit.
        d["model"].pop("fp8_weights", None)
        d["data"].pop("self_generated_dir", None)
        # Nor where the servers are or how they are asked (the store knows who wrote its text).
        for name in ("self_generate_endpoints", "self_generate_concurrency", "self_generate_timeout_seconds",
                     "self_generate_retries"):
            d["data"].pop(name, None)
        # Settings added after runs were trained leave the fingerprint as it was while they keep their default.
        for section, name in _LATER_SETTINGS:
            default = _TEXT_DEFAULTS[name] if name in _TEXT_DEFAULTS else getattr(_DEFAULTS[section], name)
            if section in d and d[section].get(name) == default:
                d[section].pop(name)
        parts = {s: d[s] for s in sections}
        if "train" in sections and self.train.select_every_steps:
            parts["eval.served_steps"] = d["eval"]["served_steps"]  # checkpoint selection scores them
        if "train" in sections and (self.train.select_every_steps or fits_distribution(self.train.loss)):
            selected = _plain(dataclasses.asdict(self.selected_serving))  # selection scores it, the loss fits it
            for name in _LATER_SERVING_SETTINGS:
                if selected.get(name) == getattr(Serving(), name):
                    selected.pop(name)
            parts["eval.selected_serving"] = selected
        if "train" in sections and self.train.select_every_steps and not self.selected_serving.greedy \
                and self.eval.sampled_continuations != 1:  # selection scores every continuation (one before there were more)
            parts["eval.sampled_continuations"] = self.eval.sampled_continuations
        return parts

    @property
    def selected_serving(self) -> Serving:
        """The serving configuration selection, the refusal and a distribution loss use (`eval.select_serving`)."""
        return selected_configuration(self.eval)


# (section, setting) pairs and serving settings that came after runs were fingerprinted: at their
# defaults they are left out of `fingerprinted`, so that such a run resumes and exports as before.
_LATER_SETTINGS = (("model", "fp8_activations"), ("data", "thinking"), ("data", "train_continuations"), ("data", "self_generate_presence_penalty"), ("data", "self_generate_frequency_penalty"),
                   ("data", "self_generate_repetition_penalty"))
_LATER_SERVING_SETTINGS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "thinking", "engine",
                           "relaxed_top_k", "relaxed_ratio")
_DEFAULTS = {"model": ModelSettings(), "data": DataSettings()}
# data.train_text's sampling fields, and the data.self_generate_* keys that spelled them before it.
_TEXT_FIELDS = ("temperature", "top_p", "top_k", "presence_penalty", "frequency_penalty", "repetition_penalty")
_REPLACED_TEXT_KEYS = tuple(f"self_generate_{name}" for name in _TEXT_FIELDS)
_TEXT_DEFAULTS = {f"self_generate_{name}": getattr(Serving(), name) for name in _TEXT_FIELDS}


def _fingerprinted_text(train_text: dict) -> dict:
    """data.train_text as the fingerprint has always spelled it: its sampling as data.self_generate_* keys."""
    return {f"self_generate_{name}": train_text[name] for name in _TEXT_FIELDS}


def selected_configuration(evaluation: EvalSettings) -> Serving:
    """The configuration of `evaluation.serving` that `evaluation.select_serving` names (empty: the first);
    ConfigError naming the labels where it names none."""
    if not evaluation.select_serving:
        return evaluation.serving[0]
    for serving in evaluation.serving:
        if serving.label() == evaluation.select_serving:
            return serving
    raise ConfigError(f"eval.select_serving: {evaluation.select_serving!r} names none of eval.serving "
                      f"({_one_of([s.label() for s in evaluation.serving])})")


def differing_settings(then: dict, now: dict, prefix: str = "") -> list[str]:
    """`dotted.key: then -> now` for every setting that differs between two `fingerprinted` trees."""
    lines = []
    for key in sorted(set(then) | set(now)):
        a, b = then.get(key), now.get(key)
        name = f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            lines += differing_settings(a, b, name + ".")
        elif a != b:
            lines.append(f"{name}: {a!r} -> {b!r}")
    return lines


def _plain(obj):
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


# ----------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------


def _coerce(value, annotation, path: str):
    """Check (and minimally convert) one YAML value against its field type."""
    origin = typing.get_origin(annotation)
    if origin is tuple:
        item_type = typing.get_args(annotation)[0]
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        return tuple(_coerce(v, item_type, f"{path}[{i}]") for i, v in enumerate(value))
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        errors = []
        for arg in args:
            try:
                return _coerce(value, arg, path)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0])
    if annotation is Serving and isinstance(value, str):  # a serving preset by name
        return serving_preset(value, path)
    if dataclasses.is_dataclass(annotation):
        return _build(annotation, value, path)
    if annotation is type(None):
        if value is not None:
            raise ConfigError(f"{path}: expected null, got {value!r}")
        return None
    if annotation is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {value!r}")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if annotation is float:
        if isinstance(value, str):
            # YAML 1.1 reads `3e-4` (no dot) as a string; accept what float() accepts.
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(f"{path}: expected a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{path}: unsupported field type {annotation!r}")


def _build(cls, values: dict, path: str):
    if not isinstance(values, dict):
        raise ConfigError(f"{path or 'config'}: expected a mapping, got {values!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    if cls is DataSettings:
        _refuse_replaced_text_keys(values)
    if cls is EvalSettings and isinstance(values.get("select_serving"), int):
        _refuse_an_index(values)
    unknown = sorted(set(values) - names)
    if unknown:
        where = f"{path}." if path else ""
        raise ConfigError(f"unknown config key {where}{unknown[0]} (known keys: {', '.join(sorted(names))})")
    kwargs = {}
    for name, value in values.items():
        annotation = hints[name]
        dotted = f"{path}.{name}" if path else name
        if dataclasses.is_dataclass(annotation) and annotation is not Serving:  # a Serving may be a preset's name
            kwargs[name] = _build(annotation, value, dotted)
        elif dotted in _SWITCHES and isinstance(value, bool):  # YAML reads on and off as true and false
            kwargs[name] = "on" if value else "off"
        else:
            kwargs[name] = _coerce(value, annotation, dotted)
    return cls(**kwargs)


def _refuse_replaced_text_keys(data: dict) -> None:
    """The data.self_generate_* sampling keys, which data.train_text replaced: one ConfigError giving the new spelling."""
    old = [key for key in _REPLACED_TEXT_KEYS if key in data]
    if not old:
        return
    given = {name: data[f"self_generate_{name}"] for name in _TEXT_FIELDS if f"self_generate_{name}" in data}
    try:
        text = _build(Serving, given, "data.train_text")
    except ConfigError:
        text = None
    spelling = f"{{{', '.join(f'{name}: {value}' for name, value in given.items())}}}"
    if text is not None:
        preset = next((name for name, p in PRESETS.items() if dataclasses.replace(p, thinking=False) == text), None)
        spelling = preset or ("greedy" if text == Serving() else spelling)
    spelling = "{}" if spelling == "greedy" else spelling  # the default: the key can go
    raise ConfigError(f"{', '.join('data.' + key for key in old)}: replaced by data.train_text, a serving configuration "
                      f"as eval.serving's entries are; write data.train_text: {spelling}")


def _refuse_an_index(evaluation: dict) -> None:
    """eval.select_serving given as an index (as it was before it named the configuration): ConfigError with the name."""
    index = evaluation["select_serving"]
    try:
        servings = _coerce(evaluation["serving"], tuple[Serving, ...], "eval.serving") if "serving" in evaluation \
            else EvalSettings().serving
    except ConfigError:
        servings = ()
    name = servings[index].label() if 0 <= index < len(servings) else None
    hint = f"eval.select_serving: {name}" if name else f"the label of one of eval.serving ({_one_of([s.label() for s in servings])})"
    raise ConfigError(f"eval.select_serving: {index} is an index; name the configuration instead: {hint}")


def _set_dotted(tree: dict, dotted: str, value) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted}: {key} is not a section")
        node = child
    node[keys[-1]] = value


def parse_override(text: str) -> tuple[str, object]:
    """`train.lr=3e-4` -> ("train.lr", 3e-4). The value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected section.key=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {text!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as err:
        reason = " ".join(str(err).split())
        hint = ""
        if any(c in raw for c in "&*!|>%@`?:#"):  # YAML's indicators: a URL-like value needs quotes
            hint = f"; quote a value with YAML's special characters, e.g. {key}='[\"hf:org/name?split=train&column=messages\"]'"
        raise ConfigError(f"override {text!r}: value is not valid YAML ({reason}){hint}") from None
    return key, value


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Defaults <- YAML file <- overrides; validated into a RunConfig.

    Relative paths in `model.*`, `data.files` and `output.dir` are kept as written
    (relative to the working directory), as users expect from a command line.
    """
    tree: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{path}: no such config file")
        try:
            tree = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: not valid YAML ({err})") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"{path}: expected a mapping at the top level")
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(tree, key, value)
    config = _build(RunConfig, tree, "")
    check(config)
    return config


def _one_of(choices) -> str:
    """Choices as a check's message names them: "a, b or c" ("a" alone)."""
    return ", ".join(choices[:-1]) + " or " + choices[-1] if len(choices) > 1 else "".join(choices)


def check(config: RunConfig) -> None:
    """Cross-field checks, each naming the option at fault."""
    checks = [
        (config.model.dtype in ("bfloat16", "float32", "float16"), "model.dtype", "bfloat16, float16 or float32"),
        (config.model.attn_implementation in ATTN_IMPLEMENTATIONS, "model.attn_implementation", _one_of(ATTN_IMPLEMENTATIONS)),
        (config.model.fp8_weights in FP8_WEIGHTS_CHOICES, "model.fp8_weights", _one_of(FP8_WEIGHTS_CHOICES)),
        (config.model.fp8_activations in FP8_ACTIVATIONS_CHOICES, "model.fp8_activations", _one_of(FP8_ACTIVATIONS_CHOICES)),
        (config.data.turns in TURN_CHOICES, "data.turns", _one_of(TURN_CHOICES)),
        (config.data.thinking in THINKING_CHOICES, "data.thinking", _one_of(THINKING_CHOICES)),
        (config.data.context_tokens >= 1, "data.context_tokens", ">= 1"),
        (config.data.answer_tokens >= 2, "data.answer_tokens", ">= 2"),
        (config.data.train_conversations >= 1, "data.train_conversations", ">= 1"),
        (config.data.heldout_conversations >= 1, "data.heldout_conversations", ">= 1"),
        (config.data.validation_conversations >= 0, "data.validation_conversations", ">= 0"),
        (config.data.answers in ("self_generated", "data", "mixed"), "data.answers", "self_generated, data or mixed"),
        (config.eval.sampled_continuations >= 1, "eval.sampled_continuations", ">= 1"),
        (config.data.train_continuations >= 1, "data.train_continuations", ">= 1"),
        (config.data.train_continuations == 1 or not config.data.train_text.greedy, "data.train_continuations",
         "1 where data.train_text is greedy (the base writes one greedy continuation of a context)"),
        (config.data.self_generate_batch_size >= 0, "data.self_generate_batch_size", "0 (as many as fit) or more"),
        (all(u.startswith(("http://", "https://")) for u in config.data.self_generate_endpoints)
         and len(set(config.data.self_generate_endpoints)) == len(config.data.self_generate_endpoints),
         "data.self_generate_endpoints", "distinct http:// or https:// URLs"),
        (config.data.self_generate_concurrency >= 1, "data.self_generate_concurrency", ">= 1"),
        (math.isfinite(config.data.self_generate_timeout_seconds) and config.data.self_generate_timeout_seconds > 0,
         "data.self_generate_timeout_seconds", "a finite number > 0"),
        (config.data.self_generate_retries >= 0, "data.self_generate_retries", ">= 0"),
        (config.data.max_record_bytes >= 1, "data.max_record_bytes", ">= 1"),
        (config.train.epochs >= 1, "train.epochs", ">= 1"),
        (config.train.windows_per_step >= 1, "train.windows_per_step", ">= 1"),
        (math.isfinite(config.train.lr) and config.train.lr > 0, "train.lr", "a finite number > 0"),
        (config.train.lr_warmup_steps >= 0, "train.lr_warmup_steps", ">= 0"),
        (0 <= config.train.lr_min_ratio <= 1, "train.lr_min_ratio", "between 0 and 1"),
        (math.isfinite(config.train.weight_decay) and config.train.weight_decay >= 0, "train.weight_decay", "a finite number >= 0"),
        (0 <= config.train.adam_beta1 < 1, "train.adam_beta1", "in [0, 1)"),
        (0 <= config.train.adam_beta2 < 1, "train.adam_beta2", "in [0, 1)"),
        (math.isfinite(config.train.adam_eps) and config.train.adam_eps > 0, "train.adam_eps", "a finite number > 0"),
        (math.isfinite(config.train.grad_clip_norm) and config.train.grad_clip_norm >= 0, "train.grad_clip_norm",
         "a finite number >= 0"),
        # A chain of K drafts anchored just before the answer predicts up to its K-th token: more steps
        # than data.answer_tokens score nothing, and the chain's activations grow with K.
        (1 <= config.train.draft_steps <= config.data.answer_tokens, "train.draft_steps",
         f"1 to data.answer_tokens ({config.data.answer_tokens})"),
        (
            not config.train.step_loss_weights or len(config.train.step_loss_weights) == config.train.draft_steps,
            "train.step_loss_weights",
            f"empty or {config.train.draft_steps} weights (one per draft step)",
        ),
        (all(math.isfinite(w) and w >= 0 for w in config.train.step_loss_weights), "train.step_loss_weights",
         "finite, non-negative weights"),
        (not config.train.step_loss_weights or sum(config.train.step_loss_weights) > 0, "train.step_loss_weights",
         "weights that do not sum to 0"),
        (len(config.train.trainable) >= 1, "train.trainable", "at least one head submodule"),
        (config.train.checkpoint_every_steps >= 1, "train.checkpoint_every_steps", ">= 1"),
        (config.train.keep_checkpoints >= 1, "train.keep_checkpoints", ">= 1"),
        (config.train.log_every_steps >= 1, "train.log_every_steps", ">= 1"),
        (config.train.select_every_steps >= 0, "train.select_every_steps", ">= 0"),
        (
            config.train.select_every_steps == 0 or config.data.validation_conversations >= 1,
            "data.validation_conversations",
            ">= 1 when train.select_every_steps > 0 (or set train.select_every_steps=0)",
        ),
        (config.train.tracker in ("none", "wandb", "tensorboard"), "train.tracker", "none, wandb or tensorboard"),
        (1 <= config.eval.draft_steps <= config.data.answer_tokens, "eval.draft_steps",
         f"1 to data.answer_tokens ({config.data.answer_tokens})"),
        (config.eval.windows_per_batch >= 1, "eval.windows_per_batch", ">= 1"),
        (
            len(config.eval.served_steps) >= 1 and all(1 <= k <= config.data.answer_tokens for k in config.eval.served_steps)
            and len(set(config.eval.served_steps)) == len(config.eval.served_steps),
            "eval.served_steps",
            f"one or more distinct step counts, each 1 to data.answer_tokens ({config.data.answer_tokens})",
        ),
        (max(config.eval.served_steps, default=1) <= config.eval.draft_steps, "eval.served_steps",
         f"step counts up to eval.draft_steps ({config.eval.draft_steps}), the chain the evaluation measures: "
         "raise eval.draft_steps to serve more"),
        (config.eval.decoder_check_windows >= 0, "eval.decoder_check_windows", ">= 0"),
        (config.output.expert_layout in ("donor", "fused", "per_expert"), "output.expert_layout", "donor, fused or per_expert"),
        (config.train.loss in LOSSES, "train.loss", _one_of(list(LOSSES))),
        (len(config.eval.serving) >= 1, "eval.serving", "one or more serving configurations"),
        (len({s.label() for s in config.eval.serving}) == len(config.eval.serving), "eval.serving",
         "distinct configurations (two entries serve the same way)"),
    ]
    data = config.data
    texts = [("data.train_text.", data.train_text), *((f"eval.serving[{i}].", s) for i, s in enumerate(config.eval.serving))]
    sampling = [(prefix, s.temperature, s.top_p, s.top_k) for prefix, s in texts]
    for prefix, temperature, top_p, top_k in sampling:
        checks += [
            (math.isfinite(temperature) and temperature >= 0, f"{prefix}temperature", "a finite number >= 0", temperature),
            (0 < top_p <= 1, f"{prefix}top_p", "a number in (0, 1]", top_p),
            (top_k >= 0, f"{prefix}top_k", "0 (every token) or more", top_k),
        ]
    checks += [(s.draft in DRAFT_RULES, f"eval.serving[{i}].draft", _one_of(DRAFT_RULES), s.draft)
               for i, s in enumerate(config.eval.serving)]
    checks += [(s.engine in ENGINES, f"{prefix}engine", _one_of(ENGINES), s.engine) for prefix, s in texts]
    penalties = [(prefix, s.temperature, s.presence_penalty, s.frequency_penalty, s.repetition_penalty) for prefix, s in texts]
    for prefix, temperature, presence, frequency, repetition in penalties:
        checks += [
            (-2 <= presence <= 2, f"{prefix}presence_penalty", "a number in [-2, 2] (the OpenAI API's range)", presence),
            (-2 <= frequency <= 2, f"{prefix}frequency_penalty", "a number in [-2, 2] (the OpenAI API's range)", frequency),
            (math.isfinite(repetition) and repetition > 0, f"{prefix}repetition_penalty", "a finite number > 0 (1: none)",
             repetition),
            (temperature > 0 or not any_penalty(presence, frequency, repetition), f"{prefix}temperature",
             "a temperature above 0 where a penalty is set (greedy decoding under penalties is not modelled)", temperature),
        ]
    for i, s in enumerate(config.eval.serving):
        where = f"eval.serving[{i}]"
        if s.relaxed_top_k < 0 or not 0 <= s.relaxed_ratio <= 1:
            raise ConfigError(f"{where}.relaxed_top_k / relaxed_ratio: expected a top-k >= 0 (0: exact acceptance) and a ratio "
                              f"in [0, 1], got {s.relaxed_top_k} and {s.relaxed_ratio:g}")
        if s.relaxed and s.greedy:
            raise ConfigError(f"{where}.relaxed_top_k: the relaxed rule is modelled for sampled serving (the target's "
                              "candidates are its processed distribution's); greedy serving's is one-hot")
        if s.relaxed and not s.thinking:
            raise ConfigError(f"{where}.relaxed_top_k: the relaxed rule accepts thinking tokens, and {s.label()} is not in "
                              "thinking mode; set thinking: true or leave relaxed_top_k at 0")
        if not s.relaxed and s.relaxed_ratio:
            raise ConfigError(f"{where}.relaxed_ratio: {s.relaxed_ratio:g} without relaxed_top_k, which turns the relaxed "
                              "rule on")
    if data.train_text.relaxed:
        raise ConfigError("data.train_text.relaxed_top_k: the relaxed rule is how a server accepts drafts, not how the base "
                          "writes text; leave it at 0")
    if config.eval.serving and selected_configuration(config.eval).relaxed:
        raise ConfigError(f"eval.select_serving: {selected_configuration(config.eval).label()} is a relaxed (lossy) "
                          "configuration (the first of eval.serving where none is named); selection and export's refusal "
                          "compare exact acceptance: name another")
    for i, s in enumerate(config.eval.serving):
        if s.min_p > 0:
            raise ConfigError(f"eval.serving[{i}].min_p: {s.min_p!r} is refused: vLLM refuses min_p with speculative "
                              "decoding (SamplingParams._validate_spec_decode, vLLM 0.32; docs/reference/CONTRACT.md section 4c), "
                              "so no served figure exists for it; leave min_p at 0")
    if data.train_text.thinking and data.thinking == "off":
        raise ConfigError(f"data.train_text: {data.train_text.label()} writes in thinking mode, and data.thinking off "
                          "renders the train prompts without it; set data.thinking=on (or auto), or give the text's "
                          "sampling as settings")
    chosen = selected_configuration(config.eval) if config.eval.serving else None
    if chosen is not None and chosen.greedy and fits_distribution(config.train.loss):
        raise ConfigError(f"train.loss: {config.train.loss} reads the base's processed distribution under the selected "
                          f"serving configuration ({chosen.label()}), and greedy serving's is one-hot: the loss would be "
                          "top1's; use train.loss=top1, or select a sampled configuration (eval.select_serving)")
    for ok, option, expected, *given in checks:
        if not ok:
            value = given[0] if given else _dotted(config.to_dict(), option)
            raise ConfigError(f"{option}: expected {expected}, got {value!r}")


def placeholders(config: RunConfig, *options: str) -> dict[str, str]:
    """Each of `options` (dotted: `model.base`, `data.files`) that still holds the placeholder `UNSET`,
    which the shipped configs leave where the user's paths go: option -> "option (value)"."""
    tree = config.to_dict()
    unset = {}
    for option in options:
        value = _dotted(tree, option)
        if any(str(v).startswith(UNSET) for v in (value if isinstance(value, list) else [value])):
            unset[option] = f"{option} ({value!r})"
    return unset


def refuse_placeholders(unset: list[str]) -> None:
    """ConfigError naming every option of `unset` (`placeholders`' values) at once."""
    if unset:
        raise ConfigError(
            f"{', '.join(unset)}: still the placeholder {UNSET}; give your own on the command line, e.g. "
            "model.base=/ckpt/occamy model.donor_head=/ckpt/donor data.files=[/data/chats.jsonl]"
        )


def _dotted(tree: dict, option: str):
    for part in option.split("."):
        tree = tree[part]
    return tree


def step_loss_weights(train: TrainSettings) -> tuple[float, ...]:
    """Per-step loss weights, normalised to sum to 1 (equal weights when unset)."""
    weights = train.step_loss_weights or (1.0,) * train.draft_steps
    total = sum(weights)
    if total <= 0:
        raise ConfigError("train.step_loss_weights: weights sum to 0")
    return tuple(w / total for w in weights)


def dump_yaml(config: RunConfig) -> str:
    return yaml.safe_dump(config.to_dict(), sort_keys=False)
