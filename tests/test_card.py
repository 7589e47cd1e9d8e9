"""What export writes for people: the head's model card (README.md), the picture of every serving
configuration, and the comparison of a run's head with a reference record (issue 43)."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
import re

import pytest
import yaml
from PIL import Image

from occamy_mtp import record as rec
from occamy_mtp.model import checkpoint as ckpt_io
from occamy_mtp.export.card import acceptance_table, hub_id, model_card
from occamy_mtp.run import RunDir
from occamy_mtp.commands import compare as compare_command
from occamy_mtp.settings import plan_of
from test_faults import exported, run_models  # noqa: F401 (fixtures)


def test_export_writes_a_card_that_says_what_the_record_says(exported):
    run_dir = RunDir.of(exported)
    card = run_dir.card.read_text()
    record = json.loads(run_dir.record.read_text())
    front = yaml.safe_load(card.split("---")[1])
    assert front["library_name"] == "occamy-mtp" and "speculative-decoding" in front["tags"]
    assert "base_model" not in front and "output.base_model_id" in card  # a local base: no Hub id to give
    assert record["outputs"]["mtp-trained.safetensors"] in card
    assert f"{record['derived']['trainable_parameters']:,} of the head's {record['derived']['head_parameters']:,}" in card
    # one row per serving configuration and served step count, donor and trained counts as the metrics have them
    metrics = record["metrics"]
    rows = [line for line in card.splitlines() if re.match(r"\| (greedy|temperature|instruct)", line)]
    assert len(rows) == len(metrics["serving"]) * len(metrics["served_steps"])
    greedy_k1 = metrics["heldout"]["trained"]["serving"]["greedy"]["served"]["1"]
    assert f"{greedy_k1['accepted'][0]:,} / {greedy_k1['proposed'][0]:,}" in rows[0]
    ceiling = metrics["ceiling"]["greedy"]["1"]["mean_accept_length"]
    assert ceiling == pytest.approx(2.0) and f"| {ceiling:.3f} |" in rows[0]  # greedy's ceiling: every draft accepted
    donor_k1 = metrics["heldout"]["donor"]["serving"]["greedy"]["served"]["1"]["mean_accept_length"]
    assert rows[0].endswith(f"| {(greedy_k1['mean_accept_length'] - donor_k1) / (ceiling - donor_k1):.1%} |")
    for command in ("assemble_head.py --base", "--speculative-algorithm NEXTN", "vllm serve", "hf upload"):
        assert command in card
    for k in metrics["served_steps"]:  # each served step count: 1, 2 (vLLM's recipe) and 3 (SGLang's)
        assert f"--speculative-num-steps {k} " in card and f'"num_speculative_tokens": {k}}}' in card
    assert "0.5.12 or later" in card and "describes the head file alone" in card
    assert "## Not validated" in card
    # what hf upload publishes: the card and the files it lists, the same files as the run's, nothing else
    assert f"hf upload ORG/NAME {run_dir.upload}" in card
    assert sorted(p.name for p in run_dir.upload.iterdir()) == sorted(
        ["README.md", ckpt_io.HEAD_FILE, ckpt_io.HEAD_CONFIG_FILE, "metrics.json", "TRAINING.json", "acceptance.png"])
    assert (run_dir.upload / "README.md").read_text() == card
    for path in run_dir.published():
        assert (run_dir.upload / path.name).read_bytes() == path.read_bytes()
        assert f"`{path.name}`" in card


def test_a_user_s_readme_in_the_output_directory_is_kept_and_the_card_names_the_hub_ids(exported, tmp_path):
    """A README.md the library did not write stays as it is (the card goes into upload/ alone); the base's Hub id
    comes from output.base_model_id, its license from the base's own card; paths with spaces are quoted."""
    import shutil

    from occamy_mtp.export.exporter import export
    from test_faults import run_config_like

    root = tmp_path / "my run"
    shutil.copytree(RunDir.of(exported).root, root)
    mine = "# My notes\n\nNot a model card.\n"
    (root / "README.md").write_text(mine)
    config = run_config_like(exported, root, base_model_id="acme/occamy")
    lines = []
    export(plan_of(config), allow_worse=True, log=lines.append)
    assert (root / "README.md").read_text() == mine
    assert any("is not a card occamy-mtp wrote, so it is left as it is" in line for line in lines)
    card = (root / "upload" / "README.md").read_text()
    front = yaml.safe_load(card.split("---")[1])
    assert front["base_model"] == "acme/occamy" and "license" not in front  # the tiny base has no card of its own
    assert f"hf upload ORG/NAME '{root}/upload'" in card and f"--head '{root}/mtp-trained.safetensors'" in card
    # the next export finds its own card at the root of a fresh run and replaces it
    (root / "README.md").unlink()
    export(plan_of(config), allow_worse=True, log=lines.append)
    assert (root / "README.md").read_text() == card


def test_the_card_takes_the_license_of_the_base_s_own_card(exported, tmp_path):
    from occamy_mtp.export.card import base_card_license, front_matter

    record = json.loads(RunDir.of(exported).record.read_text())
    assert base_card_license(str(tmp_path)) is None  # no card
    (tmp_path / "README.md").write_text("---\nlicense: apache-2.0\nbase_model: Qwen/Qwen3.6-35B-A3B\n---\n# Occamy\n")
    assert base_card_license(str(tmp_path)) == "apache-2.0"
    front = front_matter_of(model_card(record, "/runs/x", base_card_license(str(tmp_path))))
    assert front["license"] == "apache-2.0"
    (tmp_path / "README.md").write_text("# no metadata\n")
    assert base_card_license(str(tmp_path)) is None and front_matter(tmp_path / "README.md") == {}


def front_matter_of(card: str) -> dict:
    return yaml.safe_load(card.split("---")[1])


def test_the_picture_has_a_panel_per_serving_configuration(exported, tmp_path):
    from occamy_mtp.evaluation.plot import plot_served

    metrics = json.loads(RunDir.of(exported).metrics.read_text())
    one = plot_served({**metrics, "serving": metrics["serving"][:1]}, tmp_path / "one.png")
    two = plot_served(metrics, tmp_path / "two.png")
    assert len(metrics["serving"]) == 2
    assert Image.open(two).size[0] > 1.8 * Image.open(one).size[0]


def test_the_picture_says_what_its_bars_are_with_their_errors_and_the_ceiling_s_value(exported):
    """Each bar is a mean accept length with its standard error; the ceiling's value is printed; no value
    label sits where the ceiling's dashed line crosses it."""
    from occamy_mtp.evaluation.plot import LABEL_HEIGHT, served_figure

    metrics = json.loads(RunDir.of(exported).metrics.read_text())
    figure = served_figure(metrics)
    axes = figure.axes[0]
    assert axes.get_ylabel().startswith("mean accept length")
    label = metrics["serving"][0]["label"]
    error_bars = [c for c in axes.containers if getattr(c, "errorbar", None) is not None]
    assert len(error_bars) == len(metrics["heldout"])  # one set a head
    texts = [t.get_text() for t in axes.texts]
    for k in metrics["served_steps"]:
        value = metrics["ceiling"][label][str(k)]["mean_accept_length"]
        assert f"{value:.2f}" in texts
    lines = [metrics["ceiling"][label][str(k)]["mean_accept_length"] for k in metrics["served_steps"]]
    for text in axes.texts:
        if "\n(" in text.get_text():  # a bar's label: its bottom is not just below a ceiling line
            y = text.xy[1]
            assert not any(y - 0.02 < line < y + LABEL_HEIGHT for line in lines), (text.get_text(), y, lines)


def test_hub_snapshots_are_named_by_their_repository():
    assert hub_id("/root/.cache/huggingface/hub/models--Qwen--Qwen3.6-35B-A3B/snapshots/abc") == "Qwen/Qwen3.6-35B-A3B"
    assert hub_id("/ckpt/occamy") is None


def test_a_card_of_sampled_counts_says_they_are_expected():
    metrics = {"serving": [{"label": "t1", "temperature": 1.0, "top_p": 0.95, "top_k": 20}], "served_steps": [1],
               "heldout": {name: {"serving": {"t1": {"served": {"1": {
                   "accepted": [12.5], "proposed": [40.0], "acceptance": [0.3125], "mean_accept_length": 1.3125}}}}}
                   for name in ("donor", "trained")}}
    row = acceptance_table(metrics)[2]
    assert row.startswith("| temperature 1, top-p 0.95, top-k 20 | 1-step | 12.5 / 40.0 (expected) (31.25%)")
    assert row.endswith("| not measured | - |")  # a record without the ceiling
    metrics["ceiling"] = {"t1": {"1": {"mean_accept_length": 1.6}}}
    assert acceptance_table(metrics)[2].endswith("| 1.600 | 0.0% |")


# ---------------------------------------------------------------- compare


def test_compare_tells_the_same_head_an_explained_and_an_unexplained_difference(exported, tmp_path, capsys):
    record = json.loads(RunDir.of(exported).record.read_text())
    status, report = rec.compare_heads(record, record)
    assert status == rec.SAME and "figures: all" in report and "equal the reference's" in report
    moved = copy.deepcopy(record)  # the same bytes, a figure measured with another rounding
    served = moved["metrics"]["heldout"]["trained"]["serving"]["greedy"]["served"]["1"]
    served["mean_accept_length"] += 1e-6
    status, report = rec.compare_heads(moved, record)
    assert status == rec.SAME and "the same bytes" in report
    assert "figures: 1 of" in report and "by at most 1e-06 (trained head, greedy, 1-step" in report

    other = copy.deepcopy(record)
    other["outputs"]["mtp-trained.safetensors"] = "0" * 64
    other["reproducibility"]["trained_with"]["threads"] = 2
    other["settings"]["output"]["dir"] = "elsewhere"  # a place, not a cause
    status, report = rec.compare_heads(record, other)
    assert status == rec.EXPLAINED
    assert "trained with threads 1 here, 2 in the reference" in report and "output.dir" not in report

    del other["reproducibility"]["trained_with"]["threads"]
    other["reproducibility"]["trained_with"] = dict(record["reproducibility"]["trained_with"])
    status, report = rec.compare_heads(record, other)
    assert status == rec.UNEXPLAINED and "NOT expected" in report

    mine, theirs = tmp_path / "mine.json", tmp_path / "theirs.json"
    mine.write_text(json.dumps(record))
    theirs.write_text(json.dumps(other))
    assert compare_command.main([str(mine), str(theirs)]) == 1
    assert compare_command.main([str(mine), str(mine)]) == 0
    theirs.write_text("{}")
    assert compare_command.main([str(mine), str(theirs)]) == 2
    assert f"error: {theirs}: not a TRAINING.json of this version" in capsys.readouterr().err


def test_training_records_the_arithmetic_that_made_the_head(exported):
    record = json.loads(RunDir.of(exported).record.read_text())
    made = record["reproducibility"]["trained_with"]
    assert made["device"] == "cpu" and made["threads"] >= 1 and made["processes"] == 1 and made["cpu_capability"]
    assert "threads" in record["reproducibility"]["depends_on"]


# ---------------------------------------------------------------- the training console


def test_progress_shows_the_running_mean_of_the_steps_since_the_last_line():
    from occamy_mtp.train.loop import running_means

    lines = [{"step": s, "loss": loss, "scored_step1": n, "agreement_step1": a}
             for s, loss, n, a in ((5, 2.0, 10, 0.5), (6, 4.0, 30, 0.1))]
    assert running_means(lines) == {"mean loss of steps 5-6": "3.0000", "step-1 agreement": "0.200"}
    assert list(running_means(lines[:1])) == ["mean loss of step 5", "step-1 agreement"]


def test_training_prints_a_line_every_log_every_steps(run_models, tmp_path, capsys):
    from test_faults import run_config
    from occamy_mtp.train.loop import train

    train(plan_of(run_config(run_models, tmp_path / "run", "train.log_every_steps=2")))
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("train: ")]
    assert [line.split()[1] for line in lines] == ["2/6", "4/6", "6/6"]
    assert "mean loss of steps 1-2" in lines[0] and "mean loss of steps 5-6" in lines[-1]


def test_the_card_names_the_mode_the_train_text_was_written_in():
    """The reference record (the default recipe): sampled at thinking-general, in thinking mode; the same record
    with thinking off, and greedy text by the library's defaults, say so."""
    from occamy_mtp.export.card import model_card

    record = json.loads((Path(__file__).resolve().parent.parent / "TRAINING.json").read_text())
    assert ("the base's own sampled (temperature 1, top-p 0.95, top-k 20, presence penalty 1.5), thinking-mode "
            "continuations of") in model_card(record)
    record["settings"]["data"]["thinking"] = "off"
    assert "presence penalty 1.5), non-thinking continuations of" in model_card(record)
    record["settings"]["data"].update(thinking="auto", train_text={**record["settings"]["data"]["train_text"], "temperature": 0.0})
    assert "the base's own greedy continuations of" in model_card(record)
