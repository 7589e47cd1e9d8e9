"""What a checkpoint holds, before a long run: `python -m occamy_mtp inspect PATH [--json]`.

PATH is a checkpoint directory or a bare config.json. The report gives the
architecture and dimensions, whether `mtp.*` tensors are present and in which expert
layout, the head's total and trainable parameter counts, and every problem found:
missing, unexpected or mis-shaped tensors (base and head), a head whose hidden size is
not the base's, mixed expert layouts, a quantized base's missing or misshapen scales, an unreadable
index or shard; and what the base takes in memory (for an FP8 base, kept in FP8 too).

No weight is read: shapes come from the safetensors headers, and the head (and the
base, to check its tensor shapes) is built on the meta device, so a real-size
checkpoint is inspected in seconds and without memory.

Exit status: 0 when no problem was found, 1 otherwise (the report is printed either way).
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import torch

from occamy_mtp.model import checkpoint as ckpt_io
from occamy_mtp.model import fp8_weights
from occamy_mtp.model.head import MTPHead, count_parameters, set_trainable
from occamy_mtp.model.quantized import FP8, QuantizationError, scheme_of

# Per kind of tensor problem (missing, unexpected, mis-shaped), how many to list by
# name: a head with all 512 experts missing would otherwise print 1,536 lines.
MAX_LISTED_PER_KIND = 20
# safetensors dtypes a bf16 head can be read from without dequantisation.
FLOAT_DTYPES = ("BF16", "F16", "F32")
BF16_BYTES = 2
GIB = 2**30


def _listed(problems: list[str], kind: str) -> list[str]:
    if len(problems) <= MAX_LISTED_PER_KIND:
        return list(problems)
    rest = len(problems) - MAX_LISTED_PER_KIND
    return problems[:MAX_LISTED_PER_KIND] + [f"... and {rest} more {kind} tensors"]


def _tensor_problems(report: ckpt_io.LoadReport) -> list[str]:
    return (
        _listed(report.missing, "missing")
        + _listed(report.unexpected, "unexpected")
        + _listed(report.mismatched, "mis-shaped")
    )


def dimensions(text_config) -> dict:
    """The text config's sizes that decide the head's shape and the run's cost."""
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    rope = dict(getattr(text_config, "rope_parameters", None) or {})
    layer_types = list(getattr(text_config, "layer_types", None) or [])
    return {
        "hidden_size": text_config.hidden_size,
        "num_hidden_layers": text_config.num_hidden_layers,
        "full_attention_layers": layer_types.count("full_attention"),
        "linear_attention_layers": layer_types.count("linear_attention"),
        "vocab_size": text_config.vocab_size,
        "num_attention_heads": text_config.num_attention_heads,
        "num_key_value_heads": text_config.num_key_value_heads,
        "head_dim": head_dim,
        "rotary_dims": int(head_dim * rope.get("partial_rotary_factor", 1.0)),
        "rope_theta": rope.get("rope_theta"),
        "num_experts": text_config.num_experts,
        "num_experts_per_tok": text_config.num_experts_per_tok,
        "moe_intermediate_size": text_config.moe_intermediate_size,
        "shared_expert_intermediate_size": text_config.shared_expert_intermediate_size,
        "rms_norm_eps": text_config.rms_norm_eps,
        "tie_word_embeddings": bool(getattr(text_config, "tie_word_embeddings", False)),
        "mtp_num_hidden_layers": int(getattr(text_config, "mtp_num_hidden_layers", 0) or 0),
    }


def _quantization(quantization_config: dict | None) -> dict | None:
    if not quantization_config:
        return None
    return {
        "quant_method": quantization_config.get("quant_method"),
        "quant_algo": quantization_config.get("quant_algo"),
    }


def _check_head(ckpt: ckpt_io.SafetensorsCheckpoint, head: MTPHead, hidden_size: int) -> tuple[dict, list[str]]:
    disk_keys = ckpt_io.head_disk_keys(ckpt)
    mtp = {"present": bool(disk_keys), "expert_layout": None, "tensors": len(disk_keys),
           "dtypes": dict(Counter(ckpt.dtype(k) for k in sorted(disk_keys)))}
    if not disk_keys:
        return mtp, []
    problems = []
    fc_key = ckpt_io.HEAD_PREFIX + "fc.weight"
    if fc_key in disk_keys:
        fc_shape = list(ckpt.shape(fc_key))
        if fc_shape != [hidden_size, 2 * hidden_size]:
            problems.append(
                f"base/head dimension mismatch: {fc_key} in {ckpt.file_of(fc_key)} has shape {fc_shape} "
                f"(a head of hidden size {fc_shape[0]}), but the base's hidden_size is {hidden_size} "
                f"(expected {[hidden_size, 2 * hidden_size]})"
            )
    try:
        _, report = ckpt_io.check_tensors(ckpt, ckpt_io.head_module_shapes(head), ckpt_io.HEAD_PREFIX, disk_keys)
    except ckpt_io.CheckpointError as err:  # mixed expert layouts
        return mtp, problems + [str(err)]
    mtp["expert_layout"] = report.layout
    problems += _tensor_problems(report)
    quantized = sorted({d for d in mtp["dtypes"] if d not in FLOAT_DTYPES})
    if quantized:
        problems.append(
            f"mtp.* tensors stored as {', '.join(quantized)}: the head must come from a bf16 donor, not a quantized one"
        )
    return mtp, problems


def _check_base(ckpt: ckpt_io.SafetensorsCheckpoint, base) -> list[str]:
    """Base text tensors against the shapes of the base built from the config (names as load_base maps them)."""
    prefix = ckpt_io.base_text_prefix(ckpt)
    shapes = {name: tuple(t.shape) for name, t in base.state_dict().items()}
    if getattr(base.config, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)
    disk_shapes = {
        name if name == "lm_head.weight" else prefix + name[len(ckpt_io.TEXT_PREFIX):]: shape
        for name, shape in shapes.items()
    }
    disk_keys = {
        k for k in ckpt.keys()
        if k == "lm_head.weight" or (k.startswith(prefix) and not k.startswith(ckpt_io.VISION_PREFIX) and not k.startswith(ckpt_io.HEAD_PREFIX))
    }
    try:
        _, report = ckpt_io.check_tensors(ckpt, disk_shapes, "", disk_keys)
    except ckpt_io.CheckpointError as err:
        return [str(err)]
    return _tensor_problems(report)


def inspect_path(path: Path) -> dict:
    """The report for a checkpoint directory or a bare config.json, as a plain dict."""
    path = Path(path)
    report: dict = {"path": str(path), "source": "config" if path.is_file() else "checkpoint"}
    problems: list[str] = []
    notes: list[str] = []
    _inspect(path, report, problems, notes)
    report["notes"] = notes
    report["problems"] = problems  # last, so that they end the JSON as they end the text
    return report


def _inspect(path: Path, report: dict, problems: list[str], notes: list[str]) -> None:
    try:
        config = ckpt_io.read_config(path)
    except ckpt_io.CheckpointError as err:
        problems.append(str(err))
        return
    text_config = config.text_config
    architectures = config.raw.get("architectures") or []
    report.update({
        "architecture": architectures[0] if architectures else None,
        "model_type": config.raw.get("model_type"),
        "text_model_type": text_config.model_type,
        "multimodal": config.multimodal,
        "dimensions": dimensions(text_config),
        "quantization": _quantization(config.quantization_config),
    })

    with torch.device("meta"):
        head = MTPHead(text_config)
        base = ckpt_io.build_base_model(text_config)
    set_trainable(head)
    total, trainable = count_parameters(head)
    report.update({
        "head_parameters": total,
        "trainable_parameters": trainable,
        "head_bytes_bf16": total * BF16_BYTES,
        "base_parameters": sum(p.numel() for p in base.parameters()),
    })

    report["checkpoint"] = None
    report["mtp"] = {"present": None, "expert_layout": None, "tensors": 0, "dtypes": {}}
    if report["source"] == "config":
        notes.append("config only: no tensors were checked")
        try:
            scheme_of(path.parent, config.quantization_config)
        except QuantizationError as err:
            problems.append(str(err))
        return
    try:
        ckpt = ckpt_io.SafetensorsCheckpoint(path)
    except ckpt_io.CheckpointError as err:
        problems.append(str(err))
        return
    keys = ckpt.keys()
    report["checkpoint"] = {
        "files": len(ckpt.files()),
        "bytes": sum(f.stat().st_size for f in ckpt.files()),
        "tensors": len(keys),
        "text_prefix": ckpt_io.base_text_prefix(ckpt),
        "vision_tensors": sum(k.startswith(ckpt_io.VISION_PREFIX) for k in keys),
        "dtypes": dict(Counter(ckpt.dtype(k) for k in keys)),
    }
    report["mtp"], head_problems = _check_head(ckpt, head, text_config.hidden_size)
    problems += head_problems
    try:  # a quantized base as the library reads it: every scale checked, the weights' shapes dequantized
        readable = ckpt_io.dequantized(ckpt, config.quantization_config)
        if hasattr(readable, "check_scales"):
            readable.check_scales()
    except QuantizationError as err:
        problems.append(str(err))
    else:
        scheme = getattr(readable, "scheme", None)
        if scheme is not None:  # declared in config.json, or in ModelOpt's hf_quant_config.json alone
            declared = report["quantization"] or {"quant_method": None, "quant_algo": None}
            report["quantization"] = {**declared, "scheme": scheme.kind, "declared_in": scheme.source}
            notes.append(f"quantized base ({scheme.kind}{' in blocks of %d x %d' % scheme.block if scheme.kind == FP8 else ''}): "
                         "read as the frozen base; assembly keeps the head out of the quantization")
        problems += _check_base(readable, base)
        report["base_memory"] = base_memory(readable, text_config)
    declared = report["dimensions"]["mtp_num_hidden_layers"]
    if not report["mtp"]["present"]:
        notes.append("no mtp.* tensors: a donor head must be given (its mtp.* tensors) to train")
        if declared:
            notes.append(f"config declares mtp_num_hidden_layers={declared} but the checkpoint has no mtp.* tensors")


def base_memory(ckpt, text_config, dtype_bytes: int = BF16_BYTES) -> dict:
    """Bytes the base's text weights take in memory in bf16, from the headers: dequantized, and for an
    FP8 base with its decoder layers kept in FP8 (`model.fp8_weights`, the default on a GPU): their
    routed experts as stored (codes and multipliers), the rest in bf16, and the buffer the layers'
    experts are written into (the largest layer's, each stack laid out from an aligned offset as
    `fp8_weights.keep_layer` lays it out)."""
    prefix = ckpt_io.base_text_prefix(ckpt)
    keys = [k for k in ckpt.keys() if k == "lm_head.weight" or (
        k.startswith(prefix) and not k.startswith((ckpt_io.VISION_PREFIX, ckpt_io.HEAD_PREFIX)))]
    elements = {k: math.prod(ckpt.shape(k)) for k in keys}
    memory = {"dequantized_bytes": sum(elements.values()) * dtype_bytes}
    if getattr(ckpt, "scheme", None) is None or ckpt.scheme.kind != FP8:
        return memory
    layers = prefix + "layers."
    kept = [k for k in keys if k.startswith(layers) and ckpt.is_fp8(k) and fp8_weights.routed_stack(ckpt_io.module_tensor_name(k))]
    per_layer: dict[int, Counter] = {}  # layer -> its module tensors' elements (experts stacked as loaded)
    for key in kept:
        number = int(key[len(layers):].split(".")[0])
        per_layer.setdefault(number, Counter())[ckpt_io.module_tensor_name(key)] += elements[key]
    buffer = max((fp8_weights.aligned_size([sizes[name] for name in sorted(sizes)]) for sizes in per_layer.values()), default=0)
    held = (sum(ckpt.stored_bytes(k) for k in kept) + (sum(elements.values()) - sum(elements[k] for k in kept)) * dtype_bytes
            + buffer * dtype_bytes)
    memory["kept_in_fp8_bytes"] = held
    return memory


def _size(count: int) -> str:
    return f"{count / GIB:,.2f} GiB" if count >= GIB else f"{count / 2**20:,.2f} MiB"


def _count(n: int | None) -> str:
    return "?" if n is None else f"{n:,}"


def format_report(report: dict) -> str:
    """The report for people: one line per topic, problems last."""
    lines = [f"occamy-mtp inspect: {report['path']}"]

    def row(label: str, text: str) -> None:
        lines.append(f"  {label:<18}{text}")

    if "dimensions" in report:
        d = report["dimensions"]
        row("architecture", f"{report['architecture']} (model_type {report['model_type']}, text "
            f"{report['text_model_type']}, {'multimodal' if report['multimodal'] else 'text-only'})")
        row("dimensions", f"hidden {d['hidden_size']:,}, {d['num_hidden_layers']} layers ({d['full_attention_layers']} "
            f"full attention, {d['linear_attention_layers']} linear), vocab {d['vocab_size']:,}")
        row("attention", f"{d['num_attention_heads']} query / {d['num_key_value_heads']} KV heads, head_dim "
            f"{d['head_dim']}, {d['rotary_dims']} rotary dims, rope_theta {d['rope_theta']:g}")
        row("experts", f"{d['num_experts']} routed, top-{d['num_experts_per_tok']}, intermediate "
            f"{d['moe_intermediate_size']}; shared expert {d['shared_expert_intermediate_size']}")
        q = report["quantization"]
        row("quantization", "none" if q is None else q.get("scheme") or f"{q['quant_method']} {q['quant_algo'] or ''}".rstrip())
        row("base parameters", _count(report["base_parameters"]))
        row("head parameters", f"{_count(report['head_parameters'])} "
            f"({report['head_bytes_bf16'] / 2**20:,.1f} MiB in bf16), trainable {_count(report['trainable_parameters'])}")
    ckpt = report.get("checkpoint")
    if ckpt:
        row("checkpoint", f"{ckpt['files']} files, {ckpt['bytes'] / 2**20:,.1f} MiB, {ckpt['tensors']:,} tensors "
            f"({ckpt['text_prefix']}*; {ckpt['vision_tensors']} vision tensors, not loaded)")
    memory = report.get("base_memory")
    if memory:
        row("base in memory", f"{_size(memory['dequantized_bytes'])} in bf16" + (
            f"; {_size(memory['kept_in_fp8_bytes'])} with its layers kept in FP8 (model.fp8_weights)"
            if "kept_in_fp8_bytes" in memory else ""))
    mtp = report.get("mtp")
    if mtp and mtp["present"] is not None:
        row("mtp head", (f"present, {mtp['expert_layout'] or 'unknown'} expert layout, {mtp['tensors']:,} tensors "
                         f"({', '.join(sorted(mtp['dtypes']))})") if mtp["present"] else "absent")
    for note in report["notes"]:
        row("note", note)
    if report["problems"]:
        lines.append(f"  problems ({len(report['problems'])}):")
        lines += [f"    - {p}" for p in report["problems"]]
    else:
        row("problems", "none")
    return "\n".join(lines)
