"""Full-size frozen-base and head-step benchmark (issue 6 item 3).

    PYTHONPATH=. python3 bench/bench_fullsize.py --out $OUT/fullsize.json

Builds a random-weight base shaped like Qwen3.5-35B-A3B (transformers'
`Qwen3_5MoeTextConfig()` defaults: 40 layers, 256 experts top-8, vocab 248,320) and an
MTP head, directly on the GPU (no checkpoint), then measures in one run:

1. frozen-base tokens/s and peak GPU memory, side by side for the same windows:
   * `plain-logits`: transformers' forward with full logits + argmax (as in the issue);
   * `plain-chunked`: `occamy_mtp.targets.base.base_outputs` (transformers' forward, then
     lm_head + argmax in 4096-token chunks);
   * `fast`: `occamy_mtp.base.fastbase.FastBasePass` (packed, fla kernels, fused norms), and
     variants (`fast-nofuse`: fla without fused norms; `fast-graph`: CUDA graph);
2. agreement of the fast pass with the plain one (greedy match rate, hidden-state
   relative error), for uniform and for packed variable-length windows;
3. a kernel-time profile of one forward of each (top kernels, grouped);
4. head training step (K chained steps, chain loss, backward, AdamW on the trainable
   tensors) tokens/s and peak memory.

Every section is guarded: a failure (say out of memory) is recorded and the run goes on.
`--config tiny --device cpu` runs the same code on a tiny model, to check it before
spending GPU time.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from datetime import datetime, timezone

import torch

from occamy_mtp.base import fastbase
from occamy_mtp.model.head import MTPHead, SharedWeights, set_trainable
from occamy_mtp.model.loss import chain_batch, chain_loss
from occamy_mtp.targets.base import base_outputs
from timing import seconds_of, sync

GIB = 1024**3


def parse_shape(text: str) -> tuple[int, int]:
    windows, tokens = text.lower().split("x")
    return int(windows), int(tokens)



def peak_gib(device) -> float:
    return torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else float("nan")


def reset_peak(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def timed(fn, device, warmup: int, repeats: int) -> dict:
    """Median wall time of `fn` (synchronised) after warm-up, and peak memory over the timed calls."""
    for _ in range(warmup):
        fn()
    sync(device)
    reset_peak(device)
    seconds = seconds_of(fn, device, repeats)
    return {"seconds": seconds, "median_s": statistics.median(seconds), "peak_gib": peak_gib(device)}


def guarded(results: dict, key: str, fn):
    """Run one section; record its result or its error, never stop the run."""
    started = time.perf_counter()
    try:
        results[key] = fn()
    except Exception as error:  # noqa: BLE001 - a benchmark reports every failure and goes on
        results[key] = {"error": f"{type(error).__name__}: {error}"[:2000]}
        traceback.print_exc()
    print(f"[{time.perf_counter() - started:7.1f}s] {key}: {json.dumps(results[key], default=str)[:400]}", flush=True)
    reset_peak(DEVICE)


# -- models -------------------------------------------------------------------------


def text_config(name: str, layers: int | None = None):
    from transformers import Qwen3_5MoeTextConfig

    if name == "full":
        if layers is None:
            return Qwen3_5MoeTextConfig()  # transformers' defaults are the 35B-A3B dimensions
        full = Qwen3_5MoeTextConfig()
        return Qwen3_5MoeTextConfig(num_hidden_layers=layers, layer_types=full.layer_types[:layers])
    from occamy_mtp.testing.checkpoints import tiny_text_config

    return tiny_text_config()


@torch.no_grad()
def randomise(module, std: float):
    """Random weights in place: transformers' init is skipped or partial on some versions."""
    for name, param in module.named_parameters():
        if name.endswith("A_log"):
            param.copy_(torch.empty_like(param, dtype=torch.float32).uniform_(1.0, 16.0).log_())
        elif name.endswith("dt_bias"):
            param.fill_(1.0)
        elif "norm" in name and param.ndim == 1:
            # zero-centred norms (weight 0 = identity) and the gated norm (weight 1 = identity)
            param.normal_(1.0 if name.endswith("linear_attn.norm.weight") else 0.0, 0.1)
        else:
            param.normal_(0.0, std)


def build_models(config, device, experts_implementation: str):
    from transformers import Qwen3_5MoeForCausalLM

    started = time.perf_counter()
    with torch.device(device):
        base = Qwen3_5MoeForCausalLM._from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
        randomise(base, config.initializer_range)
        head = MTPHead(config, SharedWeights(base.model.embed_tokens, base.lm_head))
        head = head.to(torch.bfloat16)
        randomise(head, config.initializer_range)
    head.rotary_emb = ThreeRowRotary(type(head.rotary_emb)(head.config).to(device))  # fp32 frequencies, as loaded
    base.config._experts_implementation = experts_implementation
    base.eval().requires_grad_(False)
    sync(device)
    info = {
        "base_parameters": sum(p.numel() for p in base.parameters()),
        "head_parameters": sum(p.numel() for p in head.parameters()),
        "build_seconds": time.perf_counter() - started,
        "memory_after_build_gib": torch.cuda.memory_allocated(device) / GIB if device.type == "cuda" else None,
        "attn_implementation": base.config._attn_implementation,
        "experts_implementation": base.config._experts_implementation,
    }
    return base, head, info


class ThreeRowRotary(torch.nn.Module):
    """Hands transformers' text M-RoPE the (3, B, T) position ids it takes on every version.

    `MTPHead.backbone` passes (B, T) ids; transformers 5.24's rotary expands them, 5.17's
    (the GPU image's) does not. Bench-local shim; the fix belongs in occamy_mtp/model/head.py.
    """

    def __init__(self, rotary):
        super().__init__()
        self.rotary = rotary

    def forward(self, x, position_ids):
        if position_ids.ndim == 2:
            position_ids = position_ids[None].expand(3, -1, -1)
        return self.rotary(x, position_ids)


def random_windows(config, shape, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, shape, generator=generator)


# -- frozen base ----------------------------------------------------------------------


def plain_logits(base, ids):
    """transformers as a user calls it: full-vocabulary logits, then argmax."""
    with torch.no_grad():
        out = base(input_ids=ids, use_cache=False)
        return out.logits.argmax(-1)


def bench_base(base, config, shape, device, variants: list[str], args) -> dict:
    windows_cpu = random_windows(config, shape, seed=shape[0] * 1000 + shape[1])
    ids = windows_cpu.to(device)
    windows = list(windows_cpu)
    tokens = shape[0] * shape[1]
    calls = {
        "plain-logits": lambda: plain_logits(base, ids),
        "plain-chunked": lambda: base_outputs(base, ids),
    }
    passes = {
        "fast": lambda: fastbase.FastBasePass(base, max_tokens_per_batch=tokens, kernels=KERNELS["fast"]),
        "fast-nofuse": lambda: fastbase.FastBasePass(base, max_tokens_per_batch=tokens, kernels=KERNELS["fast-nofuse"]),
        "fast-tmoe": lambda: fastbase.FastBasePass(base, max_tokens_per_batch=tokens, kernels=KERNELS["fast-tmoe"]),
        "fast-graph": lambda: fastbase.FastBasePass(
            base, max_tokens_per_batch=tokens, kernels=KERNELS["fast"], cuda_graphs=True
        ),
    }
    out = {"tokens": tokens}
    for name in variants:
        if name in calls:
            fn = calls[name]
        elif name in passes or name in KERNELS:
            kernels = KERNELS.get(name.replace("-graph", ""))
            if kernels is None:
                continue  # kernels this device lacks (fla's: CUDA only)
            runner = passes[name]() if name in passes else fastbase.FastBasePass(base, max_tokens_per_batch=tokens, kernels=kernels)
            fn = lambda runner=runner: runner.forward_batch(windows)  # noqa: E731
            if name == "fast-graph":
                guarded(out, "graph-vs-eager", lambda runner=runner: graph_check(runner, windows))
        else:
            raise ValueError(f"unknown variant {name!r}")

        def one(fn=fn):
            result = timed(fn, device, args.warmup, args.repeats)
            result["tokens_per_s"] = tokens / result["median_s"]
            return result

        guarded(out, name, one)
    return out


@torch.no_grad()
def perturbed_plain(base, ids, seed: int = 0):
    """Plain transformers after the smallest change bf16 can make to its input: half of the
    input embedding's entries moved by one unit in the last place (chosen at random).

    Any two correct bf16 computations of the base differ by at least this much rounding,
    so how far this moves the outputs is the floor for how closely another correct pass
    (another kernel, another order of additions) can agree with the plain forward.
    """
    generator = torch.Generator(device=ids.device).manual_seed(seed)

    def hook(module, inputs, output):
        flip = torch.rand(output.shape, generator=generator, device=output.device) < 0.5
        return (output.view(torch.int16) + flip.to(torch.int16)).view(output.dtype)  # +1 ulp in magnitude

    handle = base.model.embed_tokens.register_forward_hook(hook)
    try:
        return base_outputs(base, ids)
    finally:
        handle.remove()


@torch.no_grad()
def agreement(base, config, device, shape, variable_windows: int, args, kernels_name: str = "fast", truth: bool = False) -> dict:
    """Fast pass vs plain transformers on the same windows: greedy match and hidden error.

    Two noise floors come with it. `plain-batch-vs-single`: plain transformers on a
    batch of windows against plain on each window alone (only the GEMM shapes differ).
    `plain-perturbed-1ulp`: plain against plain after a one-ulp change of its input (see
    `perturbed_plain`): random weights amplify rounding through the layers (top-8 routing
    flips), and a correct fast pass cannot be expected to agree better than this.
    With `truth`, every bf16 pass is also compared with the same model in float32
    (`fastbase.packed_hidden` with transformers' own PyTorch kernels, checked exact
    against the plain forward in tests/test_fastbase.py): a correct pass is about as close
    to it as plain bf16 transformers is.
    """
    result = {}
    ids = random_windows(config, shape, seed=7).to(device)
    plain = base_outputs(base, ids)
    flat_hidden = plain.hidden.reshape(-1, plain.hidden.shape[-1])
    flat_greedy = plain.greedy.reshape(-1)
    singles = [base_outputs(base, ids[i : i + 1]) for i in range(shape[0])]
    result["plain-batch-vs-single"] = compare(
        torch.cat([o.hidden[0] for o in singles]), torch.cat([o.greedy[0] for o in singles]), flat_hidden, flat_greedy
    )
    perturbed = perturbed_plain(base, ids)
    result["plain-perturbed-1ulp"] = compare(
        flat_hidden, flat_greedy, perturbed.hidden.reshape(flat_hidden.shape), perturbed.greedy.reshape(-1)
    )
    passes = {"plain": (flat_hidden, flat_greedy),
              "plain-perturbed-1ulp": (perturbed.hidden.reshape(flat_hidden.shape), perturbed.greedy.reshape(-1))}
    for name in [k for k in KERNELS if k.startswith("fast")]:
        if KERNELS.get(name) is None:
            continue
        fast = fastbase.FastBasePass(base, max_tokens_per_batch=shape[0] * shape[1], kernels=KERNELS[name])
        hidden, greedy, _ = fast.forward_batch(list(ids.cpu()))
        result[f"uniform-{name}"] = compare(flat_hidden, flat_greedy, hidden, greedy)
        passes[name] = (hidden, greedy)
    result["uniform"] = result[f"uniform-{kernels_name}"]
    if truth:
        truth_hidden, truth_greedy = float32_truth(base, config, ids)
        result["truth"] = {name: compare(truth_hidden, truth_greedy, h, g) for name, (h, g) in passes.items()}
    fast = fastbase.FastBasePass(base, max_tokens_per_batch=shape[0] * shape[1], kernels=KERNELS[kernels_name])
    # Packed windows of different lengths: each against its own plain forward.
    generator = torch.Generator().manual_seed(11)
    lengths = torch.randint(args.min_window, shape[1] + 1, (variable_windows,), generator=generator).tolist()
    windows = [random_windows(config, (n,), seed=100 + i) for i, n in enumerate(lengths)]
    packed = fast(windows)
    pieces = [[], [], [], []]
    for window, got in zip(windows, packed):
        ref = base_outputs(base, window[None].to(device))
        for bucket, value in zip(pieces, (ref.hidden[0], ref.greedy[0], got.hidden, got.greedy)):
            bucket.append(value)
    result["packed_variable"] = compare(*(torch.cat(p) for p in pieces))
    result["packed_variable"]["lengths"] = lengths
    return result


@torch.no_grad()
def float32_truth(base, config, ids):
    """The same weights in float32, through transformers' own PyTorch kernels: (hidden (N, D), greedy (N,))."""
    from occamy_mtp.base.logits import chunked_greedy

    wide = copy.deepcopy(base).float()
    with torch.device(ids.device):
        wide.model.rotary_emb = type(base.model.rotary_emb)(wide.config)  # fp32 frequencies, as loaded
    layout = fastbase.make_layout([ids.shape[1]] * ids.shape[0], ids.device)
    hidden = fastbase.packed_hidden(wide, ids, layout, fastbase.torch_kernels()).reshape(-1, config.hidden_size)
    greedy = chunked_greedy(hidden, wide.lm_head)
    del wide
    return hidden, greedy


def compare(ref_hidden, ref_greedy, hidden, greedy) -> dict:
    diff = (hidden.float() - ref_hidden.float())
    return {
        "positions": int(ref_greedy.numel()),
        "greedy_match": float((greedy == ref_greedy).float().mean()),
        "hidden_rel_error": float(diff.norm() / ref_hidden.float().norm()),
        "hidden_max_abs_error": float(diff.abs().max()),
        "hidden_max_abs": float(ref_hidden.float().abs().max()),
    }


@torch.no_grad()
def graph_check(runner, windows) -> dict:
    """A replayed graph must give what the same pass gives eagerly."""
    hidden, greedy, _ = runner.forward_batch(windows)
    runner.cuda_graphs = False
    eager_hidden, eager_greedy, _ = runner.forward_batch(windows)
    runner.cuda_graphs = True
    return compare(eager_hidden, eager_greedy, hidden, greedy)


def rel(got, ref) -> float:
    return float((got.float() - ref.float()).norm() / ref.float().norm())


@torch.no_grad()
def diagnose(base, config, device) -> dict:
    """Each part of the fast pass against transformers' own module on the same input."""
    model = base.model
    shape = (2, 512)
    ids = random_windows(config, shape, seed=21).to(device)
    layout = fastbase.make_layout([shape[1]] * shape[0], device)
    hidden = model.embed_tokens(ids)
    plain_positions = torch.arange(shape[1], device=device).view(1, 1, -1).expand(4, shape[0], -1)[1:]
    ours_positions = torch.arange(shape[1], device=device).expand(shape[0], -1)[None].expand(3, -1, -1)
    plain_rope = model.rotary_emb(hidden, plain_positions)
    ours_rope = model.rotary_emb(hidden, ours_positions)
    out = {"rotary_cos": rel(ours_rope[0], plain_rope[0])}
    gdn_layer = next(l for l in model.layers if l.block_type == "linear_attention")
    attn_layer = next(l for l in model.layers if l.block_type == "full_attention")
    x = gdn_layer.input_layernorm(hidden)
    reference = gdn_layer.linear_attn(x)  # transformers' forward: PyTorch conv, fla rule on repeated heads
    variants = {
        "torch": fastbase.torch_kernels(),
        "fla": fastbase.fla_kernels(False, False),
        "fla-repeat-kv": fastbase.fla_kernels(False, False, repeat_kv_heads=True),
        "fla-torch-conv": fastbase.fla_kernels(False, False, triton_conv=False),
        "fla-repeat-kv-torch-conv": fastbase.fla_kernels(False, False, repeat_kv_heads=True, triton_conv=False),
    }
    for name, kernels in variants.items():
        out[f"gdn-{name}"] = rel(fastbase._gated_deltanet(gdn_layer.linear_attn, x, layout, kernels), reference)
    mixed = gdn_layer.linear_attn.in_proj_qkv(x)
    weight = gdn_layer.linear_attn.conv1d.weight.squeeze(1)
    out["conv-fla-vs-torch"] = rel(variants["fla"].causal_conv1d(mixed, weight, None, "silu", layout),
                                   fastbase._torch_causal_conv1d(mixed, weight, None, "silu", layout))
    xa = attn_layer.input_layernorm(hidden)
    ref_attn, _ = attn_layer.self_attn(hidden_states=xa, position_embeddings=plain_rope, attention_mask=None)
    out["attention"] = rel(fastbase._attention(attn_layer.self_attn, xa, ours_rope, None, layout), ref_attn)
    out["moe-grouped"] = rel(fastbase.grouped_moe_block(gdn_layer.mlp, x), gdn_layer.mlp(x))
    out["moe-grouped-fused-glue"] = rel(fastbase.fused_moe_block(gdn_layer.mlp, x), gdn_layer.mlp(x))
    fused = fastbase.fla_kernels()
    residual = hidden
    normed, summed = fused.rms_norm(x, gdn_layer.post_attention_layernorm.weight, gdn_layer.post_attention_layernorm.eps, residual)
    out["norm-fused"] = rel(normed, gdn_layer.post_attention_layernorm(residual + x))
    core = torch.randn(4096, 128, device=device, dtype=torch.bfloat16)
    gate = torch.randn(4096, 128, device=device, dtype=torch.bfloat16)
    norm = gdn_layer.linear_attn.norm
    out["norm-gated-fused"] = rel(fused.rms_norm_gated(core, gate, norm.weight, norm.variance_epsilon), norm(core, gate))
    return out


def bench_packed(base, config, device, total_tokens: int, args) -> dict:
    """Variable-length windows (like real ones: context + answer <= 510 tokens), packed."""
    generator = torch.Generator().manual_seed(3)
    windows, used = [], 0
    while True:
        n = int(torch.randint(args.min_window, 511, (1,), generator=generator))
        if used + n > total_tokens:
            break
        windows.append(random_windows(config, (n,), seed=len(windows)))
        used += n
    runner = fastbase.FastBasePass(base, max_tokens_per_batch=total_tokens, kernels=KERNELS["fast"])
    result = timed(lambda: runner(windows), device, args.warmup, args.repeats)
    result.update(tokens=used, windows=len(windows), tokens_per_s=used / result["median_s"])
    return result


# -- profile ----------------------------------------------------------------------------

_CATEGORIES = (  # first match wins; lower-case substrings of kernel names
    ("moe grouped gemm", ("grouped", "ragged")),
    ("attention core", ("flash", "fmha", "attention", "sdpa", "efficient")),
    ("gated deltanet (fla)", ("chunk_", "solve_tril", "recompute_w_u", "l2norm", "fwd_h", "fwd_o", "kkt", "wy_", "cumsum_kernel", "gated_delta")),
    ("causal conv1d", ("conv", "causal_conv1d")),
    ("fused norms (fla)", ("layer_norm",)),
    ("dense gemm", ("gemm", "cutlass", "sm90", "sm100", "nvjet", "xmma", "cublas", "matmul", "gemv", "splitk")),
    ("sort/gather/scatter/index", ("sort", "radix", "gather", "scatter", "index", "histc", "histogram", "cumsum", "scan", "topk", "arange")),
    ("argmax/reduce", ("reduce", "argmax", "max_")),
    ("copy/cat", ("copy", "cat", "memcpy", "memset", "fill")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "pointwise")),
)


def categorise(name: str) -> str:
    lower = name.lower()
    for category, needles in _CATEGORIES:
        if any(n in lower for n in needles):
            return category
    return "other"


def profile_call(fn, device, top: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync(device)
    activities = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        fn()
        sync(device)
    wall = time.perf_counter() - start
    kernels = []
    for event in prof.key_averages():
        micros = getattr(event, "self_device_time_total", None)
        if micros is None:
            micros = getattr(event, "self_cuda_time_total", 0)
        if device.type != "cuda":
            micros = event.self_cpu_time_total
        if micros > 0:
            kernels.append((event.key, micros / 1e6, event.count))
    total = sum(k[1] for k in kernels)
    categories: dict[str, float] = {}
    for name, seconds, _ in kernels:
        categories[categorise(name)] = categories.get(categorise(name), 0.0) + seconds
    kernels.sort(key=lambda k: -k[1])
    return {
        "wall_s_profiled": wall,
        "kernel_s": total,
        "launches": sum(k[2] for k in kernels),
        "categories": {k: round(v, 5) for k, v in sorted(categories.items(), key=lambda kv: -kv[1])},
        "top": [{"name": n[:160], "s": round(s, 5), "count": c, "category": categorise(n)} for n, s, c in kernels[:top]],
    }


def bench_profiles(base, config, device, shape, args) -> dict:
    ids = random_windows(config, shape, seed=5).to(device)
    windows = list(ids.cpu())
    fast = fastbase.FastBasePass(base, max_tokens_per_batch=shape[0] * shape[1], kernels=KERNELS["fast"])
    out = {"shape": f"{shape[0]}x{shape[1]}"}
    guarded(out, "plain-chunked", lambda: profile_call(lambda: base_outputs(base, ids), device, args.profile_top))
    guarded(out, "fast", lambda: profile_call(lambda: fast.forward_batch(windows), device, args.profile_top))
    return out


# -- head training step -------------------------------------------------------------------


def bench_head_step(base, head, config, device, shape, steps: int, args) -> dict:
    """One optimizer step of the head on (B, T) windows whose base outputs are precomputed."""
    ids = random_windows(config, shape, seed=9).to(device)
    fast = fastbase.FastBasePass(base, max_tokens_per_batch=shape[0] * shape[1], kernels=KERNELS["fast"])
    hidden, greedy, _ = fast.forward_batch(list(ids.cpu()))
    hidden = hidden.view(*shape, -1)
    greedy = greedy.view(shape)
    assistant = torch.ones(shape, dtype=torch.bool, device=device)
    lengths = torch.full((shape[0],), shape[1], device=device)
    chain = chain_batch(ids, greedy, assistant, lengths, steps)
    trainable = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-5)
    weights = (1.0,) * steps

    def step():
        head_hidden = head(chain.step_token_ids, hidden)
        loss, _ = chain_loss(head, head_hidden, chain.labels, weights)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    head.train()
    result = timed(step, device, args.warmup, args.repeats)
    head.eval()
    result["tokens_per_s"] = shape[0] * shape[1] / result["median_s"]
    result["steps"] = steps
    return result


# -- report ---------------------------------------------------------------------------------


def environment(device) -> dict:
    import transformers

    env = {
        "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "kernels": {k: (v.name if v else None) for k, v in KERNELS.items()},
    }
    try:
        import fla

        env["fla"] = fla.__version__
    except ImportError:
        env["fla"] = None
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["gpu"] = props.name
        env["gpu_memory_gib"] = props.total_memory / GIB
        env["sm_count"] = props.multi_processor_count
        try:
            env["nvidia_smi"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20,
            ).stdout.strip()
        except Exception as error:  # noqa: BLE001
            env["nvidia_smi"] = f"unavailable: {error}"
    return env


def summary_lines(results: dict) -> list[str]:
    lines = ["", "== frozen base: tokens/s (peak GiB) =="]
    for shape, row in results.get("base", {}).items():
        cells = []
        best_plain = max((row[k]["tokens_per_s"] for k in ("plain-logits", "plain-chunked") if "tokens_per_s" in row.get(k, {})), default=None)
        for name, value in row.items():
            if isinstance(value, dict):
                if name == "graph-vs-eager":
                    continue
                if "tokens_per_s" in value:
                    cells.append(f"{name} {value['tokens_per_s']:,.0f} ({value['peak_gib']:.1f})")
                else:
                    cells.append(f"{name} ERROR")
        lines.append(f"{shape}: " + " | ".join(cells))
        if isinstance(row.get("graph-vs-eager"), dict) and "greedy_match" in row["graph-vs-eager"]:
            g = row["graph-vs-eager"]
            lines.append(f"    graph vs eager: greedy {g['greedy_match']:.4f}, hidden rel err {g['hidden_rel_error']:.2e}")
        for name in ("fast", "fast-graph"):
            if best_plain and "tokens_per_s" in row.get(name, {}):
                lines.append(f"    {name} / best plain = {row[name]['tokens_per_s'] / best_plain:.2f}x")
    packed = results.get("packed")
    if packed and "tokens_per_s" in packed:
        lines.append(f"packed variable windows: {packed['windows']} windows, {packed['tokens']} tokens: "
                     f"{packed['tokens_per_s']:,.0f} tok/s ({packed['peak_gib']:.1f} GiB)")
    for section in [k for k in results if k.startswith("agreement")]:
        for key, a in results[section].items():
            if isinstance(a, dict) and "greedy_match" in a:
                lines.append(f"{section} {key}: greedy {a['greedy_match']:.4f}, hidden rel err {a['hidden_rel_error']:.2e}")
        for key, a in results[section].get("truth", {}).items():
            lines.append(f"{section} {key} vs float32: greedy {a['greedy_match']:.4f}, hidden rel err {a['hidden_rel_error']:.2e}")
    if isinstance(results.get("diagnose"), dict) and "error" not in results["diagnose"]:
        lines.append("diagnose (relative error of each part vs transformers' module, same input): " + ", ".join(
            f"{k} {v:.1e}" for k, v in results["diagnose"].items()))
    lines.append("== head training step ==")
    for shape, value in results.get("head", {}).items():
        if isinstance(value, dict) and "tokens_per_s" in value:
            lines.append(f"{shape}: {value['tokens_per_s']:,.0f} tok/s, {value['median_s'] * 1000:.0f} ms, peak {value['peak_gib']:.1f} GiB")
        else:
            lines.append(f"{shape}: {value}")
    for shape_key, prof in results.get("profile", {}).items():
        for name in ("plain-chunked", "fast"):
            p = prof.get(name, {}) if isinstance(prof, dict) else {}
            if "categories" in p:
                lines.append(f"== profile {prof.get('shape')} {name}: kernels {p['kernel_s'] * 1000:.0f} ms in "
                             f"{p['launches']} launches, profiled wall {p['wall_s_profiled'] * 1000:.0f} ms ==")
                for category, seconds in p["categories"].items():
                    lines.append(f"    {category:28s} {seconds * 1000:8.1f} ms")
    return lines


KERNELS: dict = {}
DEVICE = torch.device("cpu")


def main(argv=None) -> int:
    global DEVICE
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=("full", "tiny"), default="full")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shapes", default="8x512,128x512", help="windows x tokens for the frozen-base table")
    parser.add_argument("--variants", default="plain-logits,plain-chunked,fast,fast-unfused-glue")
    parser.add_argument("--graph-shapes", default="8x512", help="shapes that also run the CUDA-graph variant (last)")
    parser.add_argument("--fast-only-shapes", default="256x512", help="extra shapes run with the fast pass only")
    parser.add_argument("--experts", default="grouped_mm", help="transformers experts_implementation of the base")
    parser.add_argument("--head-shapes", default="4x512,8x512,16x512", help="micro-batches for the head training step")
    parser.add_argument("--head-steps", type=int, default=3, help="chained draft steps K")
    parser.add_argument("--profile-shape", default="32x512", help="empty to skip the profile")
    parser.add_argument("--profile-top", type=int, default=30)
    parser.add_argument("--agreement-shape", default="8x512")
    parser.add_argument("--diagnose", action="store_true", help="compare each part of the pass with transformers' module")
    parser.add_argument("--extra-kernels", default="", help="comma list of fla variants to add: repeat-kv, torch-conv, repeat-kv+torch-conv")
    parser.add_argument("--shallow-layers", type=int, default=4, help="depth of the extra agreement model (0: skip)")
    parser.add_argument("--variable-windows", type=int, default=12)
    parser.add_argument("--packed-tokens", type=int, default=65536, help="0 to skip the packed variable-length run")
    parser.add_argument("--min-window", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="JSON file for all results")
    args = parser.parse_args(argv)

    DEVICE = device = torch.device(args.device)
    fast_kernels = fastbase.default_kernels(device)
    KERNELS.update({"fast": fast_kernels, "fast-nofuse": None, "fast-tmoe": None, "fast-unfused-glue": None, "fast-exact": None})
    if fast_kernels.name.startswith("fla"):
        KERNELS["fast-nofuse"] = fastbase.fla_kernels(fused_norms=False)  # transformers' norms
        KERNELS["fast-tmoe"] = fastbase.fla_kernels(grouped_moe=False)  # transformers' MoE block
        KERNELS["fast-unfused-glue"] = fastbase.fla_kernels(fused_moe_glue=False)  # grouped MoE, PyTorch glue
        # The parts that match transformers' modules exactly: fla's delta rule only
        # (bench/results/base-pass.md), transformers' conv, norms and MoE block.
        KERNELS["fast-exact"] = fastbase.fla_kernels(fused_norms=False, grouped_moe=False, triton_conv=False)
        for extra in filter(None, args.extra_kernels.split(",")):
            KERNELS[f"fast-{extra}"] = fastbase.fla_kernels(
                repeat_kv_heads="repeat-kv" in extra, triton_conv="torch-conv" not in extra)
    results: dict = {"argv": sys.argv, "env": environment(device)}
    print(json.dumps(results["env"], indent=1), flush=True)

    def save():
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as handle:
                json.dump(results, handle, indent=1, default=str)

    if args.shallow_layers:
        shallow_config = text_config(args.config, args.shallow_layers)
        shallow, _, _ = build_models(shallow_config, device, args.experts)
        if args.diagnose and KERNELS["fast"].name.startswith("fla"):
            guarded(results, "diagnose", lambda: diagnose(shallow, shallow_config, device))
            save()
        guarded(results, f"agreement-{args.shallow_layers}-layers", lambda: agreement(
            shallow, shallow_config, device, parse_shape(args.agreement_shape), args.variable_windows, args, truth=True))
        del shallow
        reset_peak(device)
        save()

    config = text_config(args.config)
    base, head, info = build_models(config, device, args.experts)
    results["models"] = info
    print(json.dumps(info), flush=True)
    set_trainable(head)
    for param in head.parameters():
        if param.requires_grad:
            param.data = param.data.float()  # fp32 masters, as run.load_models keeps them

    if args.agreement_shape:
        guarded(results, "agreement", lambda: agreement(base, config, device, parse_shape(args.agreement_shape), args.variable_windows, args))
        save()
    results["base"] = {}
    for text in args.shapes.split(","):
        results["base"][text] = bench_base(base, config, parse_shape(text), device, args.variants.split(","), args)
        save()
    for text in filter(None, args.fast_only_shapes.split(",")):
        results["base"][text] = bench_base(base, config, parse_shape(text), device, ["fast"], args)
        save()
    if args.packed_tokens:
        guarded(results, "packed", lambda: bench_packed(base, config, device, args.packed_tokens, args))
        save()
    if args.profile_shape:
        results["profile"] = {args.profile_shape: bench_profiles(base, config, device, parse_shape(args.profile_shape), args)}
        save()
    results["head"] = {}
    for text in filter(None, args.head_shapes.split(",")):
        guarded(results["head"], text, lambda: bench_head_step(base, head, config, device, parse_shape(text), args.head_steps, args))
        save()

    # CUDA-graph capture last: a capture that fails can leave the context unusable.
    for text in filter(None, args.graph_shapes.split(",")):
        row = results["base"].setdefault(text, {})
        row.update(bench_base(base, config, parse_shape(text), device, ["fast-graph"], args))
        save()

    lines = summary_lines(results)
    results["summary"] = lines
    save()
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
