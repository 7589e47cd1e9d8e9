"""Files the library writes, and the digests that identify files and token ids.

Every output goes through a temporary name beside it and a rename, so an interrupted
write never leaves a half file under the final name (`atomic_path`, `atomic_paths` for
a group that lands together). safetensors files are written byte for byte reproducibly.
The digests are the one place each identity is computed: `sha256_file` for a file's
bytes, `token_ids_sha256` for a sequence of token ids (a window, a context).

Files that are opened in place rather than renamed into place (locks, the stores that
lines are appended to) go through `open_owned`, which never follows a link: a link placed
there by someone else could point into the base, and the base is never written. A write
that fails for want of space becomes one `DiskFull` line naming the path, the space
needed and the space free (`disk_full`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import math
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from occamy_mtp.errors import OccamyError

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


class LinkedOutput(OccamyError, OSError):
    """A file the library would write in place is a link (or has another name): it is not opened."""


class DiskFull(OccamyError, OSError):
    """A write failed for want of space; names the path, the space needed and the space free."""


# os.open flags per mode of `open_owned`; none truncates at open (a hard link would already be
# cut before it could be refused), "w" truncates after the checks.
_OWNED_FLAGS = {
    "a": os.O_WRONLY | os.O_APPEND | os.O_CREAT,
    "a+": os.O_RDWR | os.O_APPEND | os.O_CREAT,
    "r+b": os.O_RDWR,
    "w": os.O_WRONLY | os.O_CREAT,
}


def _linked(path: Path) -> str:
    return (f"{path} is a symbolic link (to {os.readlink(path)}); the library writes no file through a link it "
            "did not make: remove the link and run the command again")


def _not_its_own(path: Path, info: os.stat_result) -> str | None:
    """Why a file of status `info` at `path` is not one the library may write in place, or None."""
    if not stat.S_ISREG(info.st_mode):  # a fifo would block, or refuse the open; a device is nobody's output
        return f"{path} is not a regular file; the library writes there only a file of its own: remove it and run the command again"
    if info.st_nlink > 1:
        return (f"{path} has {info.st_nlink - 1} other name(s) (a hard link); writing it would change those files too, "
                "so it is not opened: remove it and run the command again")
    return None


def not_owned(path: Path) -> str | None:
    """Why `open_owned` would refuse `path` (a link, another name, not a regular file), or None:
    the same refusal before anything slow starts. `open_owned` checks again on the opened file."""
    path = Path(path)
    if path.is_symlink():
        return _linked(path)
    return _not_its_own(path, os.lstat(path)) if path.exists() else None


def open_owned(path: Path, mode: str, encoding: str | None = None):
    """Open `path` for writing in place (modes "a", "a+", "r+b", "w"), never through a link.

    The last component is opened with O_NOFOLLOW, and the opened file must be a regular file
    with no other name: a symbolic link, or a hard link, placed at a lock or store path could
    point into the base directory, and opening it for writing would change the base. Such a
    path raises `LinkedOutput` before a byte is written (`not_owned` before the open, and again
    on the opened file, which a link swapped in meanwhile cannot pass). The directories above
    `path` are the caller's to check (`run.check_run` resolves every output directory against the base).
    """
    path = Path(path)
    problem = not_owned(path)
    if problem:
        raise LinkedOutput(problem)
    flags = _OWNED_FLAGS[mode] | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as err:
        if err.errno == errno.ELOOP or path.is_symlink():
            raise LinkedOutput(_linked(path)) from None
        raise
    try:
        problem = _not_its_own(path, os.fstat(fd))
        if problem:
            raise LinkedOutput(problem)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        if mode == "w":
            os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, mode, encoding=encoding) if "b" in mode else os.fdopen(fd, mode, encoding=encoding or "utf-8")


_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def lock_with_pid(handle, busy: Callable[[str], None]) -> None:
    """Take the exclusive lock of the open lock file `handle` and write this process's pid into it.
    When another process holds it, `busy(its pid, or "unknown")` is called first: it raises to
    refuse, or returns, and the lock is then waited for. Closing the file releases the lock."""
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        busy(handle.read().strip() or "unknown")
        fcntl.flock(handle, fcntl.LOCK_EX)
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()


def disk_full(path: Path, err: BaseException, needed_bytes: int | None = None) -> DiskFull | None:
    """The one-line `DiskFull` for `err`, raised while writing `path`, when it came from a lack of
    space; None for any other error (the caller re-raises it).

    Space shows up as OSError ENOSPC/EDQUOT from Python's own writes, as a message with "No space
    left on device" from safetensors, and, from torch.save, as a RuntimeError that names no cause
    ("unexpected pos ..."): that one counts as a lack of space only when the free space is below
    `needed_bytes`, the size the caller was writing.
    """
    if not isinstance(err, Exception):
        return None
    directory = Path(path).parent
    while not directory.exists() and directory.parent != directory:
        directory = directory.parent
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        free = None
    text = str(err)
    no_space = (isinstance(err, OSError) and err.errno in _NO_SPACE) or "No space left on device" in text \
        or "Disk quota exceeded" in text
    if not no_space and isinstance(err, RuntimeError) and needed_bytes is not None and free is not None:
        no_space = free < needed_bytes
    if not no_space:
        return None
    needed = f"about {size_text(needed_bytes)} is needed, " if needed_bytes else ""
    free_text = f"{size_text(free)} is free" if free is not None else "the free space could not be read"
    return DiskFull(f"{path}: no space left on the device holding {directory} ({needed}{free_text}); "
                    "free some space and run the command again")


@contextlib.contextmanager
def space_errors(path: Path, needed_bytes: int | None = None, kept: str = "",
                 cleanup: Callable[[], None] | None = None) -> Iterator[None]:
    """Turn a lack of space while writing `path` into one `DiskFull` line (`disk_full`), which ends
    with `kept`: what of the write survives. Any other error passes unchanged. `cleanup` runs
    first on any error (a partial temporary removed, so that the free space told is real)."""
    try:
        yield
    except Exception as err:  # noqa: BLE001 - only a lack of space is translated; the rest re-raised as is
        if cleanup is not None:
            cleanup()
        full = None if isinstance(err, OccamyError) else disk_full(path, err, needed_bytes)
        if full is None:
            raise
        raise DiskFull(f"{full}; {kept}" if kept else str(full)) from None


@contextlib.contextmanager
def appended_lines(path: Path, needed_bytes: int | None = None, kept: str = "") -> Iterator:
    """A text stream appending whole lines to `path` (`open_owned`, "a"). A lack of space anywhere, in a
    write, a flush or the close, is one `DiskFull` line ending with `kept` (`space_errors`), and the file
    is left holding whole lines only: a line torn by the failed write is cut off, the lines before it
    stay."""
    path = Path(path)
    stream = open_owned(path, "a")
    start = stream.tell()

    def whole_lines() -> None:
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
        with contextlib.suppress(OSError, ValueError):
            stream.close()
        with contextlib.suppress(OSError):
            _cut_torn_line(path, start)

    with space_errors(path, needed_bytes, kept, cleanup=whole_lines):
        try:
            yield stream
        finally:
            if not stream.closed:
                stream.close()  # in the handler: a flush that finds the disk full is one line too


def _cut_torn_line(path: Path, start: int) -> None:
    """Cut `path` back to its last newline at or after `start` (to `start` when none): what a failed
    append left of its last line."""
    with open_owned(path, "r+b") as raw:
        end = raw.seek(0, os.SEEK_END)
        position = end
        while position > start:
            step = min(65536, position - start)
            raw.seek(position - step)
            chunk = raw.read(step)
            found = chunk.rfind(b"\n")
            if found >= 0:
                position = position - step + found + 1
                break
            position -= step
        if position < end:
            raw.truncate(position)


def size_text(n: int) -> str:
    """A byte count as people read it: 1.5 GiB, 3.2 MiB, 12.0 KiB, 100 bytes (never 0.0 GiB)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


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


def inside(path: Path, directory: Path) -> bool:
    """Whether `path` is `directory` or lies below it, symlinks resolved."""
    path, directory = Path(path).resolve(), Path(directory).resolve()
    return path == directory or directory in path.parents


def inside_any(outputs: Sequence[tuple[str, Path]], protected: Sequence[tuple[str, Path]]) -> str | None:
    """The refusal of the first (option, path) of `outputs` that lies in one of the (option, directory)
    of `protected` (the checkpoints a command only reads), or None when none does."""
    for option, path in outputs:
        for source, directory in protected:
            if inside(path, directory):
                return f"{option}: {path} is inside {source} ({directory}), which is only ever read; choose a directory outside it"
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
def atomic_path(final: Path, needed_bytes: int | None = None) -> Iterator[Path]:
    """Yield a temporary path beside `final`; rename it over `final` only on success."""
    with atomic_paths([final], needed_bytes=needed_bytes) as (tmp,):
        yield tmp


@contextlib.contextmanager
def atomic_paths(finals: list[Path], incomplete: Path | None = None, needed_bytes: int | None = None) -> Iterator[list[Path]]:
    """Yield one temporary path per final path; on success rename them all, in the given order.

    A group of outputs that belong together (a head and the record of its hash) is
    written completely before any of them replaces an earlier good file, and the last
    path (the record) lands last. On failure every temporary is removed and no final
    file is touched. `incomplete`, when given, is a marker file that exists (fsynced)
    from before the first rename until after the last: a kill between two renames leaves
    it, and readers that find it refuse the set (`model.checkpoint.check_export_set`).
    A write that fails for want of space raises `DiskFull` (`needed_bytes`: what the group
    holds, when the caller knows), with nothing replaced.
    """
    temporaries = []
    try:
        for final in finals:
            temporaries.append(temporary_path(final))
        with space_errors(finals[0], needed_bytes, "nothing was replaced", cleanup=lambda: _remove(temporaries)):
            yield list(temporaries)
        # mkstemp (and safetensors) create 0600 files whatever the umask: a server running
        # as another user could not read the outputs. Give them the mode open() would.
        mode = 0o666 & ~_current_umask()
        for tmp in temporaries:
            os.chmod(tmp, mode)
            _fsync(tmp)
        if incomplete is not None:
            with open_owned(incomplete, "w") as marker:
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
        _remove(temporaries)


def _remove(paths: list[Path]) -> None:
    for path in paths:
        path.unlink(missing_ok=True)


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


def read_json_object(path: Path, error: type[Exception], what: str = "JSON") -> dict:
    """The JSON object in `path`; `error` naming the file and what was expected (`what`) when it cannot
    be read, is not JSON (a nesting too deep included) or is not an object."""
    try:
        obj = json.loads(Path(path).read_text())
    except (OSError, ValueError, RecursionError) as err:
        raise error(f"{path}: not readable {what} ({err})") from None
    if not isinstance(obj, dict):
        raise error(f"{path}: not {what}: a JSON object expected, got {type(obj).__name__}")
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


def link_beside(source: Path, link: Path) -> None:
    """`link` made the same file as `source` (a hard link; a copy where the filesystem has none), replacing
    what `link` was in one rename: a reader sees the old file or the new, never half of one."""
    tmp = temporary_path(link)
    tmp.unlink()  # temporary_path makes the file; os.link wants the name free
    try:
        try:
            os.link(source, tmp)
        except OSError:
            with space_errors(link, Path(source).stat().st_size, f"{link.parent} lacks {link.name}; {source} is whole"):
                shutil.copyfile(source, tmp)
        os.replace(tmp, link)
    finally:
        if tmp.exists():
            tmp.unlink()
