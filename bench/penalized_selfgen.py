"""Self-generation under a penalized preset at real size: the batch the sizing chooses, and its peak.

    PYTHONPATH=/tmp/site:. python3 bench/penalized_selfgen.py --windows 240 --out $OUT/penalized_selfgen.json

Random weights of Qwen3.5-35B-A3B's shape (`bench_decode.build`), random 128-token contexts, the
instruct-general preset's sampling (t0.7, top-p 0.8, top-k 20, presence 1.5) and thinking-general's
(t1.0, top-p 0.95, top-k 20, presence 1.5): `EmbeddedWriter.batch_for` sizes the batch beside the
resident base, then the writer decodes the windows (every continuation the whole budget: random
weights never stop). The peak must stay under the card: the sizing must never promise what does not fit.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from bench_decode import build  # noqa: E402
from occamy_mtp.config import PRESETS  # noqa: E402
from occamy_mtp.sampling import text_sampling  # noqa: E402
from occamy_mtp.selfgen.store import EmbeddedWriter  # noqa: E402

GIB = 2**30


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--windows", type=int, default=240)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=382)
    parser.add_argument("--presets", default="instruct-general,thinking-general")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = torch.device("cuda")
    base = build(False, device)
    generator = torch.Generator().manual_seed(0)
    contexts = [tuple(torch.randint(0, base.config.vocab_size, (args.prompt_tokens,), generator=generator).tolist())
                for _ in range(args.windows)]
    results = []
    for name in args.presets.split(","):
        sampling = text_sampling(PRESETS[name], seed=0)
        torch.cuda.reset_peak_memory_stats(device)
        writer = EmbeddedWriter(base, 0, sampling)
        lines = []
        size = writer.batch_for(contexts, args.new_tokens, lines.append)
        started = time.perf_counter()
        written = list(writer.answers(contexts, [True] * len(contexts), args.new_tokens, set(), lines.append))
        seconds = time.perf_counter() - started
        results.append({"preset": name, "sampling": sampling.label(), "batch": size, "sizing": lines[0],
                        "windows": len(written), "tokens": sum(len(c.tokens) for _, c in written), "seconds": seconds,
                        "peak_gib": torch.cuda.max_memory_allocated(device) / GIB,
                        "card_gib": torch.cuda.mem_get_info(device)[1] / GIB})
        print(json.dumps(results[-1]), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
                                        "runs": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
