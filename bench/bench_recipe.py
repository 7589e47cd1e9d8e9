"""Wall time and peak memory of the 512-step recipe at full size, excluding checkpoint loading.

    PYTHONPATH=. python3 bench/bench_recipe.py --out recipe.json           # H200, real dimensions
    PYTHONPATH=. python3 bench/bench_recipe.py --tiny --device cpu         # a smoke run of the same code

A random-weight Qwen3.5-35B-A3B-shaped base and head are built directly on the device
(speed and memory do not depend on the values). The recipe, timed phase by phase:

1. target pass: the frozen base over all 288 windows (256 train + 32 heldout, 128 + 382
   tokens each), one window per forward (the canonical pass of `occamy_mtp.cache`),
   keeping post-norm hidden states and greedy targets on the device;
2. 512 training steps of fc + the two pre-fc norms (fp32 masters, AdamW, clipping),
   2 epochs of one window a step, from those targets;
3. export-time evaluation of donor and trained head on the 32 heldout windows.

Windows are random tokens, so agreement figures mean nothing here; only time and memory.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from occamy_mtp.checkpoint import base_model_class, text_config_from_dict
from occamy_mtp.evaluate import evaluate_head
from occamy_mtp.head import MTPHead, SharedWeights, set_trainable
from occamy_mtp.loss import chain_batch, chain_loss
from occamy_mtp.target import BaseOutputs, base_outputs
from occamy_mtp.testing.checkpoints import QWEN3_5_35B_A3B, tiny_text_config
from occamy_mtp.train import collate, lr_at, step_windows

CONTEXT_TOKENS, ANSWER_TOKENS = 128, 382
TRAIN_WINDOWS, HELDOUT_WINDOWS, EPOCHS = 256, 32, 2


class _Window:
    """The fields of `data.Window` that training reads."""

    def __init__(self, input_ids, answer_start):
        self.input_ids = tuple(input_ids)
        self.answer_start = answer_start


class _Targets:
    """Targets of each window, looked up by its token ids (what `cache.TargetCache` does)."""

    def __init__(self):
        self.by_ids: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def outputs(self, input_ids, attention_mask=None) -> BaseOutputs:
        rows = [self.by_ids[tuple(r.tolist())] for r in input_ids]
        return BaseOutputs(torch.stack([h for h, _ in rows]), torch.stack([g for _, g in rows]))


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny dimensions (smoke run)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps-per-epoch", type=int, default=TRAIN_WINDOWS, help="fewer for a smoke run")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    config = tiny_text_config() if args.tiny else text_config_from_dict(QWEN3_5_35B_A3B)
    config._attn_implementation = "sdpa"
    dtype = torch.bfloat16

    started = time.perf_counter()
    with torch.device(device):
        base = base_model_class(config)._from_config(config, dtype=dtype)
        head = MTPHead(config, SharedWeights(base.model.embed_tokens, base.lm_head)).to(dtype)
    base.requires_grad_(False).eval()
    trainable = set_trainable(head)
    for param in head.parameters():
        if param.requires_grad:
            param.data = param.data.float()
    sync(device)
    build_seconds = time.perf_counter() - started
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()

    generator = torch.Generator().manual_seed(1)
    length = CONTEXT_TOKENS + ANSWER_TOKENS
    windows = [
        _Window(torch.randint(0, config.vocab_size, (length,), generator=generator).tolist(), CONTEXT_TOKENS)
        for _ in range(TRAIN_WINDOWS + HELDOUT_WINDOWS)
    ]
    train_windows, heldout = windows[:TRAIN_WINDOWS], windows[TRAIN_WINDOWS:]

    # 1. the target pass
    phase = time.perf_counter()
    targets = _Targets()
    for window in windows:
        ids = torch.tensor([window.input_ids], device=device)
        out = base_outputs(base, ids)
        targets.by_ids[window.input_ids] = (out.hidden[0], out.greedy[0])
    sync(device)
    target_seconds = time.perf_counter() - phase

    # 2. the 512 steps (the loop of occamy_mtp.train.train without accelerate and I/O)
    total_steps = EPOCHS * args.steps_per_epoch
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=5e-4, betas=(0.9, 0.95))
    params = [p for p in head.parameters() if p.requires_grad]
    phase = time.perf_counter()
    head.train()
    for step in range(total_steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, total_steps, 5e-4, 32, 0.1)
        batch = collate(step_windows(train_windows, step, 1, 0), device)
        out = targets.outputs(batch.input_ids)
        chain = chain_batch(batch.input_ids, out.greedy, batch.assistant, batch.lengths, 1)
        loss, _ = chain_loss(head, head(chain.step_token_ids, out.hidden), chain.labels, (1.0,))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    sync(device)
    train_seconds = time.perf_counter() - phase

    # 3. export-time evaluation, donor and trained (3 chained steps)
    phase = time.perf_counter()
    for _ in ("donor", "trained"):
        evaluate_head(targets, head, heldout, draft_steps=3, windows_per_batch=4)
    sync(device)
    eval_seconds = time.perf_counter() - phase

    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "dimensions": "tiny" if args.tiny else "Qwen3.5-35B-A3B",
        "trainable_parameters": trainable,
        "steps": total_steps,
        "build_seconds_excluded": build_seconds,
        "target_pass_seconds": target_seconds,
        "train_seconds": train_seconds,
        "eval_seconds": eval_seconds,
        "recipe_seconds": target_seconds + train_seconds + eval_seconds,
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
    }
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(result, handle, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
