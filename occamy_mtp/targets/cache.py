"""The offline target cache's format: the frozen base's outputs for every window of a run, on disk.

Shards of packed windows (token ids, post-norm hidden states, greedy targets) and a
manifest holding the cache's identity (base fingerprint, the windows' token ids, the
settings), written shard by shard so that an interrupted pass resumes, and refused when
opened for another base, other windows or other settings. `cache.py` runs the pass;
docs/guide/TARGET_CACHE.md sets out the layout, the identity and which pass computes what.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from occamy_mtp.errors import OccamyError
from occamy_mtp.model import checkpoint as ckpt_io
from occamy_mtp.base.frozen import BaseIdentity
from occamy_mtp import files
from occamy_mtp.files import sha256_file, token_ids_sha256
from occamy_mtp.data.windows import Window
from occamy_mtp.targets.base import BaseOutputs, ComputeOutputs, plain_compute_name

CACHE_FORMAT = 1
MANIFEST_NAME = "manifest.json"
SHARD_NAME = "targets-{number:05d}-of-{count:05d}.safetensors"
# 256 MiB shards: ~128 real-size windows each, so an interrupted pass loses at most
# ~1 minute of base forwards.
DEFAULT_MAX_SHARD_BYTES = 256 * 1024 * 1024
# int32 ids and int32 greedy choices stored per token, beside the hidden state.
_ID_BYTES_PER_TOKEN = 8


class CacheError(OccamyError, ValueError):
    """A cache that is missing, incomplete, corrupted or not this run's: says which and how."""


# ----------------------------------------------------------------------------------
# Identity
# ----------------------------------------------------------------------------------


def window_digest(input_ids: Sequence[int]) -> str:
    """A window's key in the cache (`files.token_ids_sha256`)."""
    return token_ids_sha256(input_ids)


def base_part(fingerprint: dict) -> dict:
    """The base part of the identity: its `checkpoint.checkpoint_fingerprint` without the summary digest."""
    return {k: fingerprint[k] for k in ("config_sha256", "index_sha256", "method", "files")}


def window_ids(windows: Sequence[Window]) -> list[tuple[int, ...]]:
    return [w.input_ids for w in windows]


def data_fingerprint(windows: Sequence[Window]) -> dict:
    """The data part of the identity: the exact token ids of every window, in order."""
    digest = hashlib.sha256()
    for window in windows:
        digest.update(bytes.fromhex(window_digest(window.input_ids)))
    return {
        "windows": len(windows),
        "tokens": sum(len(w.input_ids) for w in windows),
        "window_ids_sha256": digest.hexdigest(),
    }


@dataclass(frozen=True)
class CacheIdentity:
    """What the cached outputs are a function of, in three parts (module docstring)."""

    base: dict
    data: dict
    settings: dict

    @property
    def key(self) -> str:
        blob = json.dumps({"base": self.base, "data": self.data, "settings": self.settings}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()

    def to_dict(self) -> dict:
        return {"base": self.base, "data": self.data, "settings": self.settings}

    @classmethod
    def from_dict(cls, d: dict) -> CacheIdentity:
        return cls(d["base"], d["data"], d["settings"])

    def differences(self, expected: CacheIdentity) -> list[str]:
        """One line per differing field, `part: field: <in this cache> vs <expected>`."""
        lines = []
        for part in ("base", "data", "settings"):
            for field_path, cached, wanted in _diff(getattr(self, part), getattr(expected, part)):
                lines.append(f"{part}: {field_path}: {_short(cached)} in the cache vs {_short(wanted)} for this run")
        return lines


def _diff(cached, wanted, path: str = "") -> list[tuple[str, object, object]]:
    if isinstance(cached, dict) and isinstance(wanted, dict):
        out = []
        for key in sorted(set(cached) | set(wanted), key=str):
            out += _diff(cached.get(key), wanted.get(key), f"{path}.{key}" if path else str(key))
        return out
    if path.endswith("files") and isinstance(cached, list) and isinstance(wanted, list):
        # By file name, so that the line names the file: base: files.model-00002-of-00004.safetensors.fingerprint
        return _diff(_by_name(cached), _by_name(wanted), path)
    return [] if cached == wanted else [(path, cached, wanted)]


def _by_name(files: list) -> dict:
    return {f.get("name") if isinstance(f, dict) else str(f): f for f in files}


def _short(value) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= 80 else text[:77] + "..."


def cache_identity(base: BaseIdentity, windows: Sequence[Window], window_settings: dict) -> CacheIdentity:
    """The identity a run with this base (its whole `base.frozen.BaseIdentity`) and these windows
    (built with `window_settings`, `PreparedData.settings`) expects. The base's fingerprint is the
    identity's base part; its other fields are settings (`activations` only where emulated, as in
    every cache before it was recorded)."""
    if base.dtype not in ckpt_io.DTYPES:
        raise ValueError(f"dtype must be one of {sorted(ckpt_io.DTYPES)}, got {base.dtype!r}")
    settings = {
        "format": CACHE_FORMAT,
        "dtype": base.dtype,
        "attn_implementation": base.attn_implementation,
        "windows": dict(window_settings),
    }
    if base.activations is not None:
        settings["activations"] = base.activations
    return CacheIdentity(base_part(base.fingerprint), data_fingerprint(windows), settings)


@dataclass(frozen=True)
class _ShardPlan:
    file: str
    windows: list[tuple[int, ...]]  # token ids


def plan_shards(windows: Sequence[Sequence[int]], bytes_per_token: int, max_shard_bytes: int) -> list[_ShardPlan]:
    """Whole windows, in order, up to max_shard_bytes per shard (a bigger window gets its own)."""
    groups: list[list[tuple[int, ...]]] = [[]]
    used = 0
    for ids in windows:
        size = len(ids) * bytes_per_token
        if groups[-1] and used + size > max_shard_bytes:
            groups.append([])
            used = 0
        groups[-1].append(tuple(ids))
        used += size
    count = len(groups)
    return [_ShardPlan(SHARD_NAME.format(number=i + 1, count=count), group) for i, group in enumerate(groups)]


def _unique(windows: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    """Distinct token-id sequences, first occurrence kept (equal ids, equal outputs)."""
    return list(dict.fromkeys(tuple(ids) for ids in windows))


def _shard_tensors(windows: Sequence[tuple[int, ...]], compute: ComputeOutputs, hidden_size: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    outputs = list(compute(windows))
    if len(outputs) != len(windows):
        raise CacheError(f"compute returned {len(outputs)} outputs for {len(windows)} windows")
    ids, hidden, greedy = [], [], []
    for ids_w, out in zip(windows, outputs):
        length = len(ids_w)
        if tuple(out.hidden.shape) != (length, hidden_size) or tuple(out.greedy.shape) != (length,):
            raise CacheError(
                f"compute returned hidden {list(out.hidden.shape)} and greedy {list(out.greedy.shape)} "
                f"for a window of {length} tokens; expected [{length}, {hidden_size}] and [{length}]"
            )
        if out.hidden.dtype != dtype:
            raise CacheError(f"compute returned hidden states in {out.hidden.dtype}; this cache stores {dtype}")
        ids.append(torch.tensor(ids_w, dtype=torch.int32))
        hidden.append(out.hidden.cpu())
        greedy.append(out.greedy.to(device="cpu", dtype=torch.int32))
    lengths = torch.tensor([0] + [len(w) for w in windows], dtype=torch.int64)
    return {
        "input_ids": torch.cat(ids),
        "hidden": torch.cat(hidden),
        "greedy": torch.cat(greedy),
        "offsets": torch.cumsum(lengths, 0),
    }


def build_cache(
    directory: Path,
    identity: CacheIdentity,
    windows: Sequence[Sequence[int]],
    compute: ComputeOutputs,
    *,
    hidden_size: int,
    compute_name: str = plain_compute_name(),
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    log: Callable[[str], None] = lambda message: None,
) -> dict:
    """Compute and store the base outputs of `windows` (token ids) in `directory`; resume a partial pass.

    `compute` is called once per shard with that shard's windows. `compute_name`
    describes it (kept in the manifest; a partial cache resumes only under the same
    name, so one cache never mixes two ways of computing). A directory holding a cache
    of another identity, or files that are not a cache, is refused. Shards listed as
    done are verified (size, sha256) and kept; every other shard is computed and
    written. Returns the final manifest.
    """
    directory = Path(directory)
    dtype = ckpt_io.DTYPES[identity.settings["dtype"]]
    manifest_path = directory / MANIFEST_NAME
    if manifest_path.is_file():
        manifest = read_manifest(directory)
        cached = CacheIdentity.from_dict(manifest["identity"])
        if cached.key != identity.key:
            raise CacheError(
                f"{directory}: holds a target cache for another base, data or settings:\n  "
                + "\n  ".join(cached.differences(identity))
                + "\nremove the directory or choose another one"
            )
        if manifest["compute"] != compute_name:
            raise CacheError(
                f"{directory}: this cache was started with compute {manifest['compute']!r}, not {compute_name!r}; "
                "resume it with the same (another way of computing can change the last bits)"
            )
        log(f"resuming the cache in {directory}: {sum(s['sha256'] is not None for s in manifest['shards'])} of {len(manifest['shards'])} shards done")
    else:
        foreign = [p.name for p in directory.iterdir() if not _is_temporary(p)] if directory.is_dir() else []
        if foreign:
            raise CacheError(f"{directory}: not empty and holds no {MANIFEST_NAME} (found {sorted(foreign)[:3]}); choose an empty directory")
        plan = plan_shards(_unique(windows), hidden_size * dtype.itemsize + _ID_BYTES_PER_TOKEN, max_shard_bytes)
        manifest = {
            "format": CACHE_FORMAT,
            "key": identity.key,
            "identity": identity.to_dict(),
            "complete": False,
            "hidden_size": hidden_size,
            "hidden_dtype": identity.settings["dtype"],
            "windows": sum(len(shard.windows) for shard in plan),
            "tokens": sum(len(ids) for shard in plan for ids in shard.windows),
            "max_shard_bytes": max_shard_bytes,
            # How the outputs are computed: not part of the key (they are the base's
            # outputs either way), but one cache is never a mix of two ways.
            "compute": compute_name,
            "shards": [
                {
                    "file": shard.file,
                    "windows": [window_digest(ids) for ids in shard.windows],
                    "lengths": [len(ids) for ids in shard.windows],
                    "bytes": None,
                    "sha256": None,  # set once the file is complete: the shard is done
                }
                for shard in plan
            ],
            "producer": {},
        }
        files.write_json(manifest_path, manifest)
    for stale in directory.iterdir():
        if _is_temporary(stale):
            stale.unlink()  # a shard write killed before its rename

    by_digest = {window_digest(ids): tuple(ids) for ids in windows}
    started = time.perf_counter()
    computed = 0
    for number, shard in enumerate(manifest["shards"], start=1):
        if shard["sha256"] is not None:
            problem = shard_problem(directory, shard, manifest["key"])
            if problem is None:
                continue
            log(f"recomputing {shard['file']}: {problem}")
            shard.update(bytes=None, sha256=None)  # no longer referenced as done, should this pass die too
            manifest["complete"] = False
            files.write_json(manifest_path, manifest)
        missing = [d for d in shard["windows"] if d not in by_digest]
        if missing:  # cannot happen with an equal key; guards the plan against a bug
            raise CacheError(f"{directory}: {shard['file']} lists a window that is not among the windows given")
        shard_windows = [by_digest[d] for d in shard["windows"]]
        tensors = _shard_tensors(shard_windows, compute, hidden_size, dtype)
        path = directory / shard["file"]
        # One metadata entry only: safetensors writes several in hash-map order, and a
        # resumed pass must write the very bytes of an uninterrupted one.
        files.save_safetensors(path, tensors, metadata={"cache_key": manifest["key"]})
        shard["bytes"] = path.stat().st_size
        shard["sha256"] = sha256_file(path)
        files.write_json(manifest_path, manifest)  # only now is the shard referenced as done
        computed += len(shard_windows)
        log(f"wrote {shard['file']} ({number}/{len(manifest['shards'])}, {len(shard_windows)} windows)")

    if not manifest["complete"] or computed:
        manifest["complete"] = True
        manifest["producer"] = _producer(computed, time.perf_counter() - started)
        files.write_json(manifest_path, manifest)
    return manifest


def _is_temporary(path: Path) -> bool:
    return path.name.startswith(".") and path.name.endswith(".tmp")  # files.atomic_path's names


def _producer(computed: int, seconds: float) -> dict:
    """The pass that completed the cache (an interrupted earlier part is not counted)."""
    from occamy_mtp.record import library_identity, package_versions

    return {
        "library": library_identity(),
        "packages": {k: v for k, v in package_versions().items() if k in ("python", "torch", "transformers")},
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "windows_computed": computed,
        "seconds": seconds,
    }


# ----------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------


def read_manifest(directory: Path) -> dict:
    path = Path(directory) / MANIFEST_NAME
    if not path.is_file():
        raise CacheError(f"{directory}: no target cache here ({MANIFEST_NAME} missing); build it with `python -m occamy_mtp cache --config CONFIG`")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise CacheError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != CACHE_FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise CacheError(f"{path}: cache format {found!r}, this library reads format {CACHE_FORMAT}; rebuild the cache")
    return manifest


def shard_problem(directory: Path, shard: dict, key: str, full_hash: bool = True) -> str | None:
    """Why a shard listed as done cannot be used, or None."""
    path = Path(directory) / shard["file"]
    if not path.is_file():
        return "file missing"
    size = path.stat().st_size
    if size != shard["bytes"]:
        return f"{size} bytes, the manifest says {shard['bytes']} (truncated or rewritten)"
    if full_hash and sha256_file(path) != shard["sha256"]:
        return "sha256 differs from the manifest's (corrupted)"
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
    except Exception as err:  # safetensors raises its own error types
        return f"not readable as safetensors ({err})"
    if metadata.get("cache_key") != key:
        return "written for another cache (its cache_key differs)"
    return None


class TargetCache:
    """Read side: the cached base outputs of any batch of windows, by their token ids.

    `outputs(input_ids, attention_mask)` has the signature of `target.base_outputs`
    without the base, so it replaces the online call as is. Reads are lazy: shards are
    memory-mapped through `safe_open` and only the rows of the asked windows are read.
    """

    def __init__(self, directory: Path, manifest: dict):
        self.directory = Path(directory)
        self.manifest = manifest
        self.dtype = ckpt_io.DTYPES[manifest["hidden_dtype"]]
        self.hidden_size = int(manifest["hidden_size"])
        self._where: dict[str, tuple[int, int, int]] = {}  # digest -> (shard, first row, length)
        for number, shard in enumerate(manifest["shards"]):
            row = 0
            for digest, length in zip(shard["windows"], shard["lengths"]):
                self._where[digest] = (number, row, length)
                row += length
        self._handles: dict[int, object] = {}

    @classmethod
    def open(cls, directory: Path, expected: CacheIdentity, verify: bool = True) -> TargetCache:
        """Open a complete cache of exactly the `expected` identity, or raise CacheError saying why not.

        With `verify`, every shard's sha256 is checked (about a second per GB);
        without, only sizes and headers.
        """
        directory = Path(directory)
        manifest = read_manifest(directory)
        cached = CacheIdentity.from_dict(manifest["identity"])
        if manifest.get("key") != cached.key:
            raise CacheError(f"{directory / MANIFEST_NAME}: its key does not match its identity (edited by hand?); rebuild the cache")
        if cached.key != expected.key:
            raise CacheError(
                f"{directory}: the target cache was built for another base, data or settings; refusing to reuse it:\n  "
                + "\n  ".join(cached.differences(expected))
                + "\nrebuild it (python -m occamy_mtp cache --config CONFIG) into a new directory"
            )
        done = sum(s["sha256"] is not None for s in manifest["shards"])
        if not manifest["complete"] or done < len(manifest["shards"]):
            raise CacheError(f"{directory}: incomplete target cache ({done} of {len(manifest['shards'])} shards done); run the cache pass again to resume it")
        for shard in manifest["shards"]:
            problem = shard_problem(directory, shard, manifest["key"], full_hash=verify)
            if problem is not None:
                raise CacheError(f"{directory / shard['file']}: {problem}; run the cache pass again to recompute it")
        return cls(directory, manifest)

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, input_ids: Sequence[int]) -> bool:
        return window_digest(input_ids) in self._where

    def key(self) -> str:
        return self.manifest["key"]

    def provenance(self) -> dict:
        """For TRAINING.json: where the targets came from."""
        return {
            "source": "cache",
            "directory": str(self.directory.resolve()),
            "key": self.manifest["key"],
            "windows": self.manifest["windows"],
            "tokens": self.manifest["tokens"],
            "compute": self.manifest["compute"],
            "producer": self.manifest["producer"],
        }

    def _handle(self, shard: int):
        if shard not in self._handles:
            path = self.directory / self.manifest["shards"][shard]["file"]
            self._handles[shard] = safe_open(str(path), framework="pt")
        return self._handles[shard]

    def window_outputs(self, input_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden (T, D), greedy (T,) long) of one window, on the CPU."""
        digest = window_digest(input_ids)
        if digest not in self._where:
            raise CacheError(
                f"{self.directory}: no window with these {len(input_ids)} token ids (sha256 {digest[:12]}) in the cache; "
                "it was built for other windows"
            )
        shard, row, length = self._where[digest]
        handle = self._handle(shard)
        stored_ids = handle.get_slice("input_ids")[row : row + length]
        if not torch.equal(stored_ids, torch.tensor(list(input_ids), dtype=torch.int32)):
            raise CacheError(f"{self.directory / self.manifest['shards'][shard]['file']}: rows {row}:{row + length} do not hold the window they are listed for")
        hidden = handle.get_slice("hidden")[row : row + length]
        greedy = handle.get_slice("greedy")[row : row + length].long()
        return hidden, greedy

    def outputs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> BaseOutputs:
        """What `base_outputs(base, input_ids, attention_mask)` gives, read from the cache.

        Rows are right-padded (as `loss.collate` makes them); `attention_mask` (or, when
        None, the full row) gives each row's real length. Padded positions, which no loss
        or metric scores, hold zeros.
        """
        batch, length = input_ids.shape
        lengths = attention_mask.sum(dim=1).tolist() if attention_mask is not None else [length] * batch
        hidden = torch.zeros(batch, length, self.hidden_size, dtype=self.dtype)
        greedy = torch.zeros(batch, length, dtype=torch.long)
        rows = input_ids.cpu()
        for row in range(batch):
            real = int(lengths[row])
            hidden[row, :real], greedy[row, :real] = self.window_outputs(rows[row, :real].tolist())
        return BaseOutputs(hidden=hidden.to(input_ids.device), greedy=greedy.to(input_ids.device))
