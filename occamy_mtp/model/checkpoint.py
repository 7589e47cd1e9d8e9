"""Checkpoint I/O: configs, lazy safetensors reading, key renaming, expert layouts.

The on-disk layouts this module accepts are those of docs/reference/CONTRACT.md section 3:

* base text weights under `model.language_model.*` (multimodal checkpoint) or
  `model.*` (text-only), plus `lm_head.weight`; `model.visual.*` is never loaded;
* the head under `mtp.*`, with routed experts either per expert
  (`mtp.layers.0.mlp.experts.{e}.{gate,up,down}_proj.weight`, Qwen3.5 / Qwen3-Next)
  or fused (`...experts.gate_up_proj` [E, 2I, D] gate rows first, `...experts.down_proj`
  [E, D, I], Qwen3.6), which is also transformers' in-memory layout;
* sharded safetensors with `model.safetensors.index.json`, or one `model.safetensors`.

Nothing here writes into a checkpoint directory that it reads; what it writes goes
through `occamy_mtp.files`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import torch
from safetensors import safe_open

from occamy_mtp.errors import OccamyError
from occamy_mtp.families import FAMILIES, MULTIMODAL_TYPES, family_of
from occamy_mtp import files
from occamy_mtp.files import save_safetensors, sha256_file, write_json
from occamy_mtp.model.fp8_weights import ATTRIBUTE as FP8_KEPT, keep_layer, keeps_fp8
from occamy_mtp.model.quantized import (FP8, DequantizedCheckpoint, dequantized, emulate_activations, emulate_fp8_activations,
                                        emulated_activations)


INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
HEAD_PREFIX = "mtp."
HEAD_FILE = "mtp-trained.safetensors"  # what export.py writes into output.dir: the trained head's tensors
HEAD_CONFIG_FILE = "mtp_head_config.json"  # beside it: what a reader needs to rebuild the head
EXPORT_RECORD = "TRAINING.json"  # beside it: the export's record, with the sha256 of the head and its config
EXPORT_INCOMPLETE = ".export-incomplete"  # beside it while export renames its outputs into place
MULTIMODAL_TEXT_PREFIX = "model.language_model."
TEXT_PREFIX = "model."
LAYERS_PREFIX = "model.layers."  # a base's decoder layers, by module name
VISION_PREFIX = "model.visual."

# What an MTP head's tensors may be stored in (safetensors' names): a float the head can run in.
HEAD_DISK_DTYPES = ("BF16", "F16", "F32")
# The dtypes a run config may name (model.dtype), by name.
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

FUSED = "fused"
PER_EXPERT = "per_expert"
EXPERT_LAYOUTS = (FUSED, PER_EXPERT)


_PER_EXPERT_KEY = re.compile(r"^(?P<stem>.*\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_FUSED_KEY = re.compile(r"^(?P<stem>.*\.mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)$")


def module_tensor_name(key: str) -> str:
    """The module tensor a checkpoint key is read into: a per-expert key's fused stack
    (`...mlp.experts.gate_up_proj` or `...down_proj`), any other key itself."""
    per_expert = _PER_EXPERT_KEY.match(key)
    if per_expert is None:
        return key
    return f"{per_expert['stem']}.{'down_proj' if per_expert['proj'] == 'down_proj' else 'gate_up_proj'}"


class CheckpointError(OccamyError, ValueError):
    """A checkpoint that is not what it claims to be: names the file and tensor."""


def save_sharded(
    directory: Path, tensors: Mapping[str, torch.Tensor], max_shard_bytes: int, name: str = "model"
) -> dict[str, str]:
    """Write `tensors` as `{name}-0000i-of-0000n.safetensors` plus `{name}.safetensors.index.json`.

    Tensors are assigned to shards in key order. Returns the weight map.
    """
    directory = Path(directory)
    shards: list[list[str]] = [[]]
    shard_bytes = 0
    for key in sorted(tensors):
        nbytes = tensors[key].numel() * tensors[key].element_size()
        if shards[-1] and shard_bytes + nbytes > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(key)
        shard_bytes += nbytes
    weight_map: dict[str, str] = {}
    total = 0
    for number, keys in enumerate(shards, start=1):
        filename = f"{name}-{number:05d}-of-{len(shards):05d}.safetensors"
        save_safetensors(directory / filename, {k: tensors[k] for k in keys})
        for k in keys:
            weight_map[k] = filename
            total += tensors[k].numel() * tensors[k].element_size()
    write_json(directory / f"{name}.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
    return weight_map


# ----------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------


class SafetensorsCheckpoint:
    """Lazy, tensor-by-tensor access to a checkpoint directory (index or single file).

    Shapes and dtypes come from the file headers, so inspecting a 70 GB checkpoint
    reads no weights. `get` reads one tensor at a time.
    """

    def __init__(self, path: Path):
        path = Path(path)
        if path.is_file():  # one bare .safetensors file, e.g. mtp-trained.safetensors
            self.directory = path.parent
            self.index: Path | None = None
            self.weight_map = {k: path.name for k in self._open(path).keys()}
            self._handles: dict[str, object] = {}
            return
        self.directory = path
        index_path = self.directory / INDEX_NAME
        single_path = self.directory / SINGLE_NAME
        if not path.exists():
            raise CheckpointError(f"{path}: no such checkpoint directory or file")
        self.index = index_path if index_path.is_file() else None
        """The index the weight map was read from (None: one file)."""
        if index_path.is_file():
            self.weight_map = self._read_index(index_path)
        elif single_path.is_file():
            self.weight_map = {k: SINGLE_NAME for k in self._open(single_path).keys()}
        else:
            raise CheckpointError(
                f"{self.directory}: no {INDEX_NAME} and no {SINGLE_NAME}; not a safetensors checkpoint directory"
            )
        self._handles: dict[str, object] = {}

    def _read_index(self, index_path: Path) -> dict[str, str]:
        index = files.read_json_object(index_path, CheckpointError, "JSON of a safetensors index")
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index_path}: expected an object with a 'weight_map' of tensor name -> file name")
        for filename in sorted(set(weight_map.values())):
            shard = self.directory / filename
            if not shard.is_file():
                raise CheckpointError(f"{index_path}: names shard {filename!r}, which does not exist in {self.directory}")
        # The index must not promise tensors that a shard lacks.
        for filename in sorted(set(weight_map.values())):
            present = set(self._open(self.directory / filename).keys())
            promised = {k for k, f in weight_map.items() if f == filename}
            missing = sorted(promised - present)
            if missing:
                raise CheckpointError(
                    f"{index_path}: maps {missing[0]!r} (and {len(missing) - 1} more) to {filename}, which does not contain it"
                )
        return dict(weight_map)

    @staticmethod
    def _open(path: Path):
        try:
            return safe_open(str(path), framework="pt")
        except Exception as err:  # safetensors raises its own error types
            raise CheckpointError(f"{path}: cannot be read as safetensors ({err})") from None

    def _handle(self, key: str):
        filename = self.weight_map[key]
        if filename not in self._handles:
            self._handles[filename] = self._open(self.directory / filename)
        return self._handles[filename]

    def keys(self) -> list[str]:
        return list(self.weight_map)

    def __contains__(self, key: str) -> bool:
        return key in self.weight_map

    def file_of(self, key: str) -> Path:
        return self.directory / self.weight_map[key]

    def files(self) -> list[Path]:
        return [self.directory / f for f in sorted(set(self.weight_map.values()))]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._handle(key).get_slice(key).get_shape())

    def dtype(self, key: str) -> str:
        return self._handle(key).get_slice(key).get_dtype()

    def get(self, key: str) -> torch.Tensor:
        return self._handle(key).get_tensor(key)


# ----------------------------------------------------------------------------------
# Configs
# ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelConfig:
    """What config.json says, resolved to the text model's config."""

    path: Path
    text_config: object  # the family's text config class (`families`)
    raw: dict
    multimodal: bool
    quantization_config: dict | None = None

    @property
    def has_mtp(self) -> bool:
        return int(getattr(self.text_config, "mtp_num_hidden_layers", 0) or 0) > 0


# Bytes hashed at the start, middle and end of every tensor for `checkpoint_fingerprint`.
FINGERPRINT_BLOCK_BYTES = 1024  # 512 bf16 values: a changed matrix cannot keep them all
FINGERPRINT_METHOD = f"safetensors header + first/middle/last {FINGERPRINT_BLOCK_BYTES} bytes of every tensor"


def safetensors_fingerprint(path: Path) -> str:
    """sha256 of a safetensors file's header and of three sampled blocks of every tensor."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        (header_bytes,) = struct.unpack("<Q", handle.read(8))
        header = handle.read(header_bytes)
        digest.update(header)
        data_start = 8 + header_bytes
        entries = json.loads(header)
        for name in sorted(k for k in entries if k != "__metadata__"):
            begin, end = entries[name]["data_offsets"]
            size = end - begin
            block = min(FINGERPRINT_BLOCK_BYTES, size)
            for offset in sorted({0, (size - block) // 2, size - block}):
                handle.seek(data_start + begin + offset)
                digest.update(handle.read(block))
    return digest.hexdigest()


def checkpoint_fingerprint(directory: str | Path) -> dict:
    """The identity of a checkpoint that is cheap at 67 GB, without its path (a moved base still matches).

    sha256 of config.json and of the index; per safetensors file its name, size and
    `safetensors_fingerprint`; `weights_sample_sha256` over all of them. It detects any
    change to the config, the file set, a tensor's name, dtype or shape, and any change
    of values that touches a sampled block, which every fine-tune, merged adapter,
    re-cast or re-quantisation does. It is a guard for caches, stores and resumes, not a
    content hash: TRAINING.json keeps the full sha256 of every file.
    """
    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{directory}: no config.json; not a checkpoint directory")
    index_path = directory / INDEX_NAME
    files = [{"name": f.name, "bytes": f.stat().st_size, "fingerprint": safetensors_fingerprint(f)}
             for f in SafetensorsCheckpoint(directory).files()]
    return {
        "config_sha256": sha256_file(config_path),
        "index_sha256": sha256_file(index_path) if index_path.is_file() else None,
        "method": FINGERPRINT_METHOD,
        "files": files,
        "weights_sample_sha256": hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest(),
    }


def text_config_from_dict(text: dict, source: str = "config"):
    """Build the transformers text config class named by `text['model_type']`."""
    model_type = text.get("model_type")
    family = family_of(model_type)
    if family is None:
        raise CheckpointError(f"{source}: text model_type {model_type!r} is not supported; expected one of {sorted(FAMILIES)}")
    fields = {k: v for k, v in text.items() if k not in ("model_type", "architectures", "transformers_version")}
    config_class = family.cls("config_class")
    _check_field_types(config_class, fields, source)
    try:
        return config_class(**fields)
    except Exception as err:  # noqa: BLE001 - transformers' own checks (ValueError, TypeError, its strict-dataclass errors)
        reason = " ".join(str(err).split())
        raise CheckpointError(f"{source}: invalid {model_type} text config ({reason})") from None


# What a JSON value of each default's type may be: an int field takes no bool, a float field takes an int.
_JSON_KINDS = {bool: ((bool,), "true or false"), int: ((int,), "an integer"), float: ((int, float), "a number"),
               str: ((str,), "a string"), list: ((list,), "a list"), dict: ((dict,), "an object")}


@functools.cache
def _field_defaults(config_class) -> dict:
    return config_class().to_dict()


def _check_field_types(config_class, fields: dict, source: str) -> None:
    """Refuse a field whose JSON type is not its default's (`"hidden_size": "64"`), naming the field
    and the type expected; transformers would stop with a traceback, or build a model that fails later.
    A null passes (transformers fills in its own default), and so does a field the class does not know."""
    defaults = _field_defaults(config_class)
    for name, value in fields.items():
        default = defaults.get(name)
        if default is None or value is None or type(default) not in _JSON_KINDS:
            continue
        kinds, expected = _JSON_KINDS[type(default)]
        if not isinstance(value, kinds) or (bool not in kinds and isinstance(value, bool)):
            raise CheckpointError(f"{source}: text config field {name!r} is {json.dumps(value)} "
                                  f"({type(value).__name__}); {expected} is expected")


def declared_quantization(raw: dict):
    """What a config.json declares as its `quantization_config`: at its top level, else in its
    `text_config` (None: nothing)."""
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    return raw.get("quantization_config") or text.get("quantization_config")


def read_config(path: Path) -> ModelConfig:
    """Read a checkpoint directory's config.json (or a bare config.json path)."""
    path = Path(path)
    config_path = path / "config.json" if path.is_dir() else path
    if not config_path.is_file():
        raise CheckpointError(f"{config_path}: no such config file")
    raw = files.read_json_object(config_path, CheckpointError, "JSON of a model config")
    multimodal = "text_config" in raw
    if multimodal:
        if not isinstance(raw["text_config"], dict):
            raise CheckpointError(f"{config_path}: text_config is {type(raw['text_config']).__name__}; "
                                  "an object of the text model's fields is expected")
        text = dict(raw["text_config"])
        text.setdefault("model_type", MULTIMODAL_TYPES.get(raw.get("model_type"), raw.get("model_type")))
    else:
        text = dict(raw)
        text["model_type"] = MULTIMODAL_TYPES.get(text.get("model_type"), text.get("model_type"))
    text_config = text_config_from_dict(text, source=str(config_path))
    quantization = declared_quantization(raw)
    if quantization is not None and not isinstance(quantization, dict):
        raise CheckpointError(f"{config_path}: quantization_config is {type(quantization).__name__}; an object is expected")
    return ModelConfig(config_path, text_config, raw, multimodal, quantization)


# ----------------------------------------------------------------------------------
# Expert layouts
# ----------------------------------------------------------------------------------


def fused_to_per_expert(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """Split a fused `...experts.gate_up_proj` [E, 2I, D] or `...experts.down_proj` [E, D, I]."""
    match = _FUSED_KEY.match(name)
    if match is None:
        raise ValueError(f"{name} is not a fused expert tensor")
    stem, proj = match["stem"], match["proj"]
    out = {}
    if proj == "gate_up_proj":
        intermediate = tensor.shape[1] // 2
        for e in range(tensor.shape[0]):
            out[f"{stem}.{e}.gate_proj.weight"] = tensor[e, :intermediate]
            out[f"{stem}.{e}.up_proj.weight"] = tensor[e, intermediate:]
    else:
        for e in range(tensor.shape[0]):
            out[f"{stem}.{e}.down_proj.weight"] = tensor[e]
    return out


def to_checkpoint_layout(tensors: Mapping[str, torch.Tensor], layout: str) -> dict[str, torch.Tensor]:
    """Module-layout (fused) tensors -> the on-disk expert layout."""
    if layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert layout must be one of {EXPERT_LAYOUTS}, got {layout!r}")
    if layout == FUSED:
        return dict(tensors)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if _FUSED_KEY.match(name):
            out.update(fused_to_per_expert(name, tensor))
        else:
            out[name] = tensor
    return out


@dataclass
class _Source:
    """How one module tensor is read: directly, or stacked from per-expert tensors."""

    keys: list[str]
    kind: str  # "direct", "gate_up", "down"


def _module_sources(module_shapes: Mapping[str, tuple], disk_keys: set[str], disk_prefix: str) -> tuple[dict[str, _Source], str | None]:
    """Map each module tensor name to the checkpoint keys it is read from.

    Returns (sources, layout) where layout is the expert layout found (None if the
    module has no experts). Missing keys are reported by the caller.
    """
    sources: dict[str, _Source] = {}
    layouts: dict[str, str] = {}  # layout -> one disk key found in it, for the error message
    for name, shape in module_shapes.items():
        fused = _FUSED_KEY.match(name)
        if fused and disk_prefix + name not in disk_keys:
            stem, proj = fused["stem"], fused["proj"]
            num_experts = shape[0]
            if proj == "gate_up_proj":
                keys = [f"{disk_prefix}{stem}.{e}.{p}.weight" for e in range(num_experts) for p in ("gate_proj", "up_proj")]
                sources[name] = _Source(keys, "gate_up")
            else:
                keys = [f"{disk_prefix}{stem}.{e}.down_proj.weight" for e in range(num_experts)]
                sources[name] = _Source(keys, "down")
            found = [k for k in keys if k in disk_keys]
            if found:
                layouts.setdefault(PER_EXPERT, found[0])
        else:
            sources[name] = _Source([disk_prefix + name], "direct")
            if fused:
                layouts.setdefault(FUSED, disk_prefix + name)
    if len(layouts) > 1:
        raise CheckpointError(
            f"checkpoint mixes fused and per-expert tensors under {disk_prefix!r}: "
            f"{layouts[FUSED]} is fused but {layouts[PER_EXPERT]} is per-expert; use one expert layout"
        )
    return sources, (next(iter(layouts)) if layouts else None)


def _expected_disk_shapes(name: str, shape: tuple, source: _Source) -> dict[str, tuple]:
    if source.kind == "direct":
        return {source.keys[0]: tuple(shape)}
    if source.kind == "gate_up":
        num_experts, two_i, hidden = shape
        return {k: (two_i // 2, hidden) for k in source.keys}
    num_experts, hidden, intermediate = shape
    return {k: (hidden, intermediate) for k in source.keys}


def _read_source(ckpt: SafetensorsCheckpoint, source: _Source, dtype: torch.dtype, device) -> torch.Tensor:
    if source.kind == "direct":
        return ckpt.get(source.keys[0]).to(device=device, dtype=dtype)
    first = ckpt.shape(source.keys[0])
    if source.kind == "gate_up":
        num_experts = len(source.keys) // 2
        out = torch.empty(num_experts, 2 * first[0], first[1], dtype=dtype, device=device)
        for e in range(num_experts):
            out[e, : first[0]] = ckpt.get(source.keys[2 * e]).to(device=device, dtype=dtype)
            out[e, first[0] :] = ckpt.get(source.keys[2 * e + 1]).to(device=device, dtype=dtype)
        return out
    out = torch.empty(len(source.keys), *first, dtype=dtype, device=device)
    for e, key in enumerate(source.keys):
        out[e] = ckpt.get(key).to(device=device, dtype=dtype)
    return out


FINITE_CHECK_ELEMENTS = 2**26  # a weight is checked this many elements at a time: a bounded temporary


def _refuse_non_finite(tensor: torch.Tensor, ckpt, source: _Source) -> None:
    """CheckpointError naming the checkpoint tensor(s) when `tensor`, a base weight as loaded (or its FP8
    codes as kept), holds a NaN or an infinity: one read of the weight on the device it loads to, a
    bounded temporary at a time, so that a corrupt base is refused at its load, not found in the
    head's loss hours later."""
    flat = tensor.detach().reshape(-1)
    fp8 = flat.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    for start in range(0, flat.numel(), FINITE_CHECK_ELEMENTS):
        chunk = flat[start:start + FINITE_CHECK_ELEMENTS]
        if fp8:  # e4m3fn's only non-finite code is NaN, 0x7F / 0xFF
            bad = bool(((chunk.view(torch.uint8) & 0x7F) == 0x7F).any()) if flat.dtype == torch.float8_e4m3fn else \
                not bool(torch.isfinite(chunk.float()).all())
        else:
            bad = not bool(torch.isfinite(chunk).all())
        if bad:
            keys = ", ".join(source.keys[:2]) + (", ..." if len(source.keys) > 2 else "")
            raise CheckpointError(f"{ckpt.directory}: {keys} holds NaN or infinite values (a corrupt or badly converted "
                                  "checkpoint): the base must be finite to train on it")


def _read_fp8_source(ckpt, source: _Source, device) -> tuple[torch.Tensor, tuple[int, ...], tuple[torch.Tensor, ...]]:
    """An FP8 weight as stored, stacked as `_read_source` stacks it: (float8_e4m3fn codes of the module
    tensor's shape, each row part's rows, each part's multipliers). A fused gate_up_proj has two parts,
    gate's rows and up's, each with the blocks its own checkpoint tensor has."""
    if source.kind == "direct":
        codes, scale = ckpt.fp8_codes(source.keys[0])
        return codes.to(device), (codes.shape[-2],), (scale.to(device),)
    read = [ckpt.fp8_codes(key) for key in source.keys]
    if source.kind == "down":
        return (torch.stack([c for c, _ in read]).to(device), (read[0][0].shape[-2],),
                (torch.stack([m for _, m in read]).to(device),))
    gate, up = read[0::2], read[1::2]
    codes = torch.stack([torch.cat([g, u]) for (g, _), (u, _) in zip(gate, up)]).to(device)
    rows = read[0][0].shape[-2]
    return codes, (rows, rows), (torch.stack([m for _, m in gate]).to(device), torch.stack([m for _, m in up]).to(device))


@dataclass
class LoadReport:
    """What a load found: every problem (not only the first), and the layout."""

    layout: str | None = None
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)

    @property
    def problems(self) -> list[str]:
        return self.missing + self.unexpected + self.mismatched


def check_tensors(
    ckpt: SafetensorsCheckpoint, module_shapes: Mapping[str, tuple], disk_prefix: str, disk_keys: set[str]
) -> tuple[dict[str, _Source], LoadReport]:
    """Match module tensors against checkpoint keys under `disk_prefix`; collect every problem."""
    sources, layout = _module_sources(module_shapes, disk_keys, disk_prefix)
    report = LoadReport(layout=layout)
    expected: dict[str, tuple] = {}
    for name, shape in module_shapes.items():
        expected.update(_expected_disk_shapes(name, shape, sources[name]))
    for key, shape in expected.items():
        if key not in disk_keys:
            report.missing.append(f"missing tensor {key} (expected shape {list(shape)}) in {ckpt.directory}")
            continue
        found = ckpt.shape(key)
        if tuple(found) != tuple(shape):
            report.mismatched.append(
                f"tensor {key} in {ckpt.file_of(key)} has shape {list(found)}, expected {list(shape)}"
            )
    for key in sorted(disk_keys - set(expected)):
        report.unexpected.append(f"unexpected tensor {key} (shape {list(ckpt.shape(key))}) in {ckpt.file_of(key)}")
    return sources, report


# ----------------------------------------------------------------------------------
# The head's tensors
# ----------------------------------------------------------------------------------


def head_module_shapes(head: torch.nn.Module) -> dict[str, tuple]:
    return {name: tuple(t.shape) for name, t in head.state_dict().items()}


def head_disk_keys(ckpt: SafetensorsCheckpoint) -> set[str]:
    return {k for k in ckpt.keys() if k.startswith(HEAD_PREFIX)}


def no_head_message(ckpt: SafetensorsCheckpoint) -> str:
    """Where a checkpoint without `mtp.*` tensors was looked in, and any file beside it that holds some."""
    read = sorted(set(ckpt.weight_map.values()))
    where = (f"that {ckpt.index.name} maps, in {', '.join(read)}" if ckpt.index else f"in {ckpt.directory / read[0]}"
             ) if read else "(none)"
    message = f"{ckpt.directory}: no {HEAD_PREFIX}* tensors among the {len(ckpt.weight_map)} tensors {where}; " \
              "this checkpoint carries no MTP head"
    if ckpt.index is None:
        return message
    elsewhere = []
    for other in sorted(ckpt.directory.glob("*.safetensors")):
        if other.name in read:
            continue
        try:
            found = sum(k.startswith(HEAD_PREFIX) for k in SafetensorsCheckpoint._open(other).keys())
        except CheckpointError:
            continue
        if found:
            elsewhere.append(f"{other.name} ({found} {HEAD_PREFIX}* tensors)")
    if elsewhere:
        message += (f". But {', '.join(elsewhere)} in the same directory " + ("is" if len(elsewhere) == 1 else "are")
                    + f" not listed in {INDEX_NAME}: add its tensors to the index's weight_map, or give that file "
                    "itself as the head (model.donor_head)")
    return message


def _head_sources(ckpt: SafetensorsCheckpoint, head: torch.nn.Module) -> tuple[dict[str, _Source], LoadReport]:
    """Where each of `head`'s tensors lies in `ckpt`, from the headers alone: any missing, unexpected,
    mis-shaped or non-float `mtp.*` tensor is a CheckpointError listing all of them."""
    disk_keys = head_disk_keys(ckpt)
    if not disk_keys:
        raise CheckpointError(no_head_message(ckpt))
    sources, report = check_tensors(ckpt, head_module_shapes(head), HEAD_PREFIX, disk_keys)
    if report.problems:
        raise CheckpointError("MTP head checkpoint does not match the model config:\n  " + "\n  ".join(report.problems))
    not_float = sorted(k for k in disk_keys if ckpt.dtype(k) not in HEAD_DISK_DTYPES)
    if not_float:
        raise CheckpointError(f"{ckpt.file_of(not_float[0])}: {not_float[0]} is {ckpt.dtype(not_float[0])} "
                              f"({len(not_float)} tensors so); an MTP head is stored in {', '.join(HEAD_DISK_DTYPES)}")
    return sources, report


def head_checkpoint(source: Path):
    """The checkpoint a head is read from: one safetensors file, or a directory; a directory that is a
    quantized base (its config declares the scheme) reads its `mtp.*` tensors dequantized, when they
    are quantized there."""
    ckpt = SafetensorsCheckpoint(source)
    if not Path(source).is_dir():
        return ckpt
    config_path = Path(source) / "config.json"
    try:
        raw = json.loads(config_path.read_text()) if config_path.is_file() else {}
    except (OSError, ValueError, RecursionError):
        raw = {}  # not a base's config: nothing declares a quantization there
    return dequantized(ckpt, declared_quantization(raw if isinstance(raw, dict) else {}))


def check_head(source: Path, text_config) -> None:
    """What `load_head` checks that needs no tensor read (the export set, every `mtp.*` name, shape
    and dtype), so that a wrong head is refused before a base of minutes loads."""
    from occamy_mtp.model.head import MTPHead

    check_export_set(source)
    with torch.device("meta"):
        head = MTPHead(text_config)
    _head_sources(head_checkpoint(source), head)


def load_head_state(
    ckpt: SafetensorsCheckpoint, head: torch.nn.Module, dtype: torch.dtype = torch.bfloat16
) -> tuple[dict[str, torch.Tensor], str]:
    """Read every `mtp.*` tensor for `head` (either expert layout).

    Returns (state dict in the module's names, expert layout on disk). Any missing,
    unexpected or mis-shaped tensor is a CheckpointError listing all of them.
    """
    sources, report = _head_sources(ckpt, head)
    state = {name: _read_source(ckpt, source, dtype, "cpu") for name, source in sources.items()}
    broken = sorted(name for name, tensor in state.items() if not bool(torch.isfinite(tensor).all()))
    if broken:
        raise CheckpointError(f"{ckpt.directory}: the MTP head's {', '.join(broken[:3])} hold NaN or infinite values "
                              f"({len(broken)} tensors); a diverged training wrote them")
    return state, report.layout or FUSED


def head_checkpoint_tensors(state: Mapping[str, torch.Tensor], layout: str) -> dict[str, torch.Tensor]:
    """A head state dict -> `mtp.*` tensors in the given expert layout."""
    return {HEAD_PREFIX + k: v for k, v in to_checkpoint_layout(state, layout).items()}


# ----------------------------------------------------------------------------------
# The base model
# ----------------------------------------------------------------------------------


def base_model_class(text_config):
    """transformers' causal-LM class of the base, its Gated DeltaNet run on the kernels of the
    device of its input (`compat.route_kernels_by_device`: a CPU model next to CUDA and fla)."""
    from occamy_mtp.compat import route_kernels_by_device

    route_kernels_by_device()
    return family_of(text_config.model_type).cls("causal_lm")


def base_text_prefix(ckpt: SafetensorsCheckpoint) -> str:
    """`model.language_model.` for a multimodal checkpoint, else `model.`."""
    if any(k.startswith(MULTIMODAL_TEXT_PREFIX) for k in ckpt.keys()):
        return MULTIMODAL_TEXT_PREFIX
    return TEXT_PREFIX


def _base_disk_keys(ckpt: SafetensorsCheckpoint, prefix: str) -> set[str]:
    return {
        k
        for k in ckpt.keys()
        if (k.startswith(prefix) and not k.startswith(VISION_PREFIX)) or k == "lm_head.weight"
    }


def build_base_model(text_config, dtype: torch.dtype = torch.bfloat16, device="cpu", attn_implementation: str = "sdpa"):
    """An uninitialised base (meta tensors) ready for `load_base_weights`."""
    config = text_config
    config._attn_implementation = attn_implementation
    with torch.device("meta"):
        model = base_model_class(config)._from_config(config, dtype=dtype)
    return model


@dataclass(frozen=True)
class BaseLoad:
    """What reading a base decided beyond its weights (`open_base`)."""

    emulated: str | None
    """The rounding its linears' inputs take in their forwards: "nvfp4", "fp8" (W8A8), or None."""
    fp8_layers: int
    """Decoder layers that keep the checkpoint's FP8 weights in FP8."""


def load_base(directory: Path, dtype: torch.dtype = torch.bfloat16, device="cpu", attn_implementation: str = "sdpa",
              config=None, place_layer=None, fp8_weights: str = "auto", fp8_activations: str = "bf16"):
    """`open_base`'s model alone: the low-level read of a base for tests and benches; the library opens
    its base through `base.frozen.FrozenBase.open`, which records what the reading decided."""
    return open_base(directory, dtype, device, attn_implementation, config, place_layer, fp8_weights, fp8_activations)[0]


def open_base(directory: Path, dtype: torch.dtype = torch.bfloat16, device="cpu", attn_implementation: str = "sdpa",
              config=None, place_layer=None, fp8_weights: str = "auto", fp8_activations: str = "bf16"):
    """(model, `BaseLoad`): the frozen base text model read from a checkpoint directory.

    Tensors are read one at a time straight into the module (no second copy of a
    shard). Vision and `mtp.*` tensors are skipped. Missing, unexpected or mis-shaped
    text tensors are an error listing all of them. Returns the model in eval mode with
    every parameter frozen. `config`: the directory's `read_config`, when the caller has it.
    `place_layer(layer)`: called on each decoder layer as soon as its tensors are read, before
    the next layer's are (`sharding.shard_layer` keeps a process's shard of it, so that a
    process never holds the whole base).
    `fp8_weights` (`model.fp8_weights`): whether an FP8 base's decoder layers keep their weights
    in FP8 (`fp8_weights.keeps_fp8`), each layer's written in `dtype` for its forward; a sharded
    base (`place_layer`) is read dequantized, its shards being what saves the memory there.
    `fp8_activations` (`model.fp8_activations`): "fp8" quantizes an FP8 base's linear inputs as the
    engine's W8A8 path does (`quantized.emulate_fp8_activations`); "bf16" leaves them as computed.
    """
    config = config or read_config(directory)
    ckpt = dequantized(SafetensorsCheckpoint(directory), config.quantization_config)
    keep_fp8 = place_layer is None and getattr(ckpt, "scheme", None) is not None and ckpt.scheme.kind == FP8 \
        and keeps_fp8(fp8_weights, device)
    model = build_base_model(config.text_config, dtype, device, attn_implementation)
    load_base_weights(model, ckpt, dtype=dtype, device=device, place_layer=place_layer, keep_fp8=keep_fp8)
    emulated = None
    if getattr(ckpt, "input_scales", None):  # NVFP4: the engine's W4A4 path quantizes the inputs too
        if emulate_activations(model, ckpt.input_scales, base_text_prefix(ckpt), TEXT_PREFIX):
            emulated = ckpt.scheme.kind
    if emulated_activations(fp8_activations, getattr(ckpt, "scheme", None)):
        if emulate_fp8_activations(model, ckpt.fp8_input_features(), ckpt.scheme.block[1], base_text_prefix(ckpt), TEXT_PREFIX):
            emulated = FP8
    kept = sum(getattr(layer, FP8_KEPT, None) is not None for layer in model.model.layers)
    return model, BaseLoad(emulated, kept)


def quantization_of(directory: Path, config: ModelConfig):
    """The base's quantization (`quantized.Scheme`), every quantized weight's scales checked by name
    and shape from the headers alone; None when the base is not quantized. A scheme the library
    cannot read is a `quantized.QuantizationError` naming it and the supported ones."""
    readable = dequantized(SafetensorsCheckpoint(directory), config.quantization_config)
    if isinstance(readable, DequantizedCheckpoint):
        readable.check_scales()
    return getattr(readable, "scheme", None)


def load_base_weights(model, ckpt: SafetensorsCheckpoint, dtype: torch.dtype, device, place_layer=None,
                      keep_fp8: bool = False) -> LoadReport:
    prefix = base_text_prefix(ckpt)
    module_shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    if tied:
        module_shapes.pop("lm_head.weight", None)
    # Module names are `model.*` and `lm_head.weight`; disk names swap the `model.` prefix.
    renamed = {}
    for name, shape in module_shapes.items():
        disk = name if name == "lm_head.weight" else prefix + name[len(TEXT_PREFIX):]
        renamed[disk] = (name, shape)
    disk_keys = _base_disk_keys(ckpt, prefix)
    # _module_sources works on disk-relative names: use the disk names as "module" names with no prefix.
    sources, report = check_tensors(ckpt, {d: s for d, (n, s) in renamed.items()}, "", disk_keys)
    if report.problems:
        raise CheckpointError("base checkpoint does not match its config:\n  " + "\n  ".join(report.problems[:20]))
    # The tensors outside the decoder layers first, then a layer at a time (`open_base`'s `place_layer`);
    # check_tensors has found every one, so each part loads without the strict check.
    parts: dict[int | None, dict] = {}
    for disk, source in sources.items():
        name = renamed[disk][0]
        layer = name.split(".")[2] if name.startswith(LAYERS_PREFIX) else None
        parts.setdefault(None if layer is None else int(layer), {})[name] = source
    buffers: dict = {}  # kept in FP8, the layers share one buffer (`fp8_weights.keep_layer`)
    for index in sorted(parts, key=lambda i: -1 if i is None else i):
        fp8 = {}
        if keep_fp8 and index is not None:
            fp8 = {name: source for name, source in parts[index].items() if all(ckpt.is_fp8(k) for k in source.keys)}
        read = {name: _read_source(ckpt, source, dtype, device) for name, source in parts[index].items() if name not in fp8}
        for name, tensor in read.items():
            _refuse_non_finite(tensor, ckpt, parts[index][name])
        model.load_state_dict(read, strict=False, assign=True)
        if fp8:
            within = f"{LAYERS_PREFIX}{index}."
            held = {name[len(within):]: _read_fp8_source(ckpt, source, device) for name, source in fp8.items()}
            for name, (codes, _, _) in held.items():
                _refuse_non_finite(codes, ckpt, fp8[within + name])
            keep_layer(model.model.layers[index], held, ckpt.scheme.block, dtype, buffers)
        if index is not None and place_layer is not None:
            layer = model.model.layers[index]
            place_layer(layer.requires_grad_(False).eval())
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    _rebuild_rotary(model, device)
    model.requires_grad_(False)
    model.eval()
    return report


def _rebuild_rotary(model, device) -> None:
    """Rotary buffers are not in checkpoints (persistent=False): recompute them on `device`."""
    rotary = model.model.rotary_emb
    with torch.device(device):
        model.model.rotary_emb = type(rotary)(model.config)


def base_checkpoint_tensors(model, layout: str, multimodal: bool) -> dict[str, torch.Tensor]:
    """A base model's state dict -> on-disk names and expert layout (for fixtures and tests)."""
    prefix = MULTIMODAL_TEXT_PREFIX if multimodal else TEXT_PREFIX
    out = {}
    state = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    for name, tensor in to_checkpoint_layout(state, layout).items():
        out[name if name == "lm_head.weight" else prefix + name[len(TEXT_PREFIX):]] = tensor
    return out


_EXPORT_HASHES: dict[str, str] = {}
"""sha256 of the heads checked in this process, by path, size and mtime (`files.hash_cache_key`):
a reader that checks before the base loads and again in `load_head` reads a head once."""


def check_export_set(source: Path) -> None:
    """Refuse a head whose directory holds an export that is not one set: interrupted between
    its renames (EXPORT_INCOMPLETE is there), or a head (or head config) whose bytes are not
    the ones its TRAINING.json records. Heads without a record beside them are not checked."""
    source = Path(source)
    directory = source.parent if source.is_file() else source
    if (directory / EXPORT_INCOMPLETE).exists():
        raise CheckpointError(f"{directory}: an export into it was interrupted ({EXPORT_INCOMPLETE} is there), so its head, "
                              f"config and {EXPORT_RECORD} may be from different exports; run export.py again")
    record_path = directory / EXPORT_RECORD
    if not record_path.is_file():
        return
    try:
        recorded = json.loads(record_path.read_text()).get("outputs") or {}
    except (OSError, ValueError, AttributeError) as err:
        raise CheckpointError(f"{record_path}: unreadable ({err}), so the head beside it cannot be checked") from None
    head = source if source.is_file() else directory / HEAD_FILE
    for path in {head, directory / HEAD_CONFIG_FILE}:
        if path.name in recorded and path.is_file() and sha256_file(path, _EXPORT_HASHES) != recorded[path.name]:
            raise CheckpointError(f"{path}: its sha256 is not the one {record_path} records for it, so they are not from "
                                  "the same export; run export.py again (or read the head without the record beside it)")


def load_head(
    source: Path,
    text_config,
    shared=None,
    dtype: torch.dtype = torch.bfloat16,
    device="cpu",
    attn_implementation: str = "sdpa",
):
    """Build the MTP head for `text_config` and fill it from the `mtp.*` tensors at `source`.

    `source` is a checkpoint directory or one safetensors file; an exported head is checked
    against its record first (`check_export_set`). Returns (head, layout).
    """
    from occamy_mtp.model.head import MTPHead

    check_export_set(source)
    ckpt = head_checkpoint(source)
    with torch.device("meta"):
        head = MTPHead(text_config, attn_implementation=attn_implementation)
    state, layout = load_head_state(ckpt, head, dtype=dtype)
    head.load_state_dict({k: v.to(device) for k, v in state.items()}, strict=True, assign=True)
    with torch.device(device):
        head.rotary_emb = type(head.rotary_emb)(head.config)
    if shared is not None:
        head.attach(shared)
    return head, layout


def load_shared_weights(base_dir: str | Path, dtype: torch.dtype = torch.bfloat16, device="cpu", config=None):
    """Only the base's `embed_tokens` and `lm_head` (what the head borrows), not its layers.

    With the target cache the head trains and is evaluated without the base's 34.7B
    parameters: these two tensors are 2 x 248,320 x 2048 (~2 GB in bf16) at real size.
    `config`: the directory's `read_config`, when the caller has it.
    """
    from occamy_mtp.model.head import SharedWeights

    base_dir = Path(base_dir)
    config = config or read_config(base_dir)
    text_config = config.text_config
    ckpt = dequantized(SafetensorsCheckpoint(base_dir), config.quantization_config)
    embed_key = base_text_prefix(ckpt) + "embed_tokens.weight"
    tied = bool(getattr(text_config, "tie_word_embeddings", False))
    head_key = embed_key if tied else "lm_head.weight"
    for key in {embed_key, head_key}:
        if key not in ckpt:
            raise CheckpointError(f"{base_dir}: no tensor {key}, which the head shares with the base")
    embed = torch.nn.Embedding.from_pretrained(ckpt.get(embed_key).to(device=device, dtype=dtype), freeze=True)
    lm_head = torch.nn.Linear(text_config.hidden_size, text_config.vocab_size, bias=False, device="meta")
    lm_head.weight = embed.weight if tied else torch.nn.Parameter(ckpt.get(head_key).to(device=device, dtype=dtype), requires_grad=False)
    return SharedWeights(embed, lm_head)
