"""Thinking mode in the data path, and the served figures' error bars and groups.

Reasoning is read from `reasoning_content` (or `reasoning`) or an inline think block; windows
render each turn in the mode `data.thinking` gives it, as the chat template renders it; the
served prompts are rendered per serving configuration's mode; a template without the switch is
refused when thinking is asked; the `data` report counts the modes. Then the standard error of
a served figure against a brute-force leave-one-context-out, and the figures by group.
"""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from occamy_mtp.config import ConfigError, load_config
from occamy_mtp.data import reader, windows
from occamy_mtp.data.prepare import prepare_windows
from occamy_mtp.data.reader import DataError, normalise_record
from occamy_mtp.evaluation.breakdown import context_bucket
from occamy_mtp.evaluation.served import grouped_acceptance
from occamy_mtp.evaluation.metrics import (difference_noise, expected_rounds, jackknife_se, paired_difference_se,
                                           per_context, replayed_acceptance, replayed_counts, summed_acceptance)
from occamy_mtp.selfgen import regenerate
from occamy_mtp.testing.tokenizer import build_tokenizer
from occamy_mtp.settings import serving_texts

REPO = Path(__file__).resolve().parent.parent
CORPUS = ("Hello there. How are you today? I am fine, thank you.", "Two and two make four. The answer is four.",
          "What is two plus two? Name a colour. Red is a primary colour.")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(str(build_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=320, corpus=CORPUS)))


@pytest.fixture(scope="module")
def switchless_dir(tmp_path_factory):
    """The same tokenizer, its template without the thinking switch (generation prompt: the header alone)."""
    directory = build_tokenizer(tmp_path_factory.mktemp("switchless"), vocab_size=320, corpus=CORPUS)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = (
        "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
    config_path.write_text(json.dumps(config))
    return directory


def user(text):
    return {"role": "user", "content": text}


RECORDS = [
    {"messages": [user("What is two plus two?"), {"role": "assistant", "reasoning_content": "Two and two make four.",
                                                  "content": "Four."}], "category": "math"},
    {"messages": [user("Name a colour."), {"role": "assistant", "content": "<think>\nRed is a primary colour.\n</think>\n\nRed."}],
     "category": "art"},
    {"messages": [user("Say hello."), {"role": "assistant", "content": "Hello there."}]},
    {"messages": [user("First?"), {"role": "assistant", "reasoning": "old thought", "content": "One."},
                  user("Second?"), {"role": "assistant", "reasoning_content": "new thought", "content": "Two."}]},
]


def write(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def decode(tokenizer, ids):
    return tokenizer.decode(list(ids), skip_special_tokens=False)


# ---------------------------------------------------------------------------- reading


def test_reasoning_is_read_from_each_spelling():
    got = [normalise_record(r, f"r:{i}").messages[-1] for i, r in enumerate(RECORDS)]
    assert [(m.reasoning, m.content) for m in got] == [
        ("Two and two make four.", "Four."), ("Red is a primary colour.", "Red."), ("", "Hello there."), ("new thought", "Two.")]
    assert normalise_record(RECORDS[3], "r").messages[1].reasoning == "old thought"  # `reasoning`, as newer vLLM says
    assert normalise_record(RECORDS[0], "r").category == "math"
    # An unclosed think block is text, not reasoning (the template would render it as such).
    unclosed = {"messages": [user("Hi"), {"role": "assistant", "content": "<think>\nstill thinking"}]}
    assert normalise_record(unclosed, "r").messages[-1] == reader.Message("assistant", "<think>\nstill thinking")


def test_a_conversation_without_reasoning_keeps_its_identity():
    conversation = normalise_record(RECORDS[2], "r")
    canonical = json.dumps([["user", "Say hello."], ["assistant", "Hello there."]], ensure_ascii=False, separators=(",", ":"))
    assert conversation.content_hash == hashlib.sha256(canonical.encode()).hexdigest()
    with_reasoning = normalise_record({"messages": [user("Say hello."), {"role": "assistant", "content": "Hello there.",
                                                                           "reasoning_content": "Be brief."}]}, "r")
    assert with_reasoning.content_hash != conversation.content_hash


def test_bad_reasoning_names_the_message():
    record = {"messages": [user("Hi"), {"role": "assistant", "content": "Hello.", "reasoning_content": ["a"]}]}
    with pytest.raises(DataError, match=r"data.jsonl:3: message 1: 'reasoning_content' must be a string"):
        normalise_record(record, "data.jsonl:3")


# ---------------------------------------------------------------------------- windows


def built(tokenizer, tmp_path, thinking, served=(True, False)):
    return prepare_windows([write(tmp_path / "think.jsonl", RECORDS)], tokenizer, train_conversations=4,
                           heldout_conversations=1, heldout_fraction=0.0, thinking=thinking, served_thinking=served)


def test_windows_render_each_turn_in_its_mode(tokenizer, tmp_path):
    by_mode = {mode: {w.conversation_hash: w for w in built(tokenizer, tmp_path, mode).train} for mode in ("auto", "on", "off")}
    hashes = [normalise_record(r, "r").content_hash for r in RECORDS]
    for mode, expected in (("auto", [True, True, False, True]), ("on", [True] * 4), ("off", [False] * 4)):
        assert [by_mode[mode][h].thinking for h in hashes] == expected, mode
    texts = {mode: [(decode(tokenizer, w.input_ids[: w.answer_start]), decode(tokenizer, w.input_ids[w.answer_start:]))
                    for w in (by_mode[mode][h] for h in hashes)] for mode in by_mode}
    context, answer = texts["auto"][0]
    assert context.endswith("<|im_start|>assistant\n<think>\n")
    assert answer == "Two and two make four.\n</think>\n\nFour.<|im_end|>"
    assert texts["auto"][2][0].endswith("<think>\n\n</think>\n\n") and texts["auto"][2][1] == "Hello there.<|im_end|>"
    # on: a turn without reasoning closes an empty think block (as the template renders it)
    assert texts["on"][2][1] == "\n</think>\n\nHello there.<|im_end|>"
    # off: the reasoning is left out, the answer alone after the empty think block
    assert texts["off"][0][0].endswith("<think>\n\n</think>\n\n") and texts["off"][0][1] == "Four.<|im_end|>"
    # an earlier turn's reasoning is dropped by the template before the last question: never in a window
    context, answer = texts["auto"][3]
    assert "old thought" not in context and "One." in context and answer.startswith("new thought\n</think>")


@pytest.fixture(scope="module")
def special_markers(tmp_path_factory):
    """The same tokenizer with `<think>` and `</think>` registered as special tokens (some families do)."""
    directory = build_tokenizer(tmp_path_factory.mktemp("special"), vocab_size=320, corpus=CORPUS, special_markers=True)
    return AutoTokenizer.from_pretrained(str(directory))


def test_a_span_ends_at_the_end_of_turn_whether_or_not_the_markers_are_special(tokenizer, special_markers, tmp_path):
    """A template whose reasoning markers are special tokens gives the windows Qwen's gives, token for
    token, in every mode: each span runs through its reasoning to the end of turn, not to `<think>`."""
    assert special_markers.added_tokens_decoder[special_markers.convert_tokens_to_ids("</think>")].special
    assert windows.template_end_of_turn_id(special_markers) == windows.template_end_of_turn_id(tokenizer)
    for mode in ("on", "auto", "off"):
        plain, special = built(tokenizer, tmp_path, mode), built(special_markers, tmp_path, mode)
        assert len(special.train) == len(plain.train) == 4, mode
        assert [(w.input_ids, w.answer_start) for w in special.train] == [(w.input_ids, w.answer_start) for w in plain.train]
        assert all(decode(special_markers, w.input_ids).endswith("<|im_end|>") for w in special.train)
    # and what the base writes round-trips: test_a_generated_thinking_turn_keeps_reasoning_and_answer_apart


def test_counts_and_served_prompts(tokenizer, tmp_path):
    off = built(tokenizer, tmp_path, "off")
    assert off.reasoning_left_out == 3 and off.thinking_windows()["train"] == {"thinking": 0, "non_thinking": 4}
    assert built(tokenizer, tmp_path, "auto").reasoning_left_out == 0
    data = prepare_windows([write(tmp_path / "think.jsonl", RECORDS)], tokenizer, train_conversations=1,
                           heldout_conversations=3, thinking="auto", served_thinking=(True, False))
    assert data.heldout
    for mode, ending in ((True, "<|im_start|>assistant\n<think>\n"), (False, "<think>\n\n</think>\n\n")):
        served = data.served_windows("heldout", mode)
        assert [(w.conversation_hash, w.turn_index) for w in served] == [(w.conversation_hash, w.turn_index) for w in data.heldout]
        assert all(not w.has_answer and w.thinking == mode and decode(tokenizer, w.input_ids).endswith(ending) for w in served)
    # the served prompt of a turn rendered in the data's own mode is that window's context, token for token
    for window, served in zip(data.heldout, data.served_windows("heldout", True)):
        if window.thinking:
            assert served.input_ids == window.input_ids[: window.answer_start]
    assert set(data.domains) == set(data.heldout_hashes)
    with pytest.raises(ValueError, match="not rendered with thinking on"):
        prepare_windows([tmp_path / "think.jsonl"], tokenizer, train_conversations=1, heldout_conversations=3,
                        served_thinking=(False,)).served_windows("heldout", True)


def test_thinking_without_a_switch_is_refused_naming_the_template(switchless_dir, tmp_path):
    switchless = AutoTokenizer.from_pretrained(str(switchless_dir))
    assert not windows.has_thinking_switch(switchless)
    path = write(tmp_path / "plain.jsonl", RECORDS[2:3])
    for kwargs, setting in (({"thinking": "on"}, "data.thinking"), ({"served_thinking": (True,)}, "eval.serving")):
        with pytest.raises(ConfigError, match=rf"{setting}.*chat template of '{switchless_dir}'.*has no thinking switch"):
            prepare_windows([path], switchless, train_conversations=1, heldout_conversations=1, **kwargs)
    prepare_windows([path], switchless, train_conversations=1, heldout_conversations=1, served_thinking=(False,))


def test_data_command_reports_modes_and_refuses_switchless_thinking(tokenizer, switchless_dir, tmp_path):
    path = write(tmp_path / "think.jsonl", RECORDS)
    base = [sys.executable, "-m", "occamy_mtp", "data", f"data.files=[{path}]", "data.train_conversations=3",
            "data.heldout_conversations=1", "data.validation_conversations=0", "train.select_every_steps=0"]
    done = subprocess.run(base + [f"model.tokenizer={switchless_dir}", "data.thinking=on"], cwd=REPO, capture_output=True,
                          text=True, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0, done.stderr
    assert "has no thinking switch" in done.stderr
    tokenizer_dir = Path(tokenizer.name_or_path)
    done = subprocess.run(base + [f"model.tokenizer={tokenizer_dir}", "--json"], cwd=REPO, capture_output=True, text=True,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    counted = summary["thinking_windows"]
    assert sum(side["thinking"] for side in counted.values()) == 3 and sum(side["non_thinking"] for side in counted.values()) == 1
    done = subprocess.run(base + [f"model.tokenizer={tokenizer_dir}"], cwd=REPO, capture_output=True, text=True,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert "rendered with thinking on" in done.stdout


def test_a_template_that_rewrites_the_turn_is_a_prefix_mismatch(switchless_dir, tmp_path):
    """A template whose rendering of the turn does not continue its generation prompt: the turn is excluded."""
    directory = switchless_dir.parent / "rewriting"
    if not directory.exists():
        import shutil

        shutil.copytree(switchless_dir, directory)
        config = json.loads((directory / "tokenizer_config.json").read_text())
        config["chat_template"] = config["chat_template"].replace("'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\nSure: '")
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
    rewriting = AutoTokenizer.from_pretrained(str(directory))
    data = prepare_windows([write(tmp_path / "plain.jsonl", RECORDS[2:3])], rewriting, train_conversations=1,
                           heldout_conversations=0)
    assert data.excluded == {"template_prefix_mismatch": 1}


# ---------------------------------------------------------------------------- generate


@pytest.mark.parametrize("which", ["tokenizer", "special_markers"])
def test_a_generated_thinking_turn_keeps_reasoning_and_answer_apart(which, request):
    """Whether or not the tokenizer marks the reasoning markers special."""
    tokenizer = request.getfixturevalue(which)
    conversation = normalise_record(RECORDS[0], "r")
    prompt_text, _ = windows.render_turn(tokenizer, conversation.messages, 1, True)
    prompt = regenerate.Prompt(conversation, 1, tuple(tokenizer(prompt_text, add_special_tokens=False)["input_ids"]), True)
    end = windows.template_end_of_turn_id(tokenizer)
    written = tokenizer("I add them.\n</think>\n\nFour.", add_special_tokens=False)["input_ids"] + [end]
    record = regenerate.make_record(tokenizer, prompt, written, {end}, end)
    assert record["messages"][-1] == {"role": "assistant", "content": "Four.", "reasoning_content": "I add them."}
    assert record["meta"]["thinking"] is True and record["meta"]["roundtrip"] == regenerate.ROUNDTRIP_EXACT
    # the record reads back as the turn the base wrote
    assert normalise_record({"messages": record["messages"]}, "r").messages[-1].reasoning == "I add them."
    unfinished = tokenizer("I add", add_special_tokens=False)["input_ids"]
    record = regenerate.make_record(tokenizer, prompt, unfinished, {end}, end)
    assert record["messages"][-1] == {"role": "assistant", "content": "", "reasoning_content": "I add"}


# ---------------------------------------------------------------------------- error bars and groups


def _brute_force_se(texts, clusters, budget, steps):
    """Leave each cluster out, recompute the figure from the remaining texts from scratch."""
    keys = sorted(set(clusters))
    lengths = [replayed_acceptance([t for t, c in zip(texts, clusters) if c != key], budget, steps).mean_accept_length
               for key in keys]
    mean = sum(lengths) / len(lengths)
    return math.sqrt((len(keys) - 1) / len(keys) * sum((x - mean) ** 2 for x in lengths))


def test_standard_error_is_the_leave_one_context_out_jackknife():
    generator = torch.Generator().manual_seed(3)
    texts = []
    for n in range(9):
        length = 20 + n  # prompt 6, at most 22 generated within the budget 24
        accepted_at = torch.randint(0, 2, (length,), generator=generator).tolist()
        texts.append((accepted_at, 6))
    clusters = [n // 3 for n in range(9)]  # three contexts of three continuations each
    for steps in (1, 3):
        whole = replayed_acceptance(texts, 24, steps, clusters=clusters)
        assert whole.contexts == 3 and whole.texts == 9
        assert whole.mean_accept_length_se == pytest.approx(_brute_force_se(texts, clusters, 24, steps), rel=1e-12)
        alone = replayed_acceptance(texts, 24, steps)  # each text its own context
        assert alone.mean_accept_length_se == pytest.approx(_brute_force_se(texts, list(range(9)), 24, steps), rel=1e-12)
        assert alone.mean_accept_length_se > 0
    assert replayed_acceptance(texts[:3], 24, 3, clusters=[0, 0, 0]).mean_accept_length_se == 0.0
    with pytest.raises(ValueError, match="3 keys for 9 texts"):
        summed_acceptance([replayed_counts(a, p, 24, 3) for a, p in texts], 3, clusters=[0, 1, 2])


def test_expected_counts_carry_their_generated_tokens():
    given = [[0.5, 0.5]] * 20
    counts = expected_rounds(given, given, 5, 40, 2)
    assert counts.generated_after_first == 20 - 5 - 1
    assert jackknife_se([counts, counts], [0, 1], 2) == 0.0  # identical contexts do not spread


def test_grouped_figures_are_the_figures_of_their_members():
    class W:
        def __init__(self, n, start):
            self.conversation_hash, self.turn_index, self.answer_start = f"c{n}", 0, start

    generator = torch.Generator().manual_seed(5)
    windows_ = [W(n, start) for n, start in enumerate((10, 300, 20, 2000, 5000))]
    accepted = [torch.randint(0, 2, (w.answer_start + 20,), generator=generator).tolist() for w in windows_]
    counts = {k: [replayed_counts(a, w.answer_start, 24, k) for a, w in zip(accepted, windows_)] for k in (1, 3)}
    groups = grouped_acceptance(counts, windows_, lambda w: context_bucket(w.answer_start))
    assert list(groups) == ["<256", "256-1k", "1k-4k", "4k+"]
    short = replayed_acceptance([(accepted[0], 10), (accepted[2], 20)], 24, 3)
    assert groups["<256"]["3"]["mean_accept_length"] == pytest.approx(short.mean_accept_length)
    assert groups["<256"]["3"]["contexts"] == 2 and groups["4k+"]["1"]["contexts"] == 1
    assert grouped_acceptance(counts, windows_, lambda w: None) == {}


def test_paired_standard_error_is_the_jackknife_of_the_difference():
    generator = torch.Generator().manual_seed(9)
    texts = [(torch.randint(0, 2, (24,), generator=generator).tolist(), 4) for _ in range(8)]
    better = [([1 if u < 0.8 else a for a, u in zip(accepted, torch.rand(24, generator=generator).tolist())], p)
              for accepted, p in texts]
    clusters = [n // 2 for n in range(8)]  # four contexts, two continuations each
    a, b = ([replayed_counts(x, p, 20, 3) for x, p in side] for side in (texts, better))
    pa, pb = per_context(a, clusters, 3), per_context(b, clusters, 3)
    assert pa["contexts"] == ["0", "1", "2", "3"] and len(pa["proposed"]) == 4
    keys = sorted(set(clusters))
    differences = [replayed_acceptance([t for t, c in zip(better, clusters) if c != key], 20, 3).mean_accept_length
                   - replayed_acceptance([t for t, c in zip(texts, clusters) if c != key], 20, 3).mean_accept_length
                   for key in keys]
    mean = sum(differences) / 4
    assert paired_difference_se(pa, pb) == pytest.approx(math.sqrt(3 / 4 * sum((d - mean) ** 2 for d in differences)), rel=1e-12)
    assert paired_difference_se(pa, pa) == 0.0  # a head against itself: no noise at all
    donor = {**summed_acceptance(a, 3, clusters=clusters).to_dict(), "per_context": pa}
    trained = {**summed_acceptance(b, 3, clusters=clusters).to_dict(), "per_context": pb}
    assert difference_noise(donor, trained)["paired"] and difference_noise(donor, trained)["standard_error"] < math.hypot(
        donor["mean_accept_length_se"], trained["mean_accept_length_se"])
    with pytest.raises(ValueError, match="different contexts"):
        paired_difference_se(pa, {**pb, "contexts": ["x", "1", "2", "3"]})


def test_noise_of_a_difference():
    donor = {"mean_accept_length": 1.50, "mean_accept_length_se": 0.03}
    assert difference_noise(donor, {"mean_accept_length": 1.55, "mean_accept_length_se": 0.04}) == {
        "standard_error": pytest.approx(0.05), "paired": False, "within_noise": True}
    assert not difference_noise(donor, {"mean_accept_length": 1.70, "mean_accept_length_se": 0.04})["within_noise"]
    assert not difference_noise({"mean_accept_length": 2.0}, {"mean_accept_length": 2.0})["within_noise"]  # greedy: exact


def test_sampled_serving_is_measured_on_several_seeds():
    config = load_config(None, ["eval.sampled_continuations=3", "data.self_generate_seed=7"])
    greedy, general = config.eval.serving[0], config.eval.serving[1]
    assert [t.seed for t in serving_texts(config, general)] == [7, 8, 9]
    assert len(serving_texts(config, greedy)) == 1
    with pytest.raises(ConfigError, match="eval.sampled_continuations: expected >= 1"):
        load_config(None, ["eval.sampled_continuations=0"])
    # a selection that scores sampled text is a different run when the count changes
    selected = ["eval.select_serving=thinking-general", "train.select_every_steps=8"]
    assert load_config(None, selected).fingerprint() != load_config(None, selected + ["eval.sampled_continuations=2"]).fingerprint()
    assert load_config(None).fingerprint() == load_config(None, ["eval.sampled_continuations=2"]).fingerprint()


def test_data_thinking_is_spelled_on_off_or_auto():
    # YAML 1.1 reads a bare on / off as a boolean: taken as meant
    assert load_config(None, ["data.thinking=on"]).data.thinking == "on"
    assert load_config(None, ["data.thinking=off"]).data.thinking == "off"
    assert load_config(None).data.thinking == "auto"
    with pytest.raises(ConfigError, match="data.thinking: expected auto, on or off, got 'sometimes'"):
        load_config(None, ["data.thinking=sometimes"])


def test_a_turn_of_reasoning_alone_is_kept_in_thinking_mode(tokenizer, tmp_path):
    """A turn whose budget ended inside the think block (generate writes it with an empty answer) is text to
    score in thinking mode, and an empty answer with thinking off."""
    record = {"messages": [user("Name a colour."), {"role": "assistant", "content": "", "reasoning_content": "Red is a"}]}
    path = write(tmp_path / "unfinished.jsonl", [record])
    kept = prepare_windows([path], tokenizer, train_conversations=1, heldout_conversations=0, thinking="auto")
    assert kept.excluded == {} and decode(tokenizer, kept.train[0].input_ids[kept.train[0].answer_start:]).startswith("Red is a")
    dropped = prepare_windows([path], tokenizer, train_conversations=1, heldout_conversations=0, thinking="off")
    assert dropped.excluded == {"empty_answer": 1}
