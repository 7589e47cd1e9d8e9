"""The frozen base: the one door through which the library opens it, and the one identity of what it computes.

    facts = BaseFacts(model.base)                    # its config and quantization, read once
    base = FrozenBase.open(model, device, sharding)  # train, export, evaluate, cache, generate, validate, serve
    base.placement, base.emulated, base.fp8_layers, base.fast_paths, base.joined_groups   # what the opening decided
    BaseIdentity.of(model, facts)                    # what the stores, the target cache and the sidecar embed

`FrozenBase` reads as the transformers causal LM it holds (`model`, `lm_head`, `config`, a call
runs its forward), so the base's compute (`base.generate`, `base.fastbase`, `base.fastdecode`,
the targets) takes it where it took the module. What the opening decided is a typed field of it:
nothing is set on the module or its config to be read back later.

`BaseIdentity` holds every setting that changes what the base computes (the checkpoint's
fingerprint and vocabulary, the dtype, the attention backend, the activations' emulated rounding);
a setting that does not (keeping an FP8 base's weights in FP8, bit-identical; sharding, whose
gathered layers compute what the whole ones do) stays out of it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from occamy_mtp import families
from occamy_mtp import files as files_module
from occamy_mtp.config import ConfigError, ModelSettings
from occamy_mtp.memory import held_bytes
from occamy_mtp.model import checkpoint as ckpt_io
from occamy_mtp.model import quantized
from occamy_mtp.model.sharding import ENGINE_NAMES, Sharding, placement, shard, shard_layer
from occamy_mtp.base import joined
from occamy_mtp.base.tuning import use_tuned_kernel_configs

Log = Callable[[str], None]


def _quiet(message: str) -> None:
    """No log."""


class BaseFacts:
    """What a run reads about its base, once: its config (`checkpoint.read_config`), its quantization
    (`checkpoint.quantization_of`, refused here when unsupported) and, when first asked, its
    fingerprint (`checkpoint.checkpoint_fingerprint`, which samples every weight file)."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        if not self.directory.exists():
            raise ConfigError(f"model.base: {self.directory}: no such directory (a checkpoint directory holding config.json is expected)")
        self.config = ckpt_io.read_config(self.directory)
        self.quantization = ckpt_io.quantization_of(self.directory, self.config)
        """How the base's weights are stored (`model.quantized.Scheme`; None: unquantized), its scales checked."""

    @property
    def text_config(self):
        return self.config.text_config

    @functools.cached_property
    def fingerprint(self) -> dict:
        return ckpt_io.checkpoint_fingerprint(self.directory)


def emulated_activations(model: ModelSettings, facts: BaseFacts) -> str | None:
    """How the base's activations are rounded where the library emulates it beyond its weights
    (`quantized.emulated_activations`): part of the identity, since it changes what the base computes."""
    return quantized.emulated_activations(model.fp8_activations, facts.quantization)


@dataclass(frozen=True)
class BaseIdentity:
    """Everything that changes what the base computes (module docstring). The self-generated stores
    (`selfgen.store.store_identity`), the target cache (`targets.cache.cache_identity`) and the
    regenerate sidecar (`selfgen.regenerate`) embed it whole and compare it whole on resume."""

    fingerprint: dict
    """`checkpoint.checkpoint_fingerprint`: the config, the index and a sample of every weight file."""
    vocab_size: int
    dtype: str
    """`model.dtype`: the frozen weights' and the activations' dtype."""
    attn_implementation: str
    """`model.attn_implementation`."""
    activations: str | None = None
    """How the activations are rounded where the library emulates it (`emulated_activations`; None: as computed)."""

    @classmethod
    def of(cls, model: ModelSettings, facts: BaseFacts) -> "BaseIdentity":
        """The identity of the base `model` (the model settings) opens, from its `facts`: known before it loads."""
        return cls(facts.fingerprint, int(facts.text_config.vocab_size), model.dtype, model.attn_implementation,
                   emulated_activations(model, facts))

    @property
    def config_sha256(self) -> str:
        return self.fingerprint["config_sha256"]

    @property
    def weights_sample_sha256(self) -> str:
        return self.fingerprint["weights_sample_sha256"]

    def settings(self) -> dict:
        """The fields beside the fingerprint; `activations` left out where none are emulated (as every
        store, cache and sidecar written before it was recorded)."""
        out = {"vocab_size": self.vocab_size, "dtype": self.dtype, "attn_implementation": self.attn_implementation}
        if self.activations is not None:
            out["activations"] = self.activations
        return out


@dataclass(frozen=True)
class Placement:
    """Where the base's weights are (`sharding.placement`)."""

    sharded_over: int = 0
    """Processes its decoder layers are sharded over (0: whole in this process)."""
    offload: bool = False
    """Its layers' shards are in host memory, each copied to the card for its forward."""
    engine: str | None = None
    """What shards them (`sharding.FSDP2` or `sharding.ZERO3`; None when whole)."""

    def to_dict(self) -> dict:
        return {"sharded_over": self.sharded_over, "offload": self.offload, "engine": self.engine}

    def described(self, device) -> str:
        """In words, for the log."""
        if not self.sharded_over:
            return f"whole, on {device}"
        at = "in host memory, a layer copied to the card for its forward" if self.offload else f"on {device}"
        count = self.sharded_over
        return f"its decoder layers sharded over {count} process{'es' * (count != 1)} ({ENGINE_NAMES[self.engine]}), {at}"


class FrozenBase:
    """The frozen base as opened (`open`), reading as the causal LM it holds (module docstring)."""

    def __init__(self, module: torch.nn.Module, settings: ModelSettings | None = None, facts: BaseFacts | None = None, *,
                 placement: Placement = Placement(), emulated: str | None = None, fp8_layers: int = 0):
        self.module = module
        """The transformers causal LM, frozen and in eval mode."""
        self.settings = settings
        """The model settings it was opened with; None for a base built in memory (`in_memory`)."""
        self.facts = facts
        """Its checkpoint's config and quantization (`BaseFacts`); None for a base built in memory."""
        self.placement = placement
        self.emulated = emulated
        """The rounding its linears' inputs take in their forwards beyond the weights' format: "nvfp4" (an
        NVFP4 base, always), "fp8" (an FP8 base under `model.fp8_activations` fp8), or None."""
        self.fp8_layers = fp8_layers
        """Decoder layers that keep an FP8 checkpoint's weights in FP8 (`model.fp8_weights`)."""
        self.fast_paths = families.fast_paths(module.config) and emulated is None and not placement.sharded_over
        """Whether the library's fast paths (the packed pass, the static decoder), which read the weights
        directly, run it: its family has them, no input is fake-quantized (they would skip the emulation's
        hooks) and its layers are whole."""
        if self.fast_paths:
            joined.lay_out(module)
        self.joined_groups = joined.joined_groups(module) if self.fast_paths else 0
        """Groups of projections of one input laid out as one weight as it opened (`joined.lay_out`: each
        Gated DeltaNet's four, each attention layer's three, each MoE block's router and shared-expert
        inputs), which the static decoder reads in one GEMM each; 0 where the fast paths do not run it.
        Laid out here, before anything captures a graph of the base."""

    @property
    def quantization(self):
        """How its checkpoint stores the weights (`quantized.Scheme`; None: unquantized or built in memory)."""
        return None if self.facts is None else self.facts.quantization

    @functools.cached_property
    def identity(self) -> BaseIdentity | None:
        """What it computes (`BaseIdentity`), when first asked: its fingerprint samples every weight file,
        which a caller that writes no store (validate, the reference server) never needs; None in memory."""
        return None if self.facts is None else BaseIdentity.of(self.settings, self.facts)

    @classmethod
    def open(cls, model: ModelSettings, device, sharding: Sharding | None = None, facts: BaseFacts | None = None,
             log: Log = _quiet) -> "FrozenBase":
        """The frozen base of `model` (the model settings: the directory, dtype, attention backend, FP8
        weights and activations) on `device`; with `sharding` (the launch's) read a decoder layer at a
        time into host memory, each sharded over the processes as soon as it is read (each process
        keeps its shard, on `device` or in host memory). `facts`: the base's, when the caller has them."""
        facts = facts or BaseFacts(model.base)
        files = ckpt_io.SafetensorsCheckpoint(Path(model.base)).files()
        size = files_module.size_text(sum(f.stat().st_size for f in files))
        load_to = "cpu" if sharding is not None else device
        log(f"base: loading {model.base} ({len(files)} safetensors files, {size}) to {load_to} as {model.dtype}")
        # Sharded, each layer is placed as it is read: no process holds the whole base.
        place_layer = None if sharding is None else functools.partial(shard_layer, sharding=sharding, device=torch.device(device))
        module, loaded = ckpt_io.open_base(model.base, dtype=ckpt_io.DTYPES[model.dtype], device=load_to,
                                           attn_implementation=model.attn_implementation, config=facts.config,
                                           place_layer=place_layer, fp8_weights=model.fp8_weights,
                                           fp8_activations=model.fp8_activations)
        if loaded.fp8_layers:
            log(f"base: {loaded.fp8_layers} decoder layers keep their weights in FP8 (model.fp8_weights {model.fp8_weights}), "
                f"each layer's written in {model.dtype} for its forward; the base holds {held_bytes(module) / 2**30:.2f} GiB")
        elif sharding is not None and model.fp8_weights == "fp8":
            log("base: model.fp8_weights fp8 does not apply to a sharded base: its layers are read dequantized, then sharded")
        if sharding is not None:
            module = shard(module, sharding, torch.device(device))
        base = cls(module, model, facts, placement=Placement(**placement(module)), emulated=loaded.emulated,
                   fp8_layers=loaded.fp8_layers)
        if sharding is not None:
            log(f"base: {base.described()}")
        tuned = use_tuned_kernel_configs(torch.device(device))
        if tuned:
            log(tuned)
        return base

    @classmethod
    def in_memory(cls, module: torch.nn.Module) -> "FrozenBase":
        """A base built in memory rather than opened from a checkpoint (tests, benches): whole, its forward
        transformers' own, its identity unknown."""
        return cls(module.requires_grad_(False).eval())

    # The causal LM it holds, read as itself.
    @property
    def model(self):
        return self.module.model

    @property
    def lm_head(self):
        return self.module.lm_head

    @property
    def config(self):
        return self.module.config

    @property
    def device(self) -> torch.device:
        return self.module.lm_head.weight.device

    @property
    def forward(self):
        return self.module.forward

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def modules(self):
        return self.module.modules()

    def named_modules(self, *args, **kwargs):
        return self.module.named_modules(*args, **kwargs)

    def parameters(self, recurse: bool = True):
        return self.module.parameters(recurse)

    def named_parameters(self, *args, **kwargs):
        return self.module.named_parameters(*args, **kwargs)

    def buffers(self, recurse: bool = True):
        return self.module.buffers(recurse)

    def described(self) -> str:
        """Where its weights are, in words, for the log."""
        return self.placement.described(self.device)


def runs_fast_paths(base) -> bool:
    """Whether the library's fast paths run `base`: what its opening decided (`FrozenBase.fast_paths`);
    a bare module (a test's or a bench's) by its family alone (`families.fast_paths`), taken as whole
    and computing transformers' own forward: the library opens its bases through `FrozenBase.open`,
    which knows when they are sharded or their inputs fake-quantized."""
    return base.fast_paths if isinstance(base, FrozenBase) else families.fast_paths(base.config)
