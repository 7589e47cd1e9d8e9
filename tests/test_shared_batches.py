"""One configuration's seeds written in shared batches (`selfgen.store.write_together`, `run.write_missing`).

On the static decoder a batch's step costs about as much at 32 rows as at 104, so the heldout prompts'
continuations under one preset's seeds are decoded together rather than a store at a time. The stores must
hold what they hold when each is written alone: every continuation drawn from its own seed's stream, each
store's lines in its contexts' order, a store resumed after a lost line writing the same bytes again, and a
writer that stops keeping what came back. Checked here on the CPU's plain decoder, asked to share batches.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from occamy_mtp.testing.checkpoints import build_tiny_checkpoint
from occamy_mtp.testing.tokenizer import SAMPLE_DATA_PATH

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def models(tmp_path_factory, sample_tokenizer_dir):
    root = tmp_path_factory.mktemp("shared-batches")
    base = build_tiny_checkpoint(root / "base", layout="fused", multimodal=False, seed=2, tokenizer_dir=sample_tokenizer_dir)
    data = root / "chats.jsonl"
    data.write_text("".join(SAMPLE_DATA_PATH.read_text().splitlines(keepends=True)[:40]))
    loaded = _load(base.path)
    return {"base": base.path, "donor": base.path, "data": data, "loaded": loaded}


def _load(path: Path):
    from occamy_mtp.model import checkpoint as ckpt_io

    return ckpt_io.load_base(path, dtype=torch.float32, device=torch.device("cpu"))


def opened(models, store_dir: Path):
    """The run's stores and the windows each needs: greedy heldout text, and one preset's heldout texts under
    three seeds (`eval.sampled_continuations`), 4 heldout prompts each."""
    from occamy_mtp.base.frozen import BaseFacts
    from occamy_mtp.config import load_config
    from occamy_mtp.data.windows import stop_token_ids
    from occamy_mtp.run import HELDOUT, load_tokenizer, open_stores, prepare_data, self_generated_needed
    from occamy_mtp.settings import plan_of

    config = load_config(None, [
        f"model.base={models['base']}", f"model.donor_head={models['donor']}", "model.dtype=float32",
        f"data.files=[{models['data']}]", "data.context_tokens=16", "data.answer_tokens=12",
        "data.train_conversations=4", "data.validation_conversations=2", "data.heldout_conversations=4",
        "eval.serving=[{temperature: 0}, instruct-general]", "eval.sampled_continuations=3",
        f"data.self_generated_dir={store_dir}", f"output.dir={store_dir.parent / 'run'}",
    ])
    setup = plan_of(config).setup
    tokenizer = load_tokenizer(config.model)
    needed = self_generated_needed(setup, prepare_data(setup, tokenizer), splits=(HELDOUT,))
    stops = stop_token_ids(tokenizer, config.model.base)
    return open_stores(setup, BaseFacts(config.model.base), stops, needed), needed


def written(models, store_dir: Path, batch: int, shares: bool, log=lambda message: None):
    from occamy_mtp.run import write_missing
    from occamy_mtp.selfgen.store import EmbeddedWriter

    stores, needed = opened(models, store_dir)
    write_missing(stores, needed, EmbeddedWriter(models["loaded"], batch, shares_batches=shares), log=log)
    return stores, needed


def sampled_rows(needed) -> int:
    """The rows the three seeds' stores decode together: each store's distinct contexts."""
    from occamy_mtp.selfgen.store import context_of

    return sum(len({context_of(w) for w in windows}) for sampling, windows in needed.items() if not sampling.greedy)


def store_files(stores) -> dict[str, bytes]:
    from occamy_mtp.selfgen.store import STORE_FILE

    return {sampling.label(): (store.directory / STORE_FILE).read_bytes() for sampling, store in stores.items()}


def test_seeds_written_together_are_the_stores_written_one_at_a_time(models, tmp_path):
    """Decoded a row at a time both ways, so that the rows beside a row cannot move its arithmetic: the
    stores written together hold the bytes of the stores written alone, each seed its own stream."""
    apart, needed = written(models, tmp_path / "apart", batch=1, shares=False)
    messages: list[str] = []
    together, _ = written(models, tmp_path / "together", batch=1, shares=True, log=messages.append)
    sampled = [s for s in needed if not s.greedy]
    assert len(sampled) == 3 and len({s.seed for s in sampled}) == 3
    assert store_files(together) == store_files(apart)
    texts = {s.label(): together[s].windows(needed[s]) for s in sampled}
    assert len({tuple(w.input_ids for w in windows) for windows in texts.values()}) == 3  # three seeds, three texts
    assert any("in shared batches" in m for m in messages), messages
    assert sum(" writes " in m for m in messages) == 4  # every store says what it writes: greedy's and the three seeds'


def test_a_batch_takes_rows_of_several_seeds_and_a_lost_line_comes_back_the_same(models, tmp_path, monkeypatch):
    """Batches of 5 over 3 stores of 3 contexts: a batch holds rows of two seeds. A line removed from one
    store is written again in the same batch as before, the same bytes."""
    from occamy_mtp.selfgen import store as store_module

    calls = []
    original = store_module.EmbeddedWriter.answers

    def counting(self, contexts, missing, *args, **kwargs):
        calls.append([s.seed for s in kwargs.get("samplings") or [self.sampling] * len(contexts)])
        yield from original(self, contexts, missing, *args, **kwargs)

    monkeypatch.setattr(store_module.EmbeddedWriter, "answers", counting)
    stores, needed = written(models, tmp_path / "store", batch=5, shares=True)
    seeds = next(c for c in calls if len(set(c)) > 1)  # the shared call: every seed's rows
    assert len(seeds) == sampled_rows(needed) > 5 and sorted(set(seeds)) == [0, 1, 2]
    before = store_files(stores)

    from occamy_mtp.selfgen.store import STORE_FILE

    second = next(s for s in stores if not s.greedy and s.seed == 1)
    path = stores[second].directory / STORE_FILE
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:1] + lines[2:]))  # its second context's line lost
    calls.clear()
    again, _ = written(models, tmp_path / "store", batch=5, shares=True)
    assert calls and len(calls[0]) == sampled_rows(needed)  # the shared rows again, so that the batches are the same
    after = store_files(again)
    assert set(after) == set(before)
    for label in before:
        if label != second.label():
            assert after[label] == before[label]
    assert sorted(after[second.label()].splitlines()) == sorted(before[second.label()].splitlines())


def test_a_writer_that_stops_midway_leaves_whole_stores_of_what_came_back(models, tmp_path, monkeypatch):
    """The shared decoder stops after its first batch of 5: the rows it answered are kept in their stores, and a rerun
    writes the rest into the bytes of an uninterrupted run."""
    from occamy_mtp.selfgen import store as store_module

    reference, needed = written(models, tmp_path / "reference", batch=5, shares=True)
    rows = sampled_rows(needed)
    original = store_module.EmbeddedWriter.answers

    def stopping(self, contexts, missing, *args, **kwargs):
        for number, answer in enumerate(original(self, contexts, missing, *args, **kwargs)):
            if number == 5 and len(contexts) == rows:
                raise KeyboardInterrupt
            yield answer

    monkeypatch.setattr(store_module.EmbeddedWriter, "answers", stopping)
    with pytest.raises(KeyboardInterrupt):
        written(models, tmp_path / "store", batch=5, shares=True)
    partial, _ = opened(models, tmp_path / "store")
    lines = {label: text.count(b"\n") for label, text in store_files(partial).items() if label != "greedy"}
    assert sum(lines.values()) == 5 and len([n for n in lines.values() if n]) == 2  # the first batch: two seeds' rows
    monkeypatch.setattr(store_module.EmbeddedWriter, "answers", original)
    resumed, _ = written(models, tmp_path / "store", batch=5, shares=True)
    assert store_files(resumed) == store_files(reference)
