"""Assembly: the frozen base plus the trained head, as one directory an engine serves (docs/CONTRACT.md section 5).

    python assemble_head.py --base BASE_DIR --head mtp-trained.safetensors --out SERVE_DIR

The new directory holds

* an absolute symlink to every base file that is used unchanged (weight shards,
  tokenizer, generation config, ...). Absolute, so that the assembled directory can
  be moved; it must stay where the links point, i.e. the base must not move. No hard
  links: a hard link to a writable base file would let a write through the new
  directory change the base;
* a copy of the head file (checked: every `mtp.*` tensor present, shapes from the
  base config, bf16, nothing but `mtp.*`), so the directory holds the bytes that were
  checked, whatever later happens to the training output;
* a rewritten `model.safetensors.index.json` mapping every `mtp.*` key to the head
  file; every `mtp.*` key the base had is gone from it;
* a rewritten `config.json` with the fields that make the engines build the MTP draft,
  and, for a ModelOpt-quantized base, the head's modules added to the quantization
  exclusions (also in `hf_quant_config.json` when the base has one);
* `assembly.json`: what was done, for the record.

The base directory is only read. Everything is written into a temporary directory
beside `--out` and renamed into place at the end, so an interrupted assembly never
leaves a half directory under the final name.

What the engines do (read from their sources, see also docs/CONTRACT.md section 3):

* Weight files. vLLM and SGLang (`model_loader/weight_utils.py`,
  `filter_duplicate_safetensors_files`) glob `*.safetensors` in the model directory
  and, when `model.safetensors.index.json` exists, keep the files the index names;
  they then read EVERY tensor of each kept file, whatever the index says about single
  keys. So a base shard that still holds old `mtp.*` tensors would load the old head
  too (the order of the two decides which one wins). Hence: a base shard holding only
  `mtp.*` tensors is not linked at all, and a shard mixing `mtp.*` with base tensors
  is rewritten without them into the new directory (reported). `*.safetensors` files
  the base index does not name are not linked either.
* The head's tensor names. SGLang's `Qwen3_5ForCausalLMMTP.load_weights`
  (`srt/models/qwen3_5_mtp.py`) and vLLM's `Qwen3_5MTP.load_weights`
  (`model_executor/models/qwen3_5_mtp.py`) take `mtp.*` tensors from that stream
  (`mtp.` -> the draft's own module names), either expert layout.
* Config fields. vLLM's `SpeculativeConfig.hf_config_override` (`config/speculative.py`)
  turns a `qwen3_5_moe` config into `Qwen3_5MoeMTP` with `n_predict =
  mtp_num_hidden_layers` (read from `text_config`), and a `qwen3_next` config into
  `Qwen3NextMTP` with `n_predict = num_nextn_predict_layers`. SGLang's
  `ModelConfig._config_draft_model` (`srt/configs/model_config.py`) maps the
  architectures `Qwen3_5MoeForConditionalGeneration` -> `Qwen3_5ForCausalLMMTP` and
  `Qwen3NextForCausalLM` -> `Qwen3NextForCausalLMMTP` for `--speculative-algorithm
  NEXTN` (a text-only `Qwen3_5MoeForCausalLM` architecture is not mapped; reported as
  a note). We set the head's layer count (one) in those fields.
* Quantization exclusions. Both engines read `quantization_config` from config.json
  first and `hf_quant_config.json` otherwise; the flat config.json layout keeps its
  exclusions in `ignore`, the nested hf_quant_config.json layout in
  `quantization.exclude_modules` (vLLM `ModelOptQuantConfigBase.from_config`, SGLang
  `ModelOptFp8Config.from_config`). The draft's module prefixes are `mtp.fc`,
  `mtp.layers.0.self_attn.qkv_proj`, `mtp.layers.0.mlp.experts`, ... vLLM excludes a
  module when an entry equals it, is a substring of it, or fnmatch-es it; SGLang when
  an entry, read as a glob, matches the whole prefix or one of its dot-separated parts
  (older SGLang: plain substring). `mtp` (plain) is caught by every one of these
  checks; `mtp*` is ModelOpt's own spelling for "this module tree" and is what a
  pattern-only checker needs. A quantized base whose config leaks into the bf16 head
  collapses acceptance (SGLang and vLLM special-case only some of this, e.g. vLLM
  forces `mtp.fc` unquantized for modelopt_fp4 alone).

Other quantization methods (compressed-tensors, GPTQ, Quark, ...) spell their
exclusions differently; assembling onto such a base is refused rather than guessed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import struct
import tempfile
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from occamy_mtp import checkpoint as ckpt_io
from occamy_mtp.head import MTPHead

CONFIG_NAME = "config.json"
HF_QUANT_CONFIG_NAME = "hf_quant_config.json"
RECORD_NAME = "assembly.json"
SAFETENSORS_SUFFIX = ".safetensors"
HEAD_DTYPE = "BF16"  # safetensors' name for bfloat16

# Quantization-exclusion entries that cover the whole head (see the module docstring
# for which engine check each one satisfies).
HEAD_EXCLUSIONS = ("mtp", "mtp*")

# SGLang NEXTN turns only these architectures into its MTP draft class.
SGLANG_DRAFT_ARCHITECTURES = {
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5ForCausalLMMTP",
    "Qwen3NextForCausalLM": "Qwen3NextForCausalLMMTP",
}

_HEADER_LENGTH_BYTES = 8  # safetensors files start with a little-endian u64 header length
_MAX_HEADER_BYTES = 100 * 2**20
_COPY_CHUNK_BYTES = 16 * 2**20

LINK = "link"
REWRITE = "rewrite"
DROP = "drop"


class AssemblyError(ValueError):
    """The inputs cannot be assembled: names the file, tensor or option at fault."""


# ----------------------------------------------------------------------------------
# Plans and the report
# ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardPlan:
    """What happens to one base weight file."""

    name: str
    action: str  # LINK (no mtp.*), REWRITE (mixed: written without mtp.*), DROP (mtp.* only)
    mtp_tensors: int  # mtp.* tensors the file holds (all of them, not only those the index names)
    other_tensors: int


@dataclass
class AssemblyReport:
    """What an assembly did; `to_dict` is what `--json` prints and assembly.json holds."""

    base: str
    head_source: str
    out: str
    head_file: str  # its name inside `out`
    head_sha256: str
    head_tensors: int
    head_layout: str
    linked: list[str] = field(default_factory=list)  # names symlinked (absolute) into the base
    rewritten_shards: list[dict] = field(default_factory=list)  # {name, removed_mtp_tensors, kept_tensors}
    dropped_shards: list[str] = field(default_factory=list)  # base shards holding only mtp.* tensors
    skipped: list[str] = field(default_factory=list)  # base entries deliberately not carried over
    removed_base_mtp_keys: int = 0  # mtp.* keys of the base index that are gone
    index_keys: int = 0
    config_changes: list[str] = field(default_factory=list)
    quantization: dict | None = None  # {method, quant_algo, added: {location: [entries]}}
    notes: list[str] = field(default_factory=list)
    replaced_existing_out: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


# ----------------------------------------------------------------------------------
# Reading headers (no tensor data)
# ----------------------------------------------------------------------------------


def read_safetensors_header(path: Path) -> dict[str, dict]:
    """The tensor table of a safetensors file: name -> {dtype, shape, data_offsets}."""
    try:
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(_HEADER_LENGTH_BYTES))
            if length > _MAX_HEADER_BYTES:
                raise ValueError(f"header of {length} bytes")
            header = json.loads(handle.read(length))
    except (OSError, ValueError, struct.error) as err:
        raise AssemblyError(f"{path}: cannot be read as safetensors ({err})") from None
    header.pop("__metadata__", None)
    return header


def _tensor_bytes(entry: dict) -> int:
    start, end = entry["data_offsets"]
    return end - start


def engine_view(directory: Path) -> dict[str, str]:
    """Every tensor an engine loads from `directory` -> the file it comes from.

    vLLM and SGLang keep the `*.safetensors` files the index names (all of them when
    there is no index) and read every tensor of each. A tensor in two files is an
    error: the engine would load it twice and keep whichever came last.
    """
    directory = Path(directory)
    index_path = directory / ckpt_io.INDEX_NAME
    if index_path.is_file():
        files = sorted(set(json.loads(index_path.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in directory.glob("*" + SAFETENSORS_SUFFIX))
    view: dict[str, str] = {}
    for name in files:
        for key in read_safetensors_header(directory / name):
            if key in view:
                raise AssemblyError(f"{directory}: tensor {key} is in both {view[key]} and {name}")
            view[key] = name
    return view


# ----------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------


def _resolve(path: Path) -> Path:
    """Absolute path with symlinks resolved (the path need not exist)."""
    return Path(os.path.abspath(path)).resolve(strict=False)


def check_paths(base_dir: Path, head_file: Path, out_dir: Path, force: bool) -> tuple[Path, Path, Path]:
    # The head keeps the name it was given (a symlink, e.g. into a hub cache, may point
    # at a blob without the .safetensors suffix the engines look for).
    base, head, out = _resolve(base_dir), Path(os.path.abspath(head_file)), _resolve(out_dir)
    if not base.is_dir():
        raise AssemblyError(f"--base {base_dir}: not a directory")
    if not head.is_file():
        raise AssemblyError(f"--head {head_file}: no such file")
    if not head.name.endswith(SAFETENSORS_SUFFIX):
        raise AssemblyError(f"--head {head_file}: engines only load *{SAFETENSORS_SUFFIX} files; rename it")
    if out == base or base in out.parents:
        raise AssemblyError(f"--out {out_dir} is inside --base {base_dir}; the base directory is never written to")
    if out in base.parents:
        raise AssemblyError(f"--out {out_dir} contains --base {base_dir}; choose a directory outside it")
    if Path(os.path.abspath(out_dir)).is_symlink():
        raise AssemblyError(f"--out {out_dir} is a symbolic link; give the real directory")
    if out.exists():
        if not out.is_dir():
            raise AssemblyError(f"--out {out_dir} exists and is not a directory")
        if not force:
            raise AssemblyError(f"--out {out_dir} already exists; pass --force to replace it")
    return base, head, out


@dataclass(frozen=True)
class HeadCheck:
    keys: tuple[str, ...]
    layout: str
    num_layers: int


def check_head_file(head_file: Path, text_config) -> HeadCheck:
    """Every mtp.* tensor present with the shape the base config implies, bf16, and nothing else.

    Every problem is listed (tensor, file, found and expected shape), not only the first.
    """
    try:
        ckpt = ckpt_io.SafetensorsCheckpoint(head_file)
    except ckpt_io.CheckpointError as err:
        raise AssemblyError(f"--head: {err}") from None
    keys = set(ckpt.keys())
    problems = [
        f"tensor {k} in {head_file} is not an {ckpt_io.HEAD_PREFIX}* tensor; an engine would load it over the base's"
        for k in sorted(keys)
        if not k.startswith(ckpt_io.HEAD_PREFIX)
    ]
    disk_keys = ckpt_io.head_disk_keys(ckpt)
    if not disk_keys:
        raise AssemblyError(f"{head_file}: no {ckpt_io.HEAD_PREFIX}* tensors; this is not an MTP head file")
    with torch.device("meta"):
        head = MTPHead(text_config)
    try:
        _, report = ckpt_io.check_tensors(ckpt, ckpt_io.head_module_shapes(head), ckpt_io.HEAD_PREFIX, disk_keys)
    except ckpt_io.CheckpointError as err:  # mixed expert layouts
        raise AssemblyError(f"{head_file}: {err}") from None
    problems += report.problems
    problems += [
        f"tensor {k} in {head_file} is {ckpt.dtype(k)}, expected {HEAD_DTYPE} (the engines load the head in bf16)"
        for k in sorted(disk_keys)
        if ckpt.dtype(k) != HEAD_DTYPE
    ]
    if problems:
        raise AssemblyError("head file does not match the base config:\n  " + "\n  ".join(problems))
    return HeadCheck(tuple(sorted(disk_keys)), report.layout or ckpt_io.FUSED, len(head.layers))


def plan_shards(base: Path, weight_files: list[str]) -> list[ShardPlan]:
    """Link, rewrite or drop each base weight file, by the tensors it actually holds."""
    plans = []
    for name in weight_files:
        keys = read_safetensors_header(base / name)
        mtp = sum(k.startswith(ckpt_io.HEAD_PREFIX) for k in keys)
        other = len(keys) - mtp
        action = LINK if mtp == 0 else (DROP if other == 0 else REWRITE)
        plans.append(ShardPlan(name, action, mtp, other))
    return plans


# ----------------------------------------------------------------------------------
# Config rewriting
# ----------------------------------------------------------------------------------


def enable_mtp(raw: dict, text_config, num_layers: int) -> list[str]:
    """Set the fields the engines read to build the MTP draft, in place; returns what changed."""
    multimodal = isinstance(raw.get("text_config"), dict)
    text = raw["text_config"] if multimodal else raw
    where = "text_config." if multimodal else ""
    fields = ["mtp_num_hidden_layers"]  # vLLM n_predict for Qwen3.5; our own has_mtp
    if text_config.model_type == "qwen3_next":
        fields.append("num_nextn_predict_layers")  # vLLM n_predict for Qwen3-Next
    changes = []
    for name in fields:
        old = text.get(name)
        if old != num_layers:
            text[name] = num_layers
            changes.append(f"{where}{name}: {old!r} -> {num_layers}")
    return changes


def _is_modelopt(quant: dict) -> bool:
    producer = quant.get("producer") if isinstance(quant.get("producer"), dict) else {}
    return str(quant.get("quant_method", "")).lower().startswith("modelopt") or producer.get("name") == "modelopt"


def _quant_algo(quant: dict) -> str | None:
    section = quant["quantization"] if isinstance(quant.get("quantization"), dict) else quant
    return section.get("quant_algo")


def add_head_exclusions(quant: dict, location: str) -> dict[str, list[str]]:
    """Add HEAD_EXCLUSIONS to the exclusion lists of one ModelOpt quantization config, in place.

    Nested layout (hf_quant_config.json, or a config.json copy of it):
    `quantization.exclude_modules`. Flat config.json layout: `ignore`, which is what
    the engines read, plus `exclude_modules` where an older export wrote that too.
    Returns {"<location>: <list path>": [entries added]}.
    """
    if isinstance(quant.get("quantization"), dict):
        section, names, prefix = quant["quantization"], ["exclude_modules"], "quantization."
    else:
        section, names, prefix = quant, ["ignore"], ""
        if "exclude_modules" in quant:
            names.append("exclude_modules")
    added = {}
    for name in names:
        entries = section.get(name)
        if entries is None:
            entries = section[name] = []
        if not isinstance(entries, list):
            raise AssemblyError(f"{location}: {prefix}{name} is {type(entries).__name__}, expected a list")
        new = [e for e in HEAD_EXCLUSIONS if e not in entries]
        entries.extend(new)
        added[f"{location}: {prefix}{name}"] = new
    return added


def quantization_configs(raw: dict) -> list[tuple[str, dict]]:
    """(location, quantization config) for every place a base declares its quantization."""
    found = []
    if isinstance(raw.get("quantization_config"), dict):
        found.append((f"{CONFIG_NAME} quantization_config", raw["quantization_config"]))
    text = raw.get("text_config")
    if isinstance(text, dict) and isinstance(text.get("quantization_config"), dict):
        found.append((f"{CONFIG_NAME} text_config.quantization_config", text["quantization_config"]))
    return found


def _read_json(path: Path) -> dict:
    try:
        obj = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise AssemblyError(f"{path}: not readable JSON ({err})") from None
    if not isinstance(obj, dict):
        raise AssemblyError(f"{path}: expected a JSON object")
    return obj


def exclude_head_from_quantization(raw: dict, hf_quant: dict | None, base: Path) -> dict | None:
    """Add the head's modules to every ModelOpt exclusion list, in place; None if not quantized."""
    configs = quantization_configs(raw)
    if hf_quant is not None:
        configs.append((HF_QUANT_CONFIG_NAME, hf_quant))
    if not configs:
        return None
    for location, quant in configs:
        nested_hf = location == HF_QUANT_CONFIG_NAME and isinstance(quant.get("quantization"), dict)
        if not (_is_modelopt(quant) or nested_hf):
            method = quant.get("quant_method", "unknown")
            raise AssemblyError(
                f"{base / CONFIG_NAME}: {location} has quant_method {method!r}; assembly can exclude the bf16 head "
                "only from ModelOpt quantization (quant_method 'modelopt', lists 'ignore' / "
                "'quantization.exclude_modules'). Serving the head under another method's config would quantize it"
            )
    added = {}
    for location, quant in configs:
        added.update(add_head_exclusions(quant, location))
    _, first = configs[0]
    return {"method": "modelopt", "quant_algo": _quant_algo(first), "added": added}


# ----------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------


def _copy_with_sha256(source: Path, target: Path) -> str:
    digest = hashlib.sha256()
    with open(source, "rb") as src, open(target, "wb") as dst:
        while chunk := src.read(_COPY_CHUNK_BYTES):
            digest.update(chunk)
            dst.write(chunk)
    return digest.hexdigest()


def _rewrite_without_head(source: Path, target: Path) -> int:
    """Write `source` minus its mtp.* tensors to `target` (tensors bit-identical, metadata kept)."""
    with safe_open(str(source), framework="pt") as handle:
        keep = [k for k in handle.keys() if not k.startswith(ckpt_io.HEAD_PREFIX)]
        tensors = {k: handle.get_tensor(k) for k in keep}
        metadata = handle.metadata() or {"format": "pt"}
    ckpt_io.save_safetensors(target, tensors, metadata=metadata)
    return len(keep)


def _swap_into_place(tmp: Path, out: Path) -> bool:
    """Rename the finished `tmp` to `out`; an existing `out` is moved aside first, then removed."""
    if not out.exists():
        os.rename(tmp, out)
        return False
    old = out.parent / f".{out.name}.{uuid.uuid4().hex[:8]}.old"
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except OSError:
        os.rename(old, out)
        raise
    shutil.rmtree(old)  # unlinks the old symlinks; never follows them into the base
    return True


def assemble(base_dir: Path, head_file: Path, out_dir: Path, *, force: bool = False) -> AssemblyReport:
    """Assemble `base_dir` + `head_file` into `out_dir` (see the module docstring)."""
    base, head_path, out = check_paths(Path(base_dir), Path(head_file), Path(out_dir), force)

    # Everything is checked before anything is written.
    try:
        config = ckpt_io.read_config(base)
        base_ckpt = ckpt_io.SafetensorsCheckpoint(base)
    except ckpt_io.CheckpointError as err:
        raise AssemblyError(f"--base: {err}") from None
    head = check_head_file(head_path, config.text_config)
    raw = _read_json(base / CONFIG_NAME)
    hf_quant_path = base / HF_QUANT_CONFIG_NAME
    hf_quant = _read_json(hf_quant_path) if hf_quant_path.is_file() else None
    config_changes = enable_mtp(raw, config.text_config, head.num_layers)
    quantization = exclude_head_from_quantization(raw, hf_quant, base)

    weight_files = sorted(set(base_ckpt.weight_map.values()))
    plans = plan_shards(base, weight_files)
    entries = sorted(p.name for p in base.iterdir())
    # The head may take the name of a base shard that held only mtp.* (e.g. when the
    # base is itself an assembled directory); any other clash would hide a base file.
    dropped = {p.name for p in plans if p.action == DROP}
    if head_path.name in entries and head_path.name not in dropped:
        raise AssemblyError(
            f"--head {head_file}: the base already has a file named {head_path.name}; rename the head file"
        )

    report = AssemblyReport(
        base=str(base), head_source=str(head_path), out=str(out), head_file=head_path.name,
        head_sha256="", head_tensors=len(head.keys), head_layout=head.layout,
        config_changes=config_changes, quantization=quantization,
    )
    architecture = (raw.get("architectures") or [None])[0]
    if architecture not in SGLANG_DRAFT_ARCHITECTURES:
        report.notes.append(
            f"architecture {architecture!r}: SGLang NEXTN builds its MTP draft only for "
            f"{sorted(SGLANG_DRAFT_ARCHITECTURES)}; vLLM goes by model_type"
        )

    # The new index: the base's keys minus every mtp.* key, plus the head's.
    weight_map = {k: f for k, f in base_ckpt.weight_map.items() if not k.startswith(ckpt_io.HEAD_PREFIX)}
    report.removed_base_mtp_keys = len(base_ckpt.weight_map) - len(weight_map)
    weight_map.update({k: head_path.name for k in head.keys})
    weight_map = dict(sorted(weight_map.items()))
    report.index_keys = len(weight_map)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        generated = {CONFIG_NAME, ckpt_io.INDEX_NAME, RECORD_NAME, head_path.name}
        if hf_quant is not None:
            generated.add(HF_QUANT_CONFIG_NAME)
        by_name = {p.name: p for p in plans}
        for name in entries:
            source = base / name
            plan = by_name.get(name)
            if plan is not None and plan.action == REWRITE:
                kept = _rewrite_without_head(source, tmp / name)
                report.rewritten_shards.append({"name": name, "removed_mtp_tensors": plan.mtp_tensors, "kept_tensors": kept})
            elif plan is not None and plan.action == DROP:
                report.dropped_shards.append(name)
            elif name in generated:
                continue
            elif plan is None and name.endswith(SAFETENSORS_SUFFIX):
                report.skipped.append(f"{name} (a weight file the base index does not name)")
            elif name.startswith(".") and source.is_dir():
                report.skipped.append(f"{name} (hidden directory)")
            else:
                os.symlink(source, tmp / name)  # absolute: base is resolved
                report.linked.append(name)

        report.head_sha256 = _copy_with_sha256(head_path, tmp / head_path.name)
        total_size = 0
        for name in sorted(set(weight_map.values())):
            header = read_safetensors_header(tmp / name)
            total_size += sum(_tensor_bytes(header[k]) for k in header)
        ckpt_io.write_json(tmp / ckpt_io.INDEX_NAME, {"metadata": {"total_size": total_size}, "weight_map": weight_map})
        ckpt_io.write_json(tmp / CONFIG_NAME, raw)
        if hf_quant is not None:
            ckpt_io.write_json(tmp / HF_QUANT_CONFIG_NAME, hf_quant)

        verify_assembled(tmp, head_path.name, set(head.keys))
        report.replaced_existing_out = out.exists()
        ckpt_io.write_json(tmp / RECORD_NAME, report.to_dict())
        _swap_into_place(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return report


def verify_assembled(directory: Path, head_name: str, head_keys: set[str]) -> None:
    """What an engine would load: the index is consistent, and the only mtp.* tensors are the head's."""
    try:
        ckpt_io.SafetensorsCheckpoint(directory)  # every shard exists and holds what the index promises
    except ckpt_io.CheckpointError as err:
        raise AssemblyError(f"assembled directory is inconsistent: {err}") from None
    view = engine_view(directory)
    stray = sorted(k for k, f in view.items() if k.startswith(ckpt_io.HEAD_PREFIX) and f != head_name)
    if stray:
        raise AssemblyError(f"assembled directory still has old head tensors, e.g. {stray[0]} in {view[stray[0]]}")
    missing = sorted(head_keys - {k for k, f in view.items() if f == head_name})
    if missing:
        raise AssemblyError(f"assembled directory does not load {missing[0]} from {head_name}")


# ----------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------


def format_report(report: AssemblyReport) -> str:
    lines = [f"assembled {report.out}", f"  base: {report.base}"]
    lines.append(
        f"  head: {report.head_file} ({report.head_tensors} mtp.* tensors, {report.head_layout} experts, "
        f"copied from {report.head_source}, sha256 {report.head_sha256[:16]}...)"
    )
    lines.append(f"  linked (absolute symlinks into the base): {len(report.linked)} entries")
    for shard in report.rewritten_shards:
        lines.append(
            f"  rewritten without mtp.*: {shard['name']} ({shard['removed_mtp_tensors']} mtp.* removed, "
            f"{shard['kept_tensors']} kept)"
        )
    if report.dropped_shards:
        lines.append(f"  not linked (held only mtp.*): {', '.join(report.dropped_shards)}")
    lines += [f"  skipped: {s}" for s in report.skipped]
    lines.append(
        f"  index: {report.index_keys} keys, {report.head_tensors} mtp.* -> {report.head_file}; "
        f"{report.removed_base_mtp_keys} old mtp.* entries removed"
    )
    lines.append(f"  config: {'; '.join(report.config_changes) or 'MTP fields already set'}")
    if report.quantization is not None:
        added = "; ".join(f"{where} += {entries}" for where, entries in report.quantization["added"].items())
        lines.append(f"  quantization: ModelOpt {report.quantization['quant_algo']}: {added}")
    lines += [f"  note: {n}" for n in report.notes]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="assemble_head.py",
        description="A servable directory: links to the base's files plus the trained MTP head, "
        "a rewritten index and config. The base directory is never modified.",
    )
    parser.add_argument("--base", required=True, type=Path, help="the base checkpoint directory")
    parser.add_argument("--head", required=True, type=Path, help="the head file (mtp-trained.safetensors)")
    parser.add_argument("--out", required=True, type=Path, help="the directory to create (outside --base)")
    parser.add_argument("--force", action="store_true", help="replace --out if it exists")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    try:
        report = assemble(args.base, args.head, args.out, force=args.force)
    except (AssemblyError, OSError) as err:
        print(f"error: {err}", flush=True)
        return 2
    print(json.dumps(report.to_dict(), indent=2) if args.json else format_report(report))
    return 0
