"""The shipped demo build: it is the default build, and it is copied only whole and intact."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest

from occamy_mtp.testing import demo_models as dm


def test_the_shipped_build_is_the_default_build_of_the_shipped_data():
    # Fails when DemoSettings' defaults or data/sample.jsonl change without a rebuild of
    # data/demo-models (python -m occamy_mtp demo-models --build, one thread).
    manifest = dm.reusable(dm.SHIPPED_DIR, dm.DemoSettings(), dm.SAMPLE_DATA_PATH)
    assert manifest is not None, f"{dm.SHIPPED_DIR} is not a build of DemoSettings() on {dm.SAMPLE_DATA_PATH}"
    assert manifest["files"] == dm._build_files(dm.SHIPPED_DIR)
    assert {"base/config.json", "donor/config.json", "tokenizer/tokenizer.json"} <= set(manifest["files"])


def test_an_absent_output_gets_a_copy_of_the_shipped_build(tmp_path):
    out = tmp_path / "runs" / "demo" / "models"
    manifest = dm.build_demo_models(out, log=lambda message: None)
    assert manifest == json.loads((dm.SHIPPED_DIR / dm.MANIFEST).read_text())
    for name, digest in manifest["files"].items():
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == digest, name
    assert [p.name for p in out.parent.iterdir()] == ["models"]  # no staging directory left
    assert dm.build_demo_models(out, log=lambda message: None) == manifest  # then reused as it is


def test_a_damaged_shipped_build_is_refused_and_nothing_is_copied(tmp_path):
    shipped = tmp_path / "shipped"
    shutil.copytree(dm.SHIPPED_DIR, shipped)
    shard = next((shipped / "base").glob("model-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    out = tmp_path / "models"
    with pytest.raises(RuntimeError, match=f"does not match its {dm.MANIFEST} .*base/{shard.name}"):
        dm.copy_shipped(out, shipped)
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["shipped"]


def test_other_settings_are_built_not_copied(tmp_path, monkeypatch):
    other = dm.DemoSettings(donor_steps=1)
    assert dm.reusable(dm.SHIPPED_DIR, other, dm.SAMPLE_DATA_PATH) is None
    monkeypatch.setattr(dm, "copy_shipped", lambda *a, **k: pytest.fail("copied a build of other settings"))
    monkeypatch.setattr(dm, "build_tokenizer", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("building")))
    with pytest.raises(RuntimeError, match="building"):
        dm.build_demo_models(tmp_path / "models", other, log=lambda message: None)
