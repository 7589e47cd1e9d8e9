"""The static decoder's prefill against reading each prompt one step a token, in one run.

    PYTHONPATH=/tmp/site:. python3 bench/bench_prefill.py --context-tokens 16384 --batch 0 --out $OUT/prefill.json
    PYTHONPATH=. .venv/bin/python bench/bench_prefill.py --tiny --device cpu --context-tokens 512 --batch 4

A random-weight base (Qwen3.5-35B-A3B-shaped, or the tests' tiny one with `--tiny`) writes
`--new-tokens` after `--batch` prompts of `--context-tokens` tokens each (0: the batch that
self-generation sizes to the GPU, `EmbeddedWriter.batch_for`), twice in one process: with the
prefill (`BatchDecoder.generate`), then with it turned off (`BatchDecoder.prefills`), so that every prompt
position is one step. It prints both times, their ratio, the peak memory of each (CUDA), and
whether the two wrote the same tokens (bf16 on a GPU may part at a near tie: the prefill sums
in another order; the count of rows that agree is given). `--skip-stepped` times the prefill
alone (at 16k contexts the stepped run is the one that takes hours).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import build  # noqa: E402
from timing import sync  # noqa: E402

from occamy_mtp.base import fastdecode  # noqa: E402
from occamy_mtp.base.fastdecode import BatchDecoder  # noqa: E402
from occamy_mtp.sampling import GREEDY_TEXT  # noqa: E402
from occamy_mtp.selfgen.store import EmbeddedWriter  # noqa: E402

GIB = 2**30


def timed_generate(decoder: BatchDecoder, prompts, new_tokens: int, device) -> tuple[list[list[int]], float, float]:
    """(continuations, seconds, peak GiB) of one generate."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sync(device)
    started = time.perf_counter()
    out = decoder.generate(prompts, max_new_tokens=new_tokens, eos_token_ids=set())
    sync(device)
    seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else float("nan")
    return out, seconds, peak


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--context-tokens", type=int, default=16384)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=0, help="0: as many rows as self-generation sizes to the GPU")
    parser.add_argument("--skip-stepped", action="store_true", help="time the prefill alone")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    started = time.perf_counter()
    base = build(args.tiny, device)
    built = time.perf_counter() - started
    vocab = base.config.vocab_size
    batch = args.batch
    if batch == 0:
        contexts = [tuple(range(args.context_tokens))] * 1024
        batch = EmbeddedWriter(base, 0, GREEDY_TEXT).batch_for(contexts, args.new_tokens, lambda line: print(line, file=sys.stderr))
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab, (args.context_tokens,), generator=generator).tolist() for _ in range(batch)]
    positions = args.context_tokens + args.new_tokens - 1
    decoder = BatchDecoder(base, batch=batch, positions=positions)
    warm = [prompt[:300] for prompt in prompts[:1]]  # kernels compiled and tuned before either is timed
    decoder.generate(warm, max_new_tokens=4, eos_token_ids=set())
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "tiny": args.tiny,
              "context_tokens": args.context_tokens, "new_tokens": args.new_tokens, "batch": batch, "build_seconds": built,
              "prefill_chunk": fastdecode.PREFILL_CHUNK, "prefill_pass_bytes": fastdecode.PREFILL_PASS_BYTES}
    prefilled, report["prefill_seconds"], report["prefill_peak_gib"] = timed_generate(decoder, prompts, args.new_tokens, device)
    if not args.skip_stepped:
        decoder.prefills = False  # every prompt position one step
        decoder.generate(warm, max_new_tokens=4, eos_token_ids=set())
        stepped, report["stepped_seconds"], report["stepped_peak_gib"] = timed_generate(decoder, prompts, args.new_tokens, device)
        report["speedup"] = report["stepped_seconds"] / report["prefill_seconds"]
        report["rows_equal"] = sum(a == b for a, b in zip(prefilled, stepped))
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
