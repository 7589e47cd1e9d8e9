"""Models and datasets named by their Hugging Face Hub ids, resolved to local files.

`model.base`, `model.donor_head` and `model.tokenizer` take a local path or a Hub id,
`org/name`, optionally pinned: `org/name@revision` (a branch, tag or commit). A name that
exists on disk is always the local path. A Hub id is resolved by `huggingface_hub` to its
snapshot in the local cache (`HF_HUB_CACHE`, `HF_HOME`), downloaded first unless the cache
holds it or the Hub is offline (`HF_HUB_OFFLINE=1`, which then requires the cache). The
snapshot's directory name is the commit, which TRAINING.json records with every file's
sha256 (`record.checkpoint_identity`).

A dataset in `data.files` is written `hf:org/name?split=train&column=messages`, with
optional `subset=` and `revision=`: the repository's snapshot, read by `datasets` from that
local directory (its README's configs name the subsets), one record per row, the column
holding the conversation (a list of messages) or the prompt (a string).
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs

from occamy_mtp.errors import OccamyError

HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w./-]+))?$")
COMMIT = re.compile(r"[0-9a-f]{40}")  # a full commit hash: a revision whose snapshot never changes
DATASET_PREFIX = "hf:"
# What a model snapshot needs: config, index and shards, tokenizer and chat template, generation config.
MODEL_FILES = ["*.json", "*.safetensors", "*.txt", "*.jinja", "*.model", "*.tiktoken"]
MODEL_OPTIONS = ("base", "donor_head", "tokenizer")


class HubError(OccamyError, ValueError):
    """A Hub name that cannot be resolved: says which option, what was asked and why."""


def hub_id(spec: str) -> tuple[str, str | None] | None:
    """(repo id, revision or None) when `spec` names a Hub repository rather than a local path."""
    from occamy_mtp.config import UNSET

    if not spec or Path(spec).exists() or spec.startswith((".", "/", "~", UNSET)):
        return None
    match = HUB_ID.match(spec)
    return (match["repo"], match["revision"]) if match else None


def snapshot(repo_id: str, revision: str | None, where: str, repo_type: str = "model",
             allow_patterns: list[str] | None = None) -> Path:
    """The local snapshot directory of a Hub repository (downloaded unless cached or offline)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError,
                                        HfHubHTTPError)

    asked = f"{repo_id}" + (f"@{revision}" if revision else "")
    # A commit's snapshot never changes, and offline nothing else can be had: the cache is read
    # first, without asking the Hub (huggingface_hub 1.x asks it for a commit even offline).
    cache_first = constants.HF_HUB_OFFLINE or (revision is not None and COMMIT.fullmatch(revision) is not None)
    try:
        if cache_first:
            try:
                return Path(snapshot_download(repo_id, repo_type=repo_type, revision=revision, allow_patterns=allow_patterns,
                                              local_files_only=True))
            except LocalEntryNotFoundError:
                if constants.HF_HUB_OFFLINE:
                    raise
        return Path(snapshot_download(repo_id, repo_type=repo_type, revision=revision, allow_patterns=allow_patterns))
    except LocalEntryNotFoundError:
        mode = "the Hub is offline (HF_HUB_OFFLINE)" if constants.HF_HUB_OFFLINE else "the Hub could not be reached"
        raise HubError(f"{where}: {asked} is not a local path, and {mode} while the cache ({constants.HF_HUB_CACHE}) "
                       f"has no snapshot of it; download it first (hf download {repo_id}"
                       + (f" --revision {revision}" if revision else "") + (" --repo-type dataset" if repo_type == "dataset" else "")
                       + "), or give a local path") from None
    except RevisionNotFoundError:
        raise HubError(f"{where}: {asked} is not a local path, and the Hub repository has no revision {revision!r}") from None
    except RepositoryNotFoundError:
        raise HubError(f"{where}: {asked} is not a local path, and no {repo_type} repository on the Hub has that name "
                       "(or it needs a token: hf auth login)") from None
    except (HfHubHTTPError, OSError) as err:
        raise HubError(f"{where}: {asked} is not a local path, and the Hub answered: {err}") from None


def resolve(model):
    """The model settings `model` with every Hub id among `base`, `donor_head` and `tokenizer`
    replaced by its local snapshot directory (local paths are kept as they are)."""
    changes = {}
    for option in MODEL_OPTIONS:
        spec = getattr(model, option)
        named = hub_id(spec)
        if named is not None:
            changes[option] = str(snapshot(*named, where=f"model.{option}", allow_patterns=MODEL_FILES))
    return dataclasses.replace(model, **changes) if changes else model


# ----------------------------------------------------------------------------------
# Datasets
# ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class DatasetSpec:
    """`hf:org/name?split=...&column=...[&subset=...][&revision=...]`."""

    text: str
    repo_id: str
    split: str
    column: str
    subset: str | None = None
    revision: str | None = None


KNOWN_KEYS = ("split", "column", "subset", "revision")


def is_dataset(spec: str) -> bool:
    return str(spec).startswith(DATASET_PREFIX)


def parse_dataset(text: str) -> DatasetSpec:
    """A `data.files` entry naming a Hub dataset; HubError naming what is missing or unknown."""
    body = text[len(DATASET_PREFIX):]
    repo_id, _, query = body.partition("?")
    if not HUB_ID.match(repo_id) or "@" in repo_id:
        raise HubError(f"data.files: {text!r}: expected hf:org/name?split=SPLIT&column=COLUMN "
                       "(and optionally &subset=NAME&revision=REV)")
    values = parse_qs(query, keep_blank_values=True)
    unknown = sorted(set(values) - set(KNOWN_KEYS))
    if unknown:
        raise HubError(f"data.files: {text!r}: unknown key {unknown[0]!r}; expected {', '.join(KNOWN_KEYS)}")
    missing = [key for key in ("split", "column") if not values.get(key, [""])[0]]
    if missing:
        raise HubError(f"data.files: {text!r}: no {missing[0]}= (which {'split to read' if missing[0] == 'split' else 'column holds the conversation'})")
    one = {key: values[key][0] for key in values}
    return DatasetSpec(text, repo_id, one["split"], one["column"], one.get("subset") or None, one.get("revision") or None)


def dataset_identity(spec: DatasetSpec) -> dict:
    """What a dataset's records are a function of: the repository, its commit and every file's sha256."""
    from occamy_mtp.files import sha256_file

    directory = snapshot(spec.repo_id, spec.revision, where=f"data.files: {spec.text}", repo_type="dataset")
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    listed = [{"name": str(p.relative_to(directory)), "bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in files]
    digest = hashlib.sha256("".join(f"{f['name']}:{f['sha256']}\n" for f in listed).encode()).hexdigest()
    return {"repo_id": spec.repo_id, "revision": directory.name, "split": spec.split, "subset": spec.subset,
            "column": spec.column, "directory": str(directory), "files": listed, "sha256": digest,
            "bytes": sum(f["bytes"] for f in listed)}


def dataset_records(spec: DatasetSpec, directory: Path) -> Iterator[tuple[str, object]]:
    """(location, record) of every row of the split: {"messages": [...]} for a list of messages,
    {"prompt": str} for a string; a row whose column is neither is a malformed record."""
    import datasets

    try:
        rows = datasets.load_dataset(str(directory), name=spec.subset, split=spec.split)
    except (ValueError, FileNotFoundError) as err:
        raise HubError(f"data.files: {spec.text}: {err}") from None
    if spec.column not in rows.column_names:
        raise HubError(f"data.files: {spec.text}: no column {spec.column!r}; the split has {', '.join(rows.column_names)}")
    for number, row in enumerate(rows, start=1):
        value = row[spec.column]
        if isinstance(value, list):  # OpenAI style, or ShareGPT's from/value
            sharegpt = bool(value) and isinstance(value[0], dict) and "from" in value[0]
            record = {"conversations" if sharegpt else "messages": value}
        elif isinstance(value, str):
            record = {"prompt": value}
        else:
            record = {"messages": None}  # refused by normalise_record, naming the row
        yield f"{spec.text}: row {number}", record
