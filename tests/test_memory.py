"""Batches sized to the card (`occamy_mtp.memory`): the per-row figures against what is allocated,
the arithmetic of what fits, and the error when not even one row does."""

from __future__ import annotations

import types

import pytest
import torch

from occamy_mtp import memory
from occamy_mtp.sampling import GREEDY_TEXT, TextSampling
from occamy_mtp.selfgen.fastdecode import BatchDecoder
from occamy_mtp.testing.checkpoints import random_models, tiny_text_config

pytestmark = pytest.mark.usefixtures("single_thread")
GIB = memory.GIB


def decoder_bytes(decoder: BatchDecoder) -> int:
    """Every tensor the decoder holds for its batch."""
    tensors = [*decoder.kv.keys.values(), *decoder.kv.values.values(), decoder.conv_states, decoder.recurrent_states,
               decoder.tokens, decoder.prompts, decoder.prompt_lengths, decoder.chosen, decoder.hidden, decoder.logits,
               decoder.uniforms, decoder.span_tokens, decoder.span_hidden, decoder.span_logits]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@pytest.mark.parametrize("sampling", [GREEDY_TEXT, TextSampling(0.7, 0.8)])
def test_a_row_s_state_is_what_the_decoder_allocates_per_row(sampling):
    base, _ = random_models(tiny_text_config(), seed=0)
    base = base.float().eval()
    positions = 37
    one, five = (BatchDecoder(base, batch=b, positions=positions, sampling=sampling) for b in (1, 5))
    per_row = (decoder_bytes(five) - decoder_bytes(one)) // 4
    assert BatchDecoder.row_state_bytes(base.config, positions, torch.float32, not sampling.greedy) == per_row
    assert BatchDecoder.row_bytes(base.config, positions, torch.float32, sampling) > per_row  # and the step's transients


def test_the_real_size_row_is_near_the_measured_peak():
    """At real size the decoder's peak was 73.7 MiB a row greedy and 81.7 sampled (H200, batch 160):
    the estimate is within 3% of both (the margin takes the rest)."""
    from transformers import Qwen3_5MoeTextConfig

    config = Qwen3_5MoeTextConfig()
    for sampling, measured in ((GREEDY_TEXT, 73.7), (TextSampling(0.7, 0.8), 81.7)):
        estimate = BatchDecoder.row_bytes(config, 128 + 382 - 1, torch.bfloat16, sampling) / 2**20
        assert abs(estimate - measured) / measured < 0.03, (sampling, estimate)


def fake_cuda(monkeypatch, free: int, total: int, allocated: int, reserved: int, fraction: float = 1.0):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: fraction, raising=False)


def test_what_fits_counts_the_allocator_s_spare_memory_and_the_process_cap(monkeypatch):
    model = torch.nn.Linear(4, 4)
    device = torch.device("cuda")
    # 10 GiB free on the card, 1 GiB reserved but unused by torch: 11 GiB, less the 2 GiB margin, 1 GiB rows
    fake_cuda(monkeypatch, free=10 * GIB, total=80 * GIB, allocated=60 * GIB, reserved=61 * GIB)
    assert memory.available_bytes(device) == 11 * GIB
    sizing = memory.fitting("row", GIB, 160, device, model)
    assert sizing.count == 9 and "9 rows (what fits)" in sizing.reason
    assert memory.fitting("row", GIB, 4, device, model).count == 4  # the upper bound
    # a process capped at 72 GiB of the 80: 72 - 60 = 12 GiB, though the card has 10 free
    fake_cuda(monkeypatch, free=10 * GIB, total=80 * GIB, allocated=60 * GIB, reserved=60 * GIB, fraction=0.9)
    assert memory.available_bytes(device) == 10 * GIB
    fake_cuda(monkeypatch, free=30 * GIB, total=80 * GIB, allocated=60 * GIB, reserved=60 * GIB, fraction=0.85)
    assert memory.available_bytes(device) == int(0.85 * 80 * GIB) - 60 * GIB  # the cap, not the card


def test_not_even_one_row_is_an_error_naming_the_model_and_the_card(monkeypatch):
    model = torch.nn.Linear(1024, 1024)  # 4 MiB of weights
    fake_cuda(monkeypatch, free=2 * GIB + 100 * 2**20, total=80 * GIB, allocated=70 * GIB, reserved=70 * GIB)
    with pytest.raises(memory.NotEnoughMemory, match=r"one row: the model holds 0\.0 GiB of weights, this process has 70\.0 GiB "
                                                      r"allocated and may allocate 2\.10 GiB more of the card's 80\.0 GiB; "
                                                      r"a row needs 200 MiB"):
        memory.fitting("row", 200 * 2**20, 160, torch.device("cuda"), model)


def test_the_writer_sizes_its_batch_to_the_memory_unless_told(monkeypatch):
    from occamy_mtp.selfgen.store import EmbeddedWriter

    base = types.SimpleNamespace(config=tiny_text_config(), lm_head=types.SimpleNamespace(
        weight=torch.empty(0, dtype=torch.bfloat16)), parameters=lambda: iter([torch.empty(10)]))
    writer = EmbeddedWriter.__new__(EmbeddedWriter)
    writer.base, writer.sampling, writer.static = base, GREEDY_TEXT, True
    contexts = [(1, 2, 3)] * 300
    row = BatchDecoder.row_bytes(base.config, 3 + 10 - 1, torch.bfloat16, GREEDY_TEXT)
    fake_cuda(monkeypatch, free=2 * GIB + 7 * row, total=80 * GIB, allocated=0, reserved=0)
    logged = []
    writer.batch_size = 0
    assert writer.batch_for(contexts, 10, logged.append) == 7 and "batch 7, sized to the GPU" in logged[0]
    writer.batch_size = 12
    assert writer.batch_for(contexts, 10, logged.append) == 12  # a set batch is used as it is
    writer.batch_size, writer.static = 0, False
    assert writer.batch_for(contexts, 10, logged.append) == 160  # a CPU: the default


def test_the_cache_pass_takes_as_many_tokens_as_fit(monkeypatch):
    from transformers import Qwen3_5MoeTextConfig

    from occamy_mtp import cache as CP
    from occamy_mtp.targets.fastbase import token_bytes

    # At real size the fast pass's peak was 164.8 KiB a token over the weights (H200, 65,536 tokens)
    assert abs(token_bytes(Qwen3_5MoeTextConfig()) / 1024 - 164.8) / 164.8 < 0.05
    config = tiny_text_config()
    base = types.SimpleNamespace(config=config, lm_head=types.SimpleNamespace(weight=torch.empty(0, dtype=torch.bfloat16)),
                                 parameters=lambda: iter([torch.empty(10)]))
    row = token_bytes(config, torch.bfloat16)
    fake_cuda(monkeypatch, free=2 * GIB + 5000 * row, total=80 * GIB, allocated=0, reserved=0)
    logged = []
    assert CP.sized_fastbase_tokens(base, 510, logged.append) == 4096  # rounded down to a multiple of 1024
    assert "4096 tokens a forward, sized to the GPU" in logged[0]
    assert CP.sized_fastbase_tokens(base, 4500) == 4500  # never fewer than the longest window, when it fits
    fake_cuda(monkeypatch, free=2 * GIB + 300 * row, total=80 * GIB, allocated=0, reserved=0)
    with pytest.raises(memory.NotEnoughMemory, match="needs 510 tokens a forward .* --fastbase-tokens 0"):
        CP.sized_fastbase_tokens(base, 510)
