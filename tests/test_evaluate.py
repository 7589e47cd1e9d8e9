"""Offline chained evaluation: the aggregation against a plain per-anchor loop, the
acceptance arithmetic, exact vs approximate labelling, self-generated text, the plot and
the `python -m occamy_mtp evaluate` entry point on a tiny real-layout checkpoint."""

from __future__ import annotations

import json

import pytest

from occamy_mtp.config import EvalSettings
import torch
import torch.nn.functional as F

from occamy_mtp.data.windows import Window
from occamy_mtp.selfgen.store import context_of, self_generate, with_continuation
from occamy_mtp.evaluation.offline import SELF_GENERATED, TEACHER_FORCED, chain_outcomes, evaluate_head
from occamy_mtp.evaluation.report import format_table
from occamy_mtp.commands.evaluate import main
from occamy_mtp.evaluation.metrics import acceptance_summary, counts_from_outcomes
from occamy_mtp.evaluation.plot import plot_acceptance
from occamy_mtp.testing.checkpoints import build_tiny_checkpoint, random_models, tiny_text_config
from occamy_mtp.testing.tokenizer import SAMPLE_DATA_PATH

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CLI_CONVERSATIONS = 12


pytestmark = pytest.mark.usefixtures("single_thread")  # see conftest.py


@pytest.fixture(scope="module")
def models():
    base, head = random_models(tiny_text_config(), seed=5)
    return base.float().eval(), head.float().eval()


def random_windows(count: int, seed: int) -> list[Window]:
    generator = torch.Generator().manual_seed(seed)
    windows = []
    for n in range(count):
        length = 12 + 5 * n
        ids = torch.randint(0, 1000, (length,), generator=generator).tolist()
        windows.append(Window(f"w{n}", 0, tuple(ids), answer_start=4 + n))
    return windows


def test_acceptance_arithmetic():
    acceptance, length, rate = acceptance_summary([10, 6, 3], [6, 3, 1], drafted=25)
    assert acceptance == pytest.approx([0.6, 0.5, 1 / 3])
    assert length == pytest.approx(1 + 0.6 + 0.3 + 0.1)  # bonus token + sum of running products
    assert rate == pytest.approx(10 / 25)
    assert acceptance_summary([0, 0], [0, 0], 0) == ([0.0, 0.0], 1.0, 0.0)
    # Chains scorable for (3, 3, 1, 2) steps that accepted (0, 2, 1, 2) of them.
    proposed, accepted, drafted = counts_from_outcomes([3, 3, 1, 2], [0, 2, 1, 2], 3)
    assert proposed == [4, 2, 1] and accepted == [3, 2, 0] and drafted == 9


@torch.no_grad()
def plain_chain_reference(base, head, window: Window, steps: int):
    """Per-anchor loop: the head's whole-window chain, scored anchor by anchor in Python."""
    ids = torch.tensor([window.input_ids])
    length = ids.shape[1]
    hidden = base.model(input_ids=ids, use_cache=False).last_hidden_state
    greedy = base.lm_head(hidden).argmax(-1)[0]
    step_tokens = torch.zeros(steps, 1, length, dtype=torch.long)
    step_tokens[0, 0, :-1] = ids[0, 1:]
    for k in range(1, steps):
        step_tokens[k, 0, : length - k] = greedy[k:]
    logits = head.logits(head(step_tokens, hidden)[:, 0]).float()  # (K, L, V)
    proposed, accepted, drafted = [0] * steps, [0] * steps, 0
    agree, nll, scored = 0, 0.0, 0
    for anchor in range(length):
        if anchor + 2 >= length or anchor + 2 < window.answer_start:
            continue  # step 1's predicted position must be in the answer
        scored += 1
        agree += int(logits[0, anchor].argmax() == greedy[anchor + 1])
        nll += float(F.cross_entropy(logits[0, anchor][None], ids[0, anchor + 2][None]))
        alive = True
        for k in range(steps):
            if anchor + k + 2 >= length:
                break
            drafted += 1
            if alive:
                proposed[k] += 1
                alive = bool(logits[k, anchor].argmax() == greedy[anchor + k + 1])
                accepted[k] += alive
    return proposed, accepted, drafted, agree, nll, scored


def test_evaluate_head_equals_a_plain_per_anchor_loop(models):
    base, head = models
    windows = random_windows(3, seed=1)
    metrics = evaluate_head(base, head, windows, draft_steps=3, windows_per_batch=2)
    totals = [plain_chain_reference(base, head, w, 3) for w in windows]
    proposed = [sum(t[0][k] for t in totals) for k in range(3)]
    accepted = [sum(t[1][k] for t in totals) for k in range(3)]
    scored = sum(t[5] for t in totals)
    assert metrics.proposed == proposed and metrics.accepted == accepted
    assert metrics.drafted == sum(t[2] for t in totals)
    assert metrics.scored_positions == scored
    assert metrics.agreement == pytest.approx(sum(t[3] for t in totals) / scored)
    assert metrics.data_nll == pytest.approx(sum(t[4] for t in totals) / scored, rel=1e-5)
    assert metrics.text == TEACHER_FORCED and not metrics.exact
    assert metrics.data_matches_target < 0.5  # random tokens are rarely the base's greedy choice

    # Per-anchor outcomes aggregate to the same counts.
    outcomes = chain_outcomes(base, head, windows, draft_steps=3, windows_per_batch=2)
    assert [len(o.scorable) for o in outcomes] == [len(w.input_ids) for w in windows]
    flat = [(s, a) for o in outcomes for s, a in zip(o.scorable, o.accepted) if s]
    assert counts_from_outcomes([s for s, _ in flat], [a for _, a in flat], 3) == (proposed, accepted, metrics.drafted)


def test_self_generated_text_is_exact(models):
    base, head = models
    windows = random_windows(2, seed=2)
    continuations = self_generate(base, [context_of(w) for w in windows], 9, {1023}, batch_size=2)
    generated = [with_continuation(w, c) for w, c in zip(windows, continuations)]
    assert [len(w.input_ids) for w in generated] == [w.answer_start + 9 for w in windows]
    assert all(g.input_ids[: g.answer_start] == w.input_ids[: w.answer_start] for g, w in zip(generated, windows))
    assert sum(len(c.tokens) for c in continuations) == 18 and sum(c.finished for c in continuations) == 0
    metrics = evaluate_head(base, head, generated, 2, text=SELF_GENERATED)
    assert metrics.exact and metrics.data_matches_target == 1.0
    table = format_table({"trained": metrics.to_dict()})
    assert "exact" in table and "acceptance step 2" in table


def test_plot_writes_a_png(tmp_path, models):
    base, head = models
    metrics = evaluate_head(base, head, random_windows(1, seed=3), 3).to_dict()
    path = plot_acceptance({"donor": metrics, "trained": metrics}, tmp_path / "sub" / "acceptance.png")
    assert path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 2000


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, sample_tokenizer_dir):
    root = tmp_path_factory.mktemp("evaluate-cli")
    tokenizer = sample_tokenizer_dir
    donor = build_tiny_checkpoint(root / "donor", layout="fused", multimodal=False, seed=1, tokenizer_dir=tokenizer)
    base = build_tiny_checkpoint(root / "base", layout="per_expert", multimodal=True, seed=2, tokenizer_dir=tokenizer)
    data = root / "chats.jsonl"  # a few conversations: rendering all of the sample takes seconds
    data.write_text("".join(SAMPLE_DATA_PATH.read_text().splitlines(keepends=True)[:CLI_CONVERSATIONS]))
    return {"base": base.path, "donor": donor.path, "tokenizer": tokenizer, "data": data}


@pytest.mark.parametrize("teacher_forced_only", [True, False])
def test_cli_writes_evaluation_and_plot(checkpoints, tmp_path, capsys, teacher_forced_only):
    out = tmp_path / "eval"
    argv = [
        f"model.base={checkpoints['base']}", "--head", str(checkpoints["base"]), f"model.donor_head={checkpoints['donor']}",
        f"data.files=[{checkpoints['data']}]", f"model.tokenizer={checkpoints['tokenizer']}", "eval.draft_steps=2", "eval.served_steps=[1,2]",
        "data.context_tokens=16", "data.train_conversations=4", "data.validation_conversations=0", "train.select_every_steps=0",
        "data.heldout_conversations=2", "model.dtype=float32", f"output.dir={tmp_path / 'run'}", "--out", str(out),
    ]
    if teacher_forced_only:
        argv += ["data.answer_tokens=12", "--teacher-forced-only"]
    else:
        # greedy and t0.7-p0.8: the reference decoder samples without penalties (the default presets have some)
        argv += ["data.answer_tokens=8", "eval.served_steps=[1,2]", "--reference-decoder",
                 "eval.serving=[{temperature: 0}, {temperature: 0.7, top_p: 0.8}]"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / "evaluation.json").read_text())
    assert (out / "acceptance.png").read_bytes()[:8] == PNG_MAGIC
    assert set(report["heads"]) == {"donor", "trained"}
    assert report["exact"] is not teacher_forced_only
    assert report["text"] == (TEACHER_FORCED if teacher_forced_only else SELF_GENERATED)
    assert "donor" in printed and "trained" in printed
    if teacher_forced_only:
        for metrics in report["heads"].values():
            assert len(metrics["acceptance"]) == 2 and metrics["windows"] == 2 and not metrics["exact"]
        assert "approximate" in printed and "acceptance step 2" in printed
        return
    # the serving configurations asked for: greedy, and temperature 0.7 with top-p 0.8 (its own sampled text)
    assert report["selected_serving"] == "greedy" and [s["label"] for s in report["serving"]] == ["greedy", "t0.7-p0.8"]
    stores = report["self_generated"]["stores"]
    continuations = [f"t0.7-p0.8-seed{j}" for j in range(EvalSettings().sampled_continuations)]
    assert set(stores) == {"greedy", *continuations} and report["self_generated"]["max_new_tokens"] == 8
    assert all(0 < store["generated_tokens"] <= 16 for store in stores.values())
    # texts the run never wrote go under --out, never into the run's directory
    assert (out / "self-generated" / "self-generated.jsonl").is_file() and not (tmp_path / "run" / "self-generated").exists()
    assert (out / "self-generated" / "sampled-t0.7-p0.8-seed0" / "self-generated.jsonl").is_file()
    assert "2 heldout prompts (" in printed  # greedy, the first configuration: one text a prompt
    for head_report in report["heads"].values():
        assert list(head_report["serving"]) == ["greedy", "t0.7-p0.8"]
        for label, by_serving in head_report["serving"].items():
            assert set(by_serving["served"]) == {"1", "2"} and by_serving["every_anchor"]["exact"]
            assert by_serving["every_anchor"]["outside_support"] == 0  # each text was written under its own settings
        assert head_report["serving"]["greedy"]["every_anchor"]["data_matches_target"] == 1.0
        assert not head_report["teacher_forced"]["exact"] and head_report["teacher_forced"]["windows"] == 2
    assert "served acceptance (exact)" in printed and "2-step drafts: step 2 acceptance" in printed
    assert "t0.7-p0.8: temperature 0.7, top_p 0.8" in printed
    for name, by_serving in report["reference_decoder"].items():
        for k, check in by_serving["greedy"].items():
            assert check["decisions"] > 0 and check["decisions_equal"] == check["decisions"]
            assert check["texts_equal"] == check["windows"] == 2
            for key in ("proposed", "accepted", "drafted", "verify_passes"):
                # the decoder's own counts, the replay on its text, and the headline on the stored text agree
                assert check["measured"][key] == check["replayed"][key] == report["heads"][name]["serving"]["greedy"]["served"][k][key]
        for k, check in by_serving["t0.7-p0.8"].items():
            # sampled: 4 seeds a prompt; the z-scores' bounds are tested with many decodes in test_decode
            assert check["decodes"] == 8 and all(abs(z) < 1e6 for z in check["z"].values())
    assert "reference decoder (trained, greedy, 2-step)" in printed and "reference decoder (trained, t0.7-p0.8, 2-step)" in printed


def test_cli_refuses_missing_inputs(tmp_path, capsys):
    code = main([f"model.base={tmp_path / 'nope'}", "--head", str(tmp_path), "data.files=[x.jsonl]", "--out", str(tmp_path / "o")])
    assert code == 2 and "nope" in capsys.readouterr().err


def test_cli_takes_the_run_and_its_split_from_a_config(checkpoints, tmp_path, capsys):
    from occamy_mtp.config import load_config, window_settings
    from occamy_mtp.data.prepare import prepare_windows
    from occamy_mtp.run import load_tokenizer

    config_path = tmp_path / "run.yaml"
    config_path.write_text(
        f"model: {{base: {checkpoints['base']}, donor_head: {checkpoints['donor']}, tokenizer: {checkpoints['tokenizer']}, dtype: float32}}\n"
        f"data: {{files: [{checkpoints['data']}], context_tokens: 16, answer_tokens: 12, train_conversations: 3, "
        f"validation_conversations: 1, heldout_conversations: 3, split_seed: 7}}\n"
        f"output: {{dir: {tmp_path / 'run'}}}\n"
    )
    out = tmp_path / "eval"
    # --head names another file than the config's output.dir/mtp-trained.safetensors (which does not exist)
    argv = ["--config", str(config_path), "--head", str(checkpoints["base"]), "--teacher-forced-only", "eval.draft_steps=2", "eval.served_steps=[1,2]", "--out", str(out)]
    assert main(argv) == 0
    report = json.loads((out / "evaluation.json").read_text())
    config = load_config(config_path)
    expected = prepare_windows(config.data.files, load_tokenizer(config.model), **window_settings(config.data))
    assert report["inputs"]["base"] == str(checkpoints["base"]) and report["inputs"]["donor"] == str(checkpoints["donor"])
    assert report["inputs"]["dtype"] == "float32"
    assert report["dataset"]["settings"]["split_seed"] == 7
    assert report["heads"]["trained"]["windows"] == len(expected.heldout) > 0
    assert main(["--config", str(config_path), "--out", str(out)]) == 2  # the config's head is not there
    assert "mtp-trained.safetensors" in capsys.readouterr().err


def test_cli_max_windows_evaluates_the_first_heldout_windows(checkpoints, tmp_path, capsys):
    """--max-windows N: the first N heldout windows, the ones validate sends with --prompts N."""
    from occamy_mtp.model import checkpoint as ckpt_io
    from occamy_mtp.data.prepare import prepare_windows
    from occamy_mtp.model.head import SharedWeights
    from occamy_mtp.serve.validate import heldout_window_contexts
    from transformers import AutoTokenizer

    split = dict(context_tokens=16, answer_tokens=12, train_conversations=4, validation_conversations=0,
                 heldout_conversations=3)
    argv = [
        f"model.base={checkpoints['base']}", "--head", str(checkpoints["donor"]), f"data.files=[{checkpoints['data']}]",
        f"model.donor_head={checkpoints['donor']}", f"model.tokenizer={checkpoints['tokenizer']}", "eval.draft_steps=2", "eval.served_steps=[1,2]",
        "data.context_tokens=16", "data.answer_tokens=12", "data.train_conversations=4", "data.validation_conversations=0", "train.select_every_steps=0",
        "data.heldout_conversations=3", "model.dtype=float32", f"output.dir={tmp_path / 'run'}", "--teacher-forced-only",
        "--max-windows", "2",
    ]
    assert main(argv + ["--out", str(tmp_path / "eval")]) == 0
    report = json.loads((tmp_path / "eval" / "evaluation.json").read_text())
    assert report["heldout_windows_evaluated"] == 2 == report["heads"]["trained"]["windows"]

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoints["tokenizer"]), local_files_only=True)
    heldout = prepare_windows([checkpoints["data"]], tokenizer, **split).heldout
    assert len(heldout) > 2
    contexts = heldout_window_contexts([checkpoints["data"]], tokenizer, **split)[:2]
    assert [c.prompt_ids for c in contexts] == [tuple(w.input_ids[: w.answer_start]) for w in heldout[:2]]
    base = ckpt_io.load_base(checkpoints["base"], dtype=torch.float32, device=torch.device("cpu"))
    text_config = ckpt_io.read_config(checkpoints["base"]).text_config
    head = ckpt_io.load_head(checkpoints["donor"], text_config, SharedWeights(base.model.embed_tokens, base.lm_head),
                             dtype=torch.float32, device=torch.device("cpu"))[0]
    first_two = evaluate_head(base, head, heldout[:2], 2).to_dict()
    assert report["heads"]["trained"]["proposed"] == first_two["proposed"]
    assert report["heads"]["trained"]["accepted"] == first_two["accepted"]
    assert evaluate_head(base, head, heldout, 2).to_dict()["proposed"] != first_two["proposed"]

    assert main(argv[:-2] + ["--max-windows", "0", "--out", str(tmp_path / "zero")]) == 2
    assert "--max-windows" in capsys.readouterr().err


def test_cli_honours_the_eval_and_data_settings_of_its_config(checkpoints, tmp_path, monkeypatch):
    """eval.served_steps, eval.draft_steps and data.self_generate_batch_size of --config reach
    the evaluation (they had defaults of their own on evaluate's command line)."""
    from occamy_mtp.selfgen.store import SelfGeneratedStore

    batch_sizes = []
    real_generate = SelfGeneratedStore.generate

    def spy(self, writer, windows, log=print):
        batch_sizes.append(writer.batch_size)
        return real_generate(self, writer, windows, log)

    monkeypatch.setattr(SelfGeneratedStore, "generate", spy)
    config_path = tmp_path / "run.yaml"
    config_path.write_text(
        f"model: {{base: {checkpoints['base']}, donor_head: {checkpoints['donor']}, tokenizer: {checkpoints['tokenizer']}, dtype: float32}}\n"
        f"data: {{files: [{checkpoints['data']}], context_tokens: 16, answer_tokens: 6, train_conversations: 3, "
        f"validation_conversations: 1, heldout_conversations: 2, self_generate_batch_size: 1}}\n"
        f"eval: {{served_steps: [2], draft_steps: 2}}\n"
        f"output: {{dir: {tmp_path / 'run'}}}\n"
    )
    out = tmp_path / "eval"
    assert main(["--config", str(config_path), "--head", str(checkpoints["donor"]), "--out", str(out)]) == 0
    report = json.loads((out / "evaluation.json").read_text())
    # one store a way of writing the text (greedy, and each of the default presets' four on its own seeds), each
    # written at the config's batch
    stores = 1 + 4 * EvalSettings().sampled_continuations
    assert batch_sizes == [1] * stores and report["self_generated"]["batch_size"] == 1
    trained = report["heads"]["trained"]["serving"]
    assert report["served_steps"] == [2] and all(set(s["served"]) == {"2"} for s in trained.values())
    assert report["heads"]["trained"]["teacher_forced"]["draft_steps"] == 2
    # The continuations are the run's own stores: a second evaluation writes none.
    assert main(["--config", str(config_path), "--head", str(checkpoints["donor"]), "--out", str(out)]) == 0
    stores = json.loads((out / "evaluation.json").read_text())["self_generated"]["stores"]
    assert batch_sizes == [1] * len(stores) and all(store["generated_now"] == 0 for store in stores.values())


def test_cli_refuses_a_head_export_would_refuse(checkpoints, tmp_path, capsys):
    """Issue 22, item 7: a NaN in fc, or a head stored as integers, is one error line and exit 2
    (evaluate took both without a word: 0.00% acceptance and NaN in its JSON)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from occamy_mtp.model import checkpoint as ckpt_io

    donor = ckpt_io.SafetensorsCheckpoint(checkpoints["donor"])
    head = {k: donor.get(k) for k in ckpt_io.head_disk_keys(donor)}
    argv = [f"model.base={checkpoints['base']}", f"model.donor_head={checkpoints['donor']}", f"data.files=[{checkpoints['data']}]",
            f"model.tokenizer={checkpoints['tokenizer']}", "data.context_tokens=16", "data.answer_tokens=12",
            "data.train_conversations=4", "data.validation_conversations=0", "train.select_every_steps=0",
            "data.heldout_conversations=2", "model.dtype=float32", f"output.dir={tmp_path / 'run'}", "--teacher-forced-only",
            "--out", str(tmp_path / "eval")]
    nan = dict(head)
    nan["mtp.fc.weight"] = nan["mtp.fc.weight"].clone()
    nan["mtp.fc.weight"][0, 0] = float("nan")
    save_file(nan, str(tmp_path / "nan.safetensors"))
    assert main(argv + ["--head", str(tmp_path / "nan.safetensors")]) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # after the progress lines of the set-up
    assert last.startswith("error: ") and "fc.weight" in last and "NaN or infinite" in last and "Traceback" not in err
    integers = {k: v.to(torch.int32) for k, v in head.items()}
    save_file(integers, str(tmp_path / "int.safetensors"))
    assert main(argv + ["--head", str(tmp_path / "int.safetensors")]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: ") and "is I32" in last and "BF16, F16, F32" in last
    assert not (tmp_path / "eval" / "evaluation.json").exists()
    with safe_open(str(tmp_path / "nan.safetensors"), "pt") as handle:  # the bad file itself is left as it was
        assert torch.isnan(handle.get_tensor("mtp.fc.weight")[0, 0])
