"""TRAINING.json's schema: the repository's reference record fits it, broken records do not."""

import copy
import json
from pathlib import Path

import pytest

from occamy_mtp.record import validate_record

REFERENCE = Path(__file__).resolve().parent.parent / "TRAINING.json"


@pytest.fixture(scope="module")
def reference():
    return json.loads(REFERENCE.read_text())


def test_reference_record_fits_schema(reference):
    assert validate_record(reference) == []


def test_reference_record_is_the_demo_recipe(reference):
    windows = reference["dataset"]["windows"]
    # 256 train conversations, one window each, less the 8 that repeat a heldout answer (kept apart)
    assert windows["kept_apart"] == {"validation_windows_dropped": 0, "train_windows_dropped": 8}
    assert (windows["train"], windows["validation"], windows["heldout"]) == (256 - 8, 32, 32)
    assert reference["derived"]["total_steps"] == 2 * windows["train"]  # 2 epochs, 1 window a step
    assert reference["settings"]["data"]["answers"] == "self_generated"
    assert reference["derived"]["trainable_tensors"] == [
        "mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight"]
    metrics = reference["metrics"]
    assert metrics["comparison"]["trained_not_worse"] and not metrics["comparison"]["allow_worse"]
    # the default recipe: thinking mode, the base's text sampled as thinking-general writes it, selected there
    assert reference["settings"]["data"]["thinking"] == "on"
    assert metrics["selected_serving"] == "thinking-general" and [s["label"] for s in metrics["serving"]] == [
        "greedy", "thinking-general", "thinking-coding", "instruct-general", "instruct-reasoning"]
    for label in (s["label"] for s in metrics["serving"]):  # above the donor under every default configuration
        for k in ("1", "3"):
            donor, trained = (metrics["heldout"][name]["serving"][label]["served"][k] for name in ("donor", "trained"))
            assert trained["mean_accept_length"] > donor["mean_accept_length"], (label, k)
            assert trained["contexts"] == 32 and trained["texts"] == (32 if label == "greedy" else 4 * 32)
    # the stores: greedy, and each preset's text on four seeds (thinking-general's first is also the train text)
    seeds = range(reference["settings"]["eval"]["sampled_continuations"])
    presets = ("t1-p0.95-k20-pp1.5", "t0.6-p0.95-k20", "t0.7-p0.8-k20-pp1.5", "t1-k40-pp2")
    assert set(reference["self_generated"]) == {"greedy", *(f"{p}-seed{j}" for p in presets for j in seeds)}


@pytest.mark.parametrize(
    "path, value, message",
    [
        (("metrics", "heldout", "trained", "teacher_forced", "agreement"), "high", "expected a number"),
        (("metrics", "heldout", "donor", "serving", "greedy", "served", "1", "accepted"), 3, "expected a list"),
        (("metrics", "heldout", "trained", "serving", "instruct-general", "settings", "temperature"), "hot", "expected a number"),
        (("metrics", "serving"), {"label": "greedy"}, "expected a list"),
        (("self_generated", "greedy", "windows"), 1.5, "expected an integer"),
        (("base", "files"), {"name": "x"}, "expected a list"),
        (("library", "version"), 1, "expected str"),
        (("derived", "total_steps"), True, "expected an integer"),
    ],
)
def test_broken_records_are_rejected(reference, path, value, message):
    broken = copy.deepcopy(reference)
    node = broken
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    errors = validate_record(broken)
    assert any(".".join(path) in e and message in e for e in errors), errors


def test_missing_section_is_rejected(reference):
    broken = copy.deepcopy(reference)
    del broken["donor"]
    assert "TRAINING.donor: missing" in validate_record(broken)


def test_missing_served_step_is_rejected(reference):
    broken = copy.deepcopy(reference)
    del broken["metrics"]["heldout"]["trained"]["serving"]["instruct-general"]["served"]["3"]
    assert "TRAINING.metrics.heldout.trained.serving.instruct-general.served.3: missing" in validate_record(broken)


def test_missing_serving_configuration_and_unknown_selection_are_rejected(reference):
    broken = copy.deepcopy(reference)
    del broken["metrics"]["heldout"]["donor"]["serving"]["greedy"]
    broken["metrics"]["selected_serving"] = "t0.9"
    errors = validate_record(broken)
    assert "TRAINING.metrics.heldout.donor.serving.greedy: missing" in errors
    assert any("TRAINING.metrics.selected_serving: 't0.9' is none of" in e for e in errors), errors
