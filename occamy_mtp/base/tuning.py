"""Fixed configs for fla's autotuned kernels, so that a fresh machine does not autotune them.

fla's chunked Gated DeltaNet kernels (and its conv and l2norm) autotune on their first call
in a process: at real size over a minute in the cache pass and about as much again for the
shapes transformers' forward hands them (the decoder check's replay; bench/results/recipe.md). Triton keeps the
choice on disk, so a second process on the same machine skips it; a fresh machine pays it.
fla reads fixed configs instead from a folder of `{kernel}.json` files when told to
(`FLA_CACHE_MODE`, `FLA_CONFIG_DIR`). `tuned/sm90/` holds the configs Triton chose on an
H200 for the base's shapes, and on an H100 for the keys of windows packed at different
lengths (`cu_seqlens`; the conv's on an H200): bench/kernel_configs.py writes them from a
run's autotuning, bench/tune_fla_varlen.py runs the packed keys, bench/results/recipe.md lists
the runs. They are used on every compute capability 9.0 card (H100, H200, GH200: one
architecture, one shared-memory size), matched by fla's fuzzy lookup (the same kernel,
flags and dtypes; sizes may differ). A shape they do not cover, and every
other card, autotunes as before: once per machine.

A user's own `FLA_CACHE_MODE` or `FLA_CONFIG_DIR` is left alone.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

TUNED = Path(__file__).with_name("tuned")
FUZZY = "fuzzy"


def tuned_folder(device: torch.device) -> Path | None:
    """The fixed configs for `device`'s architecture (`tuned/sm<major><minor>`), None without them."""
    major, minor = torch.cuda.get_device_capability(device)
    folder = TUNED / f"sm{major}{minor}"
    return folder if folder.is_dir() else None


def use_tuned_kernel_configs(device: torch.device) -> str:
    """Point fla at the fixed configs for `device`, before its kernels first run; says what was done."""
    if device.type != "cuda":
        return ""
    if "FLA_CACHE_MODE" in os.environ or "FLA_CONFIG_DIR" in os.environ:
        return "fla's kernel configs: as FLA_CACHE_MODE / FLA_CONFIG_DIR set them"
    folder = tuned_folder(device)
    if folder is None:
        major, minor = torch.cuda.get_device_capability(device)
        return f"fla's kernels autotune on first use (no fixed configs for compute capability {major}.{minor}; Triton keeps them on disk)"
    try:
        from fla.ops.utils import cache as fla_cache
    except ImportError:  # no fla: transformers' own kernels, nothing to tune
        return ""
    if not hasattr(fla_cache, "FlaCacheMode"):
        return "fla's kernels autotune on first use (this fla cannot read fixed configs)"
    os.environ["FLA_CONFIG_DIR"] = str(folder)
    os.environ["FLA_CACHE_MODE"] = FUZZY  # for processes started from this one
    fla_cache.FLA_CACHE_MODE = fla_cache.FlaCacheMode(FUZZY)  # fla read the variable when it was imported
    return f"fla's kernels: fixed configs from {folder.relative_to(TUNED.parent.parent)} (no autotuning for the shapes they cover)"
