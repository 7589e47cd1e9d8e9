"""The frozen base spread over the processes of a launch (FSDP2 or DeepSpeed ZeRO-3), or held
in host memory.

Training hands accelerate the head alone: its 8.4M trainable parameters are replicated (DDP),
and its checkpoints are plain tensors whatever the launch. What fills a card is the frozen
base, 64.6 GiB in bf16 at full size. `accelerate launch --config_file
configs/accelerate/fsdp2*.yaml` asks for FSDP version 2, and `deepspeed-zero3*.yaml` for
DeepSpeed's ZeRO stage 3 (`from_launch` reads what the launcher put in the environment); the
library then shards the base's decoder layers over the processes (`shard`: one decoder layer a
unit, gathered for its forward and resharded after it; torch's `fully_shard`, or DeepSpeed's
`zero.Init` partitioning with `zero.GatheredParameters` around the layer's forward), and with
the config's offload keeps each process's shard in host memory, copied to the card a layer at
a time. The token embedding, the final norm and lm_head stay whole in every process: the head
borrows the embedding and lm_head, and they are 4% of the base. ZeRO stages 0-2 partition
optimizer states and gradients, which the frozen base has none of: under them the base is whole
in every process, as under a plain launch.

A sharded base's forward is collective: every process must run every forward, in the same
order. So wherever the library decides how many forwards run from something a process sees
alone (the memory free on its card, where its rows stop), the processes agree first
(`agreed_min`, `all_finished`), and self-generation gives each process a batch in turn (the main
one writes the store; `run.run_windows_together`). Nothing is agreed on for a base that is not sharded, so
every other run computes what it computed before.
"""

from __future__ import annotations

import datetime
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from occamy_mtp.config import ConfigError, OneProcessOnly

FSDP_CONFIGS = "configs/accelerate/"
FSDP2, ZERO3 = "fsdp2", "deepspeed-zero3"
ENGINE_NAMES = {FSDP2: "FSDP2", ZERO3: "DeepSpeed ZeRO-3"}


@dataclass(frozen=True)
class Sharding:
    """How the frozen base is placed: its decoder layers sharded over the launch's processes by
    `engine` (FSDP2 or ZERO3), and, with `offload`, each process's shard held in host memory."""

    offload: bool = False
    engine: str = FSDP2


def _flag(environ: Mapping[str, str], name: str, default: str = "false") -> bool:
    return environ.get(name, default).strip().lower() == "true"


def from_launch(environ: Mapping[str, str], command: str | None = None) -> Sharding | None:
    """The sharding `accelerate launch --config_file FILE` asked for (it writes the file's settings
    into the environment), None for a plain launch; a ConfigError naming the setting when the file
    asks for what the recipe cannot do. Read by the command, before anything loads. `command`:
    the name of a command that runs in one process (export, evaluate, cache), which refuses a
    launch of several."""
    processes = environ.get("WORLD_SIZE", "1").strip() or "1"
    if command is not None and processes != "1":
        raise OneProcessOnly(f"{command} runs in one process, and this launch started {processes}: launch it with "
                          "--num_processes 1 (the base then sits in this process alone: on the card, or in host "
                          f"memory with {FSDP_CONFIGS}fsdp2-offload.yaml)")
    accumulation = environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "1").strip()
    if accumulation not in ("", "1"):
        raise ConfigError(f"accelerate config: gradient_accumulation_steps is {accumulation}; a step's windows are set in "
                          "one place, train.windows_per_step (split over the processes), so leave it at 1")
    precision = environ.get("ACCELERATE_MIXED_PRECISION", "no").strip().lower()
    if precision not in ("", "no"):
        raise ConfigError(f"accelerate config: mixed_precision is {precision}; the run config sets the dtypes (model.dtype "
                          "for the base, train.dtype for the head's forward), so set mixed_precision: no")
    if _flag(environ, "ACCELERATE_USE_DEEPSPEED"):
        if importlib.util.find_spec("deepspeed") is None:
            raise ConfigError("accelerate config: distributed_type DEEPSPEED, but DeepSpeed is not installed: "
                              "pip install 'occamy-mtp[deepspeed]' (no compiled ops are needed)")
        return _deepspeed_from_launch(environ)
    if not _flag(environ, "ACCELERATE_USE_FSDP"):
        return None
    version = environ.get("FSDP_VERSION", "1").strip()
    if version != "2":
        raise ConfigError(f"accelerate config: fsdp_config.fsdp_version is {version}; the base is sharded with FSDP2 "
                          f"(torch's fully_shard): set fsdp_version: 2 ({FSDP_CONFIGS}fsdp2.yaml)")
    if not _flag(environ, "FSDP_RESHARD_AFTER_FORWARD", "true"):
        raise ConfigError("accelerate config: fsdp_config.fsdp_reshard_after_forward is false, which keeps every decoder "
                          "layer gathered after its forward: the whole base in every process. Set it to true")
    if _flag(environ, "FSDP_ACTIVATION_CHECKPOINTING"):
        raise ConfigError("accelerate config: fsdp_config.fsdp_activation_checkpointing is true, but the sharded base runs "
                          "without gradients (nothing to recompute) and the head is not sharded. Set it to false")
    return Sharding(offload=_flag(environ, "FSDP_OFFLOAD_PARAMS"))


def _deepspeed_from_launch(environ: Mapping[str, str]) -> Sharding | None:
    """`from_launch` for `distributed_type: DEEPSPEED`: ZeRO stage 3 shards the base (Sharding with
    engine ZERO3); stages 0-2 leave it whole (None: they partition optimizer states and gradients,
    and the base has none; the head's are 0.1 GB, kept whole under DDP). The settings come from the
    accelerate config's deepspeed_config, or from the DeepSpeed JSON file it names."""
    stage = environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "").strip()
    param_device = environ.get("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "none").strip().lower() or "none"
    optimizer_device = environ.get("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "none").strip().lower() or "none"
    clipping = environ.get("ACCELERATE_GRADIENT_CLIPPING", "none").strip().lower() or "none"
    where = "accelerate config: deepspeed_config."
    path = environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "").strip()
    if path:
        stage, param_device, optimizer_device, clipping = _deepspeed_file(path, stage, param_device, optimizer_device,
                                                                          clipping)
        where = f"{path}: "
    if stage not in ("0", "1", "2", "3"):
        raise ConfigError(f"{where}zero_stage is {stage or 'not set'}; expected 0, 1, 2 or 3 (3 shards the frozen base: "
                          f"{FSDP_CONFIGS}deepspeed-zero3.yaml)")
    if optimizer_device != "none":
        raise ConfigError(f"{where}offload_optimizer_device is {optimizer_device}; the head's optimizer is torch's AdamW "
                          "on 8.4M parameters (0.1 GB of state), which DeepSpeed offloads only with its compiled cpu_adam "
                          "op. Set it to none")
    if param_device not in ("none", "cpu"):
        raise ConfigError(f"{where}offload_param_device is {param_device}; the frozen base is held on the card (none) or "
                          "in host memory (cpu): offloading to NVMe needs DeepSpeed's compiled async_io op")
    if param_device == "cpu" and stage != "3":
        raise ConfigError(f"{where}offload_param_device is cpu with zero_stage {stage}; DeepSpeed offloads parameters "
                          "only at stage 3: set zero_stage: 3")
    if clipping not in ("none", "0", "0.0"):
        raise ConfigError(f"{where}gradient_clipping is {clipping}; the head's gradient norm is clipped in one place, "
                          "train.grad_clip_norm in the run config, so leave it out")
    if stage != "3":
        return None
    return Sharding(offload=param_device == "cpu", engine=ZERO3)


def _deepspeed_file(path: str, stage: str, param_device: str, optimizer_device: str,
                    clipping: str) -> tuple[str, str, str, str]:
    """The settings `_deepspeed_from_launch` checks, read from a DeepSpeed JSON config (accelerate's
    deepspeed_config_file); what the file leaves out keeps the launch's value. Its batch sizes
    ("auto" or numbers) are not read: the run config sets the windows of a step."""
    import json
    from pathlib import Path

    try:
        config = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as err:
        raise ConfigError(f"accelerate config: deepspeed_config_file {path} cannot be read: {err.strerror}") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: line {err.lineno}: not JSON ({err.msg})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: expected a JSON object of DeepSpeed settings")

    def section(name: str) -> dict:
        value = config.get(name) or {}
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: {name} is {value!r}; expected an object")
        return value

    zero = section("zero_optimization")
    for precision in ("fp16", "bf16"):
        if section(precision).get("enabled") in (True, "true", "auto"):
            raise ConfigError(f"{path}: {precision}.enabled is {section(precision)['enabled']}; the run config sets the "
                              "dtypes (model.dtype for the base, train.dtype for the head's forward), so leave it out")
    accumulation = config.get("gradient_accumulation_steps", 1)
    if accumulation not in (1, "1", "auto"):
        raise ConfigError(f"{path}: gradient_accumulation_steps is {accumulation}; a step's windows are set in one place, "
                          "train.windows_per_step (split over the processes), so leave it at 1")
    if "stage" in zero:
        stage = str(zero["stage"])
    param = zero.get("offload_param") or {}
    optimizer = zero.get("offload_optimizer") or {}
    if isinstance(param, dict) and "device" in param:
        param_device = str(param["device"]).lower()
    if isinstance(optimizer, dict) and "device" in optimizer:
        optimizer_device = str(optimizer["device"]).lower()
    if config.get("gradient_clipping") not in (None, "auto"):
        clipping = str(config["gradient_clipping"]).lower()
    return stage, param_device, optimizer_device, clipping


def process_group(device: torch.device) -> None:
    """A process group for the base's collectives: the launch's (accelerate set it up), else one
    of this process alone (one process holding its base in host memory)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(minutes=30))


def shard_layer(layer, sharding: Sharding, device: torch.device) -> None:
    """One decoder layer (frozen, its weights read) sharded over the process group's processes
    (`process_group`): this process keeps its shard, on `device` or, with `sharding.offload` on a
    GPU, in pinned host memory. The layer is gathered for each forward and resharded after it."""
    if sharding.engine == ZERO3:
        _partition_layer(layer, sharding, device)
        return
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    process_group(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    offload = CPUOffloadPolicy(pin_memory=True) if sharding.offload and device.type == "cuda" else OffloadPolicy()
    fully_shard(layer, mesh=mesh, reshard_after_forward=True, offload_policy=offload)


def _partition_layer(layer, sharding: Sharding, device: torch.device) -> None:
    """ZERO3's `shard_layer`: DeepSpeed partitions the layer's parameters over the processes
    (`deepspeed.zero.Init` on the built layer, each tensor keeping its dtype), each process's
    partition on `device` or, with `sharding.offload` on a GPU, in pinned host memory. Hooks
    gather the whole layer before its forward and release it after, even when the forward
    raises (`deepspeed.zero.GatheredParameters`); every process runs the same forwards, so
    every process gathers in the same order."""
    import os

    import deepspeed

    if device.type == "cpu":
        # Without a GPU, DeepSpeed's communication would compile its shared-memory collective (a C++
        # op, about 25 s, into ~/.cache) when it starts; marked unavailable, it uses gloo's, as FSDP2
        # does. DeepSpeed probes its ops' availability once a process and keeps the answer in this dict.
        import deepspeed.ops

        compatible = getattr(deepspeed.ops, "__compatible_ops__", None)
        if isinstance(compatible, dict):
            compatible["deepspeed_shm_comm"] = False
    process_group(device)
    offload = sharding.offload and device.type == "cuda"
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    # DeepSpeed gathers onto the card the launcher's LOCAL_RANK names; a process started alone
    # (`process_group`'s group of one) has none, and is given `device`'s for the call alone.
    alone = "LOCAL_RANK" not in os.environ
    if alone:
        os.environ["LOCAL_RANK"] = str(device.index or 0)
    try:
        deepspeed.zero.Init(module=layer, config_dict_or_path=config, remote_device="cpu" if offload else None,
                            pin_memory=offload, dtype=next(layer.parameters()).dtype)
    finally:
        if alone:
            del os.environ["LOCAL_RANK"]
    weights = list(layer.parameters())

    def gather(module, args):
        gathered = deepspeed.zero.GatheredParameters(weights, modifier_rank=None)
        gathered.__enter__()
        module.__dict__[_GATHERED] = gathered

    def release(module, args, output):
        gathered = module.__dict__.pop(_GATHERED, None)
        if gathered is not None:
            gathered.__exit__(None, None, None)

    layer.register_forward_pre_hook(gather)
    layer.register_forward_hook(release, always_call=True)


_GATHERED = "_occamy_gathered"  # a ZeRO-3 layer's open GatheredParameters, during its forward


def _is_partitioned(tensor) -> bool:
    return hasattr(tensor, "ds_tensor")


def _is_sharded_layer(layer) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(layer, FSDPModule) or any(_is_partitioned(p) for p in layer.parameters())


def local_part(param) -> torch.Tensor:
    """What this process holds of `param`: ZeRO-3's partition, FSDP2's local shard, or the whole
    parameter where it is not sharded."""
    if _is_partitioned(param):
        return param.ds_tensor
    return param.to_local() if hasattr(param, "to_local") else param


def shard(base, sharding: Sharding, device: torch.device):
    """`base` (frozen, eval mode) with each decoder layer sharded (`shard_layer`; the loader shards
    each as it reads it, `checkpoint.open_base`'s `place_layer`, and those are left as they are)
    and everything else moved to `device` whole. The fast paths, which read weights directly,
    stand aside for it (`base.frozen.FrozenBase.fast_paths`)."""
    layers = base.model.layers
    for layer in layers:
        if not _is_sharded_layer(layer):
            shard_layer(layer, sharding, device)
    placed = {id(t) for layer in layers for t in (*layer.parameters(), *layer.buffers())}
    for module in base.modules():  # the rest (embedding, final norm, lm_head, rotary tables) whole on the device
        for name, param in module.named_parameters(recurse=False):
            if id(param) not in placed and param.device != device:
                param.data = param.data.to(device)
        for name, buffer in module.named_buffers(recurse=False):
            if id(buffer) not in placed and buffer.device != device:
                module._buffers[name] = buffer.to(device)
    return base


def shards(model) -> int:
    """Over how many processes `model`'s decoder layers are sharded (`shard`), read from the layers'
    own parameters (FSDP2's sharded modules, ZeRO-3's partitioned parameters); 0 when they are whole."""
    import torch.distributed as dist

    layers = getattr(getattr(model, "model", None), "layers", None)
    if not layers or not _is_sharded_layer(layers[0]):
        return 0
    return dist.get_world_size() if dist.is_initialized() else 1


def placement(model) -> dict:
    """Where `model`'s weights are, for a run's record: {"sharded_over": processes (0: whole),
    "offload": whether its decoder layers' shards are in host memory while it computes elsewhere,
    "engine": what shards them (FSDP2 or ZERO3; None when whole)}."""
    processes = shards(model)
    if not processes:
        return {"sharded_over": 0, "offload": False, "engine": None}
    first = next(model.model.layers[0].parameters())
    local = local_part(first)
    return {"sharded_over": processes, "offload": local.device.type == "cpu" and model.lm_head.weight.device.type != "cpu",
            "engine": ZERO3 if _is_partitioned(first) else FSDP2}


def is_sharded(model) -> bool:
    """Whether `model` is a base `shard` placed (its forward is collective)."""
    return shards(model) > 0


def _collective(model) -> bool:
    import torch.distributed as dist

    return is_sharded(model) and dist.is_initialized() and dist.get_world_size() > 1


def _all_reduce(value: int, op, device: torch.device) -> int:
    import torch.distributed as dist

    if dist.get_backend() == "nccl" and device.type != "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    tensor = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(tensor, op=op)
    return int(tensor.item())


def agreed_min(value: int, model, device: torch.device | None = None) -> int:
    """`value` where `model` is not a sharded base; otherwise the least of every process's `value`
    (a batch size each sized to its own card: the processes must run the same forwards)."""
    if not _collective(model):
        return value
    import torch.distributed as dist

    return _all_reduce(int(value), dist.ReduceOp.MIN, device or torch.device("cpu"))


def all_finished(finished: bool, model, device: torch.device | None = None) -> bool:
    """`finished` where `model` is not a sharded base; otherwise whether every process is finished
    (a decode stops when the last process's rows have stopped)."""
    if not _collective(model):
        return finished
    import torch.distributed as dist

    return _all_reduce(int(bool(finished)), dist.ReduceOp.MIN, device or torch.device("cpu")) == 1


def share(model) -> tuple[int, int]:
    """(this process's rank, the number of processes) among those sharing the sharded `model`;
    (0, 1) for a base that is not sharded, or sharded in one process."""
    if not _collective(model):
        return 0, 1
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


def gathered(value, model) -> list:
    """Every process's `value` (picklable), in rank order, where `model` is sharded over several;
    [value] otherwise."""
    if not _collective(model):
        return [value]
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def barrier(model) -> None:
    """Wait for every process, where `model` is a sharded base."""
    if _collective(model):
        import torch.distributed as dist

        dist.barrier()
