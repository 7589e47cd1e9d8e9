"""The real entry points on a tiny config: train.py, export.py, assemble_head.py.

Checks the output files, that only fc and the two pre-fc norms changed, that every other
exported tensor is bit-identical to the donor's, that TRAINING.json fits its schema and
its metrics equal a recomputation, that a run killed midway and resumed ends with the
identical head, and that a 2-process CPU run (gloo) works through accelerate, plain and with
the frozen base sharded (configs/accelerate/fsdp2.yaml).

The models here are random (base and donor unrelated), so the trained head has nothing to
win over the donor; export is run with --allow-worse. tests/test_recipe.py runs the
recipe on a small demo build, where it must win.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from occamy_mtp.model import checkpoint as ckpt_io
from occamy_mtp.record import validate_record
from occamy_mtp.testing.checkpoints import build_tiny_checkpoint
from occamy_mtp.testing.tokenizer import SAMPLE_DATA_PATH
from occamy_mtp.settings import plan_of, serving_texts

REPO = Path(__file__).resolve().parent.parent
TRAINED = {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight"}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def models(tmp_path_factory, sample_tokenizer_dir):
    root = tmp_path_factory.mktemp("e2e-models")
    tokenizer = sample_tokenizer_dir
    donor = build_tiny_checkpoint(root / "donor", layout="fused", multimodal=False, seed=1, tokenizer_dir=tokenizer)
    base = build_tiny_checkpoint(root / "base", layout="per_expert", multimodal=True, seed=2, tokenizer_dir=tokenizer)
    return {"base": base.path, "donor": donor.path, "tokenizer": tokenizer}


def write_config(path: Path, models: dict, output: Path, data: dict | None = None, **train) -> Path:
    train_lines = "\n".join(f"  {k}: {v}" for k, v in {
        "epochs": 2, "windows_per_step": 2, "lr": 1.0e-2, "lr_warmup_steps": 2,
        "checkpoint_every_steps": 2, "log_every_steps": 2, "select_every_steps": 0, **train}.items())
    path.write_text(
        "# tiny end-to-end config\n"
        f"model:\n  base: {models['base']}\n  donor_head: {models['donor']}\n  dtype: float32\n"
        f"data:\n  files: [{SAMPLE_DATA_PATH}]\n  context_tokens: 24\n  answer_tokens: 40\n"
        "  train_conversations: 12\n  validation_conversations: 4\n  heldout_conversations: 4\n"
        + "".join(f"  {k}: {v}\n" for k, v in (data or {}).items())
        + f"train:\n{train_lines}\n"
        "eval:\n  draft_steps: 2\n  served_steps: [1, 2]\n  decoder_check_windows: 2\n"
        f"output:\n  dir: {output}\n"
    )
    return path


def run(args: list[str], env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run a command of the project in its own process group; on a timeout the whole group is
    killed (a launcher's worker processes too, which would otherwise outlive the test)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", **(env or {}))
    with subprocess.Popen([sys.executable, *args], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, start_new_session=True) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            raise
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def trained(tmp_path_factory, models):
    root = tmp_path_factory.mktemp("e2e-run")
    config = write_config(root / "run.yaml", models, root / "out")
    trained = ok(run(["train.py", "--config", str(config)]))
    exported = ok(run(["export.py", "--config", str(config), "--allow-worse"]))
    return {"config": config, "out": root / "out", "stderr": trained.stderr + exported.stderr}


def test_a_run_without_deepspeed_says_nothing_of_it(trained):
    """DeepSpeed, where it is installed, warns about the accelerator when it is imported: a plain run never
    imports it (accelerate's unwrap_model would)."""
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("DeepSpeed is not installed: nothing would import it")
    assert "real_accelerator" not in trained["stderr"] and "DeepSpeed" not in trained["stderr"], trained["stderr"][-2000:]


def test_outputs_exist_and_only_trainable_tensors_changed(trained, models):
    out = trained["out"]
    for name in ("mtp-trained.safetensors", "mtp_head_config.json", "TRAINING.json", "metrics.json", "config.resolved.yaml"):
        assert (out / name).is_file(), name
    exported = load_file(out / "mtp-trained.safetensors")
    donor = ckpt_io.SafetensorsCheckpoint(models["donor"])
    donor_keys = ckpt_io.head_disk_keys(donor)
    assert set(exported) == donor_keys  # the donor's own (fused) layout, every tensor
    for key in sorted(donor_keys):
        same = torch.equal(exported[key].view(torch.int16), donor.get(key).view(torch.int16))
        assert exported[key].dtype == torch.bfloat16
        if key in TRAINED:
            assert not same, f"{key} did not change in training"
        else:
            assert same, f"{key} is not trained but differs from the donor"


def test_training_record_fits_schema_and_metrics_recompute(trained, models):
    from transformers import AutoTokenizer

    from occamy_mtp.config import load_config
    from occamy_mtp.data.prepare import prepare_windows
    from occamy_mtp.evaluation.offline import evaluate_head
    from occamy_mtp.evaluation.served import served_acceptance
    from occamy_mtp.model.head import SharedWeights
    from occamy_mtp.data.windows import stop_token_ids
    from occamy_mtp.base.frozen import BaseFacts
    from occamy_mtp.run import open_store

    record = json.loads((trained["out"] / "TRAINING.json").read_text())
    assert validate_record(record) == []
    assert record["derived"]["trainable_tensors"] == sorted(TRAINED)
    assert record["settings"]["train"]["epochs"] == 2
    windows = record["dataset"]["windows"]
    assert (windows["train"], windows["validation"], windows["heldout"]) == (12, 4, 4)
    assert record["export"]["bit_identical_to_donor"] == record["export"]["tensors"] - len(TRAINED)
    assert [f["name"] for f in record["base"]["files"]] == [p.name for p in ckpt_io.SafetensorsCheckpoint(models["base"]).files()]

    # Recompute the trained head's heldout metrics from the exported file alone.
    base = ckpt_io.load_base(models["base"], dtype=torch.float32)
    text_config = ckpt_io.read_config(models["base"]).text_config
    head, layout = ckpt_io.load_head(trained["out"] / "mtp-trained.safetensors", text_config,
                                     SharedWeights(base.model.embed_tokens, base.lm_head), dtype=torch.float32)
    assert layout == "fused"
    tokenizer = AutoTokenizer.from_pretrained(models["tokenizer"], local_files_only=True)
    data = prepare_windows([SAMPLE_DATA_PATH], tokenizer, context_tokens=24, answer_tokens=40,
                           train_conversations=12, validation_conversations=4, heldout_conversations=4,
                           served_thinking=(False, True))
    metrics = evaluate_head(base, head, data.heldout, draft_steps=2)
    recorded = record["metrics"]["heldout"]["trained"]
    teacher_forced = recorded["teacher_forced"]
    assert metrics.scored_positions == teacher_forced["scored_positions"]
    assert metrics.agreement == pytest.approx(teacher_forced["agreement"], abs=1e-9)
    assert metrics.data_nll == pytest.approx(teacher_forced["data_nll"], rel=1e-6)
    assert metrics.accepted == teacher_forced["accepted"] and metrics.proposed == teacher_forced["proposed"]
    # The headline, from the run's stored self-generated heldout windows of each serving configuration.
    config = load_config(trained["config"])
    assert [s["label"] for s in record["metrics"]["serving"]] == ["greedy", "thinking-general", "thinking-coding", "instruct-general", "instruct-reasoning"]
    facts, stops = BaseFacts(config.model.base), stop_token_ids(tokenizer, config.model.base)
    for serving in config.eval.serving:
        # every continuation of each heldout prompt, rendered in the configuration's thinking mode, one store a seed
        prompts = data.served_windows("heldout", serving.thinking)
        texts = [w for sampling in serving_texts(config, serving) for w in open_store(plan_of(config).setup, facts, stops, sampling).windows(prompts)]
        assert len(texts) == len(prompts) * (1 if serving.greedy else config.eval.sampled_continuations)
        served = served_acceptance(base, head, texts, (1, 2), max_new_tokens=40, serving=serving)
        for k, figures in served.items():
            # greedy: integer counts; sampled: expected counts; and the figures made from them
            written = dict(recorded["serving"][serving.label()]["served"][str(k)])
            assert len(written.pop("per_context")["contexts"]) == len(prompts)
            assert figures.to_dict() == written, (serving.label(), k)
    comparison = record["metrics"]["comparison"]
    assert comparison["allow_worse"] and comparison["written"] and comparison["serving"] == "greedy"
    assert set(comparison["steps"]) == {"1", "2"}
    for check in record["metrics"]["decoder_check"]["trained"].values():  # the reference decoder agrees with the replay
        assert check["counts_equal"] and check["decisions_equal"] == check["decisions"] > 0 and check["texts_equal_to_store"] == 2


def test_training_refuses_to_overwrite_and_export_refuses_foreign_tensors(trained, models, tmp_path):
    result = run(["train.py", "--config", str(trained["config"])])
    assert result.returncode == 2 and "--resume" in result.stderr
    result = run(["export.py", "--config", str(trained["config"]), "train.lr=0.5"])
    assert result.returncode == 2 and "different model/data/train settings" in result.stderr


def kill_after_first_checkpoint(process: subprocess.Popen, output: Path) -> list[Path]:
    """Kill the training `process` (its whole process group) once `output` holds a checkpoint;
    the checkpoints written, asserting that there is one and that the run had not finished."""
    checkpoints = output / "checkpoints"
    deadline = time.time() + 300
    while time.time() < deadline and not list(checkpoints.glob("step-*.pt")) and process.poll() is None:
        time.sleep(0.01)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert not (output / "train-summary.json").exists(), "the run finished before it could be killed"
    done = sorted(checkpoints.glob("step-*.pt"))
    assert done, "no checkpoint was written before the kill"
    return done


def test_resume_after_kill_gives_identical_head(models, tmp_path):
    steps = {"epochs": 4, "checkpoint_every_steps": 2}
    reference = write_config(tmp_path / "ref.yaml", models, tmp_path / "ref", **steps)
    ok(run(["train.py", "--config", str(reference)]))

    killed = write_config(tmp_path / "killed.yaml", models, tmp_path / "killed", **steps)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    process = subprocess.Popen([sys.executable, "train.py", "--config", str(killed)], cwd=REPO, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    done = kill_after_first_checkpoint(process, tmp_path / "killed")
    total_steps = 4 * 6  # 12 windows at 2 a step, 4 epochs
    assert int(done[-1].stem.split("-")[1]) < total_steps

    ok(run(["train.py", "--config", str(killed), "--resume"]))
    a = load_file(tmp_path / "ref" / "trained-tensors.safetensors")
    b = load_file(tmp_path / "killed" / "trained-tensors.safetensors")
    assert set(a) == set(b)
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs after resume"


TWO_PROCESS_STEPS = {"epochs": 4, "checkpoint_every_steps": 2, "select_every_steps": 3}
# The base's continuations of the 19 contexts in 7 batches: a sharded base's processes take one each
# in turn, the last round's second process idle. 11 train windows, 2 a step: each epoch's last step
# holds one window, and the second process none (`loop.process_share`).
TWO_PROCESS_DATA = {"self_generate_batch_size": 3, "train_conversations": 11}


def free_port() -> int:
    """A free port for the rendezvous, not torchrun's fixed 29500, which another run on the machine may hold."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch(args: list[str], launcher: list[str], background: bool = False):
    """`accelerate launch` (torchrun underneath) of a project command; without a GPU (hidden here, so that
    a machine with one GPU runs the same test) the Accelerator runs the processes over gloo."""
    command = ["-m", "accelerate.commands.launch", *launcher, "--main_process_port", str(free_port()), *args]
    if not background:
        return run(command, env={"CUDA_VISIBLE_DEVICES": ""})
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", CUDA_VISIBLE_DEVICES="")
    return subprocess.Popen([sys.executable, *command], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


PLAIN_TWO = ["--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
def accelerate_config(name: str) -> list[str]:
    return ["--config_file", str(REPO / "configs" / "accelerate" / name)]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory, models):
    """A plain 2-process CPU run (each process holds the base), exported."""
    root = tmp_path_factory.mktemp("ddp")
    config = write_config(root / "ddp.yaml", models, root / "ddp", data=TWO_PROCESS_DATA, **TWO_PROCESS_STEPS)
    ok(launch(["train.py", "--config", str(config)], PLAIN_TWO))
    ok(run(["export.py", "--config", str(config), "--allow-worse"]))
    return root / "ddp"


def test_two_process_cpu_run(two_processes):
    summary = json.loads((two_processes / "train-summary.json").read_text())
    assert summary["processes"] == 2
    assert summary["steps"] == 24  # 11 windows, 2 a step (one on each process, then one on the first), 4 epochs
    assert summary["train_windows"] == 11
    assert summary["base_placement"] == {"sharded_over": 0, "offload": False, "engine": None}
    tensors = load_file(two_processes / "trained-tensors.safetensors")
    assert set(tensors) == {k[len("mtp."):] for k in TRAINED}


@pytest.mark.parametrize("engine, sharded, exported, whole", [
    ("fsdp2", "fsdp2.yaml", "fsdp2-offload.yaml", True),
    ("deepspeed-zero3", "deepspeed-zero3.yaml", "deepspeed-zero3-offload.yaml", False)])
def test_a_sharded_base_trains_resumes_and_exports_what_the_whole_one_does(models, two_processes, tmp_path, engine, sharded,
                                                                           exported, whole):
    """configs/accelerate/fsdp2.yaml (or deepspeed-zero3.yaml) over 2 processes, then exported by one process
    through fsdp2-offload.yaml (deepspeed-zero3-offload.yaml): the plain 2-process run's head, selection and
    metrics. The FSDP2 run does the whole of it: it writes its own text (the plain run's bytes), is killed
    after its first checkpoint and resumed. The ZeRO-3 run, the suite's slowest launch (a decode step
    gathers every layer), starts from the plain run's text and goes straight through: its stores are the
    plain run's copied, which a run takes as its own (the identity checked), and a resume reads only the
    head's checkpoint and builds the base as a fresh run does."""
    config = write_config(tmp_path / "fsdp.yaml", models, tmp_path / "fsdp", data=TWO_PROCESS_DATA, **TWO_PROCESS_STEPS)
    if whole:
        process = launch(["train.py", "--config", str(config)], accelerate_config(sharded), background=True)
        kill_after_first_checkpoint(process, tmp_path / "fsdp")
        ok(launch(["train.py", "--config", str(config), "--resume"], accelerate_config(sharded)))
    else:
        shutil.copytree(two_processes / "self-generated", tmp_path / "fsdp" / "self-generated")
        ok(launch(["train.py", "--config", str(config)], accelerate_config(sharded)))

    summary = json.loads((tmp_path / "fsdp" / "train-summary.json").read_text())
    assert summary["processes"] == 2 and summary["base_placement"] == {"sharded_over": 2, "offload": False, "engine": engine}
    plain = json.loads((two_processes / "train-summary.json").read_text())
    assert [s["score"] for s in summary["selection"]["history"]] == [s["score"] for s in plain["selection"]["history"]]
    for store in sorted((two_processes / "self-generated").rglob("self-generated.jsonl")):
        twin = tmp_path / "fsdp" / store.relative_to(two_processes)
        assert twin.read_bytes() == store.read_bytes(), f"{twin} differs from the plain run's"
    a = load_file(two_processes / "trained-tensors.safetensors")
    b = load_file(tmp_path / "fsdp" / "trained-tensors.safetensors")
    assert set(a) == set(b)
    for key in a:  # the same arithmetic in the same order: equal, not merely close
        assert torch.equal(a[key], b[key]), f"{key} differs from the plain run's"

    ok(launch(["export.py", "--config", str(config), "--allow-worse"], accelerate_config(exported)))
    mine = json.loads((tmp_path / "fsdp" / "TRAINING.json").read_text())["metrics"]
    theirs = json.loads((two_processes / "TRAINING.json").read_text())["metrics"]
    assert without_timings(mine) == without_timings(theirs)


def test_a_zero2_launch_trains_what_the_plain_one_does(models, two_processes, tmp_path):
    """configs/accelerate/deepspeed-zero2.yaml: ZeRO-2 partitions optimizer states and gradients, which the
    frozen base has none of, so the base stays whole in each process and the run is the plain one."""
    config = write_config(tmp_path / "zero2.yaml", models, tmp_path / "zero2", data=TWO_PROCESS_DATA, **TWO_PROCESS_STEPS)
    ok(launch(["train.py", "--config", str(config)], accelerate_config("deepspeed-zero2.yaml")))
    summary = json.loads((tmp_path / "zero2" / "train-summary.json").read_text())
    assert summary["processes"] == 2 and summary["base_placement"] == {"sharded_over": 0, "offload": False, "engine": None}
    a = load_file(two_processes / "trained-tensors.safetensors")
    b = load_file(tmp_path / "zero2" / "trained-tensors.safetensors")
    assert set(a) == set(b) and all(torch.equal(a[key], b[key]) for key in a)


def without_timings(value):
    """`value` (JSON) without its durations, the one thing two runs of the same arithmetic differ in."""
    if isinstance(value, dict):
        return {k: without_timings(v) for k, v in value.items() if not k.endswith("seconds")}
    if isinstance(value, list):
        return [without_timings(v) for v in value]
    return value


def test_unrolled_training_with_a_widened_trainable_set(models, tmp_path):
    """draft_steps=3 with attention trainable too: runs in bf16 (autocast path), only the named tensors change."""
    config = write_config(
        tmp_path / "mtp3.yaml", models, tmp_path / "mtp3", epochs=1,
        draft_steps=3, step_loss_weights="[0.5, 0.25, 0.25]",
        trainable="[fc, pre_fc_norm_embedding, pre_fc_norm_hidden, layers.0.self_attn]",
    )
    ok(run(["train.py", "--config", str(config), "model.dtype=bfloat16"]))
    ok(run(["export.py", "--config", str(config), "model.dtype=bfloat16", "eval.draft_steps=3", "--allow-worse"]))
    record = json.loads((tmp_path / "mtp3" / "TRAINING.json").read_text())
    attention = {k for k in record["derived"]["trainable_tensors"] if ".self_attn." in k}
    assert attention == {f"mtp.layers.0.self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}
    exported = load_file(tmp_path / "mtp3" / "mtp-trained.safetensors")
    donor = ckpt_io.SafetensorsCheckpoint(models["donor"])
    trained = set(record["derived"]["trainable_tensors"])
    expected_count = sum(exported[k].numel() for k in trained)
    assert record["derived"]["trainable_parameters"] == expected_count
    for key in exported:
        same = torch.equal(exported[key].view(torch.int16), donor.get(key).view(torch.int16))
        assert same != (key in trained), key
    summary = json.loads((tmp_path / "mtp3" / "train-summary.json").read_text())
    assert all(summary["history"][-1][f"scored_step{k}"] > 0 for k in (1, 2, 3))
    assert len(record["metrics"]["heldout"]["trained"]["teacher_forced"]["acceptance"]) == 3
