"""The recipe's unit costs at full size with the frozen base held in host memory (fsdp2-offload.yaml) beside resident.

    PYTHONPATH=/tmp/site:. python3 bench/bench_offload.py --placement offload --memory-cap-gib 40 --out $OUT/offload-40.json
    PYTHONPATH=/tmp/site:. python3 bench/bench_offload.py --placement resident --out $OUT/resident.json
    PYTHONPATH=/tmp/site:. python3 bench/bench_offload.py --placement offload --engine deepspeed-zero3 --out $OUT/zero3.json
    PYTHONPATH=. python3 bench/bench_offload.py --tiny --device cpu --placement offload      # a smoke run of the same code

A random-weight Qwen3.5-35B-A3B-shaped base (64.6 GiB in bf16) and head are built on the GPU
(values do not change speed or memory). With `--placement offload` the base is then placed as
`configs/accelerate/fsdp2-offload.yaml` places it (`model.sharding.shard`, one process; with
`--engine deepspeed-zero3`, as `deepspeed-zero3-offload.yaml` does): its
decoder layers' weights move to pinned host memory and each is copied to the card for its
forward; the embedding, final norm and lm_head stay on the card. Only then is the memory cap set
(`--memory-cap-gib`, `torch.cuda.set_per_process_memory_fraction`), and the peaks reset: a run
loads the base into host memory and never holds it whole on the card. The same phases then run
with the library's own pieces, each with its wall time and peak:

- `train_step`: `train.loop.train_step` with online targets (the base's plain forward on the
  step's windows, as `train.py` runs without `data.target_cache`), `--windows-per-step` windows of
  128 + 382 tokens, `--steps` steps after one untimed;
- `selection`: `evaluation.served.served_acceptance` on `--selection-windows` windows at 1 and 3
  draft steps (selection and export's evaluation are such passes: one base forward a batch of 4);
- `decode`: `base.generate.plain_decode` (the decoder self-generation uses on a sharded base)
  on `--decode-batch` contexts of 128 tokens, `--decode-tokens` new tokens, beside the same with one
  new token: their difference over the steps between is one decode step, where the recipe spends
  its base forwards (a continuation is up to 382 of them).

With `--placement resident` the base stays on the card (no cap) and the same phases run, with
`plain_decode` too, so that the two differ in the placement only.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from occamy_mtp.base.generate import plain_decode
from occamy_mtp.base.tuning import use_tuned_kernel_configs
from occamy_mtp.config import Serving, TrainSettings, step_loss_weights
from occamy_mtp.data.windows import Window
from occamy_mtp.evaluation.served import served_acceptance
from occamy_mtp.model.checkpoint import base_model_class, text_config_from_dict
from occamy_mtp.model.head import MTPHead, SharedWeights, set_trainable
from occamy_mtp.model.sharding import FSDP2, ZERO3, Sharding, placement, shard
from occamy_mtp.targets.base import OnlineTargets
from occamy_mtp.testing.checkpoints import QWEN3_5_35B_A3B, tiny_text_config
from occamy_mtp.train.loop import as_served, head_autocast, train_step
from report import write_report
from timing import sync

CONTEXT_TOKENS, ANSWER_TOKENS = 128, 382
GIB = 2**30



def peak_gib(device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None


def timed(device, fn):
    """(seconds, peak GiB, result) of `fn()`, the peak counted from its start."""
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    result = fn()
    sync(device)
    return time.perf_counter() - started, peak_gib(device), result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny dimensions (smoke run)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--placement", choices=("offload", "resident"), default="offload")
    parser.add_argument("--engine", choices=(FSDP2, ZERO3), default=FSDP2,
                        help="what holds the offloaded layers: FSDP2 (fsdp2-offload.yaml) or DeepSpeed ZeRO-3 "
                             "(deepspeed-zero3-offload.yaml)")
    parser.add_argument("--memory-cap-gib", type=float, default=0.0, help="set after the base is placed (offload only)")
    parser.add_argument("--windows-per-step", type=int, default=1, help="train.windows_per_step (the recipe's: 1)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--selection-windows", type=int, default=8)
    parser.add_argument("--decode-batch", default="64", help="comma-separated batch sizes")
    parser.add_argument("--decode-tokens", type=int, default=5)
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
        for param in head.parameters():  # MTPHead leaves its experts as torch.empty: garbage (NaN at times), not random
            torch.nn.init.normal_(param, std=0.02)
    base.requires_grad_(False).eval()
    sync(device)
    build_seconds = time.perf_counter() - started
    started = time.perf_counter()
    if args.placement == "offload":
        shard(base, Sharding(offload=True, engine=args.engine), device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    sync(device)
    place_seconds = time.perf_counter() - started
    if args.memory_cap_gib:
        if args.placement != "offload":
            raise SystemExit("--memory-cap-gib: the resident base alone is 64.6 GiB; cap the offload placement")
        torch.cuda.set_per_process_memory_fraction(args.memory_cap_gib * GIB / torch.cuda.mem_get_info(device)[1],
                                                   torch.cuda.current_device())
    tuned = use_tuned_kernel_configs(device)
    if tuned:
        print(tuned)
    settings = TrainSettings(windows_per_step=args.windows_per_step)
    trainable = set_trainable(head, settings.trainable)
    for param in head.parameters():
        if param.requires_grad:
            param.data = param.data.float()
    result: dict = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "dimensions": "tiny" if args.tiny else "Qwen3.5-35B-A3B",
        "placement": placement(base) | {"requested": args.placement},
        "memory_cap_gib": args.memory_cap_gib or None,
        "build_seconds_excluded": build_seconds,
        "place_seconds": place_seconds,
        "resident_after_placing_gib": torch.cuda.memory_allocated(device) / GIB if device.type == "cuda" else None,
        "trainable_parameters": trainable,
    }
    print(json.dumps(result, indent=2), flush=True)
    generator = torch.Generator().manual_seed(1)

    def windows(count: int, length: int = CONTEXT_TOKENS + ANSWER_TOKENS) -> list[Window]:
        return [Window("random", 0, tuple(torch.randint(0, config.vocab_size, (length,), generator=generator).tolist()),
                       CONTEXT_TOKENS) for _ in range(count)]

    targets = OnlineTargets(base)
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=settings.lr)
    weights = step_loss_weights(settings)
    head.train()
    step_windows = windows(args.windows_per_step)
    train_step(head, head, targets, step_windows, optimizer, settings, weights, dtype)  # untimed: kernels compile
    seconds, peak, _ = timed(device, lambda: [train_step(head, head, targets, step_windows, optimizer, settings, weights, dtype)
                                              for _ in range(args.steps)])
    result["train_step"] = {"windows_per_step": args.windows_per_step, "steps": args.steps,
                            "seconds_per_step": seconds / args.steps, "peak_gib": peak}
    print(json.dumps({"train_step": result["train_step"]}), flush=True)

    validation = windows(args.selection_windows)
    head.eval()

    def select():
        with as_served(head, dtype), head_autocast(head, device, dtype):
            return served_acceptance(targets, head, validation, (1, 3), ANSWER_TOKENS, serving=Serving())

    seconds, peak, _ = timed(device, select)
    result["selection"] = {"windows": args.selection_windows, "windows_per_batch": 4, "seconds": seconds,
                           "seconds_per_batch": seconds / -(-args.selection_windows // 4), "peak_gib": peak}
    print(json.dumps({"selection": result["selection"]}), flush=True)

    result["decode"] = []
    for batch in [int(b) for b in args.decode_batch.split(",") if b.strip()]:
        contexts = [w.input_ids for w in windows(batch, CONTEXT_TOKENS)]
        one, peak_one, _ = timed(device, lambda: plain_decode(base, contexts, max_new_tokens=1, eos_token_ids=set(),
                                                                 batch_size=batch))
        many, peak_many, out = timed(device, lambda: plain_decode(base, contexts, max_new_tokens=args.decode_tokens,
                                                                     eos_token_ids=set(), batch_size=batch))
        step = (many - one) / (args.decode_tokens - 1)
        entry = {"batch": batch, "prefill_and_first_token_seconds": one, "new_tokens": args.decode_tokens,
                 "seconds": many, "seconds_per_decode_step": step, "tokens_per_second": batch / step,
                 "peak_gib": max(p for p in (peak_one, peak_many) if p is not None) if device.type == "cuda" else None,
                 "tokens_written": sum(len(o) for o in out)}
        result["decode"].append(entry)
        print(json.dumps({"decode": entry}), flush=True)
    if device.type == "cuda" and args.memory_cap_gib:
        peaks = [result["train_step"]["peak_gib"], result["selection"]["peak_gib"], *[d["peak_gib"] for d in result["decode"]]]
        result["peak_gib"] = max(peaks)
        result["peak_under_cap"] = result["peak_gib"] < args.memory_cap_gib
    write_report(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
