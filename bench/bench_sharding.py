"""FSDP2 against DeepSpeed ZeRO-3 holding the frozen base: the same forwards, timed in one run.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node 2 bench/bench_sharding.py --out sharding.json
    PYTHONPATH=/tmp/site:. python3 -m torch.distributed.run --nproc_per_node 1 bench/bench_sharding.py --device cuda \\
        --offload --size full-layers --out $OUT/sharding-gpu.json      # one card, the layers in host memory

Each process builds the same random-weight base (transformers' Qwen3.5-MoE class, bf16), then
places a copy of it three ways, as the library does (`model.sharding.shard`): whole (every process
holds it: a plain launch), FSDP2 (`fsdp2*.yaml`) and ZeRO-3 (`deepspeed-zero3*.yaml`), with
`--offload` each process's part in host memory. For each it reports the bytes of decoder-layer
weights a process holds, the first forward (start-up: gathers and hooks made ready) and the
median of `--repeats` later forwards of `--batch` windows of `--tokens` tokens through
`targets.base.base_outputs` (the plain forward that training and selection run on a sharded
base), and checks the three compute the same hidden states and targets. Ratios are the figure
to quote on a shared machine: every placement runs in the same processes, one after the other.

`--size`: `small` (hidden 512, 8 layers, 32 experts: a CPU run of seconds), or `full-layers`
(the Qwen3.5-35B-A3B shape cut to `--layers` decoder layers: per-layer costs at full size).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch
import torch.distributed as dist

from occamy_mtp.model.checkpoint import base_model_class, text_config_from_dict
from occamy_mtp.model.sharding import FSDP2, ZERO3, Sharding, local_part, placement, shard
from occamy_mtp.targets.base import base_outputs
from occamy_mtp.testing.checkpoints import QWEN3_5_35B_A3B, TINY_QWEN3_5
from report import write_report
from timing import sync

SMALL = {**TINY_QWEN3_5, "vocab_size": 4096, "hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8,
         "num_key_value_heads": 2, "head_dim": 64, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
         "linear_num_key_heads": 4, "linear_num_value_heads": 8, "num_experts": 32, "num_experts_per_tok": 4,
         "moe_intermediate_size": 256, "shared_expert_intermediate_size": 256}


def layer_bytes(base) -> int:
    """The bytes of decoder-layer weights this process holds between forwards."""
    return sum(local_part(p).numel() * local_part(p).element_size() for p in base.model.layers.parameters())


def timed(base, ids: torch.Tensor, repeats: int, device: torch.device) -> tuple[float, list[float], object]:
    seconds = []
    outputs = None
    for _ in range(repeats + 1):
        sync(device)
        started = time.perf_counter()
        outputs = base_outputs(base, ids)
        sync(device)
        seconds.append(time.perf_counter() - started)
    return seconds[0], seconds[1:], outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--size", choices=("small", "full-layers"), default="small")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of --size full-layers")
    parser.add_argument("--offload", action="store_true", help="each process's part in host memory (a GPU run)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=510, help="a window: 128 context + 382 answer tokens")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="")
    args = parser.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(args.device, local_rank) if args.device == "cuda" else torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    fields = SMALL if args.size == "small" else {**QWEN3_5_35B_A3B, "num_hidden_layers": args.layers}
    config = text_config_from_dict(fields, source=f"bench {args.size}")
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):  # on the card where there is one: building full-size layers on a CPU is slow
        built = base_model_class(config)._from_config(config, dtype=torch.bfloat16).requires_grad_(False).eval()
    ids = torch.randint(0, config.vocab_size, (args.batch, args.tokens), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)

    result: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "processes": world, "torch": torch.__version__, "size": args.size,
                    "layers": config.num_hidden_layers, "offload": args.offload, "batch": args.batch,
                    "tokens": args.tokens, "threads": torch.get_num_threads(), "placements": {}}
    reference = None
    for name in ("whole", FSDP2, ZERO3):
        base = copy.deepcopy(built)
        started = time.perf_counter()
        if name == "whole":
            base.to(device)
        else:
            shard(base, Sharding(offload=args.offload, engine=name), device)
        sync(device)
        place_seconds = time.perf_counter() - started
        first, later, outputs = timed(base, ids, args.repeats, device)
        same = None
        if reference is None:
            reference = outputs
        else:
            same = bool(torch.equal(outputs.hidden, reference.hidden) and torch.equal(outputs.greedy, reference.greedy))
        result["placements"][name] = {
            "placement": placement(base),
            "layer_weights_gib_per_process": layer_bytes(base) / 2**30,
            "place_seconds": place_seconds,
            "first_forward_seconds": first,
            "forward_seconds_median": statistics.median(later),
            "forward_seconds": later,
            "same_outputs_as_whole": same,
        }
        del base
        if device.type == "cuda":
            torch.cuda.empty_cache()
    whole = result["placements"]["whole"]["forward_seconds_median"]
    for name in (FSDP2, ZERO3):
        result["placements"][name]["forward_vs_whole"] = result["placements"][name]["forward_seconds_median"] / whole
    result["zero3_vs_fsdp2"] = (result["placements"][ZERO3]["forward_seconds_median"]
                                / result["placements"][FSDP2]["forward_seconds_median"])
    if rank == 0:
        write_report(result, args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
