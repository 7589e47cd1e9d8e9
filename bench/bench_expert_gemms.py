"""The routed experts' two GEMMs at decode sizes: torch's grouped GEMM against `moe_kernels.expert_mlp`.

    PYTHONPATH=/tmp/site:. python3 bench/bench_expert_gemms.py --out $OUT/expert-gemms.json   # H200
    PYTHONPATH=. python3 bench/bench_expert_gemms.py --tiny --device cpu                     # smoke run

Forty layers of random Qwen3.5-35B-A3B experts (256 experts, D = 2048, I = 512, bf16; 32 GB,
more than the GPU's cache, as in a decode step) and, per layer, N tokens routed to 8 experts
each at random. One sweep of the forty layers is captured in a CUDA graph and replayed:

* `grouped_mm`: the gather of the rows, gate_up in torch's grouped GEMM, `silu_mul`, down in
  torch's grouped GEMM (what `fastbase.grouped_experts` ran for these sizes before);
* `expert_mlp`: the two Triton kernels, for each (block_n, block_k, num_warps, num_stages)
  given for the gate_up kernel (with the down kernel at its default) and for the down kernel
  (with gate_up at its default).

Both start from the same `align` output (not timed). The bound is the bytes of the experts
the tokens touch, read once, at the copy bandwidth measured in the same run. Each variant's
first-layer output is compared with the grouped GEMM's (largest difference over the largest value).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import copy_bandwidth  # noqa: E402

from occamy_mtp.base import moe_kernels  # noqa: E402
from report import write_report


def grouped_mm_mlp(x, rows, offsets, gate_up_proj, down_proj):
    from transformers.integrations.moe import _grouped_mm

    gate_up = _grouped_mm(x[rows], gate_up_proj.transpose(-2, -1), offs=offsets)
    return _grouped_mm(moe_kernels.silu_mul(gate_up), down_proj.transpose(-2, -1), offs=offsets)


def seconds_per_sweep(sweep, device, replays: int) -> float:
    """One replay of the sweep captured in a CUDA graph (eager on a CPU)."""
    if device.type != "cuda":
        started = time.perf_counter()
        sweep()
        return time.perf_counter() - started
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        sweep()  # compiles, warms
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sweep()
    graph.replay()
    torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize(device)
    return (time.perf_counter() - started) / replays


def parse_blocks(text: str) -> list[tuple[int, int, int, int]]:
    return [tuple(int(v) for v in item.split(",")) for item in text.split(";") if item]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="small widths (a smoke run of the same code)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", default="1,4,64,160", help="token counts N")
    parser.add_argument("--layers", type=int, default=40)
    parser.add_argument("--up-blocks", default="64,128,4,3;32,128,4,3;64,256,4,3;128,128,4,3;64,128,4,4;64,128,8,3")
    parser.add_argument("--down-blocks", default="64,128,4,3;32,128,4,3;64,256,4,3;128,128,4,3;64,128,4,4;64,128,8,3")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    device = torch.device(args.device)
    experts, dim, inter, top_k, layers = (16, 64, 32, 4, 2) if args.tiny else (256, 2048, 512, 8, args.layers)
    generator = torch.Generator(device=device).manual_seed(0)
    weights = [((torch.randn(experts, 2 * inter, dim, device=device, generator=generator) * 0.02).bfloat16(),
                (torch.randn(experts, dim, inter, device=device, generator=generator) * 0.02).bfloat16()) for _ in range(layers)]
    bandwidth = copy_bandwidth(device)  # nan without a GPU
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "layers": layers, "experts": experts, "dim": dim, "inter": inter, "top_k": top_k,
              "copy_bandwidth_bytes_per_second": bandwidth, "rows": []}
    expert_bytes = 3 * inter * dim * 2
    for tokens in (int(n) for n in args.tokens.split(",")):
        x = torch.randn(tokens, dim, device=device, generator=generator).bfloat16()
        routed = [moe_kernels.align(torch.rand(tokens, experts, device=device, generator=generator).topk(top_k).indices, experts)
                  for _ in range(layers)]
        touched = sum(int((torch.diff(offsets, prepend=offsets.new_zeros(1)) > 0).sum()) for _, _, offsets in routed)
        row = {"tokens": tokens, "experts_touched_per_layer": touched / layers,
               "bound_ms": 1e3 * touched * expert_bytes / bandwidth, "variants": {}}
        reference = grouped_mm_mlp(x, routed[0][0], routed[0][2], *weights[0]).float() if device.type == "cuda" else None

        def run(name, mlp):
            outs = []

            def sweep():
                outs.clear()
                for (rows, _, offsets), (gate_up, down) in zip(routed, weights):
                    outs.append(mlp(x, rows, offsets, gate_up, down))

            seconds = seconds_per_sweep(sweep, device, args.replays)
            entry = {"ms": 1e3 * seconds, "ratio_to_bound": 1e3 * seconds / row["bound_ms"]}
            if reference is not None:
                entry["max_diff_over_max"] = float((outs[0].float() - reference).abs().max() / reference.abs().max())
            row["variants"][name] = entry
            print(f"N={tokens} {name}: {json.dumps(entry)}", flush=True)

        if device.type == "cuda":
            run("grouped_mm", grouped_mm_mlp)
        for blocks in parse_blocks(args.up_blocks):
            run(f"expert_mlp up={blocks}", lambda *a, b=blocks: moe_kernels.expert_mlp(*a, up_blocks=b))
        for blocks in parse_blocks(args.down_blocks):
            run(f"expert_mlp down={blocks}", lambda *a, b=blocks: moe_kernels.expert_mlp(*a, down_blocks=b))
        result["rows"].append(row)
    write_report(result, args.out, printed=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
