"""The config loader: schema, overrides, errors that name the option, and every shipped config."""

import re
from pathlib import Path

import pytest

from occamy_mtp.config import ConfigError, RunConfig, Serving, load_config, step_loss_weights

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"
CONFIGS = sorted(CONFIGS_DIR.glob("*.yaml"))


def test_configs_directory_is_not_empty():
    names = {p.name for p in CONFIGS}
    assert {"512step.yaml", "demo.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    config = load_config(path)
    assert isinstance(config, RunConfig)
    assert path.read_text().lstrip().startswith("#"), "each config starts with the command that runs it"


def _equal_to_default(path: Path) -> list[str]:
    """The settings of the config at `path` that it sets to their default value."""
    import yaml

    tree, default = yaml.safe_load(path.read_text()) or {}, RunConfig().to_dict()
    config = load_config(path).to_dict()
    return [f"{section}.{key}" for section, values in tree.items() for key in values
            if config[section][key] == default[section][key]]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_a_shipped_config_holds_only_what_differs_from_the_defaults(path):
    assert _equal_to_default(path) == []


def test_the_defaults_check_finds_a_default(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("# a config\ntrain:\n  lr: 5.0e-4\n  epochs: 3\ndata:\n  train_text: {temperature: 0}\n")
    assert _equal_to_default(path) == ["train.lr", "data.train_text"]


def test_512step_is_the_original_recipe():
    config = load_config(Path(__file__).resolve().parent.parent / "configs" / "512step.yaml")
    steps = config.train.epochs * -(-config.data.train_conversations // config.train.windows_per_step)
    assert steps == 512
    assert (config.data.context_tokens, config.data.answer_tokens) == (128, 382)
    assert (config.data.train_conversations, config.data.heldout_conversations) == (256, 32)
    assert config.train.trainable == ("fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden")


def test_overrides_take_precedence_and_are_typed(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  lr: 1.0e-3\n")
    config = load_config(path, ["train.lr=3e-4", "data.files=[a.jsonl, b.jsonl]", "train.epochs=3"])
    assert config.train.lr == pytest.approx(3e-4)
    assert config.data.files == ("a.jsonl", "b.jsonl")
    assert config.train.epochs == 3
    assert load_config(None).train.lr == RunConfig().train.lr  # defaults live in the dataclasses


@pytest.mark.parametrize(
    "yaml_text, overrides, message",
    [
        ("train:\n  lr_warmup: 3\n", [], "unknown config key train.lr_warmup"),
        ("trian:\n  lr: 3\n", [], "unknown config key trian"),
        ("", ["train.epoch=2"], "unknown config key train.epoch"),
        ("train:\n  epochs: two\n", [], "train.epochs: expected an integer"),
        ("train:\n  epochs: 1.5\n", [], "train.epochs: expected an integer"),
        ("data:\n  files: a.jsonl\n", [], "data.files: expected a list"),
        ("train:\n  trainable: [fc]\n  draft_steps: 2\n  step_loss_weights: [1.0]\n", [], "train.step_loss_weights"),
        ("data:\n  turns: middle\n", [], "data.turns: expected last, first or every"),
        ("", ["train.lr"], "expected section.key=value"),
        ("- a\n- b\n", [], "expected a mapping"),
        # serving configurations and sampled self-generation (issue 28, item 7)
        ("", ["eval.serving=[{temperature: -0.5}]"], "eval.serving[0].temperature: expected a finite number >= 0, got -0.5"),
        ("", ["eval.serving=[{temperature: 0}, {temperature: 0.7, top_p: 0}]"], "eval.serving[1].top_p: expected a number in (0, 1]"),
        ("", ["eval.serving=[{temperature: 0.7, top_p: 1.2}]"], "eval.serving[0].top_p: expected a number in (0, 1], got 1.2"),
        ("", ["eval.serving=[{temperature: 0.7, top_k: -1}]"], "eval.serving[0].top_k: expected 0 (every token) or more"),
        ("", ["eval.serving=[{temperature: 0.7, draft: beam}]"], "eval.serving[0].draft: expected greedy or sampled"),
        ("", ["eval.serving=[{temprature: 0.7}]"], "unknown config key eval.serving[0].temprature"),
        ("", ["eval.serving=[{temperature: 0.7}, {temperature: 0.7}]"], "eval.serving: expected distinct configurations"),
        ("", ["eval.serving=[]"], "eval.serving: expected one or more"),
        ("", ["eval.select_serving=t0.7"], "eval.select_serving: 't0.7' names none of eval.serving (greedy, thinking-general, "
                                           "thinking-coding, instruct-general or instruct-reasoning)"),
        # the index it was before it named the configuration, and the keys data.train_text replaced: the new spelling
        ("", ["eval.select_serving=1"], "eval.select_serving: 1 is an index; name the configuration instead: "
                                        "eval.select_serving: thinking-general"),
        ("", ["eval.serving=[instruct-general, {temperature: 0.7, top_p: 0.8}]", "eval.select_serving=1"],
         "name the configuration instead: eval.select_serving: t0.7-p0.8"),
        ("", ["data.self_generate_temperature=1.0", "data.self_generate_top_p=0.95", "data.self_generate_top_k=20",
              "data.self_generate_presence_penalty=1.5"],
         "data.self_generate_temperature, data.self_generate_top_p, data.self_generate_top_k, data.self_generate_presence_penalty: "
         "replaced by data.train_text, a serving configuration as eval.serving's entries are; write data.train_text: thinking-general"),
        ("data:\n  self_generate_temperature: 0.7\n  self_generate_top_p: 0.8\n", [],
         "write data.train_text: {temperature: 0.7, top_p: 0.8}"),
        ("", ["data.train_continuations=2"], "data.train_continuations: expected 1 where data.train_text is greedy"),
        ("", ["data.train_text=thinking-general", "data.thinking=off"], "data.train_text: thinking-general writes in thinking mode"),
        ("", ["data.train_text=thinking-genral"], "data.train_text: unknown serving preset 'thinking-genral'; expected greedy or "
                                                  "one of thinking-general"),
        ("", ["train.loss=ce"], "train.loss: expected top1, top1-certainty, top1-margin, kl or tv"),
        # a loss that cannot apply to the configuration it is asked for
        ("", ["train.loss=tv"], "train.loss: tv reads the base's processed distribution under the selected serving "
                                "configuration (greedy), and greedy serving's is one-hot"),
        ("", ["data.train_text={temperature: -1}"], "data.train_text.temperature: expected a finite number >= 0"),
        ("", ["data.train_text={temperature: 0.7, top_p: 0}"], "data.train_text.top_p: expected a number in (0, 1]"),
        ("", ["data.train_text={temperature: 0.7, top_k: -3}"], "data.train_text.top_k: expected 0 (every token) or more"),
    ],
)
def test_bad_configs_name_the_option(tmp_path, yaml_text, overrides, message):
    path = tmp_path / "c.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(path, overrides)


def test_serving_configurations_and_their_labels():
    config = load_config(None, ["eval.serving=[{temperature: 0.6, top_k: 20, draft: sampled}, {temperature: 0}]"])
    assert [s.label() for s in config.eval.serving] == ["t0.6-k20-sampled-drafts", "greedy"]
    assert config.selected_serving == config.eval.serving[0] and config.selected_serving.top_p == 1.0
    default = load_config(None)
    assert [s.label() for s in default.eval.serving] == ["greedy", "thinking-general", "thinking-coding",
                                                         "instruct-general", "instruct-reasoning"]
    assert [s.thinking for s in default.eval.serving] == [False, True, True, False, False]
    assert default.selected_serving.greedy
    # a configuration of the presets' settings in the other thinking mode is not the preset, and says so
    other = load_config(None, ["eval.serving=[{temperature: 0, thinking: true}, {temperature: 0.7, top_p: 0.8, top_k: 20, "
                               "presence_penalty: 1.5, thinking: true}]"])
    assert [s.label() for s in other.eval.serving] == ["greedy-thinking", "t0.7-p0.8-k20-pp1.5-thinking"]
    # selection scores the selected configuration, so it is part of what a resume must match
    assert default.fingerprint() != load_config(None, ["eval.select_serving=thinking-general"]).fingerprint()
    assert load_config(None, ["eval.select_serving=thinking-general"]).selected_serving == default.eval.serving[1]
    # greedy by its label wherever a preset's name is taken, as the 512-step config's comment spells the greedy recipe
    greedy = load_config(CONFIGS_DIR / "512step.yaml", ["data.thinking=auto", "data.train_text=greedy", "eval.select_serving=greedy",
                                                        "eval.serving=[greedy, thinking-general]"])
    assert greedy.data.train_text == Serving() and greedy.selected_serving == Serving() == greedy.eval.serving[0]
    assert default.fingerprint() == load_config(None, ["eval.serving=[{temperature: 0}]"]).fingerprint()


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "absent.yaml")


def test_fingerprint_tracks_training_settings_only():
    a = load_config(None)
    assert a.fingerprint() == load_config(None, ["output.dir=elsewhere", "eval.draft_steps=4"]).fingerprint()
    assert a.fingerprint() != load_config(None, ["train.lr=1e-5"]).fingerprint()


def test_step_loss_weights_normalised():
    config = load_config(None, ["train.draft_steps=3", "train.step_loss_weights=[2, 1, 1]"])
    assert step_loss_weights(config.train) == pytest.approx((0.5, 0.25, 0.25))
    assert step_loss_weights(load_config(None, ["train.draft_steps=2"]).train) == pytest.approx((0.5, 0.5))


def test_fingerprint_ignores_where_targets_are_read_from():
    assert load_config(None).fingerprint() == load_config(None, ["data.target_cache=/cache"]).fingerprint()


def test_window_settings_are_prepare_windows_arguments_with_the_same_defaults():
    import inspect

    from occamy_mtp.config import WINDOW_SETTINGS, DataSettings, window_settings
    from occamy_mtp.data.prepare import prepare_windows

    parameters = inspect.signature(prepare_windows).parameters
    for name, value in window_settings(DataSettings()).items():
        assert name in parameters, name
        if name == "validation_conversations":  # the function splits two ways unless asked; runs and CLIs ask
            assert parameters[name].default == 0
            continue
        if name == "prompts":  # derived from data.answers; the function keeps recorded answers only unless asked
            assert parameters[name].default is False and value is True
            continue
        assert parameters[name].default == value, f"data.{name}: DataSettings {value!r}, prepare_windows {parameters[name].default!r}"
    assert set(WINDOW_SETTINGS) | {"prompts"} == set(window_settings(DataSettings()))
    assert window_settings(DataSettings(answers="data"))["prompts"] is False


def test_a_command_line_takes_the_run_config_then_the_overrides(tmp_path):
    from occamy_mtp.cli import parse, parser
    from occamy_mtp.config import window_settings

    config = tmp_path / "run.yaml"
    config.write_text("data:\n  train_conversations: 40\n  validation_conversations: 0\n  context_tokens: 64\n  max_record_bytes: 1000\n"
                      "train:\n  select_every_steps: 0\n")
    cli = parser("test", "a command", config_required=False)
    cli.add_argument("--own", action="store_true")
    args, run = parse(cli, ["data.context_tokens=32", "--config", str(config), "--own"])  # in any order
    split = window_settings(run.data)
    assert run.data.train_conversations == 40 and args.own
    assert split["train_conversations"] == 40 and split["validation_conversations"] == 0 and split["max_record_bytes"] == 1000
    assert split["context_tokens"] == 32  # the override wins
    assert split["heldout_conversations"] == 32 and split["skip_bad_records"] is False  # the defaults
    _, run = parse(cli, ["data.skip_bad_records=true"])
    assert run.data.skip_bad_records is True and run.data.validation_conversations == 32
    config.write_text("data:\n  max_record_bytes: 0\n")
    with pytest.raises(ConfigError, match="data.max_record_bytes"):
        parse(cli, ["--config", str(config)])


def test_fp8_activations_change_the_targets_so_the_fingerprint_but_the_default_leaves_it_as_it_was():
    """model.fp8_activations fp8 changes what the base computes (a resume must refuse it); bf16, the
    default, leaves the fingerprint of runs trained before the setting existed unchanged."""
    default = load_config(None)
    assert "fp8_activations" not in default.fingerprinted()["model"]
    assert default.fingerprint() == load_config(None, ["model.fp8_activations=bf16"]).fingerprint()
    assert default.fingerprint() != load_config(None, ["model.fp8_activations=fp8"]).fingerprint()
    with pytest.raises(ConfigError, match="model.fp8_activations"):
        load_config(None, ["model.fp8_activations=int8"])


def test_served_step_counts_default_to_1_2_3_and_stop_at_the_measured_chain():
    """2 is vLLM's recipe for Qwen3.5/3.6, 3 SGLang's; a count past eval.draft_steps has no measured chain (issue 60)."""
    assert load_config(None, []).eval.served_steps == (1, 2, 3)
    assert load_config(None, ["eval.served_steps=[4]", "eval.draft_steps=4"]).eval.served_steps == (4,)
    with pytest.raises(ConfigError, match=r"eval.served_steps: expected step counts up to eval.draft_steps \(3\)"):
        load_config(None, ["eval.served_steps=[1, 4]"])
