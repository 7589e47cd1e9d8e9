"""`expert_mlp`'s row tiles unrolled (the library's kernel) against the same kernel with a plain loop.

    PYTHONPATH=. python3 bench/bench_expert_compile.py   # H200, about 30 s

The plain-loop kernel is the library's source with `tl.static_range(m_tiles)` replaced by
`range(m_tiles)`, written to a temporary module. For each: the first call's wall time at 1,
128 and 160 tokens with an empty Triton cache (its compilation of the gate_up and down
kernels), then one CUDA-graph replay of 40 layers of real-width experts at 1, 64 and 160
tokens, and whether the two give the same bits.
"""

import inspect
import os
import sys
import tempfile
import textwrap
import time

os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp())
import torch  # noqa: E402
import triton  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_expert_gemms import seconds_per_sweep  # noqa: E402

from occamy_mtp.base import moe_kernels as mk  # noqa: E402

src = textwrap.dedent(inspect.getsource(mk._expert_gemm_kernel.fn))
src = src.replace("@triton.jit\n", "").replace("def _expert_gemm_kernel(", "def looped_kernel(").replace("tl.static_range(m_tiles)", "range(m_tiles)")
path = os.path.join(tempfile.mkdtemp(), "looped_mod.py")
open(path, "w").write("import triton\nimport triton.language as tl\n\n@triton.jit\n" + src)
sys.path.insert(0, os.path.dirname(path))
import looped_mod  # noqa: E402
looped = looped_mod.looped_kernel


def mlp(kernel, x, rows, offsets, gate_up, down):
    """`moe_kernels.expert_mlp` with this kernel, at the library's default blocks."""
    tokens, dim = x.shape
    inter = gate_up.shape[1] // 2
    hidden, out = x.new_empty(rows.numel(), inter), x.new_empty(rows.numel(), dim)
    m_tiles = triton.cdiv(tokens, mk.EXPERT_BLOCK_M)
    for a, width, weight, k_dim, result, first, blocks in ((x, inter, gate_up, dim, hidden, True, mk.EXPERT_UP_BLOCKS),
                                                            (hidden, dim, down, inter, out, False, mk.EXPERT_DOWN_BLOCKS)):
        block_n, block_k, warps, stages = blocks
        kernel[(gate_up.shape[0], triton.cdiv(width, block_n))](
            a, rows, offsets, weight, result, width, k_dim=k_dim, gate_up=first, m_tiles=m_tiles,
            block_m=mk.EXPERT_BLOCK_M, block_n=block_n, block_k=block_k, num_warps=warps, num_stages=stages)
    return out


dev = torch.device("cuda")
g = torch.Generator(device=dev).manual_seed(0)
layers = 40
W = [((torch.randn(256, 1024, 2048, device=dev, generator=g) * .02).bfloat16(), (torch.randn(256, 2048, 512, device=dev, generator=g) * .02).bfloat16()) for _ in range(layers)]
for name, kernel in (("unrolled", mk._expert_gemm_kernel), ("looped", looped)):
    for tokens in (1, 128, 160):
        x = torch.randn(tokens, 2048, device=dev, generator=g).bfloat16()
        r, _, o = mk.align(torch.rand(tokens, 256, device=dev, generator=g).topk(8).indices, 256)
        torch.cuda.synchronize(); t = time.perf_counter(); mlp(kernel, x, r, o, *W[0]); torch.cuda.synchronize()
        print(f"{name} tokens={tokens} first call (compile) {time.perf_counter() - t:.2f} s", flush=True)
for tokens in (1, 64, 160):
    x = torch.randn(tokens, 2048, device=dev, generator=g).bfloat16()
    routed = [mk.align(torch.rand(tokens, 256, device=dev, generator=g).topk(8).indices, 256) for _ in range(layers)]
    res = {}
    for name, kernel in (("unrolled", mk._expert_gemm_kernel), ("looped", looped)):
        outs = []
        def sweep():
            outs.clear()
            for (r, _, o), (gu, dn) in zip(routed, W):
                outs.append(mlp(kernel, x, r, o, gu, dn))
        res[name] = 1e3 * seconds_per_sweep(sweep, dev, 20)
        res[name + "_out0"] = outs[0].clone()
    print(f"tokens={tokens} unrolled {res['unrolled']:.2f} ms looped {res['looped']:.2f} ms equal={torch.equal(res['unrolled_out0'], res['looped_out0'])}", flush=True)
