"""The cache pass: the frozen base once over every window of a run, into the offline target cache.

    python -m occamy_mtp cache --config configs/512step.yaml [--dir DIR] [section.key=value ...]

The run's windows are those train and export read (`run.open_run`'s); the base first
writes the continuations the run's store lacks, so that training and export from the
cache never load the base. The pass is the plain one (`target.plain_compute`, one
window a forward: the canonical targets) or, where it runs its kernels, the packed
fast one (`fastbase.FastBasePass`); the manifest records which (docs/guide/TARGET_CACHE.md).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from occamy_mtp import files
from occamy_mtp.config import ConfigError
from occamy_mtp.base.frozen import BaseFacts, BaseIdentity, FrozenBase, runs_fast_paths
from occamy_mtp.run import (
    check_inputs, check_store_writable, refuse_inside_models, continuation_writer,
    load_tokenizer, open_stores, prepare_data, quiet, run_windows, self_generated_needed,
)
from occamy_mtp.model.sharding import Sharding
from occamy_mtp.data.windows import stop_token_ids
from occamy_mtp.settings import CachePlan, Setup
from occamy_mtp.targets.base import ComputeOutputs, plain_compute, plain_compute_name
from occamy_mtp.targets.cache import (
    MANIFEST_NAME,
    build_cache,
    cache_identity,
    read_manifest,
    shard_problem,
    window_ids,
)

DEFAULT_FASTBASE_TOKENS = 65536  # tokens per forward of the fast pass; its peak at real size: bench/results/base-pass.md
WINDOW_ALIGNMENT_TOKENS = 1024  # a token budget sized to the card is rounded down to a multiple of this


def auto_fastbase_tokens(base) -> int:
    """What `fastbase_tokens=None` (auto) picks: the fast pass where it runs its kernels, else the plain one (0).

    The fast pass is picked for a Qwen3.5-MoE base on CUDA with fla importable. It
    computes what the plain pass computes through other kernels (checked: with
    transformers' own conv, norms and MoE block it equals the plain forward bit for bit
    at real size; its own kernels move the outputs by no more than a one-ulp change of
    the input does; bench/results/base-pass.md). Elsewhere the plain pass is the faster one.
    """
    from occamy_mtp.base import fastbase

    if base.lm_head.weight.device.type != "cuda" or not runs_fast_paths(base):
        return 0
    try:
        fastbase.fla_kernels()
    except ImportError:
        return 0
    return DEFAULT_FASTBASE_TOKENS


def sized_fastbase_tokens(base, longest_window: int, log: Callable[[str], None] = quiet) -> int:
    """The fast pass's tokens per forward sized to the GPU: as many as fit beside the base
    (`memory.fitting`, `fastbase.token_bytes` a token), at most DEFAULT_FASTBASE_TOKENS, rounded
    down to a multiple of WINDOW_ALIGNMENT_TOKENS and never fewer than the longest window's."""
    from occamy_mtp.memory import NotEnoughMemory, fitting
    from occamy_mtp.base.fastbase import token_bytes

    row = token_bytes(base.config, base.lm_head.weight.dtype)
    sizing = fitting("token", row, DEFAULT_FASTBASE_TOKENS, base.lm_head.weight.device, base)
    tokens = max(sizing.count // WINDOW_ALIGNMENT_TOKENS * WINDOW_ALIGNMENT_TOKENS, min(sizing.count, longest_window))
    if tokens < longest_window:
        raise NotEnoughMemory(f"the cache pass needs {longest_window} tokens a forward for its longest window and the GPU "
                              f"holds {sizing.count} beside the base ({sizing.reason}); run it with --fastbase-tokens 0 "
                              "(the plain pass, one window a forward)")
    log(f"target cache: {tokens} tokens a forward, sized to the GPU: {sizing.reason} (--fastbase-tokens sets it)")
    return tokens


def make_compute(base, windows_per_batch: int = 1, fastbase_tokens: int | None = 0, longest_window: int = 0,
                 log: Callable[[str], None] = quiet) -> tuple[ComputeOutputs, str]:
    """(compute, its name): the plain pass, or `fastbase.FastBasePass` when `fastbase_tokens` > 0.

    fastbase_tokens None: `auto_fastbase_tokens(base)`, unless several windows per plain
    forward were asked for (then the plain pass); the fast pass then takes as many tokens a
    forward as fit on the GPU (`sized_fastbase_tokens`, given the `longest_window`).
    """
    if fastbase_tokens is None:
        fastbase_tokens = auto_fastbase_tokens(base) if windows_per_batch == 1 else 0
        if fastbase_tokens:
            fastbase_tokens = sized_fastbase_tokens(base, longest_window, log)
    if fastbase_tokens > 0:
        from occamy_mtp.base.fastbase import FastBasePass

        return FastBasePass(base, max_tokens_per_batch=fastbase_tokens), f"fastbase.FastBasePass, {fastbase_tokens} tokens per forward"
    return plain_compute(base, windows_per_batch), plain_compute_name(windows_per_batch)


def build_for_run(setup: Setup, plan: CachePlan, log: Callable[[str], None] = quiet, sharding: Sharding | None = None) -> dict:
    """Build (or resume, or confirm) the target cache of a run at `plan.directory`; returns the manifest.

    Loads only the base (not the donor head), on the GPU when there is one (`sharding`: its
    placement, `model.sharding`; one process). The run's
    windows are those training and export read (`run.run_windows`); the base
    first writes the self-generated continuations the run's store lacks, so that
    training and export from this cache never need the base. See `make_compute` for
    the pass. A complete cache of this identity that verifies is left as it is (the
    base is not loaded).
    """
    facts = check_inputs(setup)
    model = setup.model
    tokenizer = load_tokenizer(model)
    stop_ids = stop_token_ids(tokenizer, model.base)
    data = prepare_data(setup, tokenizer)
    needed = self_generated_needed(setup, data)
    stores = open_stores(setup, facts, stop_ids, needed)
    directory = Path(plan.directory)
    refuse_inside_models(model, [("data.target_cache", directory)]
                         + [("data.self_generated_dir", store.directory) for store in stores.values()])
    check_store_writable(stores, needed)
    complete = (directory / MANIFEST_NAME).is_file() and read_manifest(directory).get("complete")
    problem = None if complete else files.unwritable(directory)
    if problem:  # before the base loads
        raise ConfigError(f"data.target_cache: {directory} cannot be written: {problem}")
    base = None
    lacking = any(stores[sampling].missing(windows) for sampling, windows in needed.items())
    if lacking and not setup.selfgen.endpoints:
        base = _load_base(model, facts, sharding, log)  # it writes the continuations (servers write them when named)
    windows = run_windows(setup, data, stores, continuation_writer(setup.selfgen, tokenizer, facts, stop_ids, base), log).all()
    identity = cache_identity(BaseIdentity.of(model, facts), windows, data.settings)
    if (directory / MANIFEST_NAME).is_file():
        manifest = read_manifest(directory)
        if manifest.get("key") == identity.key and manifest.get("complete"):
            if all(shard_problem(directory, s, identity.key) is None for s in manifest["shards"]):
                log(f"{directory}: target cache complete and verified ({manifest['windows']} windows); nothing to do")
                return manifest
    base = base or _load_base(model, facts, sharding, log)
    compute, compute_name = make_compute(base, plan.windows_per_batch, plan.fastbase_tokens,
                                         max(len(w.input_ids) for w in windows), log)
    log(f"target cache: {len(windows)} windows -> {directory} ({compute_name})")
    return build_cache(
        directory,
        identity,
        window_ids(windows),
        compute,
        hidden_size=base.config.hidden_size,
        compute_name=compute_name,
        max_shard_bytes=plan.max_shard_bytes,
        log=log,
    )


def _load_base(model, facts: BaseFacts, sharding: Sharding | None, log) -> FrozenBase:
    return FrozenBase.open(model, torch.device("cuda" if torch.cuda.is_available() else "cpu"), sharding, facts, log)


