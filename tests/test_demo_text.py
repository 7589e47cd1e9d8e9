"""The demo's shipped text (data/demo-text): what the shipped base writes, store for store.

`scripts/demo.sh` copies data/demo-text into runs/demo/self-generated, so that a new user's first
result does not wait for the base to write its 920 continuations (about three minutes of the demo
on the 2-core machine, bench/results/fresh-clone.md). These tests hold the shipped text to what the
library writes: every store opens for the demo's run (its identity: the shipped base, the settings,
the writer) with nothing missing, and continuations removed from a greedy and a sampled store are
written again, by the library's own writer, into the same lines.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from occamy_mtp.base.frozen import BaseFacts, FrozenBase
from occamy_mtp.config import load_config
from occamy_mtp.data.windows import load_tokenizer, stop_token_ids
from occamy_mtp.run import continuation_writer, open_stores, prepare_data, self_generated_needed, write_missing
from occamy_mtp.selfgen.store import STORE_FILE
from occamy_mtp.settings import plan_of
from occamy_mtp.testing.demo_models import SHIPPED_DIR

REPO = Path(__file__).resolve().parent.parent
SHIPPED_TEXT = REPO / "data" / "demo-text"

pytestmark = pytest.mark.usefixtures("single_thread")  # the shipped text was written with one thread


def demo_setup(text_dir: Path, tmp_path: Path):
    config = load_config(REPO / "configs" / "demo.yaml", [
        f"model.base={SHIPPED_DIR / 'base'}", f"model.donor_head={SHIPPED_DIR / 'donor'}",
        f"model.tokenizer={SHIPPED_DIR / 'tokenizer'}", f"data.self_generated_dir={text_dir}",
        f"output.dir={tmp_path / 'run'}"])
    setup = plan_of(config).setup
    tokenizer = load_tokenizer(setup.model)
    facts = BaseFacts(setup.model.base)
    stop_ids = stop_token_ids(tokenizer, setup.model.base)
    needed = self_generated_needed(setup, prepare_data(setup, tokenizer))
    return setup, tokenizer, facts, stop_ids, needed


def test_the_shipped_text_holds_every_continuation_the_demo_needs(tmp_path):
    setup, _, facts, stop_ids, needed = demo_setup(SHIPPED_TEXT, tmp_path)
    stores = open_stores(setup, facts, stop_ids, needed)
    assert len(stores) == 17
    assert {str(s.directory.relative_to(SHIPPED_TEXT)) for s in stores.values()} == \
        {str(p.parent.relative_to(SHIPPED_TEXT)) for p in SHIPPED_TEXT.rglob(STORE_FILE)}
    assert all(not store.missing(needed[sampling]) for sampling, store in stores.items())


def test_removed_continuations_are_written_again_into_the_same_lines(tmp_path):
    text = tmp_path / "text"
    shutil.copytree(SHIPPED_TEXT, text)
    setup, tokenizer, facts, stop_ids, needed = demo_setup(text, tmp_path)
    greedy = next(s for s in needed if s.greedy)
    sampled = next(s for s in needed if not s.greedy and s.presence_penalty)  # thinking-general's, the train text's
    removed = {}
    for sampling in (greedy, sampled):
        path = Path(setup.store_dir(sampling)) / STORE_FILE
        lines = path.read_text().splitlines(keepends=True)
        removed[path] = set(lines[:2])
        path.write_text("".join(lines[2:]))
    stores = open_stores(setup, facts, stop_ids, needed)
    assert sum(len(store.missing(needed[s])) for s, store in stores.items()) == 4
    base = FrozenBase.open(setup.model, "cpu")
    write_missing(stores, needed, continuation_writer(setup.selfgen, tokenizer, facts, stop_ids, base))
    for path, lines in removed.items():
        assert set(path.read_text().splitlines(keepends=True)) == set((SHIPPED_TEXT / path.relative_to(text)).read_text()
                                                                       .splitlines(keepends=True))
        assert lines <= set(path.read_text().splitlines(keepends=True))
