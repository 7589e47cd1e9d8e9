"""A full-size MoE layer's routed experts at decode sizes: bf16 weights, FP8 codes written to bf16 first,
and FP8 codes read by the expert GEMMs themselves, each beside its weight-read bound.

    PYTHONPATH=. python3 bench/bench_fp8_experts.py --out fp8-experts.json
    PYTHONPATH=. python3 bench/bench_fp8_experts.py --tiny --device cpu --repeats 1   # a smoke run (reference path)

One layer of Qwen3.5-35B-A3B (256 experts, D = 2048, I = 512, top-8, the family's 128 x 128 blocks),
for decode batches of `--tokens` rows routed at random, three ways, each timed as a decode step runs it
(the routing's alignment, the two expert GEMMs, the combine; one CUDA graph each, so that launches do not
count):

- `bf16`: the weights resident in bf16 (`moe_kernels.expert_mlp` on them);
- `fp8-write`: the weights kept in FP8, the routed experts' written to bf16 first
  (`fp8_weights.dequantize_into` of the experts the step routes to, as `Fp8Layer.materialize_experts`
  did for every decode step), then the bf16 GEMMs;
- `fp8-read`: the weights kept in FP8, read as codes and multipliers by the GEMMs
  (`moe_kernels.expert_mlp(..., fp8=)`, as `fastbase.grouped_experts` now runs a decode-sized batch).

Each figure is the median of `--repeats` replays, beside the time to read the routed experts' weights
once at the card's bandwidth (`--bandwidth-gbs`, 3,350 GB/s: an H100 SXM's HBM3): two bytes a weight
in bf16, one (and the multipliers) in FP8. The outputs of `fp8-read` and of the bf16 GEMMs on the
dequantized weights are checked equal, bit for bit.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from occamy_mtp.base import moe_kernels
from occamy_mtp.model.fp8_weights import dequantize_into
from bench_fp8_write import random_fp8_stack
from report import write_report
from timing import seconds_of


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--tokens", default="1,8,32,64,160,256", help="decode rows, comma-separated")
    parser.add_argument("--bandwidth-gbs", type=float, default=3350.0)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    device = torch.device(args.device)
    experts, hidden, inter, top_k = (8, 256, 128, 2) if args.tiny else (256, 2048, 512, 8)
    block = (128, 128)
    generator = torch.Generator(device=device).manual_seed(0)
    (gate, gate_s), (up, up_s), (down, down_s) = (random_fp8_stack(experts, rows, cols, block, generator, device)
                                                  for rows, cols in ((inter, hidden), (inter, hidden), (hidden, inter)))
    fp8 = moe_kernels.Fp8Experts(torch.cat([gate, up], dim=1), gate_s, up_s, down, down_s, block)
    resident = fp8.dequantized(torch.bfloat16)  # the bf16 base's weights (the same values)
    written = (torch.empty_like(resident[0]), torch.empty_like(resident[1]))  # the shared buffer the write fills

    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "experts": experts, "hidden": hidden, "moe_intermediate": inter, "top_k": top_k,
              "bandwidth_gbs": args.bandwidth_gbs, "steps": []}
    for tokens in [int(t) for t in args.tokens.split(",") if t.strip()]:
        x = torch.randn(tokens, hidden, generator=generator, device=device).to(torch.bfloat16)
        logits = torch.randn(tokens, experts, generator=generator, device=device)
        weights, chosen = moe_kernels.route(logits, top_k)

        def aligned():
            return moe_kernels.align(chosen, experts)

        def bf16():
            rows, inverse, offsets = aligned()
            return moe_kernels.combine(moe_kernels.expert_mlp(x, rows, offsets, *resident), inverse, weights)

        def fp8_write():
            rows, inverse, offsets = aligned()
            used = torch.zeros(experts + 1, dtype=torch.int32, device=device)
            used.scatter_(0, chosen.reshape(-1), 1)
            dequantize_into(written[0][:, :inter], gate, gate_s, block, used[:experts])
            dequantize_into(written[0][:, inter:], up, up_s, block, used[:experts])
            dequantize_into(written[1], down, down_s, block, used[:experts])
            return moe_kernels.combine(moe_kernels.expert_mlp(x, rows, offsets, *written), inverse, weights)

        def fp8_read():
            rows, inverse, offsets = aligned()
            return moe_kernels.combine(moe_kernels.expert_mlp(x, rows, offsets, None, None, fp8=fp8), inverse, weights)

        reference = bf16()
        same = bool(torch.equal(fp8_read(), reference)) and bool(torch.equal(fp8_write(), reference))
        routed = int(torch.unique(chosen).numel())
        bf16_bytes = routed * 3 * inter * hidden * 2
        fp8_bytes = routed * 3 * inter * hidden + sum(s.numel() * 4 for s in (gate_s, up_s, down_s)) * routed // experts
        entry = {"tokens": tokens, "experts_routed": routed, "outputs_equal": same,
                 "bound_ms": {"bf16": bf16_bytes / (args.bandwidth_gbs * 1e9) * 1e3,
                              "fp8": fp8_bytes / (args.bandwidth_gbs * 1e9) * 1e3}}
        for name, step in (("bf16", bf16), ("fp8-write", fp8_write), ("fp8-read", fp8_read)):
            entry[f"{name}_ms"] = statistics.median(_timed(step, device, args.repeats)) * 1e3
        entry["fp8_read_over_bf16"] = entry["fp8-read_ms"] / entry["bf16_ms"]
        entry["fp8_read_over_its_bound"] = entry["fp8-read_ms"] / entry["bound_ms"]["fp8"]
        entry["bf16_over_its_bound"] = entry["bf16_ms"] / entry["bound_ms"]["bf16"]
        result["steps"].append(entry)
        print(json.dumps(entry), flush=True)
    write_report(result, args.out)
    return 0


def _timed(step, device: torch.device, repeats: int) -> list[float]:
    """Seconds of each of `repeats` replays of `step`, captured in one CUDA graph on a GPU (run as it is elsewhere)."""
    run = step
    if device.type == "cuda":
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                step()  # compiles the kernels, warms the allocator
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        run = graph.replay
    run()
    return seconds_of(run, device, repeats)


if __name__ == "__main__":
    raise SystemExit(main())
