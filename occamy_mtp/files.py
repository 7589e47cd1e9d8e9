"""Files the library writes, and the digests that identify files and token ids.

Every output goes through a temporary name beside it and a rename, so an interrupted
write never leaves a half file under the final name (`atomic_path`, `atomic_paths` for
a group that lands together). safetensors files are written byte for byte reproducibly.
The digests are the one place each identity is computed: `sha256_file` for a file's
bytes, `token_ids_sha256` for a sequence of token ids (a window, a context).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

HASH_BLOCK_BYTES = 16 * 1024 * 1024


def hash_cache_key(path: Path) -> str:
    """A file's entry in a `sha256_file` cache: its resolved path, size and mtime."""
    stat = Path(path).stat()
    return f"{Path(path).resolve()}|{stat.st_size}|{stat.st_mtime_ns}"


def sha256_file(path: Path, cache: dict | None = None) -> str:
    """sha256 of a file's bytes; `cache` (`hash_cache_key` -> digest) spares reading a file
    again, so that a 67 GB base is read once across exports."""
    path = Path(path)
    key = None
    if cache is not None:
        key = hash_cache_key(path)
        if key in cache:
            return cache[key]
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(HASH_BLOCK_BYTES):
            digest.update(block)
    if key is not None:
        cache[key] = digest.hexdigest()
    return digest.hexdigest()


def token_ids_sha256(token_ids: Sequence[int]) -> str:
    """sha256 of token ids as little-endian int32: the key of a window in the target cache and
    of a context in the self-generated store."""
    return hashlib.sha256(np.asarray(token_ids, dtype="<i4").tobytes()).hexdigest()




TEMPORARY_SUFFIX = ".tmp"


def unwritable(directory: Path) -> str | None:
    """Why files cannot be created in `directory` (or, where it does not exist yet, in the
    directory that would hold it), or None when they can: a file is created there and removed,
    so that read-only mounts, immutable directories and permissions are all found, as they
    would be by the write itself."""
    directory = Path(directory)
    existing = directory
    while not existing.exists():
        if existing.parent == existing:
            break
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file, so {directory} cannot be made there"
    try:
        fd, probe = tempfile.mkstemp(prefix=".occamy-write-check.", dir=existing)
    except OSError as err:
        return f"files cannot be created in {existing} ({err.strerror or err})"
    os.close(fd)
    os.unlink(probe)
    return None


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def temporary_path(final: Path) -> Path:
    """A new, empty file beside `final`: `.{name}.XXXX.tmp`."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=TEMPORARY_SUFFIX, dir=final.parent)
    os.close(fd)
    return Path(tmp)


def stale_temporaries(final: Path) -> list[Path]:
    """Temporaries of `final` left behind by a killed writer."""
    final = Path(final)
    return sorted(final.parent.glob(f".{final.name}.*{TEMPORARY_SUFFIX}")) if final.parent.is_dir() else []


@contextlib.contextmanager
def atomic_path(final: Path) -> Iterator[Path]:
    """Yield a temporary path beside `final`; rename it over `final` only on success."""
    with atomic_paths([final]) as (tmp,):
        yield tmp


@contextlib.contextmanager
def atomic_paths(finals: list[Path], incomplete: Path | None = None) -> Iterator[list[Path]]:
    """Yield one temporary path per final path; on success rename them all, in the given order.

    A group of outputs that belong together (a head and the record of its hash) is
    written completely before any of them replaces an earlier good file, and the last
    path (the record) lands last. On failure every temporary is removed and no final
    file is touched. `incomplete`, when given, is a marker file that exists (fsynced)
    from before the first rename until after the last: a kill between two renames leaves
    it, and readers that find it refuse the set (`model.checkpoint.check_export_set`).
    """
    temporaries = []
    try:
        for final in finals:
            temporaries.append(temporary_path(final))
        yield list(temporaries)
        # mkstemp (and safetensors) create 0600 files whatever the umask: a server running
        # as another user could not read the outputs. Give them the mode open() would.
        mode = 0o666 & ~_current_umask()
        for tmp in temporaries:
            os.chmod(tmp, mode)
            _fsync(tmp)
        if incomplete is not None:
            with open(incomplete, "w") as marker:
                marker.write(f"pid {os.getpid()} is renaming {', '.join(f.name for f in finals)} into place\n")
                marker.flush()
                os.fsync(marker.fileno())
            _fsync(incomplete.parent)
        for tmp, final in zip(temporaries, finals):
            os.replace(tmp, final)
        _fsync(finals[-1].parent)
        if incomplete is not None:
            incomplete.unlink()
            _fsync(incomplete.parent)
    finally:
        for tmp in temporaries:
            if tmp.exists():
                tmp.unlink()


def _fsync(path: Path) -> None:
    """Make a file's bytes, or a directory's entries, durable before what depends on them."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def json_text(obj) -> str:
    """`obj` as standard JSON: a value that is not finite (a NaN loss, an infinite NLL) is written
    as null, never as the NaN or Infinity that strict readers refuse."""
    return json.dumps(_finite_or_null(obj), indent=2, sort_keys=False, allow_nan=False) + "\n"


def _finite_or_null(obj):
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {key: _finite_or_null(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite_or_null(value) for value in obj]
    return obj


def write_json(path: Path, obj) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json_text(obj))


def write_safetensors(path: Path, tensors: Mapping[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """One safetensors file at `path` (not atomic: see `save_safetensors`), byte for byte reproducible.

    safetensors writes the `__metadata__` entries in an order that changes from process to
    process, so the same tensors gave files of different sha256; the header is rewritten
    in place with the entries sorted (same length, so nothing moves).
    """
    contiguous = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    save_file(contiguous, str(path), metadata=metadata or {"format": "pt"})
    with open(path, "r+b") as handle:
        header_bytes = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(header_bytes))
        ordered = {"__metadata__": dict(sorted(header.pop("__metadata__", {}).items())), **header}
        text = json.dumps(ordered, separators=(",", ":")).encode()
        if len(text) > header_bytes:  # cannot happen: the same entries, reordered
            raise ValueError(f"{path}: the sorted safetensors header does not fit ({len(text)} > {header_bytes} bytes)")
        handle.seek(8)
        handle.write(text.ljust(header_bytes, b" "))


def save_safetensors(path: Path, tensors: Mapping[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """One safetensors file, written atomically and reproducibly."""
    with atomic_path(path) as tmp:
        write_safetensors(tmp, tensors, metadata)
