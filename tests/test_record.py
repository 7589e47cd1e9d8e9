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
    assert reference["derived"]["total_steps"] == 512
    assert reference["dataset"]["windows"]["train"] == 256 and reference["dataset"]["windows"]["heldout"] == 32
    assert reference["derived"]["trainable_tensors"] == [
        "mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight"]
    heldout = reference["metrics"]["heldout"]
    assert heldout["trained"]["agreement"] > heldout["donor"]["agreement"]


@pytest.mark.parametrize(
    "path, value, message",
    [
        (("metrics", "heldout", "trained", "agreement"), "high", "expected a number"),
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
