"""The edge (`occamy_mtp/settings.py`): a run's config resolved once into what each stage reads."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from occamy_mtp.config import ConfigError, RunConfig, Serving, load_config
from occamy_mtp.run import check_inputs
from occamy_mtp.sampling import GREEDY_TEXT, TextSampling
from occamy_mtp.settings import Plan, plan_of

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def _objects(value, seen=None):
    """Every object reachable from `value` through dataclass fields, dicts, lists and tuples."""
    seen = set() if seen is None else seen
    if id(value) in seen:
        return
    seen.add(id(value))
    yield value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        children = [getattr(value, f.name) for f in dataclasses.fields(value)]
    elif isinstance(value, dict):
        children = [*value.keys(), *value.values()]
    elif isinstance(value, (list, tuple)):
        children = list(value)
    else:
        children = []
    for child in children:
        yield from _objects(child, seen)


@pytest.mark.parametrize("name", ["512step.yaml", "demo.yaml"])
def test_no_stage_is_handed_the_whole_config(name):
    plan = plan_of(load_config(CONFIGS / name))
    assert isinstance(plan, Plan)
    assert not [o for o in _objects(plan) if isinstance(o, RunConfig)]


def test_each_derived_setting_is_what_the_config_says():
    config = load_config(CONFIGS / "512step.yaml", [
        "data.self_generate_seed=7", "eval.sampled_continuations=3", "data.self_generated_dir=/stores/run",
        "train.step_loss_weights=[2, 1, 1]", "train.draft_steps=3", "data.train_text={temperature: 0.7, top_p: 0.8}",
        "eval.serving=[{temperature: 0}, instruct-general]", "eval.select_serving=instruct-general"])
    plan = plan_of(config)
    setup = plan.setup
    greedy, general = config.eval.serving
    assert setup.selected == general and plan.train.measuring.selected == general
    assert setup.texts(greedy) == (GREEDY_TEXT,)
    assert [t.seed for t in setup.texts(general)] == [7, 8, 9] and all(t.temperature == 0.7 for t in setup.texts(general))
    assert setup.train_texts == (TextSampling(0.7, 0.8, 0, 7),)
    more = plan_of(load_config(CONFIGS / "512step.yaml", ["data.self_generate_seed=7", "data.train_continuations=3"])).setup
    assert [t.seed for t in more.train_texts] == [7, 8, 9] and more.train_texts[0] == TextSampling(1.0, 0.95, 20, 7, 1.5)
    assert setup.store_dir(GREEDY_TEXT) == Path("/stores/run")
    assert setup.store_dir(setup.texts(general)[1]) == Path(f"/stores/run/sampled-{setup.texts(general)[1].label()}")
    assert setup.stored_texts()[0] == GREEDY_TEXT and len(setup.stored_texts()) == len(set(setup.stored_texts())) == 5
    assert plan.train.step_weights == (0.5, 0.25, 0.25) and plan.train.embed_text
    assert plan.fingerprint.value == config.fingerprint() and plan.train.fingerprint == plan.export.fingerprint
    assert plan.run_dir.root == Path(config.output.dir) and plan.cache.directory == config.data.target_cache
    assert plan.export.settings == config.to_dict() and plan.train.tracked["train.trainable"].startswith("[")


def test_the_default_store_lives_in_the_run_directory():
    config = load_config(CONFIGS / "512step.yaml", ["output.dir=/runs/a"])
    assert plan_of(config).setup.store_dir() == Path("/runs/a/self-generated")


def test_a_fingerprint_refuses_other_settings_and_names_them():
    then = plan_of(load_config(CONFIGS / "512step.yaml")).fingerprint
    now = plan_of(load_config(CONFIGS / "512step.yaml", ["train.lr=1e-3"])).fingerprint
    assert then.refusal(then.value, then.settings) is None
    assert now.refusal(then.value, then.settings) == "train.lr: 0.0005 -> 0.001"
    assert now.refusal(then.value, {}).startswith("data: None -> {")  # a record without its settings: every section differs
    assert now.refusal(None, then.settings) == "train.lr: 0.0005 -> 0.001"


def test_the_placeholders_are_refused_together_before_anything_reads(tmp_path):
    config = load_config(CONFIGS / "512step.yaml")
    setup = plan_of(config).setup
    assert set(setup.unset) == {"model.base", "model.donor_head", "data.files"}
    with pytest.raises(ConfigError, match=r"^model\.base \('REPLACE_ME/occamy-base'\), data\.files .*still the placeholder"):
        check_inputs(setup)
    given = dataclasses.replace(config, model=dataclasses.replace(config.model, base=str(tmp_path)))
    assert "model.base" not in plan_of(given).setup.unset


def test_a_serving_configuration_s_texts_follow_its_own_sampling():
    config = load_config(CONFIGS / "512step.yaml", ["eval.serving=[thinking-coding]", "eval.select_serving=thinking-coding",
                                                         "eval.sampled_continuations=2"])
    (coding,) = config.eval.serving
    texts = plan_of(config).setup.texts(coding)
    assert [(t.temperature, t.top_p, t.top_k) for t in texts] == [(0.6, 0.95, 20)] * 2
    assert plan_of(config).setup.texts(Serving(temperature=0.6, top_p=0.95, top_k=20, thinking=True)) == texts
