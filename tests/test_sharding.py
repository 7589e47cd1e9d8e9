"""The frozen base sharded over a launch's processes (FSDP2 or DeepSpeed ZeRO-3,
`occamy_mtp.model.sharding`).

What `accelerate launch --config_file` writes into the environment is read once, by the
command, and a setting that conflicts with the recipe is one line with exit status 2 before
anything is written. A sharded base computes what the whole one computes: the processes gather
each layer for its forward and agree on every decision that sets how many forwards run.
The runs themselves, 2 processes over gloo through accelerate, are in tests/test_end_to_end.py.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch

from occamy_mtp.config import ConfigError
from occamy_mtp.model.sharding import FSDP2 as FSDP2_ENGINE
from occamy_mtp.model.sharding import ZERO3, Sharding, from_launch, local_part

ENGINE_NAMES = {FSDP2_ENGINE: "FSDP2", ZERO3: "DeepSpeed ZeRO-3"}  # as the run's console names them

ROOT = Path(__file__).resolve().parent.parent
ACCELERATE_CONFIGS = ROOT / "configs" / "accelerate"


def launch_environment(config_file: Path) -> tuple[dict, int]:
    """The environment `accelerate launch --config_file FILE` gives its processes, and their number."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(config_file), "train.py"])
    args, defaults, _ = _validate_launch_command(args)
    if args.use_deepspeed:
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)  # as launch_command sets it
        return prepare_deepspeed_cmd_env(args)[1], args.num_processes
    return prepare_multi_gpu_env(args), args.num_processes


@pytest.mark.parametrize("name, sharding, processes", [
    ("fsdp2.yaml", Sharding(), 2),
    ("fsdp2-offload.yaml", Sharding(offload=True), 1),
    ("deepspeed-zero3.yaml", Sharding(engine=ZERO3), 2),
    ("deepspeed-zero3-offload.yaml", Sharding(offload=True, engine=ZERO3), 1),
    ("deepspeed-zero2.yaml", None, 2),  # ZeRO-2 partitions optimizer states and gradients: the base has none
])
def test_the_shipped_accelerate_configs_ask_for_what_the_docs_say(name, sharding, processes):
    environ, launched = launch_environment(ACCELERATE_CONFIGS / name)
    assert from_launch(environ) == sharding
    assert launched == processes


def test_every_shipped_accelerate_config_is_checked():
    tested = {"fsdp2.yaml", "fsdp2-offload.yaml", "deepspeed-zero3.yaml", "deepspeed-zero3-offload.yaml", "deepspeed-zero2.yaml"}
    assert {path.name for path in ACCELERATE_CONFIGS.glob("*.yaml")} == tested


def test_a_plain_launch_leaves_the_base_whole():
    assert from_launch({}) is None
    assert from_launch({"ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_USE_FSDP": "false"}) is None


FSDP2 = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}
DEEPSPEED = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}
CONFLICTS = [
    ({**DEEPSPEED, "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu"},
     r"deepspeed_config.offload_optimizer_device is cpu; .*compiled cpu_adam op. Set it to none"),
    ({**FSDP2, "FSDP_VERSION": "1"}, r"fsdp_config.fsdp_version is 1; .*set fsdp_version: 2"),
    ({**FSDP2, "FSDP_RESHARD_AFTER_FORWARD": "false"}, r"fsdp_reshard_after_forward is false, .*the whole base in every process"),
    ({**FSDP2, "FSDP_ACTIVATION_CHECKPOINTING": "true"}, r"fsdp_activation_checkpointing is true, .*Set it to false"),
    ({**FSDP2, "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4"}, r"gradient_accumulation_steps is 4; .*train.windows_per_step"),
    ({"ACCELERATE_MIXED_PRECISION": "bf16"}, r"mixed_precision is bf16; .*model.dtype .*train.dtype"),
    ({**DEEPSPEED, "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "2"}, r"gradient_accumulation_steps is 2; "),
    ({**DEEPSPEED, "ACCELERATE_DEEPSPEED_ZERO_STAGE": "4"}, r"deepspeed_config.zero_stage is 4; expected 0, 1, 2 or 3"),
    ({**DEEPSPEED, "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "nvme"},
     r"offload_param_device is nvme; .*compiled async_io op"),
    ({**DEEPSPEED, "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2", "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "cpu"},
     r"offload_param_device is cpu with zero_stage 2; .*only at stage 3"),
    ({**DEEPSPEED, "ACCELERATE_GRADIENT_CLIPPING": "1.0"}, r"gradient_clipping is 1.0; .*train.grad_clip_norm"),
]


@pytest.mark.parametrize("settings, message", [
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}, r"offload_optimizer_device is cpu"),
    ({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}, r"bf16.enabled is True; the run config sets the dtypes"),
    ({"zero_optimization": {"stage": 3}, "gradient_accumulation_steps": 8}, r"gradient_accumulation_steps is 8"),
    ({"zero_optimization": {"stage": 3}, "gradient_clipping": 0.5}, r"gradient_clipping is 0.5"),
    ({"zero_optimization": "three"}, r"zero_optimization is 'three'; expected an object"),
    ("[1, 2]", r"expected a JSON object of DeepSpeed settings"),
    ("{\n  \"zero_optimization\": {\n}}}", r"line 3: not JSON"),
])
def test_a_deepspeed_config_file_that_conflicts_with_the_recipe_is_named(tmp_path, settings, message):
    import json

    path = tmp_path / "ds.json"
    path.write_text(settings if isinstance(settings, str) else json.dumps(settings))
    with pytest.raises(ConfigError, match=rf"^{path}: .*{message}"):
        from_launch({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(path)})


def test_a_deepspeed_config_file_is_read_for_the_stage_and_the_offload(tmp_path):
    import json

    path = tmp_path / "ds.json"
    environ = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(path)}
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                                "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True}}}))
    assert from_launch(environ) == Sharding(offload=True, engine=ZERO3)
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    assert from_launch(environ) is None
    with pytest.raises(ConfigError, match=f"deepspeed_config_file {tmp_path / 'missing.json'} cannot be read"):
        from_launch({**environ, "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(tmp_path / "missing.json")})


def test_a_deepspeed_launch_without_deepspeed_installed_says_how_to_install_it(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    with pytest.raises(ConfigError, match=r"DEEPSPEED, but DeepSpeed is not installed: pip install 'occamy-mtp\[deepspeed\]'"):
        from_launch(DEEPSPEED)


@pytest.mark.parametrize("environ, message", CONFLICTS)
def test_a_launch_that_conflicts_with_the_recipe_is_named(environ, message):
    with pytest.raises(ConfigError, match=message):
        from_launch(environ)


@pytest.mark.parametrize("environ, message", [CONFLICTS[0], CONFLICTS[1], CONFLICTS[-1]])
def test_the_train_command_refuses_a_conflicting_launch_at_once_and_writes_nothing(monkeypatch, tmp_path, capsys,
                                                                                    environ, message):
    from occamy_mtp.commands.train import main

    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    output = tmp_path / "run"
    status = main(["--config", str(ROOT / "configs" / "demo.yaml"), f"output.dir={output}"])
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err
    assert err.startswith("error: accelerate config: ") and len(err.strip().splitlines()) == 1
    assert not output.exists()


@pytest.mark.parametrize("command", ["export", "evaluate", "cache"])
def test_a_one_process_command_refuses_a_launch_of_several(monkeypatch, tmp_path, capsys, command):
    from occamy_mtp.__main__ import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    for key, value in FSDP2.items():
        monkeypatch.setenv(key, value)
    extra = ["--out", str(tmp_path / "out"), "--head", str(ROOT / "README.md")] if command == "evaluate" else []
    status = main([command, "--config", str(ROOT / "configs" / "demo.yaml"), f"output.dir={tmp_path / 'run'}", *extra])
    err = capsys.readouterr().err
    assert status == 2 and f"{command} runs in one process, and this launch started 2" in err
    assert not (tmp_path / "run").exists() and not (tmp_path / "out").exists()
    monkeypatch.setenv("RANK", "1")  # the second process refuses too, and leaves the saying to the first
    status = main([command, "--config", str(ROOT / "configs" / "demo.yaml"), f"output.dir={tmp_path / 'run'}", *extra])
    assert status == 2 and capsys.readouterr().err == ""


# ----------------------------------------------------------------------------------
# A sharded base computes what the whole one computes
# ----------------------------------------------------------------------------------


@pytest.fixture
def one_process_group():
    """This process alone as a gloo process group (as `sharding.process_group` makes it), torn down after."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("engine", [FSDP2_ENGINE, ZERO3])
def test_a_base_sharded_in_one_process_computes_what_the_whole_one_computes(single_thread, one_process_group, engine):
    import copy

    from occamy_mtp.base.frozen import FrozenBase, Placement
    from occamy_mtp.base.generate import plain_decode
    from occamy_mtp.model.sharding import placement, shard
    from occamy_mtp.sampling import TextSampling
    from occamy_mtp.targets.base import base_outputs
    from occamy_mtp.testing.checkpoints import random_models, tiny_text_config
    from torch.distributed.tensor import DTensor

    whole, _ = random_models(tiny_text_config(), seed=3)
    whole = whole.float().eval().requires_grad_(False)
    sharded = shard(copy.deepcopy(whole), Sharding(offload=True, engine=engine), torch.device("cpu"))  # offload: nothing to do on a CPU
    if engine == FSDP2_ENGINE:
        assert all(isinstance(p, DTensor) for layer in sharded.model.layers for p in layer.parameters())
        assert not isinstance(sharded.lm_head.weight, DTensor) and not isinstance(sharded.model.embed_tokens.weight, DTensor)
    else:  # partitioned: between forwards a layer's parameters hold nothing, their partitions all of it (one process)
        assert all(p.numel() == 0 and p.ds_tensor.numel() >= p.ds_numel for p in sharded.model.layers.parameters())
        assert [p.ds_tensor.dtype for p in sharded.model.layers.parameters()] == [p.dtype for p in whole.model.layers.parameters()]
        assert not hasattr(sharded.lm_head.weight, "ds_tensor") and sharded.lm_head.weight.numel() > 0
        from deepspeed.comm import comm

        assert comm.cdb.shm_comm_op is None  # no compiled op: gloo's collectives, as FSDP2's
    assert placement(sharded) == {"sharded_over": 1, "offload": False, "engine": engine}
    assert placement(whole) == {"sharded_over": 0, "offload": False, "engine": None}
    opened = FrozenBase(sharded, placement=Placement(**placement(sharded)))  # as FrozenBase.open records it
    assert opened.described() == f"its decoder layers sharded over 1 process ({ENGINE_NAMES[engine]}), on cpu"  # offload means nothing here
    assert FrozenBase.in_memory(whole).fast_paths and not opened.fast_paths
    assert not [name for name in vars(sharded.config) if name.startswith("occamy")]  # nothing tagged onto the config

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (3, 21), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 15:] = 0
    a, b = base_outputs(whole, ids, mask), base_outputs(sharded, ids, mask)
    assert torch.equal(a.hidden, b.hidden) and torch.equal(a.greedy, b.greedy)

    prompts = [ids[0, :5].tolist(), ids[1, :13].tolist(), ids[2, :2].tolist()]
    for sampling, uniforms in [(TextSampling(), None),
                               (TextSampling(temperature=1.0, top_p=0.95, top_k=20, presence_penalty=1.5),
                                [torch.rand(10, generator=generator, dtype=torch.float64) for _ in prompts])]:
        expected = plain_decode(whole, prompts, max_new_tokens=10, eos_token_ids={7}, batch_size=2, sampling=sampling,
                                   uniforms=uniforms)
        assert plain_decode(sharded, prompts, max_new_tokens=10, eos_token_ids={7}, batch_size=2, sampling=sampling,
                               uniforms=uniforms) == expected


AGREEMENT = """
import os, sys, torch, torch.distributed as dist
from occamy_mtp.model.sharding import agreed_min, all_finished, barrier
dist.init_process_group("gloo")
rank = dist.get_rank()
from types import SimpleNamespace
# what the functions read of a base: whether its first decoder layer is sharded; here one as ZeRO-3 leaves
# it, each parameter carrying this process's partition (`ds_tensor`), without DeepSpeed's threads
layer = torch.nn.Linear(4, 4)
layer.weight.ds_tensor = layer.weight.detach()[rank * 2 : rank * 2 + 2]
sharded, whole = (SimpleNamespace(model=SimpleNamespace(layers=[module])) for module in (layer, torch.nn.Linear(4, 4)))
barrier(sharded)
figures = (rank, agreed_min(10 + 5 * rank, sharded), agreed_min(10 + 5 * rank, whole),
           all_finished(rank == 0, sharded), all_finished(rank == 0, whole), all_finished(True, sharded))
with open(f"{sys.argv[1]}/rank-{rank}.txt", "w") as out:  # a file each: the two processes share one stdout
    out.write(" ".join(map(str, figures)))
dist.barrier()  # both are done with the group before either leaves
# Leave without tearing gloo down: in this short script one process's teardown racing the other's (rank 0 holds
# the rendezvous store) aborted a run now and then ("terminate called without an active exception", 2 of about 8
# fresh-clone suites), after both had written their figures. What is tested is above; the exit is not.
os._exit(0)
"""


def test_the_processes_of_a_sharded_base_agree_and_an_unsharded_one_decides_alone(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "agree.py"
    script.write_text(AGREEMENT)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                             str(port), str(script), str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [(tmp_path / f"rank-{rank}.txt").read_text() for rank in (0, 1)]
    # the least batch, and a decode that goes on while rank 1's rows run, when sharded; each its own otherwise
    assert lines == ["0 10 10 False True True", "1 10 15 False False True"]


@pytest.mark.gpu
@pytest.mark.parametrize("engine", [FSDP2_ENGINE, ZERO3])
def test_a_base_held_in_host_memory_computes_on_the_gpu_what_the_resident_one_computes(one_process_group, engine):
    """fsdp2-offload.yaml's (deepspeed-zero3-offload.yaml's) placement on one card: the decoder layers'
    weights in pinned host memory, each copied to the card for its forward; the copy is exact, so are
    the outputs."""
    import copy

    from occamy_mtp.base.frozen import Placement
    from occamy_mtp.base.generate import plain_decode
    from occamy_mtp.model.sharding import placement, shard
    from occamy_mtp.targets.base import base_outputs
    from occamy_mtp.testing.checkpoints import random_models, tiny_text_config

    cuda = torch.device("cuda")
    whole, _ = random_models(tiny_text_config(), seed=3)
    whole = whole.eval().requires_grad_(False)  # bf16, as a run holds it
    held = shard(copy.deepcopy(whole), Sharding(offload=True, engine=engine), cuda)
    whole = whole.to(cuda)
    assert placement(held) == {"sharded_over": 1, "offload": True, "engine": engine}
    assert Placement(**placement(held)).described(cuda) == (f"its decoder layers sharded over 1 process ({ENGINE_NAMES[engine]}), in host memory, "
                               "a layer copied to the card for its forward")
    assert all(local_part(p).device.type == "cpu" and local_part(p).is_pinned() for p in held.model.layers.parameters())
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (3, 33), generator=generator).to(cuda)
    a, b = base_outputs(whole, ids), base_outputs(held, ids)
    assert torch.equal(a.hidden, b.hidden) and torch.equal(a.greedy, b.greedy)
    prompts = [ids[0, :5].tolist(), ids[1, :13].tolist(), ids[2, :2].tolist()]
    assert (plain_decode(held, prompts, max_new_tokens=10, eos_token_ids=set(), batch_size=3)
            == plain_decode(whole, prompts, max_new_tokens=10, eos_token_ids=set(), batch_size=3))


def test_the_loader_shards_each_layer_before_it_reads_the_next(single_thread, one_process_group, tmp_path,
                                                                sample_tokenizer_dir):
    """No process holds the whole base: each decoder layer is placed as soon as it is read, while
    the layers after it are still unread (meta); the result computes what the whole base computes."""
    from occamy_mtp.model import checkpoint as ckpt_io
    from occamy_mtp.model.sharding import shard, shard_layer
    from occamy_mtp.targets.base import base_outputs
    from occamy_mtp.testing.checkpoints import build_tiny_checkpoint

    built = build_tiny_checkpoint(tmp_path / "base", layout="per_expert", multimodal=True, seed=2,
                                  tokenizer_dir=sample_tokenizer_dir)
    whole = ckpt_io.load_base(built.path, dtype=torch.float32)
    seen = []

    def place(layer):
        index = len(seen)
        later = [p for later_layer in loading.model.layers[index + 1:] for p in later_layer.parameters()]
        seen.append(all(p.is_meta for p in later))
        shard_layer(layer, Sharding(), torch.device("cpu"))

    loading = ckpt_io.build_base_model(ckpt_io.read_config(built.path).text_config, torch.float32)
    ckpt = ckpt_io.SafetensorsCheckpoint(built.path)
    ckpt_io.load_base_weights(loading, ckpt, dtype=torch.float32, device="cpu", place_layer=place)
    assert seen == [True] * len(loading.model.layers) and len(seen) > 1
    sharded = shard(loading, Sharding(), torch.device("cpu"))
    ids = torch.randint(0, 1000, (2, 17), generator=torch.Generator().manual_seed(0))
    a, b = base_outputs(whole, ids), base_outputs(sharded, ids)
    assert torch.equal(a.hidden, b.hidden) and torch.equal(a.greedy, b.greedy)


@pytest.mark.parametrize("scheme", ["fp8", "nvfp4"])
def test_a_quantized_base_sharded_computes_what_it_computes_whole(single_thread, one_process_group, tmp_path,
                                                                   sample_tokenizer_dir, scheme):
    """A quantized base placed a layer at a time: FP8 read dequantized (even when asked to keep FP8:
    FSDP2 shards a layer's own tensors), NVFP4 with its inputs still fake-quantized (the hooks run inside
    the sharded layers' forwards), the same outputs as the base loaded whole."""
    from occamy_mtp.model import checkpoint as ckpt_io
    from occamy_mtp.model.fp8_weights import ATTRIBUTE
    from occamy_mtp.model.sharding import shard, shard_layer
    from occamy_mtp.targets.base import base_outputs
    from occamy_mtp.testing.checkpoints import build_tiny_checkpoint
    from occamy_mtp.testing.quantize import write_quantized_copy

    built = build_tiny_checkpoint(tmp_path / "base", layout="per_expert", multimodal=True, seed=4,
                                  tokenizer_dir=sample_tokenizer_dir)
    path = write_quantized_copy(built.path, tmp_path / scheme, scheme, block=(16, 16))
    whole = ckpt_io.load_base(path, dtype=torch.float32, fp8_weights="dequantized")
    loaded = ckpt_io.load_base(path, dtype=torch.float32, fp8_weights="fp8",
                               place_layer=lambda layer: shard_layer(layer, Sharding(), torch.device("cpu")))
    assert not any(hasattr(layer, ATTRIBUTE) for layer in loaded.model.layers)
    sharded = shard(loaded, Sharding(), torch.device("cpu"))
    ids = torch.randint(0, 1000, (2, 17), generator=torch.Generator().manual_seed(1))
    a, b = base_outputs(whole, ids), base_outputs(sharded, ids)
    assert torch.equal(a.hidden, b.hidden) and torch.equal(a.greedy, b.greedy)
