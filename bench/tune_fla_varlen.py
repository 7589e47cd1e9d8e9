"""Autotune fla's kernels at real size on packed, variable-length windows, for bench/kernel_configs.py.

    TRITON_CACHE_DIR=/tmp/tc PYTHONPATH=. python3 bench/tune_fla_varlen.py && \\
        python3 bench/kernel_configs.py /tmp/tc occamy_mtp/base/tuned/sm90 --triton "$(python3 -c 'import triton; print(triton.__version__)')"

The cache pass packs windows of different lengths into one sequence (`fastbase.PackLayout`,
`cu_seqlens`): fla's tuning keys then say IS_VARLEN and carry the offsets' dtypes, keys a
run of equal-length windows (bench_recipe's random windows) never meets. This runs the
pass's delta rule (16 query/key heads, 32 value heads, head dim 128) and its conv (8192
channels, width 4) on four windows packed into 8192 tokens, under the shipped configs:
what they do not cover is autotuned, and Triton keeps the result under TRITON_CACHE_DIR.
Prints which kernels ran on a shipped config (true) and which were benchmarked (false).
"""

from __future__ import annotations

import json
import sys

import torch

from occamy_mtp.base.fastbase import fla_kernels

TOKENS = 8192
WINDOW_STARTS = (0, 510, 1020, 4000)
QK_HEADS, V_HEADS, HEAD_DIM, CONV_CHANNELS, CONV_WIDTH = 16, 32, 128, 8192, 4


def main() -> int:
    fla_kernels()  # points fla at the shipped configs (base.tuning)
    from fla.modules.causal_conv1d import causal_conv1d
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.utils.cache import CachedAutotuner

    device, bf16 = "cuda", torch.bfloat16
    cu = torch.tensor([*WINDOW_STARTS, TOKENS], dtype=torch.int32, device=device)
    q, k = (torch.randn(1, TOKENS, QK_HEADS, HEAD_DIM, device=device, dtype=bf16) for _ in range(2))
    v = torch.randn(1, TOKENS, V_HEADS, HEAD_DIM, device=device, dtype=bf16)
    g = -torch.rand(1, TOKENS, V_HEADS, device=device)
    beta = torch.rand(1, TOKENS, V_HEADS, device=device, dtype=bf16)
    chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    x = torch.randn(1, TOKENS, CONV_CHANNELS, device=device, dtype=bf16)
    causal_conv1d(x, weight=torch.randn(CONV_CHANNELS, CONV_WIDTH, device=device, dtype=bf16), bias=None,
                  activation="silu", cu_seqlens=cu)
    torch.cuda.synchronize()
    used = {}
    for module in [m for n, m in sys.modules.items() if n.startswith("fla.")]:
        for value in vars(module).values():
            while value is not None and not isinstance(value, CachedAutotuner):  # under @triton.heuristics and the like
                value = getattr(value, "fn", None) if not isinstance(value, type) else None
            if value is not None and value.cache:
                used[value.kernel_name] = getattr(value, "configs_timings", None) is None  # set by a benchmark only
    print(json.dumps(used))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
