"""Offline target cache: the frozen base runs once over every window; training reads it.

The base (34.7B parameters at real size) gives the same outputs for a window in every
epoch, so a pass over all windows (train and heldout) stores what training and
evaluation need, and later epochs, the evaluation of the donor and of the trained
head, and any re-run with other train settings cost no base forward; the base need
not even be on the GPU while the head trains (the head borrows only `embed_tokens`
and `lm_head`, see `load_shared_weights`). The online path (no cache) remains.

    python -m occamy_mtp.cache --config configs/512step.yaml [--dir DIR] [section.key=value ...]

Layout of a cache directory::

    manifest.json                          written first, rewritten (atomically) per shard
    targets-00001-of-00003.safetensors     per shard, packed over its windows' tokens:
        input_ids  int32 [N]               the windows' token ids, concatenated
        hidden     [N, D] base dtype       post-final-norm hidden states (docs/CONTRACT.md section 4)
        greedy     int32 [N]               argmax(W @ hidden): the base's choice for t+1
        offsets    int64 [W + 1]           window w is rows offsets[w]:offsets[w + 1]

At real size 288 windows x 510 tokens x 2048 x 2 bytes is ~0.6 GB. Shards hold whole
windows, in the order train then heldout, up to `max_shard_bytes` each; a shard file
is written under a temporary name and renamed when complete, and only then does the
manifest list it as done, with its size and sha256. An interrupted pass resumes:
shards that are listed and verify are kept, the others are computed again; a partial
shard is never referenced.

Identity. The manifest holds the cache's identity in three parts, and its key is the
sha256 of all three; `TargetCache.open` refuses any cache whose key is not the one the
run expects, naming which parts differ and how:

* base: sha256 of config.json and of the index, each safetensors file's name and
  size, and a sampled fingerprint of each file: the sha256 of its header (every
  tensor's name, dtype, shape and offsets) and of the first, middle and last
  `FINGERPRINT_BLOCK_BYTES` of every tensor's data. At real size that is ~100 MB in
  ~100k small reads (per-expert layout; far fewer fused) instead of hashing 67 GB.
  It detects any change to the config, to the file set, to a tensor's name, dtype or
  shape, and any change of a tensor's values that touches one of the sampled blocks,
  which every fine-tune, merged adapter, re-cast or re-quantisation does (they change
  nearly every element of each matrix they touch). It does not
  detect an edit confined to a few unsampled elements; TRAINING.json keeps the full
  sha256 of every file (`record.checkpoint_identity`) for that audit.
* data: the exact token ids of every window the run reads targets for, in order
  (`run_setup.RunWindows.all()`: the train windows, the self-generated validation and
  heldout windows, the recorded heldout answers; a sha256 over each window's ids),
  with the counts.
* settings: what else changes the numbers or the windows: the base's dtype and
  attention implementation, the window settings (`PreparedData.settings`) and the
  cache format.

A window's targets are the base's outputs for that window as the pass computed them.
The plain pass (`plain_compute`) runs `target.base_outputs` on one window at a
time: the canonical value, which the online path reproduces bit for bit when it too
runs one window per forward (`train.windows_per_step: 1`, the original recipe); seen
on CPU and on an H200 (bf16 and fp32). In a padded multi-window batch a window's
numbers depend on its batch-mates, since batch shape changes the kernels' blocking:
fp32 by ~1e-6 (CPU and H200), bf16 on an H200 by up to 1.6e-2 with one greedy token
in 510 flipped. The online and the cached head then agree to that rounding, not
bitwise; the cached targets are the batch-independent ones. A faster pass plugs in as
`compute`: any callable from a list of windows' token ids to their per-window outputs
(`hidden` (T, D), `greedy` (T,)), such as `fastbase.FastBasePass` as it is. The
command line picks the fast pass by itself where it runs its kernels (a Qwen3.5-MoE
base on CUDA with fla: `auto_fastbase_tokens`), and the plain pass elsewhere; the
manifest records which (`compute`), and a cache never mixes the two.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from safetensors import safe_open

from occamy_mtp import checkpoint as ckpt_io
from occamy_mtp.data import Window
from occamy_mtp.run_setup import load_tokenizer, open_store, prepare_data, run_windows, self_generated_needed
from occamy_mtp.target import DEFAULT_LOGITS_CHUNK_TOKENS, BaseOutputs, OnlineTargets, TargetSource, base_outputs

CACHE_FORMAT = 1
MANIFEST_NAME = "manifest.json"
SHARD_NAME = "targets-{number:05d}-of-{count:05d}.safetensors"
# 256 MiB shards: ~128 real-size windows each, so an interrupted pass loses at most
# ~1 minute of base forwards, and a 288-window cache is three files.
DEFAULT_MAX_SHARD_BYTES = 256 * 1024 * 1024
# Bytes hashed at the start, middle and end of every tensor for the base fingerprint.
FINGERPRINT_BLOCK_BYTES = 1024  # 512 bf16 values: a changed matrix cannot keep them all
FINGERPRINT_METHOD = f"safetensors header + first/middle/last {FINGERPRINT_BLOCK_BYTES} bytes of every tensor"
# int32 ids and int32 greedy choices stored per token, beside the hidden state.
_ID_BYTES_PER_TOKEN = 8
_HASH_BLOCK_BYTES = 16 * 1024 * 1024


class WindowTargets(Protocol):
    """The base's outputs for one window of T tokens (`fastbase.WindowOutputs` is one)."""

    hidden: torch.Tensor  # (T, D) post-final-norm hidden states, base dtype
    greedy: torch.Tensor  # (T,) argmax(W @ hidden)


# A pass over windows: token ids of each window -> its outputs, in order. It batches as
# it likes: `plain_compute` below, or `fastbase.FastBasePass` (packed, fla kernels) as is.
ComputeOutputs = Callable[[Sequence[Sequence[int]]], Sequence[WindowTargets]]


class CacheError(ValueError):
    """A cache that is missing, incomplete, corrupted or not this run's: says which and how."""


# ----------------------------------------------------------------------------------
# Identity
# ----------------------------------------------------------------------------------


def window_digest(input_ids: Sequence[int]) -> str:
    """sha256 of a window's token ids as little-endian int32: its key in the cache."""
    return hashlib.sha256(np.asarray(input_ids, dtype="<i4").tobytes()).hexdigest()


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(_HASH_BLOCK_BYTES):
            digest.update(block)
    return digest.hexdigest()


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


def base_fingerprint(base_dir: Path) -> dict:
    """The base part of the identity (see the module docstring); no path, so a moved base still matches."""
    base_dir = Path(base_dir)
    ckpt = ckpt_io.SafetensorsCheckpoint(base_dir)
    config_path = base_dir / "config.json"
    index_path = base_dir / ckpt_io.INDEX_NAME
    return {
        "config_sha256": _sha256_file(config_path) if config_path.is_file() else None,
        "index_sha256": _sha256_file(index_path) if index_path.is_file() else None,
        "method": FINGERPRINT_METHOD,
        "files": [{"name": f.name, "bytes": f.stat().st_size, "fingerprint": safetensors_fingerprint(f)} for f in ckpt.files()],
    }


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


def cache_identity(base_dir: Path, windows: Sequence[Window], window_settings: dict, dtype: str, attn_implementation: str) -> CacheIdentity:
    """The identity a run with this base, these windows (built with `window_settings`,
    `PreparedData.settings`) and these settings expects."""
    if dtype not in ckpt_io.DTYPES:
        raise ValueError(f"dtype must be one of {sorted(ckpt_io.DTYPES)}, got {dtype!r}")
    settings = {
        "format": CACHE_FORMAT,
        "dtype": dtype,
        "attn_implementation": attn_implementation,
        "windows": dict(window_settings),
    }
    return CacheIdentity(base_fingerprint(base_dir), data_fingerprint(windows), settings)


# ----------------------------------------------------------------------------------
# The pass
# ----------------------------------------------------------------------------------


def padded_ids(rows: Sequence[Sequence[int]], device="cpu") -> tuple[torch.Tensor, torch.Tensor | None]:
    """(input_ids (B, T) right-padded with 0, attention_mask (B, T) or None): as `loss.collate` pads."""
    lengths = torch.tensor([len(ids) for ids in rows])
    length = int(lengths.max())
    input_ids = torch.zeros(len(rows), length, dtype=torch.long)
    for row, ids in enumerate(rows):
        input_ids[row, : len(ids)] = torch.tensor(ids)
    padded = bool((lengths < length).any())
    attention_mask = (torch.arange(length)[None] < lengths[:, None]).long() if padded else None
    return input_ids.to(device), None if attention_mask is None else attention_mask.to(device)


@dataclass(frozen=True)
class _Outputs:
    hidden: torch.Tensor  # (T, D)
    greedy: torch.Tensor  # (T,)


def plain_compute(base, windows_per_batch: int = 1, logits_chunk_tokens: int = DEFAULT_LOGITS_CHUNK_TOKENS) -> ComputeOutputs:
    """The reference pass: `base_outputs` on `windows_per_batch` windows at a time, right-padded.

    One window per forward (the default) gives each window's canonical targets, free of
    any dependence on batch composition.
    """
    if windows_per_batch < 1:
        raise ValueError(f"windows_per_batch must be >= 1, got {windows_per_batch}")
    device = next(base.parameters()).device

    def compute(windows: Sequence[Sequence[int]]) -> list[_Outputs]:
        out = []
        for start in range(0, len(windows), windows_per_batch):
            batch = windows[start : start + windows_per_batch]
            outputs = base_outputs(base, *padded_ids(batch, device), logits_chunk_tokens)
            out += [_Outputs(outputs.hidden[row, : len(ids)], outputs.greedy[row, : len(ids)]) for row, ids in enumerate(batch)]
        return out

    return compute


def plain_compute_name(windows_per_batch: int = 1) -> str:
    return f"target.base_outputs, {windows_per_batch} window(s) per forward"


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
        manifest = _read_manifest(directory)
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
        ckpt_io.write_json(manifest_path, manifest)
    for stale in directory.iterdir():
        if _is_temporary(stale):
            stale.unlink()  # a shard write killed before its rename

    by_digest = {window_digest(ids): tuple(ids) for ids in windows}
    started = time.perf_counter()
    computed = 0
    for number, shard in enumerate(manifest["shards"], start=1):
        if shard["sha256"] is not None:
            problem = _shard_problem(directory, shard, manifest["key"])
            if problem is None:
                continue
            log(f"recomputing {shard['file']}: {problem}")
            shard.update(bytes=None, sha256=None)  # no longer referenced as done, should this pass die too
            manifest["complete"] = False
            ckpt_io.write_json(manifest_path, manifest)
        missing = [d for d in shard["windows"] if d not in by_digest]
        if missing:  # cannot happen with an equal key; guards the plan against a bug
            raise CacheError(f"{directory}: {shard['file']} lists a window that is not among the windows given")
        shard_windows = [by_digest[d] for d in shard["windows"]]
        tensors = _shard_tensors(shard_windows, compute, hidden_size, dtype)
        path = directory / shard["file"]
        # One metadata entry only: safetensors writes several in hash-map order, and a
        # resumed pass must write the very bytes of an uninterrupted one.
        ckpt_io.save_safetensors(path, tensors, metadata={"cache_key": manifest["key"]})
        shard["bytes"] = path.stat().st_size
        shard["sha256"] = _sha256_file(path)
        ckpt_io.write_json(manifest_path, manifest)  # only now is the shard referenced as done
        computed += len(shard_windows)
        log(f"wrote {shard['file']} ({number}/{len(manifest['shards'])}, {len(shard_windows)} windows)")

    if not manifest["complete"] or computed:
        manifest["complete"] = True
        manifest["producer"] = _producer(computed, time.perf_counter() - started)
        ckpt_io.write_json(manifest_path, manifest)
    return manifest


def _is_temporary(path: Path) -> bool:
    return path.name.startswith(".") and path.name.endswith(".tmp")  # ckpt_io.atomic_path's names


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


def _read_manifest(directory: Path) -> dict:
    path = Path(directory) / MANIFEST_NAME
    if not path.is_file():
        raise CacheError(f"{directory}: no target cache here ({MANIFEST_NAME} missing); build it with `python -m occamy_mtp.cache --config CONFIG`")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise CacheError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != CACHE_FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise CacheError(f"{path}: cache format {found!r}, this library reads format {CACHE_FORMAT}; rebuild the cache")
    return manifest


def _shard_problem(directory: Path, shard: dict, key: str, full_hash: bool = True) -> str | None:
    """Why a shard listed as done cannot be used, or None."""
    path = Path(directory) / shard["file"]
    if not path.is_file():
        return "file missing"
    size = path.stat().st_size
    if size != shard["bytes"]:
        return f"{size} bytes, the manifest says {shard['bytes']} (truncated or rewritten)"
    if full_hash and _sha256_file(path) != shard["sha256"]:
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
        manifest = _read_manifest(directory)
        cached = CacheIdentity.from_dict(manifest["identity"])
        if manifest.get("key") != cached.key:
            raise CacheError(f"{directory / MANIFEST_NAME}: its key does not match its identity (edited by hand?); rebuild the cache")
        if cached.key != expected.key:
            raise CacheError(
                f"{directory}: the target cache was built for another base, data or settings; refusing to reuse it:\n  "
                + "\n  ".join(cached.differences(expected))
                + "\nrebuild it (python -m occamy_mtp.cache --config CONFIG) into a new directory"
            )
        done = sum(s["sha256"] is not None for s in manifest["shards"])
        if not manifest["complete"] or done < len(manifest["shards"]):
            raise CacheError(f"{directory}: incomplete target cache ({done} of {len(manifest['shards'])} shards done); run the cache pass again to resume it")
        for shard in manifest["shards"]:
            problem = _shard_problem(directory, shard, manifest["key"], full_hash=verify)
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


def open_targets(
    cache_dir: str | Path, base_dir: str | Path, windows: Sequence[Window], window_settings: dict, dtype: str,
    attn_implementation: str, base=None,
) -> TargetSource:
    """The target source of a run: the cache at `cache_dir` (checked against this run's windows), or online when it is ""."""
    if not str(cache_dir):
        if base is None:
            raise ValueError("no target cache configured, so the base itself is needed for the online path")
        return OnlineTargets(base)
    return TargetCache.open(Path(cache_dir), cache_identity(Path(base_dir), windows, window_settings, dtype, attn_implementation))


# ----------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------


DEFAULT_FASTBASE_TOKENS = 65536  # tokens per forward of the fast pass: 73-75 GiB peak at real size (bench/RESULTS.md)


def auto_fastbase_tokens(base) -> int:
    """What `fastbase_tokens=None` (auto) picks: the fast pass where it runs its kernels, else the plain one (0).

    The fast pass is picked for a Qwen3.5-MoE base on CUDA with fla importable. It
    computes what the plain pass computes through other kernels (checked: with
    transformers' own conv, norms and MoE block it equals the plain forward bit for bit
    at real size; its own kernels move the outputs by no more than a one-ulp change of
    the input does; bench/RESULTS.md). Elsewhere the plain pass is the faster one.
    """
    from occamy_mtp import fastbase

    if base.lm_head.weight.device.type != "cuda" or base.config.model_type != "qwen3_5_moe_text":
        return 0
    try:
        fastbase.fla_kernels()
    except ImportError:
        return 0
    return DEFAULT_FASTBASE_TOKENS


def make_compute(base, windows_per_batch: int = 1, fastbase_tokens: int | None = 0) -> tuple[ComputeOutputs, str]:
    """(compute, its name): the plain pass, or `fastbase.FastBasePass` when `fastbase_tokens` > 0.

    fastbase_tokens None: `auto_fastbase_tokens(base)`, unless several windows per plain
    forward were asked for (then the plain pass).
    """
    if fastbase_tokens is None:
        fastbase_tokens = auto_fastbase_tokens(base) if windows_per_batch == 1 else 0
    if fastbase_tokens > 0:
        from occamy_mtp.fastbase import FastBasePass

        return FastBasePass(base, max_tokens_per_batch=fastbase_tokens), f"fastbase.FastBasePass, {fastbase_tokens} tokens per forward"
    return plain_compute(base, windows_per_batch), plain_compute_name(windows_per_batch)


def build_for_config(
    config,
    directory: str | Path,
    *,
    windows_per_batch: int = 1,
    fastbase_tokens: int | None = 0,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    log: Callable[[str], None] = print,
) -> dict:
    """Build (or resume, or confirm) the target cache of a run config; returns the manifest.

    Loads only the base (not the donor head), on the GPU when there is one. The run's
    windows are those training and export read (`run_setup.run_windows`); the base
    first writes the self-generated continuations the run's store lacks, so that
    training and export from this cache never need the base. See `make_compute` for
    the pass. A complete cache of this identity that verifies is left as it is (the
    base is not loaded).
    """
    tokenizer = load_tokenizer(config)
    data = prepare_data(config, tokenizer)
    store = open_store(config, tokenizer)
    directory = Path(directory)
    base = None
    if store.missing(self_generated_needed(config, data)):
        base = _load_base(config)
    windows = run_windows(config, data, store, base, log).all()
    identity = cache_identity(Path(config.model.base), windows, data.settings, config.model.dtype, config.model.attn_implementation)
    if (directory / MANIFEST_NAME).is_file():
        manifest = _read_manifest(directory)
        if manifest.get("key") == identity.key and manifest.get("complete"):
            if all(_shard_problem(directory, s, identity.key) is None for s in manifest["shards"]):
                log(f"{directory}: target cache complete and verified ({manifest['windows']} windows); nothing to do")
                return manifest
    base = base or _load_base(config)
    compute, compute_name = make_compute(base, windows_per_batch, fastbase_tokens)
    log(f"target cache: {len(windows)} windows -> {directory} ({compute_name})")
    return build_cache(
        directory,
        identity,
        window_ids(windows),
        compute,
        hidden_size=base.config.hidden_size,
        compute_name=compute_name,
        max_shard_bytes=max_shard_bytes,
        log=log,
    )


def _load_base(config):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return ckpt_io.load_base(
        config.model.base, dtype=ckpt_io.DTYPES[config.model.dtype], device=device, attn_implementation=config.model.attn_implementation
    )


def _tokens_or_auto(text: str) -> int | None:
    if text == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of tokens or 'auto', got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or more tokens, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m occamy_mtp.cache",
        description="Run the frozen base once over a run's windows (train and heldout) and store its targets.",
    )
    parser.add_argument("--config", required=True, help="YAML run config, e.g. configs/512step.yaml")
    parser.add_argument("--dir", default="", help="cache directory (default: the config's data.target_cache)")
    parser.add_argument("--windows-per-batch", type=int, default=1, help="windows per plain base forward (1: the canonical per-window targets)")
    parser.add_argument(
        "--fastbase-tokens", type=_tokens_or_auto, default=None, metavar="N|auto",
        help="tokens per forward of the packed fast pass (occamy_mtp.fastbase); 0: the plain pass, one window a forward "
        f"(the canonical targets); auto (default): {DEFAULT_FASTBASE_TOKENS} for a Qwen3.5-MoE base on CUDA with fla, else 0",
    )
    parser.add_argument("--max-shard-bytes", type=int, default=DEFAULT_MAX_SHARD_BYTES, help="upper bound of one shard file")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides, as for train.py")
    args = parser.parse_args(argv)
    from occamy_mtp.config import ConfigError, load_config
    from occamy_mtp.data import DataError

    try:
        config = load_config(args.config, args.overrides)
        directory = args.dir or config.data.target_cache
        if not directory:
            raise ConfigError("data.target_cache: no cache directory configured; set it or pass --dir")
        build_for_config(
            config, directory, windows_per_batch=args.windows_per_batch, fastbase_tokens=args.fastbase_tokens, max_shard_bytes=args.max_shard_bytes
        )
    except (ConfigError, ckpt_io.CheckpointError, DataError, CacheError) as err:
        print(f"error: {err}", flush=True)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
