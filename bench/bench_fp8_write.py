"""The write of a full-size decoder layer's experts from FP8 (`model.fp8_weights`), beside its bound.

    PYTHONPATH=. python3 bench/bench_fp8_write.py --out fp8-write.json
    PYTHONPATH=. python3 bench/bench_fp8_write.py --tiny --device cpu        # a smoke run of the same code

One layer of Qwen3.5-35B-A3B's routed experts kept in FP8 (gate_up_proj (256, 1024, 2048) in two row
parts of 512, down_proj (256, 2048, 512), blocks of 128 x 128) is written into bf16
(`fp8_weights.dequantize_into`, as `Fp8Layer.materialize_experts` writes it), for all 256 experts
and for the experts a decode step of a few rows routes to. Each figure is the median of `--repeats`
writes, beside the time to move its bytes (a byte read and two written a weight, and the
multipliers) at the card's memory bandwidth (`--bandwidth-gbs`, 3,350 GB/s: an H100 SXM's HBM3).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from occamy_mtp.model.fp8_weights import dequantize_into
from occamy_mtp.model.quantized import FP8_MAX
from report import write_report
from timing import seconds_of


def random_fp8_stack(experts: int, rows: int, cols: int, block: tuple[int, int], generator, device):
    """An experts stack of random e4m3 codes over the format's whole range and random multipliers, one a
    block: (codes (E, rows, cols), multipliers (E, ceil(rows / block[0]), ceil(cols / block[1])))."""
    codes = torch.rand(experts, rows, cols, generator=generator, device=device) * 2 * FP8_MAX - FP8_MAX
    scale = torch.rand(experts, -(-rows // block[0]), -(-cols // block[1]), generator=generator, device=device) * 1e-3
    return codes.to(torch.float8_e4m3fn), scale


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--routed", default="8,32,128,256", help="experts written, comma-separated")
    parser.add_argument("--bandwidth-gbs", type=float, default=3350.0)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    device = torch.device(args.device)
    experts, hidden, inter = (8, 256, 128) if args.tiny else (256, 2048, 512)
    block = (128, 128)
    generator = torch.Generator(device=device).manual_seed(0)
    gate, up, down = (random_fp8_stack(experts, rows, cols, block, generator, device)
                      for rows, cols in ((inter, hidden), (inter, hidden), (hidden, inter)))
    gate_up_out = torch.empty(experts, 2 * inter, hidden, dtype=torch.bfloat16, device=device)
    down_out = torch.empty(experts, hidden, inter, dtype=torch.bfloat16, device=device)

    def write(used):
        dequantize_into(gate_up_out[:, :inter], *gate, block, used)
        dequantize_into(gate_up_out[:, inter:], *up, block, used)
        dequantize_into(down_out, *down, block, used)

    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "experts": experts, "hidden": hidden, "moe_intermediate": inter, "bandwidth_gbs": args.bandwidth_gbs, "writes": []}
    for count in [int(c) for c in args.routed.split(",") if c.strip()]:
        count = min(count, experts)
        used = torch.zeros(experts, dtype=torch.int32, device=device)
        used[torch.randperm(experts, generator=torch.Generator().manual_seed(count))[:count].to(device)] = 1
        write(used)  # untimed: compiles the kernel
        seconds = seconds_of(lambda: write(used), device, args.repeats)
        weights = count * 3 * inter * hidden
        scales = sum(s.numel() * 4 for _, s in (gate, up, down)) * count // experts
        moved = weights * 3 + scales
        median = statistics.median(seconds)
        entry = {"experts_written": count, "median_ms": median * 1e3, "bytes_moved": moved,
                 "bound_ms": moved / (args.bandwidth_gbs * 1e9) * 1e3, "achieved_gbs": moved / median / 1e9}
        result["writes"].append(entry)
        print(json.dumps(entry), flush=True)
    write_report(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
