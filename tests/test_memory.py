"""Batches sized to the card (`occamy_mtp.memory`): the per-row figures against what is allocated,
the arithmetic of what fits, and the error when not even one row does."""

from __future__ import annotations

import types

import pytest
import torch

from occamy_mtp import memory
from occamy_mtp.losses import LOSSES
from occamy_mtp.sampling import GREEDY_TEXT, TextSampling
from occamy_mtp.base.fastdecode import PREFILL_PASS_BYTES, BatchDecoder
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
    """A card as seen after `torch.cuda.empty_cache()` (`free` and `reserved` are then what they say)."""
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: fraction, raising=False)


def test_what_fits_is_the_free_memory_within_the_process_cap(monkeypatch):
    model = torch.nn.Linear(4, 4)
    device = torch.device("cuda")
    # 10 GiB free on the card (torch's cached blocks handed back), less the 2 GiB margin, 1 GiB rows
    fake_cuda(monkeypatch, free=10 * GIB, total=80 * GIB, allocated=60 * GIB, reserved=61 * GIB)
    assert memory.available_bytes(device) == 10 * GIB
    sizing = memory.fitting("row", GIB, 160, device, model)
    assert sizing.count == 8 and "8 rows (what fits)" in sizing.reason
    assert memory.fitting("row", GIB, 4, device, model).count == 4  # the upper bound
    # a process capped at 72 GiB of the 80 holding 61: 11 GiB more, though the card has 30 free
    fake_cuda(monkeypatch, free=30 * GIB, total=80 * GIB, allocated=60 * GIB, reserved=61 * GIB, fraction=0.9)
    assert memory.available_bytes(device) == int(0.9 * 80 * GIB) - 61 * GIB
    fake_cuda(monkeypatch, free=5 * GIB, total=80 * GIB, allocated=60 * GIB, reserved=60 * GIB, fraction=0.9)
    assert memory.available_bytes(device) == 5 * GIB  # the card, not the cap


def test_the_allocator_s_cached_blocks_are_handed_back_before_counting(monkeypatch):
    handed_back = []
    fake_cuda(monkeypatch, free=10 * GIB, total=80 * GIB, allocated=60 * GIB, reserved=60 * GIB)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: handed_back.append(True))
    memory.available_bytes(torch.device("cuda"))
    assert handed_back


def test_with_expandable_segments_the_logits_chunks_count_the_cache_without_handing_it_back(monkeypatch):
    handed_back = []
    # 10 GiB free on the card, 4 GiB of the 64 reserved cached unused; a cap of 72 GiB of the 80
    fake_cuda(monkeypatch, free=10 * GIB, total=80 * GIB, allocated=60 * GIB, reserved=64 * GIB, fraction=0.9)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: handed_back.append(True))
    vocab, per_logit = 2**20, 1024  # a position's logits: 1 GiB
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert memory.logit_rows(torch.device("cuda"), vocab, per_logit, 100) == 12 - 2  # min(10 + 4, 72 - 60) less the margin
    assert not handed_back
    assert memory.available_bytes(torch.device("cuda"), hand_back=False) == 12 * GIB
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    assert memory.logit_rows(torch.device("cuda"), vocab, per_logit, 100) == 8 - 2  # min(10, 72 - 64), handed back
    assert handed_back
    handed_back.clear()
    memory.fitting("row", GIB, 100, torch.device("cuda"))  # a batch's sizing hands the cache back whatever the allocator
    assert handed_back


@pytest.mark.parametrize("alloc_conf, cuda_alloc_conf, expandable", [
    (None, "expandable_segments:True", True),
    (None, "max_split_size_mb:512", False),
    (None, "expandable_segments:True,expandable_segments:False", False),  # the last mention wins
    ("expandable_segments:False", "expandable_segments:True", True),  # PYTORCH_CUDA_ALLOC_CONF, where set
    ("garbage_collection_threshold:0.8, expandable_segments:True", None, True),
])
def test_expandable_segments_are_read_as_torch_reads_its_settings(monkeypatch, alloc_conf, cuda_alloc_conf, expandable):
    for name, value in (("PYTORCH_ALLOC_CONF", alloc_conf), ("PYTORCH_CUDA_ALLOC_CONF", cuda_alloc_conf)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert memory.expandable_segments() is expandable


def test_not_even_one_row_is_an_error_naming_the_model_and_the_card(monkeypatch):
    model = torch.nn.Linear(1024, 1024)  # 4 MiB of weights
    fake_cuda(monkeypatch, free=2 * GIB + 100 * 2**20, total=80 * GIB, allocated=70 * GIB, reserved=70 * GIB)
    with pytest.raises(memory.NotEnoughMemory, match=r"one row: the model holds 4\.0 MiB of weights, this process has 70\.0 GiB "
                                                      r"allocated and may allocate 2\.1 GiB more of the card's 80\.0 GiB; "
                                                      r"a row needs 200\.0 MiB"):
        memory.fitting("row", 200 * 2**20, 160, torch.device("cuda"), model)


def test_the_writer_sizes_its_batch_to_the_memory_unless_told(monkeypatch):
    from occamy_mtp.selfgen.store import EmbeddedWriter

    base = types.SimpleNamespace(config=tiny_text_config(), lm_head=types.SimpleNamespace(
        weight=torch.empty(0, dtype=torch.bfloat16)), parameters=lambda: iter([torch.empty(10)]))
    writer = EmbeddedWriter.__new__(EmbeddedWriter)
    writer.base, writer.sampling, writer.static = base, GREEDY_TEXT, True
    contexts = [(1, 2, 3)] * 300
    row = BatchDecoder.row_bytes(base.config, 3 + 10 - 1, torch.bfloat16, GREEDY_TEXT)
    # kept free: the margin and one prefill pass
    fake_cuda(monkeypatch, free=memory.MARGIN_BYTES + PREFILL_PASS_BYTES + 7 * row, total=80 * GIB, allocated=0, reserved=0)
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
    from occamy_mtp.base.fastbase import token_bytes

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


def test_logits_chunks_take_the_positions_that_fit_and_none_are_sized_off_the_gpu(monkeypatch):
    vocab, per_logit = 248_320, 10
    row = vocab * per_logit
    fake_cuda(monkeypatch, free=2 * GIB + 700 * row + 5, total=80 * GIB, allocated=70 * GIB, reserved=70 * GIB)
    assert memory.logit_rows(torch.device("cuda"), vocab, per_logit, 4096) == 700
    assert memory.logit_rows(torch.device("cuda"), vocab, per_logit, 512) == 512  # the loop's own bound
    assert memory.logit_rows(torch.device("cpu"), vocab, per_logit, 4096) == 4096  # a CPU: nothing is sized
    fake_cuda(monkeypatch, free=2 * GIB + row - 1, total=80 * GIB, allocated=77 * GIB, reserved=77 * GIB)
    with pytest.raises(memory.NotEnoughMemory, match=r"one position's logits: this process has 77\.0 GiB allocated .* "
                                                      r"needs 2\.4 MiB beside a margin of 2\.0 GiB"):
        memory.logit_rows(torch.device("cuda"), vocab, per_logit, 4096)


class _Head:
    """An lm_head alone, at real size: what the chunked loops ask of a head."""

    def __init__(self, vocab: int, dim: int, device):
        self.lm_head = torch.nn.Linear(dim, vocab, bias=False, dtype=torch.bfloat16, device=device)
        self.vocab_size = vocab

    def logits(self, hidden):
        return self.lm_head(hidden.to(torch.bfloat16))


def _peak_per_logit(run, rows: int, vocab: int) -> float:
    """Bytes a logit took at `run`'s peak, over what was allocated before it (a first call
    warms up what stays: cuBLAS's workspace, a gradient's buffer)."""
    run()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / (rows * vocab)


@pytest.mark.gpu
@pytest.mark.parametrize("what", ["greedy", "figures", "odds", "top1", "kl"])
def test_each_chunked_loop_s_bytes_per_logit_cover_its_measured_peak(what):
    """At real size (V = 248,320, D = 2,048) each loop's figure is at least its peak, and not
    more than twice it (the figures size the chunks: too small runs out of memory, too large
    wastes the card)."""
    from occamy_mtp.config import Serving
    from occamy_mtp.evaluation import offline
    from occamy_mtp.model import loss
    from occamy_mtp.base.logits import chunked_greedy, greedy_bytes_per_logit

    device, vocab, dim, rows = torch.device("cuda"), 248_320, 2048, 512
    torch.manual_seed(0)
    head = _Head(vocab, dim, device)
    hidden = torch.randn(rows, dim, device=device, dtype=torch.bfloat16)
    other = torch.randn(rows, dim, device=device, dtype=torch.bfloat16)
    tokens = torch.randint(0, vocab, (rows,), device=device)
    serving = Serving(temperature=0.7, top_p=0.8)
    if what == "greedy":
        figure, run = greedy_bytes_per_logit(head.lm_head), lambda: chunked_greedy(hidden, head.lm_head, rows)
    elif what == "figures":
        figure, run = offline.FIGURES_BYTES_PER_LOGIT, lambda: offline.figures_of(head, hidden, tokens, tokens)
    elif what == "odds":
        figure, run = offline.ODDS_BYTES_PER_LOGIT, lambda: offline.odds_of(head, offline.base_distribution(head, other, serving), hidden, tokens, serving)
    else:
        chain = hidden[None, None].detach().requires_grad_(True)  # (K=1, B=1, T, D), every pair scored
        objective = loss.Objective("top1" if what == "top1" else "kl", serving)
        base_hidden = torch.cat([other, other[:1]])[None]  # (1, T + 1, D): step 1 at anchor i fits p from H_{i+1}
        figure = LOSSES[objective.loss].bytes_per_logit

        def run():
            total, _ = loss.chain_loss(head, chain, tokens[None, None], (1.0,), rows, objective, base_hidden)
            total.backward()
    measured = _peak_per_logit(run, rows, vocab)
    assert measured <= figure <= 2 * measured, (what, measured, figure)


def test_evaluation_batches_keep_the_order_and_shrink_where_long_windows_would_not_fit(monkeypatch):
    """Evaluation's batches (`window_batches`): on a GPU a batch grows only while its padded chain
    fits beside what is allocated; off CUDA they are `eval.windows_per_batch` as before."""
    from occamy_mtp.evaluation.offline import grouped, window_batches
    from occamy_mtp.model.head import MASK_BYTES_PER_SCORE, MTPHead, SharedWeights

    lengths = [3, 5, 9, 2, 2, 2, 2, 7]
    runs = list(grouped(lengths, 3, lambda run: sum(run) <= 10))
    assert runs == [[3, 5], [9], [2, 2, 2], [2, 7]] and sum(runs, []) == lengths
    assert list(grouped([12, 1], 3, lambda run: False)) == [[12], [1]]  # too long alone still runs, alone

    base, _ = random_models(tiny_text_config(), seed=0)
    head = MTPHead(base.config, SharedWeights(base.model.embed_tokens, base.lm_head))
    windows = [types.SimpleNamespace(input_ids=[0] * n) for n in (500, 500, 500, 4000, 500, 500)]
    assert [len(b) for b in window_batches(base, head, windows, 3, 4)] == [4, 2]  # a CPU: nothing is sized
    one_long = head.chain_bytes(1, 4000, 3) + 4000 * evaluate_token_bytes(base)
    fake_cuda(monkeypatch, free=2 * GIB + one_long + 10, total=80 * GIB, allocated=0, reserved=0)
    monkeypatch.setattr(type(head.fc.weight), "device", property(lambda self: torch.device("cuda")))
    batches = list(window_batches(base, head, windows, 3, 4))
    assert [len(b) for b in batches] == [3, 1, 2] and sum(batches, []) == windows  # the long window goes alone
    mask = head.chain_bytes(1, 8000, 3) - 2 * head.chain_bytes(1, 4000, 3)  # linear terms cancel: the mask's growth
    assert mask == (8000 * 3 * 8000 - 2 * 4000 * 3 * 4000) * MASK_BYTES_PER_SCORE


def evaluate_token_bytes(base) -> int:
    from occamy_mtp.evaluation.offline import _target_token_bytes

    return _target_token_bytes(base)


@pytest.mark.gpu
def test_the_chain_s_bytes_cover_its_measured_peak_at_real_size():
    """At real size the head's chain (3 steps, no gradients, as evaluation runs it) takes at its
    peak no more than `MTPHead.chain_bytes` says, and at least half: the figure sizes evaluation's
    batches of long windows."""
    from transformers import Qwen3_5MoeTextConfig

    from occamy_mtp.model.head import MTPHead, SharedWeights

    config = Qwen3_5MoeTextConfig()
    device = torch.device("cuda")
    embed = torch.nn.Embedding(config.vocab_size, config.hidden_size, device=device, dtype=torch.bfloat16)
    lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False, device=device, dtype=torch.bfloat16)
    with torch.device(device):
        head = MTPHead(config, SharedWeights(embed, lm_head)).to(torch.bfloat16).eval()
    for rows, length in ((1, 4096), (2, 2048), (1, 8192)):
        steps = 3
        tokens = torch.randint(0, config.vocab_size, (steps, rows, length), device=device)
        hidden = torch.randn(rows, length, config.hidden_size, device=device, dtype=torch.bfloat16)
        with torch.no_grad():
            head(tokens, hidden)
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            head(tokens, hidden)
            torch.cuda.synchronize()
        measured = torch.cuda.max_memory_allocated() - before
        figure = head.chain_bytes(rows, length, steps)
        assert measured <= figure <= 2 * measured, (rows, length, measured / GIB, figure / GIB)


def test_importing_the_library_asks_for_expandable_segments_unless_told_otherwise():
    import subprocess
    import sys

    code = ("import os, occamy_mtp, torch; from occamy_mtp import memory; "
            "print(os.environ.get('PYTORCH_CUDA_ALLOC_CONF'), memory.expandable_segments())")
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}

    def seen(**settings):
        done = subprocess.run([sys.executable, "-c", code], env={**env, **settings}, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.strip()

    assert seen() == "expandable_segments:True True"
    # a user's own settings win, in either variable torch reads
    assert seen(PYTORCH_CUDA_ALLOC_CONF="max_split_size_mb:512") == "max_split_size_mb:512 False"
    assert seen(PYTORCH_ALLOC_CONF="expandable_segments:False") == "None False"
