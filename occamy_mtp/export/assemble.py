"""Assembly: the frozen base plus the trained head, as one directory an engine serves (docs/reference/CONTRACT.md section 5).

docs/guide/ASSEMBLY.md sets out the details.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import struct
import sys
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from occamy_mtp.errors import OccamyError
from occamy_mtp.families import draft_architectures, family_of
from occamy_mtp.model import checkpoint as ckpt_io
from occamy_mtp import files
from occamy_mtp.model.head import MTPHead

CONFIG_NAME = "config.json"
HF_QUANT_CONFIG_NAME = "hf_quant_config.json"
RECORD_NAME = "assembly.json"
WRITTEN_BY = "occamy_mtp.export.assemble"  # assembly.json's marker: a directory this module wrote
SAFETENSORS_SUFFIX = ".safetensors"
# Weight files of other formats: never copied (the engines load the indexed *.safetensors).
WEIGHT_SUFFIXES = (SAFETENSORS_SUFFIX, ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".msgpack", ".h5")
HEAD_DTYPE = "BF16"  # safetensors' name for bfloat16

# Quantization-exclusion entries that cover the whole head (see the module docstring
# for which engine check each one satisfies).
HEAD_EXCLUSIONS = ("mtp", "mtp*")

# SGLang NEXTN turns only these architectures into its MTP draft class (each family's, `families`).
SGLANG_DRAFT_ARCHITECTURES = draft_architectures()

_HEADER_LENGTH_BYTES = 8  # safetensors files start with a little-endian u64 header length
_MAX_HEADER_BYTES = 100 * 2**20
_COPY_CHUNK_BYTES = 16 * 2**20
_FINITE_CHECK_ELEMENTS = 2**24  # elements checked at a time (bounds the mask's memory)
_FICLONE = 0x40049409  # Linux ioctl: _IOW(0x94, 9, int), a copy-on-write clone of a whole file
_NO_CLONE_ERRNOS = frozenset({errno.EOPNOTSUPP, errno.ENOTTY, errno.EXDEV, errno.EINVAL, errno.ENOSYS})
_GIB = 2**30

LINK = "link"  # the shard is used unchanged: placed by `--weights`
REWRITE = "rewrite"
DROP = "drop"

# How an unchanged weight shard is placed (--weights).
AUTO = "auto"  # CLONE where possible, else SYMLINK into a read-only base, else COPY
CLONE = "clone"
SYMLINK = "symlink"
COPY = "copy"
WEIGHT_MODES = (AUTO, CLONE, SYMLINK, COPY)


class AssemblyError(OccamyError, ValueError):
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
    weights_mode: str = AUTO
    weight_files: dict[str, str] = field(default_factory=dict)  # unchanged base shard -> CLONE, SYMLINK or COPY
    copied: list[str] = field(default_factory=list)  # other base files, copied
    rewritten_shards: list[dict] = field(default_factory=list)  # {name, removed_mtp_tensors, kept_tensors}
    dropped_shards: list[str] = field(default_factory=list)  # base shards holding only mtp.* tensors
    skipped: list[str] = field(default_factory=list)  # base entries deliberately not carried over
    removed_base_mtp_keys: int = 0  # mtp.* keys of the base index that are gone
    index_keys: int = 0
    config_changes: list[str] = field(default_factory=list)
    quantization: dict | None = None  # {method, quant_algo, added: {location: [entries]}}
    notes: list[str] = field(default_factory=list)
    replaced_existing_out: bool = False
    written_by: str = WRITTEN_BY
    entries: list[str] = field(default_factory=list)  # every name written into `out` (assembly.json included)

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
    """(base, head, out) as absolute paths, or an AssemblyError saying which path is wrong and why.

    `--out` must lie outside the base (symlinks resolved), must not contain it, must not
    be the head's directory or contain the head (a directory beside the head, e.g. in
    the training run's output.dir, is fine), and an existing `--out` is replaced only
    with `--force` and only if this module wrote it (`check_replaceable`).
    """
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
        raise AssemblyError(f"--out {out_dir} is inside --base {base_dir} (as {out}); the base directory is never written to")
    if out in base.parents:
        raise AssemblyError(f"--out {out_dir} contains --base {base_dir}; choose a directory outside it")
    # The head as given (its directory resolved) and the file it resolves to.
    for head_location in (_resolve(head.parent) / head.name, head.resolve()):
        if out == head_location.parent:
            raise AssemblyError(
                f"--out {out_dir} is the directory of --head {head_file} ({out}); choose a directory of its own"
            )
        if out in head_location.parents:
            raise AssemblyError(f"--out {out_dir} contains --head {head_file} ({head_location}); choose a directory outside it")
    if Path(os.path.abspath(out_dir)).is_symlink():
        raise AssemblyError(f"--out {out_dir} is a symbolic link; give the real directory")
    if out.exists():
        if not out.is_dir():
            raise AssemblyError(f"--out {out_dir} exists and is not a directory")
        if not force:
            raise AssemblyError(f"--out {out_dir} already exists; pass --force to replace it")
        check_replaceable(out, out_dir)
    return base, head, out


# The fields of assembly.json before it carried the marker: such a directory was written
# by this module too, and `_written_entries` rebuilds what it wrote from them.
_UNMARKED_RECORD_FIELDS = frozenset({
    "base", "head_source", "out", "head_file", "head_sha256", "head_tensors", "head_layout", "linked",
    "rewritten_shards", "dropped_shards", "skipped", "removed_base_mtp_keys", "index_keys", "config_changes",
    "quantization", "notes", "replaced_existing_out",
})


def check_replaceable(out: Path, out_arg: Path | str) -> None:
    """Refuse (AssemblyError) to replace `out` unless this module wrote it and it holds nothing else.

    Its assembly.json must be an assembly record (`written_by`, or the fields of a
    record from before the marker), every entry of `out` must be one the record says
    was written, and none may be a directory (an assembly writes none). An empty
    directory holds nothing to lose and is replaced too.
    """
    present = sorted(p.name for p in out.iterdir())
    if not present:
        return
    refusal = f"--out {out_arg} exists and was not written by assemble_head.py"
    record_path = out / RECORD_NAME
    if record_path.is_symlink() or not record_path.is_file():
        raise AssemblyError(f"{refusal} (it has no {RECORD_NAME}); nothing was deleted: choose another --out, or remove it yourself")
    try:
        record = json.loads(record_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise AssemblyError(f"{refusal}: {record_path} is not readable JSON ({err}); nothing was deleted") from None
    written = _written_entries(record)
    if written is None:
        raise AssemblyError(f"{refusal}: {record_path} is not an assembly record; nothing was deleted: remove it yourself")
    foreign = [name for name in present if name not in written]
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise AssemblyError(
            f"--out {out_arg} holds entries that assembly did not write ({shown}); nothing was deleted: "
            "move them out, or choose another --out"
        )
    directories = [name for name in present if (out / name).is_dir() and not (out / name).is_symlink()]
    if directories:
        raise AssemblyError(
            f"--out {out_arg}: {directories[0]} is now a directory, which assembly never writes; nothing was deleted: "
            "move it out, or choose another --out"
        )


def _written_entries(record) -> set[str] | None:
    """The names an assembly record says were written into its directory; None if it is not one."""
    if not isinstance(record, dict):
        return None
    if record.get("written_by") == WRITTEN_BY:
        entries = record.get("entries")
        return set(entries) if isinstance(entries, list) and all(isinstance(e, str) for e in entries) else None
    if not _UNMARKED_RECORD_FIELDS <= set(record):
        return None
    try:
        written = {CONFIG_NAME, ckpt_io.INDEX_NAME, RECORD_NAME, HF_QUANT_CONFIG_NAME, str(record["head_file"])}
        written |= {str(name) for name in record["linked"]}
        written |= {str(shard["name"]) for shard in record["rewritten_shards"]}
    except (TypeError, KeyError):
        return None
    return written


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
        ckpt_io.check_export_set(head_file)
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
    problems += non_finite_tensors(ckpt, sorted(disk_keys))
    if problems:
        raise AssemblyError("head file does not match the base config:\n  " + "\n  ".join(problems))
    return HeadCheck(tuple(sorted(disk_keys)), report.layout or ckpt_io.FUSED, len(head.layers))


def non_finite_tensors(ckpt: ckpt_io.SafetensorsCheckpoint, keys: list[str]) -> list[str]:
    """One problem per tensor holding a NaN or an infinity (a diverged training run exports those)."""
    problems = []
    for key in keys:
        flat = ckpt.get(key).reshape(-1)
        if not flat.is_floating_point():
            continue
        nan = inf = 0
        for start in range(0, flat.numel(), _FINITE_CHECK_ELEMENTS):
            chunk = flat[start : start + _FINITE_CHECK_ELEMENTS]
            nan += int(torch.isnan(chunk).sum())
            inf += int(torch.isinf(chunk).sum())
        if nan or inf:
            problems.append(
                f"tensor {key} in {ckpt.file_of(key)} is not finite: {nan} NaN and {inf} infinite values "
                f"of {flat.numel()}; a head with them drafts garbage"
            )
    return problems


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
    changes = []
    for name in family_of(text_config.model_type).n_predict_fields:
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
    return files.read_json_object(path, AssemblyError)


def exclude_head_from_quantization(raw: dict, hf_quant: dict | None, base: Path) -> dict | None:
    """Add the head's modules to every ModelOpt exclusion list, in place; None if not quantized."""
    configs = quantization_configs(raw)
    if hf_quant is not None:
        configs.append((HF_QUANT_CONFIG_NAME, hf_quant))
    if not configs:
        return None
    for location, quant in configs:
        nested_hf = location == HF_QUANT_CONFIG_NAME and isinstance(quant.get("quantization"), dict)
        if not (_is_modelopt(quant) or nested_hf or _is_block_fp8(quant)):
            method = quant.get("quant_method", "unknown")
            raise AssemblyError(
                f"{base / CONFIG_NAME}: {location} has quant_method {method!r}; assembly can exclude the bf16 head "
                "only from ModelOpt quantization (quant_method 'modelopt', lists 'ignore' / "
                "'quantization.exclude_modules') and the family's block-wise FP8 (quant_method 'fp8', list "
                "'modules_to_not_convert'). Serving the head under another method's config would quantize it"
            )
    added = {}
    for location, quant in configs:
        if _is_block_fp8(quant):
            added.update(_add_fp8_exclusions(quant, location))
        else:
            added.update(add_head_exclusions(quant, location))
    _, first = configs[0]
    if _is_block_fp8(first):
        return {"method": "fp8", "quant_algo": None, "added": added}
    return {"method": "modelopt", "quant_algo": _quant_algo(first), "added": added}


def _is_block_fp8(quant: dict) -> bool:
    return str(quant.get("quant_method", "")).lower() == "fp8"


def _add_fp8_exclusions(quant: dict, location: str) -> dict[str, list[str]]:
    """Add HEAD_EXCLUSIONS to a block-wise FP8 config's `modules_to_not_convert`, in place."""
    entries = quant.get("modules_to_not_convert")
    if entries is None:
        entries = quant["modules_to_not_convert"] = []
    if not isinstance(entries, list):
        raise AssemblyError(f"{location}: modules_to_not_convert is {type(entries).__name__}, expected a list")
    new = [e for e in HEAD_EXCLUSIONS if e not in entries]
    entries.extend(new)
    return {f"{location}: modules_to_not_convert": new}


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
    files.save_safetensors(target, tensors, metadata=metadata)
    return len(keep)


def clone_file(source: Path, target: Path) -> bool:
    """Make `target` a copy-on-write clone of `source` (Linux FICLONE); False, and no
    `target`, where the filesystems cannot (ext4, tmpfs, two filesystems, not Linux).

    A clone shares the base's blocks until either side is written, and a write to it
    never reaches the base: the safety of a copy at the cost of none.
    """
    if not sys.platform.startswith("linux"):
        return False
    import fcntl

    with open(source, "rb") as src, open(target, "wb") as dst:
        try:
            fcntl.ioctl(dst.fileno(), _FICLONE, src.fileno())
            return True
        except OSError as err:
            if err.errno not in _NO_CLONE_ERRNOS:
                raise
    os.unlink(target)
    return False


def on_read_only_filesystem(path: Path) -> bool:
    """Whether `path` lies on a filesystem mounted read-only (then nobody, root included, writes it)."""
    return bool(os.statvfs(path).f_flag & os.ST_RDONLY)


def _place_weight_files(base: Path, names: list[str], tmp: Path, mode: str, report: AssemblyReport) -> None:
    """Clone, link or copy each unchanged base shard into `tmp` as `mode` says (see the module docstring)."""
    copy_space_checked = False
    for position, name in enumerate(names):
        source, target = base / name, tmp / name
        if mode in (AUTO, CLONE) and clone_file(source, target):
            report.weight_files[name] = CLONE
            continue
        if mode == CLONE:
            raise AssemblyError(
                f"--weights clone: {source} cannot be cloned into {tmp.parent} (no copy-on-write clones on this "
                "filesystem, or base and --out lie on different filesystems); use --weights auto or copy"
            )
        if mode == SYMLINK or (mode == AUTO and on_read_only_filesystem(source)):
            os.symlink(source, target)  # absolute: base is resolved
            report.weight_files[name] = SYMLINK
            continue
        if not copy_space_checked:  # before the first byte: the rest may need copying too
            _check_space_for_copies(base, names[position:], tmp, mode)
            copy_space_checked = True
        shutil.copyfile(source, target)
        report.weight_files[name] = COPY


def _check_space_for_copies(base: Path, names: list[str], tmp: Path, mode: str) -> None:
    needed = sum((base / name).stat().st_size for name in names if mode == COPY or not on_read_only_filesystem(base / name))
    free = shutil.disk_usage(tmp).free
    if needed > free:
        raise AssemblyError(
            f"copying the base's weight shards into {tmp.parent} needs {needed / _GIB:.2f} GiB and "
            f"{free / _GIB:.2f} GiB are free. They are copied because that filesystem cannot clone them from "
            f"{base} and the base is writable, so a link would let a write through the assembled directory "
            "change the base. Put --out where the base's files can be cloned (btrfs, XFS with reflink), mount the "
            "base read-only, free space, or pass --weights symlink to link anyway"
        )


def _temporary_directory(out: Path) -> Path:
    """A new, empty directory beside `out`: `.{name}.XXXXXXXX.tmp`.

    os.mkdir applies the umask, as a plain mkdir does (tempfile.mkdtemp would make it
    0700, unreadable to a server running as another user once it is renamed to `out`).
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    while True:
        tmp = out.parent / f".{out.name}.{uuid.uuid4().hex[:8]}{files.TEMPORARY_SUFFIX}"
        try:
            os.mkdir(tmp)
        except FileExistsError:
            continue
        return tmp


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
    shutil.rmtree(old)  # files and symlinks only (check_replaceable); never follows a link into the base
    return True


def assemble(base_dir: Path, head_file: Path, out_dir: Path, *, force: bool = False, weights: str = AUTO) -> AssemblyReport:
    """Assemble `base_dir` + `head_file` into `out_dir` (see the module docstring).

    `weights` says how the unchanged base shards are placed (WEIGHT_MODES); `force`
    replaces an existing `out_dir` that an earlier assembly wrote (nothing else).
    """
    if weights not in WEIGHT_MODES:
        raise AssemblyError(f"--weights {weights!r}: expected one of {', '.join(WEIGHT_MODES)}")
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
        head_sha256="", head_tensors=len(head.keys), head_layout=head.layout, weights_mode=weights,
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

    tmp = _temporary_directory(out)
    try:
        generated = {CONFIG_NAME, ckpt_io.INDEX_NAME, RECORD_NAME, head_path.name}
        if hf_quant is not None:
            generated.add(HF_QUANT_CONFIG_NAME)
        by_name = {p.name: p for p in plans}
        unchanged_shards = []
        for name in entries:
            source = base / name
            plan = by_name.get(name)
            if plan is not None and plan.action == LINK:
                unchanged_shards.append(name)
            elif plan is not None and plan.action == REWRITE:
                kept = _rewrite_without_head(source, tmp / name)
                report.rewritten_shards.append({"name": name, "removed_mtp_tensors": plan.mtp_tensors, "kept_tensors": kept})
            elif plan is not None and plan.action == DROP:
                report.dropped_shards.append(name)
            elif name in generated:
                continue
            elif name.endswith(WEIGHT_SUFFIXES):
                report.skipped.append(f"{name} (a weight file the base index does not name)")
            elif source.is_dir():
                report.skipped.append(f"{name} (a directory: the engines read the top level)")
            elif not source.is_file():
                report.skipped.append(f"{name} (not a regular file)")
            else:
                shutil.copyfile(source, tmp / name)  # small (tokenizer, generation config, ...): a copy of its own
                report.copied.append(name)
        _place_weight_files(base, unchanged_shards, tmp, weights, report)
        linked_writable = [n for n, how in report.weight_files.items() if how == SYMLINK and not on_read_only_filesystem(base / n)]
        if linked_writable:
            report.notes.append(
                f"{len(linked_writable)} weight shards are symlinks into the writable base (--weights symlink): a tool "
                f"that writes one in place through {out} rewrites the base's file"
            )

        report.head_sha256 = _copy_with_sha256(head_path, tmp / head_path.name)
        total_size = 0
        for name in sorted(set(weight_map.values())):
            header = read_safetensors_header(tmp / name)
            total_size += sum(_tensor_bytes(header[k]) for k in header)
        files.write_json(tmp / ckpt_io.INDEX_NAME, {"metadata": {"total_size": total_size}, "weight_map": weight_map})
        files.write_json(tmp / CONFIG_NAME, raw)
        if hf_quant is not None:
            files.write_json(tmp / HF_QUANT_CONFIG_NAME, hf_quant)

        verify_assembled(tmp, head_path.name, set(head.keys))
        report.replaced_existing_out = out.exists()
        report.entries = sorted({p.name for p in tmp.iterdir()} | {RECORD_NAME})
        files.write_json(tmp / RECORD_NAME, report.to_dict())
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
    placed = {how: [n for n, h in report.weight_files.items() if h == how] for how in (CLONE, SYMLINK, COPY)}
    described = {CLONE: "cloned (copy-on-write)", SYMLINK: "symlinked into the base", COPY: "copied"}
    for how, names in placed.items():
        if names:
            lines.append(f"  weight shards {described[how]}: {len(names)}")
    lines.append(f"  other base files copied: {len(report.copied)}")
    for shard in report.rewritten_shards:
        lines.append(
            f"  rewritten without mtp.*: {shard['name']} ({shard['removed_mtp_tensors']} mtp.* removed, "
            f"{shard['kept_tensors']} kept)"
        )
    if report.dropped_shards:
        lines.append(f"  left out (held only mtp.*): {', '.join(report.dropped_shards)}")
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
