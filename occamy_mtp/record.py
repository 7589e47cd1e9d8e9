"""TRAINING.json: the provenance and results record of a run (docs/reference/CONTRACT.md section 5), and its schema.

The schema is a plain nested description checked by `validate_record`; a test checks
that every exported record passes it and that a broken one does not.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

import torch

from occamy_mtp.files import hash_cache_key, read_json_object, sha256_file

from occamy_mtp import __version__
from occamy_mtp.errors import OccamyError
from occamy_mtp.model import checkpoint as ckpt_io

RECORD_FORMAT = 5  # 3: metrics and self-generated stores per serving configuration; 4: the ceiling, reproducibility;
# 5: standard errors, several sampled continuations a context, figures by context length, file and category
_PACKAGES = ("torch", "transformers", "accelerate", "safetensors", "datasets", "tokenizers", "numpy", "deepspeed", "wandb")
def load_hash_cache(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def git_commit(repo: Path | None = None) -> dict:
    """The library's git commit and whether its tree had uncommitted changes (None outside git)."""
    repo = repo or Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, check=True).stdout.strip()
        return {"commit": commit, "dirty": bool(dirty)}
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None}


def _revision(path: Path) -> str | None:
    """A hub revision when the directory is a hub cache snapshot (`.../snapshots/<sha>/`)."""
    parts = Path(path).resolve().parts
    if len(parts) >= 2 and parts[-2] == "snapshots":
        return parts[-1]
    return None


def checkpoint_identity(path: Path, hash_cache: dict, log=None) -> dict:
    """Config hash and sha256 of every safetensors file of a checkpoint (directory or one file).

    `log`, when given, hears of every file that is hashed (not found in `hash_cache`): at
    real size that is minutes of reading.
    """
    path = Path(path)
    ckpt = ckpt_io.SafetensorsCheckpoint(path)
    if log is not None:
        files = ckpt.files()
        for number, f in enumerate(files, start=1):
            if hash_cache_key(f) not in hash_cache:
                log(f"hashing {f} ({number}/{len(files)}, {f.stat().st_size / 2**30:.2f} GiB)")
                sha256_file(f, hash_cache)
    config_path = path / "config.json" if path.is_dir() else None
    identity = {
        "path": str(path.resolve()),
        "revision": _revision(path) if path.is_dir() else None,
        "config_sha256": sha256_file(config_path, hash_cache) if config_path and config_path.is_file() else None,
        "files": [
            {"name": f.name, "bytes": f.stat().st_size, "sha256": sha256_file(f, hash_cache)} for f in ckpt.files()
        ],
    }
    index = path / ckpt_io.INDEX_NAME if path.is_dir() else None
    if index is not None and index.is_file():
        identity["index_sha256"] = sha256_file(index, hash_cache)
    return identity


def package_versions() -> dict:
    versions = {"python": sys.version.split()[0]}
    for name in _PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def hardware(processes: int) -> dict:
    info = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "processes": processes,
        "cuda_devices": [],
    }
    if torch.cuda.is_available():
        info["cuda_devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def arithmetic(device, processes: int) -> dict:
    """What, beyond a run's inputs, decides the bits of what it computes: the torch build, the device
    (on a CPU its model and the SIMD kernels torch dispatches to), and how the sums are split
    (intra-op threads per process, processes)."""
    device = torch.device(device)
    if device.type == "cuda":
        where = {"device": torch.cuda.get_device_name(device), "cuda": torch.version.cuda}
    else:
        where = {"device": "cpu", "cpu": _cpu_model(), "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    return {"torch": torch.__version__, **where, "threads": torch.get_num_threads(), "processes": processes}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


BYTES_DEPEND_ON = (
    "The head's bytes are a function of its inputs (the base's and donor's files, the data files, every "
    "setting, the library's commit) and of the arithmetic of the machine that trained it (`arithmetic`): "
    "the torch version, the device (a CPU's model and SIMD capability, or the GPU), the threads per process "
    "and the processes, which decide how floating-point sums are split. Where all of these match, a CPU run "
    "gives the same bytes; where one differs, the figures agree within noise and the bytes do not."
)


def library_identity() -> dict:
    return {"name": "occamy-mtp", "version": __version__, **git_commit()}


_LOSS_WINDOW_STEPS = 16  # steps summarised at each end of the loss curve


def training_record(settings: dict, identities: dict, dataset: dict, summary: dict, self_generated: dict, metrics: dict, *,
                    derived: dict, export: dict, seconds: dict, outputs: dict) -> dict:
    """TRAINING.json: provenance and results of one exported head (SCHEMA below); `settings` is the
    run's whole config as a plain tree.

    `summary` is train.py's train-summary.json; `self_generated` the provenance of the
    continuations export read (any it wrote itself are timed there); `seconds` the
    export's own timings.
    """
    losses = [h["loss"] for h in summary["history"]]
    return {
        "format": RECORD_FORMAT,
        "library": library_identity(),
        "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        **identities,
        "dataset": dataset,
        "settings": settings,
        "derived": {"total_steps": summary["steps"], "steps_per_epoch": summary["steps_per_epoch"], **derived,
                    "train_windows": summary["train_windows"]},
        "packages": package_versions(),
        "hardware": hardware(summary["processes"]),
        "timings": {
            "train_seconds": summary["train_seconds"],
            "base_forward_seconds": summary["base_forward_seconds"],
            # the continuations are usually written by train.py; export writes any it lacks (the
            # heldout ones of every serving configuration)
            "self_generation_seconds": sum(store["generation_seconds"] for store in summary["self_generated"].values())
            + sum(store["generation_seconds"] for store in self_generated.values()),
            **seconds,
        },
        "training": {
            "final_loss": summary["final_loss"],
            "loss_first_steps": losses[:_LOSS_WINDOW_STEPS],
            "loss_last_steps": losses[-_LOSS_WINDOW_STEPS:],
            "selection": summary["selection"],
        },
        "self_generated": self_generated,
        "metrics": metrics,
        "export": export,
        "outputs": outputs,
        "reproducibility": {"head_sha256": outputs[ckpt_io.HEAD_FILE], "trained_with": summary.get("arithmetic"),
                            "depends_on": BYTES_DEPEND_ON},
    }


# ----------------------------------------------------------------------------------
# Schema
# ----------------------------------------------------------------------------------

# Counts are numbers: integers under greedy serving, expected counts (fractional) under sampled.
_METRICS = {
    "windows": int, "scored_positions": int, "agreement": float, "data_nll": float, "draft_steps": int,
    "proposed": [float], "accepted": [float], "acceptance": [float], "mean_accept_length": float,
    "accept_rate": float, "text": str, "exact": bool,
}
_SERVED = {
    "draft_steps": int, "texts": int, "proposed": [float], "accepted": [float], "drafted": float, "acceptance": [float],
    "mean_accept_length": float, "accept_rate": float, "verify_passes": float, "tokens_per_verify_pass": float,
    "contexts": int, "mean_accept_length_se": float,
}
_SETTINGS = {"temperature": float, "top_p": float, "top_k": int, "draft": str}
# "serving" maps each serving configuration's label to _SERVING_REPORT, whose "served" maps each
# served step count ("1", "3") to _SERVED; both checked in validate_record.
_SERVING_REPORT = {"settings": {**_SETTINGS, "thinking": bool}, "served": dict, "every_anchor": _METRICS,
                   "by_context": dict, "by_file": dict, "by_category": dict}
_HEAD_REPORT = {"serving": dict, "teacher_forced": (_METRICS, None)}  # None: prompts only
_STORE = {"identity": dict, "windows": int, "finished": int, "generated_tokens": int, "generation_seconds": float}
_IDENTITY = {
    "path": str, "revision": (str, None), "config_sha256": (str, None),
    "files": [{"name": str, "bytes": int, "sha256": str}],
}
SCHEMA = {
    "format": int,
    "library": {"name": str, "version": str, "commit": (str, None), "dirty": (bool, None)},
    "created_utc": str,
    "base": _IDENTITY,
    "donor": _IDENTITY,
    "dataset": {
        "files": [dict], "conversations_read": int, "conversations_kept": int, "excluded": dict,
        "windows": dict, "split": dict,
    },
    "settings": {"model": dict, "data": dict, "train": dict, "eval": dict, "output": dict},
    "derived": {"total_steps": int, "steps_per_epoch": int, "trainable_parameters": int, "head_parameters": int,
                "trainable_tensors": [str], "donor_layout": str, "export_layout": str},
    "packages": {"python": str, "torch": str, "transformers": str, "accelerate": str, "safetensors": str},
    "hardware": {"platform": str, "cpu_count": (int, None), "processes": int, "cuda_devices": [str]},
    "timings": {"train_seconds": float, "base_forward_seconds": float, "self_generation_seconds": float,
                "export_seconds": float},
    "training": {"final_loss": (float, None), "loss_first_steps": [float], "loss_last_steps": [float],
                 "selection": {"enabled": bool, "written_step": (int, None)}},
    "self_generated": dict,  # label of each way the text was written -> _STORE; checked in validate_record
    "metrics": {
        "format": int, "headline": str, "serving": [{"label": str, **_SETTINGS}], "selected_serving": str,
        "served_steps": [int], "max_new_tokens": int,
        "heldout": {"donor": _HEAD_REPORT, "trained": _HEAD_REPORT},
        "ceiling": dict,  # label -> served step count -> _SERVED, checked in validate_record
        "comparison": {"criterion": str, "serving": str, "steps": dict, "trained_not_worse": bool, "allow_worse": bool,
                       "written": bool},
        "decoder_check": {"donor": dict, "trained": dict},
    },
    "export": {"tensors": int, "replaced": [str], "bit_identical_to_donor": int, "max_abs_rounding_error": float},
    "outputs": {"mtp-trained.safetensors": str, "mtp_head_config.json": str},
    "reproducibility": {"head_sha256": str, "trained_with": (dict, None), "depends_on": str},
}


def _check(value, schema, path: str, errors: list[str]) -> None:
    if isinstance(schema, tuple):  # alternatives, e.g. (str, None)
        failures: list[list[str]] = []
        for option in schema:
            if option is None and value is None:
                return
            sub: list[str] = []
            if option is not None:
                _check(value, option, path, sub)
                if not sub:
                    return
                failures.append(sub)
        if len(failures) == 1 and value is not None:  # one shape besides null: say what in it is wrong
            errors.extend(failures[0])
        else:
            errors.append(f"{path}: expected one of {schema}, got {value!r:.80}")
    elif isinstance(schema, dict):
        if not isinstance(value, dict):
            errors.append(f"{path}: expected an object, got {type(value).__name__}")
            return
        for key, sub_schema in schema.items():
            if key not in value:
                errors.append(f"{path}.{key}: missing")
            else:
                _check(value[key], sub_schema, f"{path}.{key}", errors)
    elif isinstance(schema, list):
        if not isinstance(value, list):
            errors.append(f"{path}: expected a list, got {type(value).__name__}")
            return
        for i, item in enumerate(value):
            _check(item, schema[0], f"{path}[{i}]", errors)
    elif schema is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            errors.append(f"{path}: expected a number, got {value!r:.80}")
    elif schema is int:
        if isinstance(value, bool) or not isinstance(value, int):
            errors.append(f"{path}: expected an integer, got {value!r:.80}")
    elif not isinstance(value, schema):
        errors.append(f"{path}: expected {schema.__name__}, got {type(value).__name__}")


def validate_record(record: dict) -> list[str]:
    """Every way `record` departs from SCHEMA (empty when it conforms)."""
    errors: list[str] = []
    _check(record, SCHEMA, "TRAINING", errors)
    if errors:
        return errors
    if not record["self_generated"]:
        errors.append("TRAINING.self_generated: no store of self-generated text")
    for label, store in record["self_generated"].items():
        _check(store, _STORE, f"TRAINING.self_generated.{label}", errors)
    metrics = record["metrics"]
    labels = [s["label"] for s in metrics["serving"]]
    if metrics["selected_serving"] not in labels:
        errors.append(f"TRAINING.metrics.selected_serving: {metrics['selected_serving']!r} is none of {labels}")
    steps = [str(k) for k in metrics["served_steps"]]
    for label in labels:
        for k in steps:
            where = f"TRAINING.metrics.ceiling.{label}.{k}"
            if k not in metrics["ceiling"].get(label, {}):
                errors.append(f"{where}: missing")
            else:
                _check(metrics["ceiling"][label][k], _SERVED, where, errors)
    for name, report in metrics["heldout"].items():
        for label in labels:
            where = f"TRAINING.metrics.heldout.{name}.serving.{label}"
            if label not in report["serving"]:
                errors.append(f"{where}: missing")
                continue
            _check(report["serving"][label], _SERVING_REPORT, where, errors)
            for k in steps:
                if k not in report["serving"][label].get("served", {}):
                    errors.append(f"{where}.served.{k}: missing")
                else:
                    _check(report["serving"][label]["served"][k], _SERVED, f"{where}.served.{k}", errors)
    return errors


# ----------------------------------------------------------------------------------
# Comparing two records: is a head the reference's, and if not, why
# ----------------------------------------------------------------------------------

# Settings that name where things are, not what they are: the files' hashes say that.
_PLACES = ("model.base", "model.donor_head", "model.tokenizer", "data.files", "data.self_generated_dir",
           "data.target_cache", "output.dir")


def _flat_settings(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        out.update(_flat_settings(value, name + ".") if isinstance(value, dict) else {name: value})
    return out


def record_differences(record: dict, reference: dict) -> list[str]:
    """What of the inputs and the arithmetic differs between two TRAINING.json records, one line each:
    why two heads of the same recipe can differ in their bytes (BYTES_DEPEND_ON)."""
    lines = []

    def files_of(identity: dict) -> dict:
        return {f["name"]: f["sha256"] for f in identity.get("files", [])}

    for part in ("base", "donor"):
        if files_of(record[part]) != files_of(reference[part]) or record[part].get("config_sha256") != reference[part].get(
                "config_sha256"):
            lines.append(f"{part}: other files (sha256 of the checkpoint's files differ)")
    if sorted(f["sha256"] for f in record["dataset"]["files"]) != sorted(f["sha256"] for f in reference["dataset"]["files"]):
        lines.append("data: other files (sha256 differ)")
    ours, theirs = _flat_settings(record["settings"]), _flat_settings(reference["settings"])
    for key in sorted(set(ours) | set(theirs)):
        if key not in _PLACES and ours.get(key) != theirs.get(key):
            lines.append(f"setting {key}: {ours.get(key)!r} here, {theirs.get(key)!r} in the reference")
    if record["library"].get("commit") != reference["library"].get("commit"):
        lines.append(f"library commit: {record['library'].get('commit')} here, {reference['library'].get('commit')} in the "
                     "reference (a change of the code may change the arithmetic)")
    for package in ("torch", "transformers"):
        if record["packages"].get(package) != reference["packages"].get(package):
            lines.append(f"{package}: {record['packages'].get(package)} here, {reference['packages'].get(package)} in the reference")
    ours = (record.get("reproducibility") or {}).get("trained_with") or {}
    theirs = (reference.get("reproducibility") or {}).get("trained_with") or {}
    if not theirs:
        lines.append("the reference does not record the arithmetic it was trained with (threads, CPU), which may differ")
    for key in sorted(set(ours) | set(theirs)):
        if key != "torch" and theirs and ours.get(key) != theirs.get(key):
            lines.append(f"trained with {key} {ours.get(key)!r} here, {theirs.get(key)!r} in the reference")
    return lines


SAME, EXPLAINED, UNEXPLAINED = "same", "explained", "unexplained"


def compare_heads(record: dict, reference: dict) -> tuple[str, str]:
    """(SAME, EXPLAINED or UNEXPLAINED; the report): the head's sha256 beside the reference's and,
    when they differ, what explains it (`record_differences`), or that nothing does; then the served
    figures beside the reference's (`figure_differences`), which the bytes do not decide: the same head
    can be measured with other roundings (another CPU's kernels, evaluation batches sized otherwise)."""
    ours, theirs = record["outputs"][ckpt_io.HEAD_FILE], reference["outputs"][ckpt_io.HEAD_FILE]
    figures = _figures_line(record, reference)
    if ours == theirs:
        return SAME, f"head sha256 {ours}: the same bytes as the reference's\n{figures}"
    reasons = record_differences(record, reference)
    lines = [f"head sha256 {ours}: not the reference's {theirs}"]
    if not reasons:
        lines.append("NOT expected: the inputs, settings, code and arithmetic all match the reference's")
        return UNEXPLAINED, "\n".join(lines + [figures])
    lines.append("expected: the run differs from the reference in what decides the bytes:")
    lines += [f"  - {reason}" for reason in reasons]
    return EXPLAINED, "\n".join(lines + [figures])


def served_figures(record: dict) -> dict[tuple[str, str, str], float]:
    """Every served mean accept length of a TRAINING.json: (head, configuration, drafts) -> figure."""
    heldout = (record.get("metrics") or {}).get("heldout") or {}
    return {(head, label, k): figure["mean_accept_length"]
            for head, part in heldout.items() if isinstance(part, dict)
            for label, serving in (part.get("serving") or {}).items()
            for k, figure in (serving.get("served") or {}).items() if "mean_accept_length" in figure}


def figure_differences(record: dict, reference: dict) -> list[tuple[tuple[str, str, str], float, float]]:
    """(key, ours, theirs) of every served figure the two records both hold and that differs."""
    ours, theirs = served_figures(record), served_figures(reference)
    return [(key, ours[key], theirs[key]) for key in sorted(ours) if key in theirs and ours[key] != theirs[key]]


def _figures_line(record: dict, reference: dict) -> str:
    ours, theirs = served_figures(record), served_figures(reference)
    shared = [key for key in ours if key in theirs]
    if not shared:
        return "figures: none to compare (a record without served figures)"
    differ = figure_differences(record, reference)
    if not differ:
        return f"figures: all {len(shared)} served accept lengths equal the reference's"
    (head, label, k), a, b = max(differ, key=lambda d: abs(d[1] - d[2]))
    return (f"figures: {len(differ)} of {len(shared)} served accept lengths differ from the reference's, by at most "
            f"{abs(a - b):.2g} ({head} head, {label}, {k}-step: {a:.6f} here, {b:.6f} in the reference)")


def read_record(path: Path) -> dict:
    """A TRAINING.json that fits the schema; RecordError naming the file otherwise."""
    record = read_json_object(path, RecordError, "TRAINING.json")
    errors = validate_record(record)
    if errors:
        raise RecordError(f"{path}: not a TRAINING.json of this version ({errors[0]}"
                          + (f"; {len(errors) - 1} more" if len(errors) > 1 else "") + ")")
    return record


class RecordError(OccamyError, ValueError):
    """A record that cannot be read or does not fit the schema."""
