"""One head scored on the base it is served on, beside the base it was trained on.

A head is trained on one base's predictions and often served on another: the family's FP8 or
an NVFP4 copy of the base. `evaluate_on_bases` runs the whole evaluation (`evaluate_run`: the
base's own text under every serving configuration, both heads, the ceiling) once on the run's
base and once on each served base, the served base writing its own continuations into its own
store (under `--out`: a store is tied to the base that wrote it). The report gives every served
figure on each base, their differences, with the paired standard error where the two texts are
the same contexts, and a warning where the head was trained on a base other than the one it is
scored on (its TRAINING.json, when it has one, names the base it was trained on).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from occamy_mtp.config import ConfigError
from occamy_mtp.errors import OccamyError
from occamy_mtp.evaluation.evaluate import EVALUATION_FILE, evaluate_run
from occamy_mtp.files import sha256_file, write_json
from occamy_mtp.model import checkpoint as ckpt_io
from occamy_mtp.settings import Plan

SERVED_BASES_FORMAT = 1


def on_base(plan: Plan, base: Path, out: Path) -> Plan:
    """`plan` with `base` as the frozen base, its continuations stored under `out`, no target cache
    (a cache holds another base's targets)."""
    setup = plan.setup
    model = dataclasses.replace(setup.model, base=str(base))
    data = dataclasses.replace(setup.data, target_cache="")
    unset = {k: v for k, v in setup.unset.items() if k != "model.base"}
    setup = dataclasses.replace(setup, model=model, data=data, store_root=Path(out) / "self-generated", unset=unset)
    inputs = {**plan.evaluate.inputs, "base": str(base)}
    return dataclasses.replace(plan, setup=setup, evaluate=dataclasses.replace(plan.evaluate, inputs=inputs))


def check_served_bases(plan: Plan, bases: list[Path]) -> None:
    """Each served base is the run's base in another form (another precision, another file layout): the
    same family and shape, the same vocabulary and tokenizer, its config and quantization readable; a
    ConfigError naming `--served-base` and the first difference otherwise, before anything loads."""
    from occamy_mtp.base.frozen import BaseFacts
    from occamy_mtp.data.windows import load_tokenizer, tokenizer_identity

    run_model = plan.setup.model
    run = BaseFacts(run_model.base).text_config
    run_tokenizer = None
    for base in bases:
        try:
            served = BaseFacts(base).text_config
        except OccamyError as err:
            raise ConfigError(f"--served-base {base}: {err}") from None
        for name in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers"):
            ours, theirs = getattr(run, name, None), getattr(served, name, None)
            if ours != theirs:
                raise ConfigError(f"--served-base {base}: {name} {theirs!r}, the run's base {run_model.base} has {ours!r}: "
                                  "a served base is the run's base in another form (precision, layout), not another model")
        if run_model.tokenizer or not _has_tokenizer(Path(base)):
            continue  # the run's tokenizer (model.tokenizer) reads both bases' text
        run_tokenizer = run_tokenizer or load_tokenizer(run_model)
        theirs = load_tokenizer(dataclasses.replace(run_model, base=str(base)))
        same = {k: v for k, v in tokenizer_identity(run_tokenizer).items() if k != "name_or_path"} == \
            {k: v for k, v in tokenizer_identity(theirs).items() if k != "name_or_path"} and run_tokenizer.get_vocab() == theirs.get_vocab()
        if not same:
            raise ConfigError(f"--served-base {base}: its tokenizer is not the run's ({run_model.base}): other tokens or another "
                              "chat template; give both the same tokenizer files, or model.tokenizer")


def _has_tokenizer(directory: Path) -> bool:
    return any((directory / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


def trained_on(head_path: Path) -> dict | None:
    """The base identity the head's TRAINING.json records (path, config and file hashes), or None
    where the head has no record beside it."""
    directory = head_path if head_path.is_dir() else head_path.parent
    record = directory / ckpt_io.EXPORT_RECORD
    if not record.is_file():
        return None
    try:
        base = json.loads(record.read_text()).get("base")
    except json.JSONDecodeError:
        return None
    return base if isinstance(base, dict) else None


def same_base(identity: dict | None, base: Path) -> bool | None:
    """Whether `identity` (TRAINING.json's) is the checkpoint at `base`, by its weight files'
    names and sizes and its config's hash; None when there is no identity to compare."""
    if identity is None:
        return None
    ckpt = ckpt_io.SafetensorsCheckpoint(base)
    files = sorted((f.name, f.stat().st_size) for f in ckpt.files())
    recorded = sorted((f["name"], f["bytes"]) for f in identity.get("files", []))
    if files != recorded:
        return False
    config = base / "config.json"
    return identity.get("config_sha256") in (None, sha256_file(config, {}) if config.is_file() else None)


def differences(first: dict, second: dict) -> dict:
    """Per head, serving configuration and served step count: the mean accept length on each base
    and second minus first."""
    out = {}
    for head, report in first["heads"].items():
        for label, figures in report.get("serving", {}).items():
            other = second["heads"].get(head, {}).get("serving", {}).get(label)
            if other is None:
                continue
            for k, served in figures["served"].items():
                a, b = served["mean_accept_length"], other["served"][k]["mean_accept_length"]
                out.setdefault(head, {}).setdefault(label, {})[k] = {"run_base": a, "served_base": b, "difference": b - a}
    return out


def evaluate_on_bases(plan: Plan, head_path: Path, out: Path, device, bases: list[Path], **options) -> tuple[dict, str]:
    """`evaluate_run` on the run's base, then on each of `bases` (into `out/served-on-<name>`);
    evaluation.json gains `served_bases`: per base its report's path, whether the head was trained
    on it, and every served figure's difference from the run's base. Returns the report and the
    printed tables, the warnings first."""
    names = [Path(base).name for base in bases]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:  # each base's evaluation goes to out/served-on-<name>
        raise ConfigError(f"--served-base: two bases are named {twice[0]!r}; their evaluations would share "
                          f"{Path(out) / ('served-on-' + twice[0])}: give each its own directory name")
    check_served_bases(plan, bases)  # before the run's own evaluation: minutes on the demo, hours at real size
    report, printed = evaluate_run(plan, head_path, out, device, **options)
    identity = trained_on(Path(head_path))
    sections, warnings = {}, []
    run_base = Path(plan.setup.model.base)
    primary_trained = same_base(identity, run_base)
    if primary_trained is False:
        warnings.append(f"warning: the head was not trained on the run's base {run_base} (its TRAINING.json names "
                        f"{identity.get('path')})")
    for base in bases:
        base = Path(base)
        target = Path(out) / f"served-on-{base.name}"
        served, text = evaluate_run(on_base(plan, base, target), head_path, target, device, **options)
        trained_here = same_base(identity, base)
        diff = differences(report, served)
        worst = min((d["difference"] for h in diff.get("trained", {}).values() for d in h.values()), default=0.0)
        if trained_here is False or (trained_here is None and base != run_base):
            warnings.append(f"warning: the head was trained on {identity.get('path') if identity else 'another base'} "
                            f"and is scored here on {base}: its served accept length moves by as much as {worst:+.3f} "
                            f"there (the trained head's figures, {base.name} minus the run's base)")
        sections[str(base)] = {"report": str(target / EVALUATION_FILE), "head_trained_on_it": trained_here,
                               "differences": diff}
        printed += f"\n\nserved on {base}:\n{text}"
    report["served_bases"] = {"format": SERVED_BASES_FORMAT, "run_base": str(run_base),
                              "head_trained_on_run_base": primary_trained, "bases": sections, "warnings": warnings}
    write_json(Path(out) / EVALUATION_FILE, report)
    table = _format(report["served_bases"])
    return report, "\n".join(warnings + [printed, table])


def _format(section: dict) -> str:
    lines = ["", "accept length on each served base against the run's base (trained head; donor in brackets):"]
    for base, entry in section["bases"].items():
        diff = entry["differences"]
        for label, by_k in diff.get("trained", {}).items():
            for k, d in by_k.items():
                donor = diff.get("donor", {}).get(label, {}).get(k)
                tail = f" [{donor['run_base']:.3f} -> {donor['served_base']:.3f}]" if donor else ""
                lines.append(f"  {Path(base).name:<16} {label:<20} K={k}: {d['run_base']:.3f} -> {d['served_base']:.3f} "
                             f"({d['difference']:+.3f}){tail}")
    return "\n".join(lines)
