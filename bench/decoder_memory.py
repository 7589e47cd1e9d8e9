"""The allocator around self-generation's decoder at full size: what each of its buffers takes.

    PYTHONPATH=. python3 bench/decoder_memory.py --memory-cap-gib 79.6                 # the library's allocator settings
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False PYTHONPATH=. python3 bench/decoder_memory.py --decoders 2

A random-weight Qwen3.5-35B-A3B-shaped base (and head, donor and fp32 masters, as
`bench_recipe.py` holds them) is built on the GPU, under the cap where one is given; the
batch is sized as self-generation sizes it (`EmbeddedWriter.batch_for`) and the allocator's
segments with the most free bytes are listed; then `BatchDecoder` is built with every
`torch.zeros` it makes logged beside the allocator's counters (allocated, reserved, free in
split segments), and one batch is decoded. With `--decoders N` that is done N times, each
decoder built after the last is dropped, with no sizing in between: on fixed segments the
second ran out of memory until `BatchDecoder` handed the allocator's cache back itself
(bench/results/decode.md). Out of memory, the segments are listed again, to tell fragmentation
from a wrong sizing.
"""

from __future__ import annotations

import argparse
import copy
import gc
import time

import torch

from occamy_mtp.base import fastdecode
from occamy_mtp.base.tuning import use_tuned_kernel_configs
from occamy_mtp.memory import expandable_segments
from occamy_mtp.model.checkpoint import base_model_class, text_config_from_dict
from occamy_mtp.config import TrainSettings
from occamy_mtp.model.head import MTPHead, SharedWeights, set_trainable
from occamy_mtp.selfgen.store import EmbeddedWriter
from occamy_mtp.testing.checkpoints import QWEN3_5_35B_A3B

GIB = 2**30


def counters(device) -> str:
    stats = torch.cuda.memory_stats(device)
    return (f"allocated {stats['allocated_bytes.all.current'] / GIB:.2f} GiB, reserved {stats['reserved_bytes.all.current'] / GIB:.2f}, "
            f"free in split segments {stats['inactive_split_bytes.all.current'] / GIB:.2f}, "
            f"segments {stats['segment.all.current']}")


def fragmentation(device, top: int = 8) -> None:
    """The segments holding the most free bytes: their size, what is allocated in them, their largest free block."""
    rows = []
    for segment in torch.cuda.memory_snapshot():
        if segment["device"] != device.index:
            continue
        free = [b["size"] for b in segment["blocks"] if b["state"] == "inactive"]
        rows.append((segment["total_size"] - segment["allocated_size"], segment["total_size"], segment["allocated_size"],
                     max(free, default=0), len(segment["blocks"]), segment["segment_type"]))
    rows.sort(reverse=True)
    print(f"segments: {len(rows)}; free bytes in them {sum(r[0] for r in rows) / GIB:.2f} GiB; the {top} with the most:")
    for free, total, allocated, largest, blocks, kind in rows[:top]:
        print(f"  {kind:5} segment {total / GIB:7.3f} GiB: allocated {allocated / GIB:7.3f}, free {free / GIB:7.3f}, "
              f"largest free block {largest / GIB:7.3f}, {blocks} blocks")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory-cap-gib", type=float, default=0.0, help="the process's cap (0: the card)")
    parser.add_argument("--context-tokens", type=int, default=128)
    parser.add_argument("--answer-tokens", type=int, default=382)
    parser.add_argument("--decoders", type=int, default=1,
                        help="decoders built one after another, each after the last is dropped, with no sizing between")
    parser.add_argument("--prompts", type=int, default=160, help="contexts to size the batch for (the recipe's 320 are sized at most 160)")
    args = parser.parse_args()
    device = torch.device("cuda", torch.cuda.current_device())
    if args.memory_cap_gib:
        torch.cuda.set_per_process_memory_fraction(args.memory_cap_gib * GIB / torch.cuda.mem_get_info(device)[1], device.index)
    print(f"expandable segments: {expandable_segments()}; cap {args.memory_cap_gib or 'none'} GiB")
    torch.manual_seed(0)
    config = text_config_from_dict(QWEN3_5_35B_A3B)
    config._attn_implementation = "sdpa"
    with torch.device(device):
        base = base_model_class(config)._from_config(config, dtype=torch.bfloat16)
        head = MTPHead(config, SharedWeights(base.model.embed_tokens, base.lm_head)).to(torch.bfloat16)
        for param in head.parameters():  # as bench_recipe.py: random values, not torch.empty's
            torch.nn.init.normal_(param, std=0.02)
    base.requires_grad_(False).eval()
    set_trainable(head, TrainSettings().trainable)
    for param in head.parameters():
        if param.requires_grad:
            param.data = param.data.float()  # the fp32 masters a run holds
    donor = copy.deepcopy(head, memo={id(head.shared): head.shared})  # noqa: F841 (held to the end, as the recipe holds it)
    use_tuned_kernel_configs(device)
    print(f"built: {counters(device)}")

    generator = torch.Generator().manual_seed(1)
    contexts = [tuple(torch.randint(0, config.vocab_size, (args.context_tokens,), generator=generator).tolist())
                for _ in range(args.prompts)]
    size = EmbeddedWriter(base, 0).batch_for(contexts, args.answer_tokens, print)
    print(f"sized: {counters(device)}")
    fragmentation(device)

    zeros = torch.zeros

    def logged_zeros(*shape, **kwargs):
        tensor = zeros(*shape, **kwargs)
        print(f"  zeros {tuple(tensor.shape)} {tensor.dtype}: {tensor.numel() * tensor.element_size() / GIB:.3f} GiB -> {counters(device)}")
        return tensor

    try:
        for number in range(1, args.decoders + 1):
            if number > 1:  # the last decoder dropped, its memory left in the allocator's cache
                del decoder
                print(f"decoder {number - 1} dropped: {counters(device)}")
                gc.collect()
                print(f"and garbage collected: {counters(device)}")
                fragmentation(device)
            torch.zeros = logged_zeros
            try:
                decoder = fastdecode.BatchDecoder(base, batch=size, positions=args.context_tokens + args.answer_tokens - 1)
            finally:
                torch.zeros = zeros
            print(f"decoder {number} built: {counters(device)}")
            started = time.perf_counter()
            decoder.generate(contexts[:size], max_new_tokens=args.answer_tokens, eos_token_ids=set())
            torch.cuda.synchronize(device)
            print(f"one batch of {size} decoded in {time.perf_counter() - started:.1f} s: {counters(device)}; "
                  f"peak {torch.cuda.max_memory_allocated(device) / GIB:.2f} GiB allocated, "
                  f"{torch.cuda.max_memory_reserved(device) / GIB:.2f} GiB reserved")
    except torch.OutOfMemoryError as error:
        print(f"OUT OF MEMORY: {str(error).splitlines()[0]}")
        print(counters(device))
        fragmentation(device)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
