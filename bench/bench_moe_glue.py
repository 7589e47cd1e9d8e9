"""One real-width MoE block, PyTorch glue against the Triton glue of `occamy_mtp.base.moe_kernels`.

    PYTHONPATH=. python3 bench/bench_moe_glue.py --out $OUT/glue.json

For each token count N, a random-weight `Qwen3_5MoeSparseMoeBlock` of Qwen3.5-35B-A3B
width (D = 2048, 256 experts, top-8, I = 512) runs through `fastbase.grouped_moe_block`
with `fused_glue` off and on. Reported per variant, in one run:

* `gpu_ms`: wall time of one call with the GPU kept busy (50 calls queued, then one
  synchronise): what the kernels cost;
* `launch_ms`: host time to queue one call when the GPU is idle ahead of it (the
  call returns before its kernels finish): what the CPU costs. A pass is held back by
  this when it exceeds `gpu_ms`;
* `graph_ms`: one replay of the call captured in a CUDA graph (no host cost).

And the host time of one launch of the combine kernel alone, on a tiny input.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from occamy_mtp.base import fastbase
from occamy_mtp.base import moe_kernels
from report import write_report


def block_of_real_width(device):
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
        Qwen3_5MoeSparseMoeBlock,
    )

    config = Qwen3_5MoeTextConfig()
    with torch.device(device):
        block = Qwen3_5MoeSparseMoeBlock(config).to(torch.bfloat16)
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0.0, 0.02)
    return block.eval().requires_grad_(False), config


def gpu_ms(fn, calls: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1000


def launch_ms(fn, calls: int = 20) -> float:
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return sorted(times)[len(times) // 2] * 1000


def graph_ms(fn, calls: int = 50) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return gpu_ms(graph.replay, calls)


@torch.no_grad()
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="512,4096,16384,65536")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    device = torch.device("cuda")
    block, config = block_of_real_width(device)
    result: dict = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "rows": {}}
    for tokens in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(1, tokens, config.hidden_size, device=device, dtype=torch.bfloat16)
        row = {}
        for name, fused in (("torch-glue", False), ("triton-glue", True)):
            fn = lambda fused=fused, x=x: fastbase.grouped_moe_block(block, x, fused_glue=fused)  # noqa: E731
            row[name] = {"gpu_ms": gpu_ms(fn), "launch_ms": launch_ms(fn), "graph_ms": graph_ms(fn)}
        reference = fastbase.grouped_moe_block(block, x)
        fused = fastbase.grouped_moe_block(block, x, fused_glue=True)
        row["relative_difference"] = float((fused.float() - reference.float()).norm() / reference.float().norm())
        result["rows"][tokens] = row
        print(tokens, json.dumps(row), flush=True)

    tiny = [t.to(device) if isinstance(t, torch.Tensor) else t for t in (
        torch.randn(16, 64).bfloat16(), torch.arange(16), torch.rand(8, 2).bfloat16(), torch.randn(8, 64).bfloat16(),
        torch.randn(8, 1).bfloat16())]
    result["combine_launch_ms"] = launch_ms(lambda: moe_kernels.combine(*tiny), calls=200)
    result["torch_add_launch_ms"] = launch_ms(lambda: tiny[3] + tiny[3], calls=200)
    write_report(result, args.out, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
