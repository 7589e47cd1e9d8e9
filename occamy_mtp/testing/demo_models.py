"""The embedded default's models: a donor with its MTP head, and a base fine-tuned away from it.

This reproduces, at toy size and on CPU, the situation the library exists for:

1. a *donor* model is trained as a language model on the shipped sample chats, and its
   MTP head is trained with it (the head learns to predict x_{i+2} from the donor's
   post-norm H_i and x_{i+1});
2. the *base* ("Occamy") is a fine-tune of the donor on a restyled copy of the chats
   (answers rewritten in a house style), so its hidden states drift and the donor's
   head agrees with it less often;
3. both are written in the real on-disk layout: the donor as a text-only checkpoint
   with fused experts (as Qwen3.6 ships), the base as a multimodal checkpoint with
   per-expert tensors that still carries the donor's stale `mtp.*` tensors, each with
   the tokenizer and its chat template.

Run `python -m occamy_mtp demo-models --out runs/demo/models`. The build is
deterministic for a given number of threads and skipped when `--out` already holds a
build of the same settings and data. The repository ships the default build
(`data/demo-models/`, built by this module with one thread; about 35 minutes on two
shared cores): when `--out` holds no build, that one is copied (its files' sha256
checked) instead of building anew, unless `--build` is given.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from occamy_mtp.console import plural
from occamy_mtp.model import checkpoint as ckpt_io
from occamy_mtp import files
from occamy_mtp.model.head import MTPHead, SharedWeights
from occamy_mtp.testing.checkpoints import tiny_text_config, write_checkpoint
from occamy_mtp.testing.tokenizer import SAMPLE_DATA_PATH, build_tokenizer

MANIFEST = "demo-models.json"
SHIPPED_DIR = SAMPLE_DATA_PATH.parent / "demo-models"  # the default build, committed


@dataclass(frozen=True)
class DemoSettings:
    seed: int = 0
    sequence_tokens: int = 512
    """Length of the packed language-model training sequences."""
    sequences_per_step: int = 8
    donor_steps: int = 480
    """Language-model steps of the donor (with its head trained jointly). With 120 the base's
    greedy text is mostly one phrase repeated (distinct 4-grams ~0.09 of its answers), which
    saturates any head; with 480 it is ~0.41, nearer the text a real base writes."""
    donor_lr: float = 3e-3
    finetune_steps: int = 80
    """Steps of the base's fine-tune on the restyled chats (the head is not updated)."""
    finetune_lr: float = 2e-3
    hidden_size: int = 64
    linear_head_dim: int = 64
    """Gated DeltaNet key and value head dim. 64 (or 128) is what vLLM's CPU kernels accept,
    so that a real engine can serve the demo; the test models use 16."""
    thinking: bool = True
    """Train on each conversation twice: as it is, rendered with thinking off, and with reasoning
    (`demo_reasoning`) before its last answer, rendered with thinking on. The models then write
    reasoning after a thinking-mode prompt (`<think>\\n`) and answer at once after a
    non-thinking one (the empty think block), as the Qwen3.5 family does."""


def restyle(text: str) -> str:
    """The base's "house style": answers in lower case with a fixed opening.

    A deterministic rewrite is enough to move the fine-tuned base's hidden states away
    from the donor's, which is what makes the donor's head go stale.
    """
    return "Occamy here. " + text.lower()


def _first_sentence(paragraph: str, limit: int = 120) -> str:
    """The paragraph's first sentence (or line), whitespace collapsed, at most `limit` characters."""
    text = " ".join(paragraph.split())
    end = min((i + 1 for i in (text.find(". "), text.find(": ")) if i >= 0), default=len(text))
    return text[: min(end, limit)].rstrip()


def demo_reasoning(question: str, answer: str) -> str:
    """The demo's reasoning before `answer` to `question`: the question restated, then the first
    sentences of the answer's first paragraphs as a plan. Deterministic, and made of the
    conversation's own words, as a real model's reasoning mostly is."""
    paragraphs = [p for p in answer.split("\n\n") if p.strip()]
    lines = [f"The user asks: {_first_sentence(question)}",
             f"The documentation answers this in {len(paragraphs)} parts. The first ones say:"]
    lines += [f"- {_first_sentence(p)}" for p in paragraphs[:4]]
    lines.append("I will answer with that text, in its order.")
    return "\n".join(lines)


def with_reasoning(messages: list[dict]) -> list[dict]:
    """`messages` whose last assistant turn carries `demo_reasoning` as its reasoning_content."""
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    question = next(m["content"] for m in reversed(messages[:last]) if m["role"] == "user")
    return [dict(m, reasoning_content=demo_reasoning(question, m["content"])) if i == last else m
            for i, m in enumerate(messages)]


def _conversations(path: Path) -> list[list[dict]]:
    out = []
    with open(path) as handle:
        for line in handle:
            if line.strip():
                out.append(json.loads(line)["messages"])
    return out


def _packed_sequences(tokenizer, conversations: list[list[dict]], length: int) -> torch.Tensor:
    """Render every conversation with the chat template and pack them into (N, length) rows. A
    conversation whose last answer carries reasoning is rendered with thinking on."""
    stream: list[int] = []
    for messages in conversations:
        thinking = any("reasoning_content" in m for m in messages)
        ids = tokenizer.apply_chat_template(messages, tokenize=True, enable_thinking=thinking)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        stream.extend(ids)
    rows = len(stream) // length
    return torch.tensor(stream[: rows * length]).view(rows, length)


def _lm_steps(base, head, sequences, steps, lr, settings: DemoSettings, seed: int, train_head: bool, log=print) -> list[float]:
    """Train `base` as a language model (and `head` on its hidden states) for `steps` steps."""
    params = list(base.parameters()) + (list(head.parameters()) if train_head else [])
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)
    losses = []
    for step in range(steps):
        for group in optimizer.param_groups:  # cosine to 10%
            group["lr"] = lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / max(1, steps - 1))))
        rows = torch.randint(0, sequences.shape[0], (settings.sequences_per_step,), generator=generator)
        ids = sequences[rows]
        hidden = base.model(input_ids=ids, use_cache=False).last_hidden_state
        lm_loss = F.cross_entropy(base.lm_head(hidden[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        loss = lm_loss
        if train_head:
            # Head at anchor i: embeds x_{i+1}, sees H_i, predicts x_{i+2}.
            g = head(ids[None, :, 1:-1], hidden[:, :-2].detach())[0]
            head_loss = F.cross_entropy(head.logits(g).flatten(0, 1), ids[:, 2:].flatten())
            loss = loss + head_loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(lm_loss.detach()))
        if (step + 1) % 20 == 0 or step + 1 == steps:
            log(f"  step {step + 1}/{steps}: language-model loss {losses[-1]:.3f}")
    return losses


def settings_hash(settings: DemoSettings, data_path: Path, torch_threads: int | None = None) -> str:
    """Identity of a build: settings, data and the thread count it was built with, which
    changes the floating-point sums (a build is deterministic for a given number of threads)."""
    threads = torch.get_num_threads() if torch_threads is None else torch_threads
    identity = {**asdict(settings), "torch_threads": threads}
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode())
    digest.update(Path(data_path).read_bytes())
    return digest.hexdigest()


def _build_files(directory: Path) -> dict[str, str]:
    """sha256 of every file of a build (the manifest excluded), by relative path."""
    return {
        p.relative_to(directory).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*")) if p.is_file() and p.name != MANIFEST
    }


def reusable(directory: Path, settings: DemoSettings, data_path: Path) -> dict | None:
    """The manifest of `directory` when it holds a whole build of these settings and data
    (made with any number of threads), else None."""
    manifest_path = Path(directory) / MANIFEST
    if not manifest_path.is_file():
        return None
    manifest = json.loads(manifest_path.read_text())
    threads = manifest.get("torch_threads")
    if not isinstance(threads, int) or manifest.get("fingerprint") != settings_hash(settings, data_path, threads):
        return None
    if not all((Path(directory) / d / "config.json").is_file() for d in ("donor", "base")):
        return None
    return manifest


def copy_shipped(out_dir: Path, shipped: Path = SHIPPED_DIR) -> dict:
    """Copy the shipped build to `out_dir` (absent), after checking each file's sha256
    against its manifest; the copy appears under its name only when whole."""
    manifest = json.loads((shipped / MANIFEST).read_text())
    found = _build_files(shipped)
    if found != manifest.get("files"):
        bad = sorted(set(found.items()) ^ set((manifest.get("files") or {}).items()))
        raise RuntimeError(f"{shipped}: the shipped demo build does not match its {MANIFEST} (first difference: {bad[0][0]})")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        shutil.copytree(shipped, staging / "build")
        os.replace(staging / "build", out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return manifest


def build_demo_models(
    out_dir: Path, settings: DemoSettings = DemoSettings(), data_path: Path = SAMPLE_DATA_PATH, log=print, use_shipped: bool = True
) -> dict:
    """Build (or reuse, or copy the shipped one of) tokenizer, donor and base under `out_dir`; returns the manifest."""
    from transformers import AutoTokenizer

    out_dir = Path(out_dir)
    fingerprint = settings_hash(settings, data_path)
    manifest_path = out_dir / MANIFEST
    manifest = reusable(out_dir, settings, data_path)
    if manifest is not None:
        log(f"demo models: reusing {out_dir}")
        return manifest
    if use_shipped and not out_dir.exists() and reusable(SHIPPED_DIR, settings, data_path) is not None:
        manifest = copy_shipped(out_dir)
        log(f"demo models: copied the shipped build {SHIPPED_DIR} to {out_dir} (built with {manifest['torch_threads']} "
            f"{plural(manifest['torch_threads'], 'thread')} in {manifest['build_seconds']:.0f} s; --build builds them here instead)")
        return manifest
    started = time.perf_counter()
    torch.manual_seed(settings.seed)
    torch.use_deterministic_algorithms(True)
    tokenizer_dir = build_tokenizer(out_dir / "tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)

    conversations = _conversations(data_path)
    if settings.thinking:
        conversations = conversations + [with_reasoning(messages) for messages in conversations]
    restyled = [
        [{**m, "content": restyle(m["content"]), **({"reasoning_content": restyle(m["reasoning_content"])}
                                                     if "reasoning_content" in m else {})}
         if m["role"] == "assistant" else m for m in messages]
        for messages in conversations
    ]
    donor_sequences = _packed_sequences(tokenizer, conversations, settings.sequence_tokens)
    finetune_sequences = _packed_sequences(tokenizer, restyled, settings.sequence_tokens)

    text_config = tiny_text_config(
        vocab_size=len(tokenizer),
        hidden_size=settings.hidden_size,
        linear_key_head_dim=settings.linear_head_dim,
        linear_value_head_dim=settings.linear_head_dim,
    )
    model_class = ckpt_io.base_model_class(text_config)
    donor = model_class._from_config(text_config, dtype=torch.float32)
    head = MTPHead(text_config, SharedWeights(donor.model.embed_tokens, donor.lm_head), experts_implementation="eager")
    with torch.no_grad():
        head.layers[0].mlp.experts.gate_up_proj.normal_(0.0, text_config.initializer_range)
        head.layers[0].mlp.experts.down_proj.normal_(0.0, text_config.initializer_range)
    log(f"demo models: training the donor for {settings.donor_steps} steps on {donor_sequences.shape[0]} sequences")
    donor_losses = _lm_steps(donor, head, donor_sequences, settings.donor_steps, settings.donor_lr, settings, settings.seed, True, log)
    donor_state = {k: v.clone() for k, v in donor.state_dict().items()}
    write_checkpoint(out_dir / "donor", text_config, donor, head, layout=ckpt_io.FUSED, multimodal=False, tokenizer_dir=tokenizer_dir)

    log(f"demo models: fine-tuning the base for {settings.finetune_steps} steps on restyled chats")
    base = model_class._from_config(text_config, dtype=torch.float32)
    base.load_state_dict(donor_state)
    head.attach(SharedWeights(base.model.embed_tokens, base.lm_head))
    finetune_losses = _lm_steps(base, head, finetune_sequences, settings.finetune_steps, settings.finetune_lr, settings, settings.seed + 1, False, log)
    # The base still ships the donor's (now stale) head, as a real fine-tune does.
    write_checkpoint(out_dir / "base", text_config, base, head, layout=ckpt_io.PER_EXPERT, multimodal=True, tokenizer_dir=tokenizer_dir)
    torch.use_deterministic_algorithms(False)

    manifest = {
        "fingerprint": fingerprint,
        "settings": asdict(settings),
        "torch_threads": torch.get_num_threads(),
        "vocab_size": len(tokenizer),
        "donor_lm_loss_first_last": [donor_losses[0], donor_losses[-1]],
        "finetune_lm_loss_first_last": [finetune_losses[0], finetune_losses[-1]],
        "build_seconds": time.perf_counter() - started,
        "files": _build_files(out_dir),
    }
    files.write_json(manifest_path, manifest)
    log(f"demo models: built in {manifest['build_seconds']:.0f} s under {out_dir}")
    return manifest


def build_quantized_demo_base(out_dir: Path, scheme: str, data_path: Path = SAMPLE_DATA_PATH, log=print) -> Path:
    """`out_dir/base-<scheme>`: the demo base at `out_dir/base` (`build_demo_models` writes it)
    quantized under `scheme` ("fp8" or "nvfp4") in the layout users serve (`testing.quantize`);
    NVFP4's input scales calibrated on the sample chats as the template renders them. Reused when it
    exists."""
    from transformers import AutoTokenizer

    from occamy_mtp.testing.quantize import write_quantized_copy

    out_dir = Path(out_dir)
    target = out_dir / f"base-{scheme}"
    if (target / "config.json").is_file():
        log(f"demo models: reusing {target}")
        return target
    tokenizer = AutoTokenizer.from_pretrained(out_dir / "tokenizer", local_files_only=True)
    calibration = _packed_sequences(tokenizer, _conversations(data_path)[:32], 256).tolist()
    started = time.perf_counter()
    write_quantized_copy(out_dir / "base", target, scheme, calibration=calibration)
    log(f"demo models: wrote the {scheme} base {target} ({time.perf_counter() - started:.1f} s)")
    return target
