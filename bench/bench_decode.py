"""The base's decode step at real size: the static batch decoder against `plain_decode`, beside the read bound.

    PYTHONPATH=/tmp/site:. python3 bench/bench_decode.py --out $OUT/decode.json     # H200, fla carried as a wheel
    PYTHONPATH=. .venv/bin/python bench/bench_decode.py --tiny --device cpu --batches 4 --legacy-batch 4
    ... --base-weights bf16,fp8     # the same base, then kept in FP8 (its bound in FP8 bytes), in one process

A random-weight Qwen3.5-35B-A3B-shaped base is built on the device (speed and memory do
not depend on the values; routing does, so the weights are randomised as in
bench_fullsize.py). Per batch size:

* `fastdecode.BatchDecoder`: time of one step (the slope between a `generate` of a quarter of
  `--timed-new-tokens` and one of all of them over `--prompt-tokens`-token prompts: the prompt is
  read in one prefill pass, then every step a CUDA-graph replay), the prefill's time,
  tokens per second, peak memory of the whole generate;
* the bound: the bytes one step must move, read at the copy bandwidth measured in the
  same run: every dense weight of the 40 layers, the routed experts the batch's tokens
  actually pick (counted from one step's router), lm_head, and the decoder's state (the
  Gated DeltaNet recurrent state read and written in fp32, the attention keys and values
  read);
* `--temperatures 0,0.7 --top-p 0.8`: the decoder greedy and sampled (each token drawn from the
  processed distribution inside the captured step: a sort of the vocabulary for top-p, a
  cumulative sum and a search), each batch timed under each;
* `--legacy-batch`: `generate.plain_decode`, the generator this replaces, timed as the
  slope between 8 and 40 new tokens;
* `--windows N --default-batch B`: the whole self-generation of N windows (the default
  recipe's 320), every continuation the full budget (random weights never stop: the worst case);
* `--reference-runners`: the reference decoder's base at batch 1 (`fastdecode.StaticRunner`
  against `decode.BaseRunner`): a one-token forward, and a 4-token verify between a snapshot
  and a restore;
* `--profile-batches`: the kernels of one eager step (the kernels a graph replays) at each
  batch, by category, with their count; `--profile-span` adds a span step of that many
  tokens at batch 1 (the reference decoder's verify pass);
* `--variants before,joined,after`: everything above for each decoder in turn, in one process:
  `before` each projection in its own weight (as built) and the attention's query/key norms and
  rotation the module's operations; `joined` the projections of one input laid out as one weight
  (`joined.lay_out`, what a base opened by the library holds); `after` also the norms and rotation
  in one kernel (`decode_kernels.norm_rotate`), what a run decodes with.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fullsize import profile_call, randomise  # noqa: E402

from occamy_mtp.sampling import GREEDY_TEXT, TextSampling  # noqa: E402
from occamy_mtp.base.fastdecode import BatchDecoder, fast_plain_decode  # noqa: E402
from occamy_mtp.base.generate import plain_decode  # noqa: E402
from occamy_mtp.base import decode_kernels, fastdecode, joined, moe_kernels  # noqa: E402
from occamy_mtp.memory import held_bytes  # noqa: E402
from occamy_mtp.testing.checkpoints import tiny_text_config  # noqa: E402
from occamy_mtp.testing.quantize import keep_in_fp8  # noqa: E402
from timing import sync  # noqa: E402

GIB = 2**30
VARIANTS = ("before", "joined", "after")



def build(tiny: bool, device):
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    config = tiny_text_config() if tiny else Qwen3_5MoeTextConfig()
    with torch.device(device):
        base = Qwen3_5MoeForCausalLM._from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
        randomise(base, config.initializer_range)
    return base.eval().requires_grad_(False)


@torch.no_grad()
def apart(base) -> None:
    """Each projection of every group in a storage of its own again (as the base was built): the baseline of `lay_out`."""
    for layer in base.model.layers:
        for group in joined.groups(layer):
            for module, name in group:
                getattr(module, name).data = getattr(module, name).data.clone()


def copy_bandwidth(device) -> float:
    """Bytes per second of a device-to-device copy of 4 GiB (read + write counted)."""
    if device.type != "cuda":
        return float("nan")
    src = torch.empty(GIB, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    started = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    sync(device)
    seconds = (time.perf_counter() - started) / 5
    del src, dst
    return 2 * 4 * GIB / seconds


def touched_experts(base, decoder: BatchDecoder) -> list[int]:
    """Distinct routed experts each layer's router picks for the batch, over one eager step
    (counted where the decode's MoE block routes: `moe_kernels.route` on CUDA, the router module elsewhere)."""
    from occamy_mtp.base import moe_kernels

    picked = []
    route = moe_kernels.route

    def counted(logits, top_k):
        weights, experts = route(logits, top_k)
        picked.append(experts.unique().numel())
        return weights, experts

    hooks = [layer.mlp.gate.register_forward_hook(lambda module, args, out: picked.append(out[-1].unique().numel()))
             for layer in base.model.layers[: base.config.num_hidden_layers]]
    moe_kernels.route = counted
    try:
        decoder.step()
    finally:
        moe_kernels.route = route
        for hook in hooks:
            hook.remove()
    return picked


def stored_bytes(layer) -> dict[str, int]:
    """Bytes each parameter of a decoder layer is stored in: its own, or, for a layer kept in FP8
    (`model.fp8_weights`), its float8 codes and float32 multipliers (what a step must read)."""
    from occamy_mtp.model.fp8_weights import ATTRIBUTE

    sizes = {name: p.numel() * p.element_size() for name, p in layer.named_parameters()}
    held = getattr(layer, ATTRIBUTE, None)
    if held is not None:
        owners = {id(module): name for name, module in layer.named_modules()}
        for weight in held.weights:
            owner = owners[id(weight.module)]
            name = f"{owner}.{weight.name}" if owner else weight.name
            sizes[name] = weight.codes.numel() * weight.codes.element_size() + sum(t.numel() * t.element_size() for t in weight.scales)
    return sizes


def step_bytes(base, decoder: BatchDecoder, experts_per_layer: list[int]) -> dict:
    """What one step must read (and write): weights touched, lm_head, the decoder's state."""
    dense = routed = 0
    for layer, touched in zip(base.model.layers[: base.config.num_hidden_layers], experts_per_layer):
        stored = stored_bytes(layer)
        experts = layer.mlp.experts
        per_expert = sum(stored[name] // experts.gate_up_proj.shape[0] for name in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))
        routed += touched * per_expert
        dense += sum(size for name, size in stored.items() if not name.startswith("mlp.experts."))
    head = base.lm_head.weight.numel() * base.lm_head.weight.element_size()
    recurrent = 2 * sum(t.numel() * t.element_size() for t in decoder.recurrent_state.values())  # read + write
    conv = 2 * sum(t.numel() * t.element_size() for t in decoder.conv_state.values())
    kv = sum(t.numel() * t.element_size() for t in [*decoder.kv.keys.values(), *decoder.kv.values.values()])
    return {"dense_weights": dense, "routed_experts_touched": routed, "lm_head": head, "weights": dense + routed + head,
            "recurrent_state": recurrent, "conv_state": conv, "kv_read": kv,
            "total": dense + routed + head + recurrent + conv + kv}


def time_decoder(base, batch: int, prompt_tokens: int, new_tokens: int, timed_new_tokens: int, bandwidth: float, device,
                 sampling: TextSampling = GREEDY_TEXT) -> dict:
    generator = torch.Generator().manual_seed(batch)
    prompts = torch.randint(0, base.config.vocab_size, (batch, prompt_tokens), generator=generator).tolist()
    uniforms = None if sampling.greedy else [sampling.uniforms(str(row), new_tokens) for row in range(batch)]
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    decoder = BatchDecoder(base, batch=batch, positions=prompt_tokens + new_tokens - 1, sampling=sampling)
    started = time.perf_counter()
    decoder.generate(prompts, max_new_tokens=4, eos_token_ids=set(), uniforms=uniforms)  # captures the graph, autotunes
    sync(device)
    first_seconds = time.perf_counter() - started
    # The prompt is read in one prefill pass, then one step a new token: the step is the slope between
    # two budgets (a budget's time divided by prompt + new tokens, as this bench once took it, counted the
    # prompt's tokens as steps when a prefill had replaced them, and read a third of the step).
    seconds = {}
    for new in (timed_new_tokens // 4, timed_new_tokens):
        started = time.perf_counter()
        decoder.generate(prompts, max_new_tokens=new, eos_token_ids=set(), uniforms=uniforms)
        sync(device)
        seconds[new] = time.perf_counter() - started
    short, steps = min(seconds), max(seconds) - min(seconds)
    seconds_per_step = (seconds[timed_new_tokens] - seconds[short]) / steps
    prefill_seconds = seconds[short] - short * seconds_per_step  # the prompt but its last token, then a step a new token
    peak = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None
    experts = touched_experts(base, decoder)
    moved = step_bytes(base, decoder, experts)
    return {
        "batch": batch, "sampling": sampling.label(), "positions": decoder.positions, "steps_timed": steps,
        "seconds_per_step": seconds_per_step, "tokens_per_second": batch / seconds_per_step,
        "prefill_seconds": prefill_seconds, f"seconds_of_{timed_new_tokens}_new_tokens": seconds[timed_new_tokens],
        "first_generate_seconds_with_capture": first_seconds, "peak_gib": peak,
        "experts_touched_per_layer_mean": sum(experts) / len(experts),
        "bytes_per_step": moved,
        "bound_seconds_weights_only": moved["weights"] / bandwidth,
        "bound_seconds_with_state": moved["total"] / bandwidth,
        "ratio_to_bound_with_state": seconds_per_step / (moved["total"] / bandwidth),
        # what the batch sizing counts a row (`BatchDecoder.row_bytes`), beside the weights: the peak less
        # the weights, over the batch, is the row's measured share
        "row_bytes_sized": BatchDecoder.row_bytes(base.config, decoder.positions, base.lm_head.weight.dtype, sampling),
    }


def time_legacy(base, batch: int, prompt_tokens: int, device) -> dict:
    """plain_decode's per-step time: the slope between 8 and 40 new tokens, after a warm-up of the same batch."""
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, base.config.vocab_size, (batch, prompt_tokens), generator=generator).tolist()
    plain_decode(base, prompts, max_new_tokens=8, eos_token_ids=set(), batch_size=batch)
    seconds = {}
    for new in (8, 40):
        sync(device)
        started = time.perf_counter()
        plain_decode(base, prompts, max_new_tokens=new, eos_token_ids=set(), batch_size=batch)
        sync(device)
        seconds[new] = time.perf_counter() - started
    per_step = (seconds[40] - seconds[8]) / 32
    return {"batch": batch, "seconds_per_step": per_step, "tokens_per_second": batch / per_step}


def time_reference_runners(base, prompt_tokens: int, device, bandwidth: float) -> dict:
    """The reference decoder's base at batch 1: one-token forwards, and a verify pass of 4 tokens
    (a 3-step draft) between a snapshot and a restore, as `decode.speculative_decode` runs them; beside
    the read bound of a forward of 1 token and of 4 (routed to the experts 4 random rows pick)."""
    from occamy_mtp.evaluation.decode import BaseRunner
    from occamy_mtp.base.fastdecode import StaticRunner

    prompt = torch.randint(0, base.config.vocab_size, (prompt_tokens,), generator=torch.Generator().manual_seed(3)).tolist()
    out = {}
    for name, runner in (("static", StaticRunner(base, prompt_tokens + 64)), ("transformers", BaseRunner(base))):
        runner.forward(prompt)
        runner.forward([1])  # warm-up (the static runner captures its graph here)
        sync(device)
        started = time.perf_counter()
        for _ in range(20):
            runner.forward([1])
        sync(device)
        single = (time.perf_counter() - started) / 20
        started = time.perf_counter()
        for _ in range(5):
            saved = runner.snapshot()
            runner.forward([1, 2, 3, 4])
            runner.restore(saved)
        sync(device)
        out[name] = {"seconds_per_one_token_forward": single, "seconds_per_verify_of_4_with_restore": (time.perf_counter() - started) / 5}
    # The read bound of a forward of 1 and of 4 tokens: what a step of the batch decoder with as many rows must
    # read (its dense weights, the experts those rows pick, lm_head, the state), at the copy bandwidth.
    for rows in (1, 4):
        decoder = BatchDecoder(base, batch=rows, positions=prompt_tokens + 64, cuda_graph=False)
        decoder._reset([prompt] if rows == 1 else
                       torch.randint(0, base.config.vocab_size, (rows, prompt_tokens), generator=torch.Generator().manual_seed(5)).tolist())
        moved = step_bytes(base, decoder, touched_experts(base, decoder))
        out[f"bound_seconds_{rows}_token"] = moved["total"] / bandwidth
        out[f"bytes_{rows}_token"] = moved
        del decoder
    out["static_one_token_over_bound"] = out["static"]["seconds_per_one_token_forward"] / out["bound_seconds_1_token"]
    return out


def profile_steps(base, batches: list[int], span: int, prompt_tokens: int, new_tokens: int, device, top: int = 25) -> list[dict]:
    """Kernels of one eager step per batch (and one span step at batch 1), by category: where a step's time goes."""
    out = []
    for batch in batches:
        prompts = torch.randint(0, base.config.vocab_size, (batch, prompt_tokens), generator=torch.Generator().manual_seed(4)).tolist()
        decoder = BatchDecoder(base, batch=batch, positions=prompt_tokens + new_tokens - 1, cuda_graph=False)
        decoder._reset(prompts)
        for _ in range(4):
            decoder.step()
        out.append({"what": f"step, batch {batch}", **profile_call(decoder.step, device, top)})
        print(json.dumps({k: out[-1][k] for k in ("what", "kernel_s", "launches", "categories")}), flush=True)
        del decoder
    if span:
        decoder = BatchDecoder(base, batch=1, positions=prompt_tokens + new_tokens - 1, cuda_graph=False, span=span)
        decoder._reset([[1] * prompt_tokens])
        decoder.span_tokens.random_(0, base.config.vocab_size)
        out.append({"what": f"span step of {span} tokens, batch 1", **profile_call(lambda: decoder.span_step(span), device, top)})
        print(json.dumps({k: out[-1][k] for k in ("what", "kernel_s", "launches", "categories")}), flush=True)
    return out


def time_windows(base, windows: int, batch: int, prompt_tokens: int, new_tokens: int, device) -> dict:
    generator = torch.Generator().manual_seed(2)
    prompts = torch.randint(0, base.config.vocab_size, (windows, prompt_tokens), generator=generator).tolist()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    sync(device)
    started = time.perf_counter()
    out = fast_plain_decode(base, prompts, max_new_tokens=new_tokens, eos_token_ids=set(), batch_size=batch)
    sync(device)
    seconds = time.perf_counter() - started
    return {"windows": windows, "batch": batch, "new_tokens": new_tokens, "seconds": seconds,
            "tokens": sum(len(c) for c in out), "tokens_per_second": sum(len(c) for c in out) / seconds,
            "peak_gib": torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None}


def measure(base, mode: str, args, samplings, bandwidth: float, device) -> dict:
    """Every measurement the arguments ask for, of `base` as it is held now (`mode`: bf16, or fp8 kept in FP8)."""
    run = {"base_weights": mode, "weights_gib": held_bytes(base) / GIB, "decoder": [], "legacy": None, "windows": None,
           "reference_runners": None, "profiles": None}
    library_limit = moe_kernels.EXPERT_MAX_TOKENS
    gemms = ("triton", "grouped_mm") if args.expert_gemms == "both" else (args.expert_gemms,)
    for batch in (int(b) for b in args.batches.split(",") if b):
        for gemm in gemms:
            for sampling in samplings:
                moe_kernels.EXPERT_MAX_TOKENS = library_limit if gemm == "triton" else 0  # 0: every batch takes the grouped GEMM
                try:
                    timed = time_decoder(base, batch, args.prompt_tokens, args.new_tokens, args.timed_new_tokens, bandwidth,
                                         device, sampling)
                except torch.OutOfMemoryError as err:
                    timed = {"batch": batch, "sampling": sampling.label(), "error": f"out of memory: {err}"[:300]}
                run["decoder"].append({"base_weights": mode, **timed, "expert_gemms": gemm})
                print(json.dumps(run["decoder"][-1]), flush=True)
    moe_kernels.EXPERT_MAX_TOKENS = library_limit
    if args.legacy_batch:
        run["legacy"] = time_legacy(base, args.legacy_batch, args.prompt_tokens, device)
        print(json.dumps(run["legacy"]), flush=True)
    if args.windows:
        run["windows"] = time_windows(base, args.windows, args.default_batch, args.prompt_tokens, args.new_tokens, device)
        print(json.dumps({"base_weights": mode, **run["windows"]}), flush=True)
    if args.reference_runners:
        run["reference_runners"] = time_reference_runners(base, args.prompt_tokens, device, bandwidth)
        print(json.dumps({"base_weights": mode, **run["reference_runners"]}), flush=True)
    if args.profile_batches or args.profile_span:
        batches = [int(b) for b in args.profile_batches.split(",") if b]
        run["profiles"] = profile_steps(base, batches, args.profile_span, args.prompt_tokens, args.new_tokens, device)
    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny model (a smoke run of the same code)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batches", default="64,160,192", help="batch sizes of the decoder")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=382, help="the decoder's budget (positions = prompt + this - 1)")
    parser.add_argument("--timed-new-tokens", type=int, default=64)
    parser.add_argument("--legacy-batch", type=int, default=64, help="0: skip plain_decode")
    parser.add_argument("--windows", type=int, default=0, help="time the self-generation of this many windows")
    parser.add_argument("--default-batch", type=int, default=160)
    parser.add_argument("--reference-runners", action="store_true", help="time the reference decoder's base at batch 1")
    parser.add_argument("--profile-batches", default="", help="profile one eager step at each of these batches")
    parser.add_argument("--profile-span", type=int, default=0, help="also profile a span step of this many tokens at batch 1")
    parser.add_argument("--expert-gemms", choices=("triton", "grouped_mm", "both"), default="triton",
                        help="the routed experts' GEMMs of the step: moe_kernels.expert_mlp (the library's), torch's grouped GEMM, or each in turn")
    parser.add_argument("--temperatures", default="0", help="time each batch greedy (0) and at each of these temperatures")
    parser.add_argument("--top-p", type=float, default=1.0, help="top_p of the sampled decoders")
    parser.add_argument("--top-k", type=int, default=0, help="top_k of the sampled decoders")
    parser.add_argument("--presence-penalty", type=float, default=0.0, help="presence penalty of the sampled decoders")
    parser.add_argument("--base-weights", default="bf16",
                        help="bf16, fp8 or bf16,fp8: the base as built, and/or its decoder layers quantized in blocks of "
                             "128 x 128 and kept in FP8 (model.fp8_weights fp8), measured in that order in one process")
    parser.add_argument("--variants", default="after",
                        help="the decoder measured, in this order: before (each projection in its own weight, as built, and the "
                             "attention's norms and rotation the module's operations), joined (the projections of one input "
                             "laid out as one weight, joined.lay_out, as a base opens), after (joined, and the norms and "
                             "rotation in one kernel, decode_kernels.norm_rotate: what a run decodes with)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    samplings = [TextSampling(float(t), args.top_p, args.top_k, 0, args.presence_penalty) if float(t) > 0 else GREEDY_TEXT
                 for t in args.temperatures.split(",") if t]
    modes = [m for m in args.base_weights.split(",") if m]
    if modes not in (["bf16"], ["fp8"], ["bf16", "fp8"]):
        parser.error(f"--base-weights {args.base_weights!r}: expected bf16, fp8 or bf16,fp8 (fp8 last: the base is quantized in place)")
    device = torch.device(args.device)
    started = time.perf_counter()
    base = build(args.tiny, device)
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "model": "tiny" if args.tiny else "Qwen3.5-35B-A3B", "build_seconds": time.perf_counter() - started,
              "copy_bandwidth_bytes_per_second": copy_bandwidth(device), "runs": []}
    bandwidth = result["copy_bandwidth_bytes_per_second"]
    if bandwidth != bandwidth:  # no GPU: nothing to bound against
        bandwidth = 1.0
    variants = [v for v in args.variants.split(",") if v]
    if not variants or any(v not in VARIANTS for v in variants) or len(set(variants)) != len(variants):
        parser.error(f"--variants {args.variants!r}: expected some of {', '.join(VARIANTS)}, each once")
    for mode in modes:
        if mode == "fp8":
            keep_in_fp8(base)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        for variant in variants:
            (apart if variant == "before" else joined.lay_out)(base)
            fastdecode.norm_rotate = decode_kernels.norm_rotate if variant == "after" else decode_kernels.norm_rotate_reference
            run = measure(base, mode, args, samplings, bandwidth, device)
            run["variant"] = variant
            result["runs"].append(run)
            print(json.dumps({"base_weights": mode, "variant": variant, "joined_groups": joined.joined_groups(base)}), flush=True)
            if args.out:  # after each run: a run cut short by its time limit keeps what it measured
                args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
