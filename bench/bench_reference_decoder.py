"""Where the reference decoder's time goes at full size, and the self-generation batch's peak memory.

    PYTHONPATH=/tmp/site:. python3 bench/bench_reference_decoder.py --out $OUT/reference-decoder.json   # H200
    PYTHONPATH=. python3 bench/bench_reference_decoder.py --tiny --device cpu                          # smoke run

A random-weight Qwen3.5-35B-A3B-shaped base and one head are built on the device, as a
training run holds them (the head's trainable tensors as fp32 masters). Then:

1. self-generation peaks: one batch of each `--batch-sizes` contexts (128 tokens each)
   continued for the whole 382-token budget (`selfgen.store.self_generate`), with its wall time
   and the peak GPU memory with the base and the head resident: what decides the default
   `data.self_generate_batch_size` (under 78 GiB);
2. the reference decoder check (`decoder_check.reference_decoder_check`, export's check) on one
   random heldout prompt at K = 1 and 3, the head in the model dtype as export holds it, one
   pair of runners for all checks as export shares them; each check run twice (the first pays
   compilation, autotuning and the graphs' capture), the second broken down by what it
   calls: the base runner's forwards (prefill, verify passes, and the re-runs after a
   rollback where the runner cannot keep part of a pass), its snapshots, restores and keeps,
   the head runner's step-1 extensions and K-step chains, and the offline replay
   (`offline._run_batch`). Each piece is timed between two device synchronisations, so the
   pieces add up to a little more than the unbroken run. Where the head runs on
   `fastdecode.StaticHeadRunner` (a GPU), the same checks follow with `decode.HeadRunner`
   (`*_eager_head`), then with it and the base's rejected passes fed again rather than kept
   (`*_eager_head_rerun`: the decoder as it was before both): the three in one process.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch

from occamy_mtp.base import joined
from occamy_mtp.data.windows import Window
from occamy_mtp.evaluation import decode, decoder_check, offline
from occamy_mtp.model.checkpoint import base_model_class, text_config_from_dict
from occamy_mtp.model.head import MTPHead, SharedWeights, set_trainable
from occamy_mtp.base import fastdecode
from occamy_mtp.selfgen.store import self_generate
from occamy_mtp.testing.checkpoints import QWEN3_5_35B_A3B, tiny_text_config
from report import write_report
from timing import sync

CONTEXT_TOKENS, ANSWER_TOKENS = 128, 382



class Timers:
    """Seconds and calls per named piece, each timed between two synchronisations."""

    def __init__(self, device):
        self.device, self.seconds, self.calls = device, defaultdict(float), defaultdict(int)

    def wrap(self, owner, attribute: str, name: str):
        original = getattr(owner, attribute)

        def timed(*args, **kwargs):
            sync(self.device)
            started = time.perf_counter()
            value = original(*args, **kwargs)
            sync(self.device)
            self.seconds[name] += time.perf_counter() - started
            self.calls[name] += 1
            return value

        setattr(owner, attribute, timed)
        return original

    def report(self) -> dict:
        return {name: {"seconds": self.seconds[name], "calls": self.calls[name],
                       "ms_per_call": 1e3 * self.seconds[name] / max(self.calls[name], 1)} for name in self.seconds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch-sizes", default="160,128", help="self-generation batches measured (empty: none)")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    config = tiny_text_config() if args.tiny else text_config_from_dict(QWEN3_5_35B_A3B)
    config._attn_implementation = "sdpa"
    with torch.device(device):
        base = base_model_class(config)._from_config(config, dtype=torch.bfloat16)
        head = MTPHead(config, SharedWeights(base.model.embed_tokens, base.lm_head)).to(torch.bfloat16)
    base.requires_grad_(False).eval()
    joined.lay_out(base)  # as a base opened by the library holds it
    set_trainable(head)
    for param in head.parameters():
        if param.requires_grad:
            param.data = param.data.float()
    head.eval()
    generator = torch.Generator().manual_seed(1)
    result: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "dimensions": "tiny" if args.tiny else "Qwen3.5-35B-A3B"}

    def random_ids(n: int) -> tuple[int, ...]:
        return tuple(torch.randint(0, config.vocab_size, (n,), generator=generator).tolist())

    for size in [int(x) for x in args.batch_sizes.split(",") if x.strip()]:
        contexts = [random_ids(CONTEXT_TOKENS) for _ in range(size)]
        sync(device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        started = time.perf_counter()
        self_generate(base, contexts, ANSWER_TOKENS, set(), size)
        sync(device)
        result[f"self_generate_batch{size}"] = {
            "seconds": time.perf_counter() - started, "tokens": size * ANSWER_TOKENS,
            "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None}
        print(f"batch {size}: {json.dumps(result[f'self_generate_batch{size}'])}", flush=True)

    window = Window("random", 0, random_ids(CONTEXT_TOKENS + ANSWER_TOKENS), CONTEXT_TOKENS)
    for param in head.parameters():  # as export evaluates it: every tensor in the model dtype
        param.data = param.data.to(torch.bfloat16)
    # One pair of runners for every check, as export shares them (one base runner throughout);
    # "eager" is decode.HeadRunner (transformers' layer on a growing cache), "static" fastdecode.StaticHeadRunner.
    shared = decode.decodes_runners(base, head, [CONTEXT_TOKENS], ANSWER_TOKENS, 3)
    eager_head = decode.Runners(shared.base, decode.HeadRunner(head), shared.positions, shared.span)
    variants = {"": shared, "_eager_head": eager_head, "_eager_head_rerun": eager_head}
    if not fastdecode.static_head_decoding(head):
        variants = {"_eager_head": shared}
    for suffix, runners in variants.items():
        if suffix == "_eager_head_rerun":  # as before keeping: the snapshot restored and the kept tokens fed again
            runners.base.keep = lambda snapshot, tokens, runner=runners.base: (
                runner.restore(snapshot), runner.forward(fastdecode.kept_tokens(runner._last_forward, snapshot, tokens)))
        for k in (1, 3):
            for attempt in ("first", "second"):
                timers = Timers(device)
                restore = []
                if attempt == "second":
                    for attribute in ("forward", "snapshot", "restore", "keep"):
                        restore.append((type(runners.base), attribute,
                                        timers.wrap(type(runners.base), attribute, f"base_runner.{attribute}")))
                    for attribute in ("extend", "chain"):
                        restore.append((type(runners.head), attribute,
                                        timers.wrap(type(runners.head), attribute, f"head_runner.{attribute}")))
                    restore.append((offline, "_run_batch", timers.wrap(offline, "_run_batch", "offline_replay")))
                sync(device)
                started = time.perf_counter()
                check = decoder_check.reference_decoder_check(base, head, [window], k, ANSWER_TOKENS, set(), runners=runners)
                sync(device)
                seconds = time.perf_counter() - started
                for owner, attribute, original in restore:
                    setattr(owner, attribute, original)
                forwards = timers.calls.get("base_runner.forward", 0)
                name = f"decoder_check_k{k}_{attempt}{suffix}"
                result[name] = {
                    "seconds": seconds, "decode_seconds": check["decode_seconds"], "verify_passes": check["measured"]["verify_passes"],
                    "counts_equal": check["measured"]["proposed"] == check["replayed"]["proposed"],
                    "decisions_equal": f"{check['decisions_equal']}/{check['decisions']}",
                    "pieces": timers.report(), "base_forwards": forwards,
                    "ms_per_base_forward": 1e3 * timers.seconds.get("base_runner.forward", 0.0) / max(forwards, 1)}
                print(f"{name}: {json.dumps(result[name])}", flush=True)
    write_report(result, args.out, printed=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
