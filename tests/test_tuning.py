"""The fixed configs of fla's autotuned kernels (`base.tuning`): the shipped files in fla's
format, when they are used, and on the GPU that fla's kernels then run without autotuning."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
import types

import pytest
import torch

from occamy_mtp.base import tuning

KERNEL_FIELDS = {"kwargs", "num_warps", "num_stages", "num_ctas", "maxnreg"}


def test_the_shipped_configs_are_fla_s_format_keyed_by_fla_s_hash():
    sys.path.insert(0, "bench")
    from kernel_configs import FLA_CACHED_KERNELS

    files = sorted((tuning.TUNED / "sm90").glob("*.json"))
    assert {f.stem for f in files} == set(FLA_CACHED_KERNELS)
    for path in files:
        content = json.loads(path.read_text())
        assert content["kernel_name"] == path.stem and content["autotune_entries"], path
        for digest, entry in content["autotune_entries"].items():
            key = json.dumps(entry["autotune_key"], separators=(",", ":"), sort_keys=True)
            assert hashlib.md5(key.encode()).hexdigest() == digest, (path, digest)
            assert set(entry["config"]) == KERNEL_FIELDS and entry["config"]["num_warps"] in (1, 2, 4, 8, 16, 32), path


def fake_gpu(monkeypatch, capability):
    for name in ("FLA_CACHE_MODE", "FLA_CONFIG_DIR"):  # what the function sets is undone after the test
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)

    class Mode(str):
        pass

    fla_cache = types.SimpleNamespace(FlaCacheMode=Mode, FLA_CACHE_MODE=Mode("disabled"))
    for name, module in (("fla", types.ModuleType("fla")), ("fla.ops", types.ModuleType("fla.ops")),
                         ("fla.ops.utils", types.ModuleType("fla.ops.utils"))):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setitem(sys.modules, "fla.ops.utils.cache", fla_cache)
    sys.modules["fla.ops.utils"].cache = fla_cache
    return fla_cache


def test_an_sm90_card_gets_the_configs_and_other_cards_autotune(monkeypatch):
    import os

    fla_cache = fake_gpu(monkeypatch, (9, 0))
    said = tuning.use_tuned_kernel_configs(torch.device("cuda", 0))
    assert "fixed configs from base/tuned/sm90" in said
    assert os.environ["FLA_CONFIG_DIR"] == str(tuning.TUNED / "sm90") and fla_cache.FLA_CACHE_MODE == "fuzzy"
    fake_gpu(monkeypatch, (8, 0))
    assert "no fixed configs for compute capability 8.0" in tuning.use_tuned_kernel_configs(torch.device("cuda", 0))
    assert "FLA_CONFIG_DIR" not in os.environ
    assert tuning.use_tuned_kernel_configs(torch.device("cpu")) == ""


def test_a_user_s_own_fla_settings_are_left_alone(monkeypatch):
    import os

    fla_cache = fake_gpu(monkeypatch, (9, 0))
    monkeypatch.setenv("FLA_CACHE_MODE", "strict")
    assert "as FLA_CACHE_MODE / FLA_CONFIG_DIR set them" in tuning.use_tuned_kernel_configs(torch.device("cuda", 0))
    assert os.environ["FLA_CACHE_MODE"] == "strict" and fla_cache.FLA_CACHE_MODE == "disabled" and "FLA_CONFIG_DIR" not in os.environ


# The cache pass's delta rule and conv at real size on packed windows (bench/tune_fla_varlen.py),
# in a fresh process with an empty Triton cache: no autotuner may have benchmarked
# (`configs_timings` is set only by a benchmark or a disk-cache hit), every one used must hold
# a config.
TUNE_SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "tune_fla_varlen.py"


@pytest.mark.gpu
def test_fla_s_kernels_run_without_autotuning_on_a_fresh_machine(tmp_path):
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("FLA_")}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")  # nothing kept from an earlier process
    done = subprocess.run([sys.executable, str(TUNE_SCRIPT)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    used = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(used) >= 6 and all(used.values()), used  # each kernel ran on a shipped config, none benchmarked
