"""Quantized bases read as the frozen base: the family's block-wise FP8 layout and ModelOpt's NVFP4.

FP8, as the family publishes it (`quantization_config`: `quant_method` "fp8", `fmt` "e4m3",
`weight_block_size` [bo, bi], `modules_to_not_convert`): a quantized linear's `X.weight` is
float8_e4m3fn, (out, in) or (experts, out, in), and `X.weight_scale_inv` float32 holds one
multiplier per (bo x bi) block, (ceil(out / bo), ceil(in / bi)): W = q * scale_inv, block by
block. Every other tensor is stored as it is.

NVFP4, ModelOpt's layout (`quant_algo` "NVFP4" in `config.json`'s `quantization_config` or in
`hf_quant_config.json`, `group_size` 16, `exclude_modules`/`ignore`): `X.weight` is uint8 (out,
in / 2), two e2m1 codes a byte, the low nibble first; `X.weight_scale` float8_e4m3fn (out, in / 16),
one scale per 16 elements; `X.weight_scale_2` and `X.input_scale` float32 scalars. W = e2m1(code)
* weight_scale * weight_scale_2. The engine's W4A4 path quantizes each such linear's input the same
way, per 16 elements, with the global scale `input_scale` (`fake_quantize_nvfp4`).

An engine serving the FP8 layout runs W8A8: each FP8 linear's input is quantized to float8_e4m3fn
per token, per group of `weight_block_size[1]` (128) features, at the group's absolute maximum over
448 (`fake_quantize_fp8_groups`). `model.fp8_activations` fp8 emulates that; bf16 (the default)
leaves the inputs as they are (W8A16).

`dequantized` gives a checkpoint whose tensors read dequantized, in float32, so that every path that
loads the base (training, self-generation, evaluation, the cache pass) reads a quantized base as
it reads a bf16 one. Each quantized weight's scales are checked, by name and shape, before any is
read. Any other scheme is refused by name (`QuantizationError`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from occamy_mtp import files
from occamy_mtp.errors import OccamyError

FP8 = "fp8"
NVFP4 = "nvfp4"
SUPPORTED = "block-wise FP8 (quant_method 'fp8', fmt 'e4m3', weight_block_size) and ModelOpt NVFP4 (quant_algo 'NVFP4')"
HF_QUANT_CONFIG_NAME = "hf_quant_config.json"
NVFP4_GROUP = 16
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
E2M1_MAX = 6.0
# The eight magnitudes of an e2m1 code (bit 3 is the sign).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_KNOWN_OTHERS = ("gptq", "awq", "gguf", "mxfp4", "bitsandbytes", "compressed-tensors", "compressed_tensors", "hqq", "aqlm",
                 "eetq", "torchao", "fbgemm_fp8", "quanto", "exl2", "marlin", "bitnet", "vptq", "higgs", "spqr")
_SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale_2", ".weight_scale", ".input_scale")
_KV_CACHE_SCALES = (".k_scale", ".v_scale")
SAFETENSORS_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "BF16": 2, "F16": 2, "I16": 2, "U16": 2,
                     "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}


class QuantizationError(OccamyError, ValueError):
    """A quantized base the library cannot read: an unsupported scheme, or a tensor whose scales are
    missing or of the wrong shape (named)."""


@dataclass(frozen=True)
class Scheme:
    """How a base is quantized, as its config declares it."""

    kind: str  # FP8 or NVFP4
    block: tuple[int, int] = (128, 128)  # FP8's weight_block_size
    excluded: tuple[str, ...] = ()  # modules stored unquantized, as declared (informational)
    source: str = ""  # where the scheme was declared


def _declared(directory: Path, quantization: dict | None) -> tuple[dict | None, str]:
    """The quantization config a base declares (config.json's, else hf_quant_config.json's) and where."""
    if quantization is not None:
        return quantization, f"{directory / 'config.json'} quantization_config"
    path = directory / HF_QUANT_CONFIG_NAME
    if path.is_file():
        return files.read_json_object(path, QuantizationError, "JSON of a quantization config"), str(path)
    return None, ""


def scheme_of(directory: str | Path, quantization: dict | None) -> Scheme | None:
    """The base's `Scheme` (None: not quantized), from `quantization` (its config.json's
    `quantization_config`) or its hf_quant_config.json; QuantizationError, naming the scheme and the
    supported ones, for anything else."""
    declared, where = _declared(Path(directory), quantization)
    if declared is None:
        return None
    if not isinstance(declared, dict):
        raise QuantizationError(f"{where}: expected an object, got {type(declared).__name__}")
    section = declared["quantization"] if isinstance(declared.get("quantization"), dict) else declared
    method = str(declared.get("quant_method") or section.get("quant_method") or "").lower()
    algo = str(section.get("quant_algo") or "").upper()
    if method.startswith("modelopt") or algo or isinstance(declared.get("quantization"), dict):
        if algo == "NVFP4":
            group = section.get("group_size", NVFP4_GROUP)
            if group != NVFP4_GROUP:
                raise QuantizationError(f"{where}: group_size {group!r}; NVFP4 has one scale per {NVFP4_GROUP} elements")
            excluded = section.get("exclude_modules") or declared.get("ignore") or ()
            return Scheme(NVFP4, excluded=tuple(excluded), source=where)
        raise QuantizationError(f"{where}: ModelOpt quant_algo {algo or None!r} is not supported; supported: {SUPPORTED}")
    if method == "fp8":
        fmt = str(declared.get("fmt", "e4m3")).lower()
        block = declared.get("weight_block_size")
        if fmt != "e4m3":
            raise QuantizationError(f"{where}: fp8 fmt {fmt!r} is not supported; supported: {SUPPORTED}")
        if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise QuantizationError(f"{where}: weight_block_size {block!r}; block-wise FP8 needs two positive "
                                    f"integers (the family's is [128, 128]); supported: {SUPPORTED}")
        return Scheme(FP8, block=(block[0], block[1]), excluded=tuple(declared.get("modules_to_not_convert") or ()),
                      source=where)
    named = method or str(declared.get("format") or declared.get("quant_type") or "unknown")
    known = " (known, not supported)" if any(named.startswith(k) for k in _KNOWN_OTHERS) else ""
    raise QuantizationError(f"{where}: quantization {named!r}{known}; supported: {SUPPORTED}")


# ----------------------------------------------------------------------------------
# Dequantization: plain references
# ----------------------------------------------------------------------------------


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float32 W of a float8_e4m3fn (..., out, in) weight and its (..., ceil(out/bo), ceil(in/bi)) multipliers."""
    out_dim, in_dim = weight.shape[-2:]
    scales = scale_inv.float().repeat_interleave(block[0], dim=-2)[..., :out_dim, :]
    scales = scales.repeat_interleave(block[1], dim=-1)[..., :in_dim]
    return weight.float() * scales


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of 4-bit e2m1 codes (integers 0..15; bit 3 the sign)."""
    magnitudes = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    values = magnitudes[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -values, values)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """(..., n / 2) uint8, two codes a byte (low nibble first) -> (..., n) codes."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)


def dequantize_nvfp4(packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    """float32 W of an NVFP4 weight: e2m1 codes times their 16-element group's fp8 scale times the global scale."""
    values = e2m1_decode(unpack_e2m1(packed))
    groups = scale.float().repeat_interleave(NVFP4_GROUP, dim=-1)
    return values * groups * scale_2.float()


def e2m1_round(x: torch.Tensor) -> torch.Tensor:
    """`x` (float32, already scaled into [-6, 6]) rounded to the nearest e2m1 value, ties to the even code
    (as the hardware's conversion rounds)."""
    magnitudes = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=x.device)
    a = x.abs().clamp(max=E2M1_MAX)
    distance = (a[..., None] - magnitudes).abs()
    nearest = distance.min(dim=-1, keepdim=True).values
    ties = distance == nearest  # two candidates at a midpoint: the even code (its lowest bit 0) wins
    codes = torch.arange(len(E2M1_VALUES), device=x.device)
    preferred = torch.where(ties, (codes % 2) * len(E2M1_VALUES) + codes, 10 * len(E2M1_VALUES))
    index = preferred.argmin(dim=-1)
    return torch.sign(x) * magnitudes[index]


def nvfp4_blocks(x: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4's rounding of float32 `x` (its last dimension a multiple of 16) at `global_scale`: per
    16 elements a scale amax / 6 / global_scale rounded to float8_e4m3fn, and the elements rounded
    to e2m1 at that scale times `global_scale`. Returns (e2m1 values (..., blocks, 16), scales
    (..., blocks) float8_e4m3fn): x is about values * scale * global_scale."""
    groups = x.reshape(*x.shape[:-1], x.shape[-1] // NVFP4_GROUP, NVFP4_GROUP)
    scale = (groups.abs().amax(dim=-1) / E2M1_MAX / global_scale).clamp(max=FP8_MAX).to(torch.float8_e4m3fn)
    step = (scale.float() * global_scale)[..., None]
    return torch.where(step > 0, e2m1_round(groups / torch.where(step > 0, step, 1.0)), 0.0), scale


def fake_quantize_nvfp4(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """`x` as the W4A4 path sees it (`nvfp4_blocks` at the global scale `input_scale`), multiplied
    back; in `x`'s dtype. The last dimension must be a multiple of 16 (ModelOpt quantizes no other
    linear)."""
    global_scale = input_scale.float().to(x.device)
    values, scale = nvfp4_blocks(x.float(), global_scale)
    return (values * (scale.float() * global_scale)[..., None]).reshape(x.shape).to(x.dtype)


FP8_GROUP_EPS = 1e-10  # the engines' floor under a group's absolute maximum (an all-zero group)


def fake_quantize_fp8_groups(x: torch.Tensor, group: int) -> torch.Tensor:
    """`x` as an FP8 engine's W8A8 path sees it: per row, per `group` consecutive features (the last
    dimension a multiple of `group`), scale = max(amax, 1e-10) / 448 in float32, the elements
    x / scale rounded to float8_e4m3fn (round to nearest even, saturating at 448), multiplied back;
    in `x`'s dtype."""
    groups = x.float().reshape(*x.shape[:-1], x.shape[-1] // group, group)
    scale = groups.abs().amax(dim=-1, keepdim=True).clamp(min=FP8_GROUP_EPS) / FP8_MAX
    codes = (groups / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return (codes.float() * scale).reshape(x.shape).to(x.dtype)


def quantize_fp8(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 multipliers) of a (..., out, in) weight, one multiplier per
    block: its absolute maximum over 448, so that the block's largest element is representable."""
    w = weight.float()
    out_dim, in_dim = w.shape[-2:]
    rows, cols = math.ceil(out_dim / block[0]), math.ceil(in_dim / block[1])
    padded = torch.zeros(*w.shape[:-2], rows * block[0], cols * block[1], device=w.device)
    padded[..., :out_dim, :in_dim] = w
    blocks = padded.reshape(*w.shape[:-2], rows, block[0], cols, block[1])
    amax = blocks.abs().amax(dim=(-3, -1))
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    expanded = scale_inv.repeat_interleave(block[0], dim=-2)[..., :out_dim, :].repeat_interleave(block[1], dim=-1)[..., :in_dim]
    return (w / expanded).to(torch.float8_e4m3fn), scale_inv


def quantize_nvfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed uint8 codes, float8_e4m3fn scales per 16 elements, float32 global scale) of an
    (out, in) weight, as ModelOpt writes NVFP4: global scale amax / (6 * 448), each group's scale
    its amax / 6 over the global scale, rounded to fp8, each element rounded to e2m1."""
    w = weight.float()
    global_scale = (w.abs().amax() / (E2M1_MAX * FP8_MAX)).clamp(min=torch.finfo(torch.float32).tiny)
    values, scale = nvfp4_blocks(w, global_scale)
    values = values.reshape(w.shape)
    magnitudes = torch.tensor(E2M1_VALUES)
    codes = (values.abs()[..., None] == magnitudes).float().argmax(dim=-1) | torch.where(values < 0, 8, 0)
    codes = codes.to(torch.uint8).reshape(*w.shape[:-1], w.shape[-1] // 2, 2)
    return codes[..., 0] | (codes[..., 1] << 4), scale, global_scale.reshape(())


# ----------------------------------------------------------------------------------
# A quantized checkpoint, read dequantized
# ----------------------------------------------------------------------------------


@dataclass
class _Quantized:
    weight: str  # the weight's key
    scales: dict = field(default_factory=dict)  # role -> key


class DequantizedCheckpoint:
    """A `SafetensorsCheckpoint` of a quantized base whose quantized weights read dequantized
    (float32) under their own names, and whose scale tensors are hidden; everything else as stored.
    `input_scales` maps an NVFP4 linear's weight key to its input scale, for `emulate_activations`."""

    def __init__(self, ckpt, scheme: Scheme):
        self._ckpt, self.scheme = ckpt, scheme
        self.directory, self.index, self.weight_map = ckpt.directory, ckpt.index, ckpt.weight_map
        self._quantized = self._find_quantized()
        hidden = {s for q in self._quantized.values() for s in q.scales.values()}
        self._keys = [k for k in ckpt.keys() if k not in hidden and not k.endswith(_KV_CACHE_SCALES)]
        self._key_set = set(self._keys)
        self.input_scales: dict[str, torch.Tensor] = {}
        if scheme.kind == NVFP4:
            self.input_scales = {w: ckpt.get(q.scales["input_scale"]) for w, q in self._quantized.items()}

    def _find_quantized(self) -> dict[str, _Quantized]:
        ckpt, scheme = self._ckpt, self.scheme
        keys = set(ckpt.keys())
        found: dict[str, _Quantized] = {}
        where = ckpt.directory
        for key in sorted(keys):
            if not key.endswith(".weight"):
                continue
            stem = key[: -len(".weight")]
            dtype = ckpt.dtype(key)
            if scheme.kind == FP8 and dtype == "F8_E4M3":
                scale = stem + ".weight_scale_inv"
                if scale not in keys:
                    raise QuantizationError(f"{where}: {key} is float8_e4m3fn but {scale} is missing; "
                                            "block-wise FP8 stores one multiplier per block beside each weight")
                shape = ckpt.shape(key)
                expected = (*shape[:-2], math.ceil(shape[-2] / scheme.block[0]), math.ceil(shape[-1] / scheme.block[1]))
                if ckpt.shape(scale) != expected:
                    raise QuantizationError(f"{where}: {scale} has shape {list(ckpt.shape(scale))}, expected {list(expected)} "
                                            f"for {key} {list(shape)} in blocks of {list(scheme.block)} (weight_block_size)")
                found[key] = _Quantized(key, {"weight_scale_inv": scale})
            elif scheme.kind == NVFP4 and dtype == "U8":
                names = {role: f"{stem}.{role}" for role in ("weight_scale", "weight_scale_2", "input_scale")}
                absent = [n for n in names.values() if n not in keys]
                if absent:
                    raise QuantizationError(f"{where}: {key} is packed NVFP4 but {', '.join(absent)} "
                                            f"{'is' if len(absent) == 1 else 'are'} missing")
                shape = ckpt.shape(key)
                expected = (*shape[:-1], shape[-1] * 2 // NVFP4_GROUP)
                if ckpt.shape(names["weight_scale"]) != expected or (shape[-1] * 2) % NVFP4_GROUP:
                    raise QuantizationError(
                        f"{where}: {names['weight_scale']} has shape {list(ckpt.shape(names['weight_scale']))}, expected "
                        f"{list(expected)}: one scale per {NVFP4_GROUP} elements of {key} (packed {list(shape)}, "
                        f"{shape[-1] * 2} elements a row)")
                for role in ("weight_scale_2", "input_scale"):
                    if math.prod(ckpt.shape(names[role])) != 1:
                        raise QuantizationError(f"{where}: {names[role]} has shape {list(ckpt.shape(names[role]))}; "
                                                "a scalar (one global scale) is expected")
                found[key] = _Quantized(key, names)
        scale_keys = {k for k in keys if k.endswith(_SCALE_SUFFIXES)}
        used = {s for q in found.values() for s in q.scales.values()}
        orphans = sorted(scale_keys - used)
        if orphans:
            raise QuantizationError(f"{where}: {orphans[0]} scales no quantized weight "
                                    f"({'float8_e4m3fn' if scheme.kind == FP8 else 'packed uint8'} {orphans[0].rsplit('.', 1)[0]}.weight expected)")
        return found

    def keys(self) -> list[str]:
        """The tensors a model reads: the scales hidden, and the KV cache's (`k_scale`, `v_scale`, which
        ModelOpt writes with an fp8 KV cache; the cache is not emulated, docs/guide/QUANTIZED.md)."""
        return list(self._keys)

    def __contains__(self, key: str) -> bool:
        return key in self._key_set

    def file_of(self, key: str) -> Path:
        return self._ckpt.file_of(key)

    def files(self) -> list[Path]:
        return self._ckpt.files()

    def shape(self, key: str) -> tuple[int, ...]:
        shape = self._ckpt.shape(key)
        if self.scheme.kind == NVFP4 and key in self._quantized:
            return (*shape[:-1], shape[-1] * 2)
        return shape

    def dtype(self, key: str) -> str:
        return "F32" if key in self._quantized else self._ckpt.dtype(key)

    def stored_bytes(self, key: str) -> int:
        """The bytes `key` takes as stored, with its scales when it is quantized (from the headers)."""
        quantized = self._quantized.get(key)
        keys = [key, *(quantized.scales.values() if quantized else ())]
        return sum(math.prod(self._ckpt.shape(k)) * SAFETENSORS_BYTES[self._ckpt.dtype(k)] for k in keys)

    def fp8_input_features(self) -> dict[str, int]:
        """The FP8 weights (float8_e4m3fn with their multipliers) by key -> the features each takes in
        (its last dimension); none for NVFP4."""
        return {k: self._ckpt.shape(k)[-1] for k in sorted(self._quantized)} if self.scheme.kind == FP8 else {}

    def is_fp8(self, key: str) -> bool:
        """Whether `key` is an FP8 weight (`fp8_codes` reads it as stored)."""
        return self.scheme.kind == FP8 and key in self._quantized

    def fp8_codes(self, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """An FP8 weight as stored: (float8_e4m3fn codes, float32 multipliers, one a block)."""
        return self._ckpt.get(key), self._scale(key, "weight_scale_inv").float()

    def check_scales(self) -> None:
        """Every quantized weight's scales read and checked (`_scale`): about one byte in 16,000 of an FP8
        base at the family's blocks, cheap enough to do before anything loads."""
        for key, quantized in self._quantized.items():
            for kind in quantized.scales:
                self._scale(key, kind)

    def _scale(self, key: str, kind: str) -> torch.Tensor:
        """A quantized weight's scale tensor, refused when it holds NaN, an infinity or a negative value (a
        scale is a small fraction of the weight's bytes: always checked)."""
        name = self._quantized[key].scales[kind]
        scale = self._ckpt.get(name)
        values = scale.float()
        if not bool(torch.isfinite(values).all()) or bool((values < 0).any()):
            raise QuantizationError(f"{self.directory}: {name} holds NaN, infinite or negative multipliers: the "
                                    f"weight {key} cannot be read from it (a corrupt or badly converted checkpoint)")
        return scale

    def get(self, key: str) -> torch.Tensor:
        quantized = self._quantized.get(key)
        if quantized is None:
            return self._ckpt.get(key)
        stored = self._ckpt.get(key)
        if self.scheme.kind == FP8:
            return dequantize_fp8(stored, self._scale(key, "weight_scale_inv"), self.scheme.block)
        return dequantize_nvfp4(stored, self._scale(key, "weight_scale"), self._scale(key, "weight_scale_2"))


def dequantized(ckpt, quantization: dict | None):
    """`ckpt` (a `SafetensorsCheckpoint` of a base) with its quantized weights read dequantized
    (`DequantizedCheckpoint`) when the base declares a supported scheme (`quantization`, its
    config.json's `quantization_config`, or its hf_quant_config.json); `ckpt` itself when it
    declares none."""
    scheme = scheme_of(ckpt.directory, quantization)
    if scheme is None:
        scales = [key for key in ckpt.keys() if key.endswith(_SCALE_SUFFIXES)]
        if scales:  # read as plain weights, they would be refused one by one, the missing declaration unsaid
            raise QuantizationError(
                f"{Path(ckpt.directory) / 'config.json'}: no quantization_config (missing or null) and no "
                f"{HF_QUANT_CONFIG_NAME}, yet {len(scales)} tensors hold quantization scales ({scales[0]}, ...): the "
                "checkpoint is quantized and its declaration is lost; restore config.json's quantization_config as the "
                'checkpoint was published with it (the family\'s FP8: {"quant_method": "fp8", "fmt": "e4m3", '
                '"weight_block_size": [128, 128]})')
        return ckpt
    return DequantizedCheckpoint(ckpt, scheme)


# ----------------------------------------------------------------------------------
# Activations, emulated: NVFP4's (W4A4) and FP8's (W8A8)
# ----------------------------------------------------------------------------------

_EXPERT_KEY = re.compile(r"^(?P<stem>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)$")


def emulate_activations(model: torch.nn.Module, input_scales: dict[str, torch.Tensor], disk_prefix: str,
                        module_prefix: str = "model.") -> int:
    """Fake-quantize the input of every NVFP4 linear of the loaded `model` as the engine's W4A4 path
    quantizes it (`fake_quantize_nvfp4`), with its checkpoint's `input_scale`; returns how many
    modules were hooked (`_hook_inputs`)."""
    return _hook_inputs(model, input_scales, disk_prefix, module_prefix, NVFP4, fake_quantize_nvfp4)


def emulated_activations(fp8_activations: str, scheme: "Scheme | None") -> str | None:
    """How a base stored in `scheme` rounds its activations beyond its weights' format where the library
    emulates it: "fp8" for an FP8 base under `model.fp8_activations` fp8 (W8A8), else None (NVFP4's are
    emulated always, as part of reading the base)."""
    return "fp8" if fp8_activations == "fp8" and scheme is not None and scheme.kind == FP8 else None


def emulate_fp8_activations(model: torch.nn.Module, input_features: dict[str, int], group: int, disk_prefix: str,
                            module_prefix: str = "model.") -> int:
    """Fake-quantize the input of every FP8 linear of the loaded `model` (`input_features`: the
    checkpoint's float8_e4m3fn weight keys -> the features each takes in, its last dimension) as the
    engine's W8A8 path quantizes it (`fake_quantize_fp8_groups`, groups of `group` features); returns how
    many modules were hooked (`_hook_inputs`). A weight whose input is not a whole number of groups is a
    QuantizationError (the engine's kernel takes none)."""
    keys = [k for k in input_features if k.startswith(disk_prefix)]  # the text model's (the base loads no other)
    for key in keys:
        if input_features[key] % group:
            raise QuantizationError(f"{key}: its input has {input_features[key]} features, not a multiple of the {group}-feature "
                                    "groups the engine's FP8 activations are quantized in (weight_block_size)")
    quantize = lambda x, _scale: fake_quantize_fp8_groups(x, group)  # noqa: E731
    return _hook_inputs(model, dict.fromkeys(keys), disk_prefix, module_prefix, FP8, quantize)


def _module_name(key: str, disk_prefix: str, module_prefix: str) -> str:
    name = key[: -len(".weight")]
    return module_prefix + name[len(disk_prefix):] if name.startswith(disk_prefix) else name


def _hook_inputs(model: torch.nn.Module, input_scales: dict[str, torch.Tensor | None], disk_prefix: str,
                 module_prefix: str, kind: str, quantize) -> int:
    """Run `quantize(input, scale)` on the input of the module of each weight key of `input_scales`
    (its scale, or None where the quantization is dynamic). Linear modules take a forward pre-hook;
    a fused experts module (3-D gate_up_proj / down_proj) runs `_emulated_experts`, each expert's
    input and its activation quantized with that expert's scales. The fast paths, which read the
    weights directly, would skip the hooks: the base's opening records the emulation
    (`base.frozen.FrozenBase.emulated`) and they stand aside. Returns how many modules were hooked."""
    modules = dict(model.named_modules())
    linear_scales: dict[str, torch.Tensor | None] = {}
    expert_scales: dict[str, dict[str, dict[int, torch.Tensor | None]]] = {}
    for key, scale in input_scales.items():
        name = _module_name(key, disk_prefix, module_prefix)
        expert = _EXPERT_KEY.match(name)
        if name in modules and isinstance(modules[name], torch.nn.Linear):
            linear_scales[name] = scale
        elif expert and expert["stem"] in modules:
            part = "down" if expert["proj"] == "down_proj" else "gate_up"
            expert_scales.setdefault(expert["stem"], {}).setdefault(part, {})[int(expert["expert"])] = scale
        else:
            raise QuantizationError(f"{key}: an {kind.upper()} weight whose module the base does not have ({name})")
    for name, scale in linear_scales.items():
        modules[name].register_forward_pre_hook(lambda module, args, s=scale: (quantize(args[0], s), *args[1:]))
    for name, scales in expert_scales.items():
        module = modules[name]
        count = module.gate_up_proj.shape[0]
        for part in ("gate_up", "down"):
            if sorted(scales.get(part, {})) != list(range(count)):
                raise QuantizationError(f"{name}: {kind.upper()} input scales for {part} of {len(scales.get(part, {}))} "
                                        f"of {count} experts")
        module.forward = _emulated_experts(module, [scales["gate_up"][e] for e in range(count)],
                                           [scales["down"][e] for e in range(count)], quantize)
    return len(linear_scales) + len(expert_scales)


def _emulated_experts(module, gate_up_scales: list, down_scales: list, quantize):
    """The fused experts' forward (hidden (N, D), top_k_index (N, k), top_k_weights (N, k)) one
    expert at a time, its input and its activation fake-quantized (`quantize(x, scale)`) with the
    expert's scales: the plain reference the quantized engine's grouped kernel computes."""

    def forward(hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for expert in top_k_index.unique().tolist():
            rows, slot = (top_k_index == expert).nonzero(as_tuple=True)
            x = quantize(hidden_states[rows], gate_up_scales[expert])
            gate, up = torch.nn.functional.linear(x, module.gate_up_proj[expert]).chunk(2, dim=-1)
            h = quantize(module.act_fn(gate) * up, down_scales[expert])
            y = torch.nn.functional.linear(h, module.down_proj[expert])
            out.index_add_(0, rows, (y * top_k_weights[rows, slot, None]).to(out.dtype))
        return out

    return forward
