"""Shared test fixtures: tiny real-layout checkpoints, built once per session.

Every checkpoint is written by `occamy_mtp.testing.checkpoints` in the real on-disk
layout (sharded safetensors with an index, `model.language_model.*` or `model.*` base
keys, `model.visual.*` tensors for the multimodal ones, `mtp.*` in either expert
layout). The in-memory models that were written come with it, so a test can compare
what a loader reads back against the model itself. They are shared by every test of
the session: treat them as read-only.

All variants of one family are written from the same seed, so the per-expert and the
fused checkpoint of a family hold the very same weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from occamy_mtp.model import checkpoint as ckpt_io
from occamy_mtp.model.head import MTPHead
from occamy_mtp.testing.checkpoints import random_models, tiny_text_config, write_checkpoint

QWEN3_5 = "qwen3_5_moe_text"
QWEN3_NEXT = "qwen3_next"
FIXTURE_SEED = 0


@dataclass(frozen=True)
class WrittenCheckpoint:
    """A tiny checkpoint on disk and the in-memory models it was written from."""

    path: Path
    family: str
    layout: str
    multimodal: bool
    text_config: object
    base: torch.nn.Module  # transformers' *ForCausalLM, bf16, as written
    head: MTPHead  # bf16, as written (its mtp.* tensors are in the checkpoint)


def pytest_collection_modifyitems(config, items):
    """Skip `@pytest.mark.gpu` tests on machines without CUDA."""
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Factory: `tiny_checkpoint(family, layout, multimodal)` -> WrittenCheckpoint.

    Each variant is built on first use and cached for the session. Qwen3-Next ships
    text-only checkpoints, so `multimodal` must be False for it.
    """
    cache: dict[tuple[str, str, bool], WrittenCheckpoint] = {}

    def get(family: str = QWEN3_5, layout: str = ckpt_io.PER_EXPERT, multimodal: bool = True) -> WrittenCheckpoint:
        if family == QWEN3_NEXT and multimodal:
            raise ValueError("Qwen3-Next checkpoints are text-only; ask for multimodal=False")
        key = (family, layout, multimodal)
        if key not in cache:
            text_config = tiny_text_config(family)
            base, head = random_models(text_config, FIXTURE_SEED)
            name = f"{family}-{layout}-{'multimodal' if multimodal else 'text'}"
            path = tmp_path_factory.mktemp(name)
            write_checkpoint(path, text_config, base, head, layout=layout, multimodal=multimodal)
            base.eval()
            cache[key] = WrittenCheckpoint(path, family, layout, multimodal, text_config, base, head)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def sample_tokenizer_dir(tmp_path_factory) -> Path:
    """The default test tokenizer (vocab 1024, trained on data/sample.jsonl), built once.

    Tests only read it (checkpoint builders copy its files), so one build serves all.
    """
    from occamy_mtp.testing.tokenizer import build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("sample_tokenizer"))


@pytest.fixture(scope="session")
def sample_tokenizer(sample_tokenizer_dir):
    """`sample_tokenizer_dir` loaded once (read-only, as the directory is)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(sample_tokenizer_dir))


@pytest.fixture(scope="module")
def single_thread():
    """One intra-op thread for a module of tiny-tensor tests (opt in with
    `pytestmark = pytest.mark.usefixtures("single_thread")`).

    At hidden 64 a second thread only adds synchronisation, and on a busy CPU the
    OpenMP barriers dominate: a bf16 depthwise conv1d of the Gated DeltaNet layers was
    measured at 3 s with two threads against 1 ms with one.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
