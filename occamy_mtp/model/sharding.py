"""The frozen base spread over the processes of a launch (FSDP2), or held in host memory.

Training hands accelerate the head alone: its 8.4M trainable parameters are replicated (DDP),
and its checkpoints are plain tensors whatever the launch. What fills a card is the frozen
base, 64.6 GiB in bf16 at full size. `accelerate launch --config_file
configs/accelerate/fsdp2*.yaml` asks for FSDP version 2 (`from_launch` reads what the launcher
put in the environment); the library then shards the base's decoder layers over the processes
(`shard`: torch's `fully_shard`, one decoder layer a unit, gathered for its forward and
resharded after it), and with `fsdp_offload_params` keeps each process's shard in pinned host
memory, copied to the card a layer at a time. The token embedding, the final norm and lm_head
stay whole in every process: the head borrows the embedding and lm_head, and they are 4% of
the base.

A sharded base's forward is collective: every process must run every forward, in the same
order. So wherever the library decides how many forwards run from something a process sees
alone (the memory free on its card, where its rows stop), the processes agree first
(`agreed_min`, `all_finished`), and self-generation gives each process a batch in turn (the main
one writes the store; `run.run_windows_together`). Nothing is agreed on for a base that is not sharded, so
every other run computes what it computed before.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from occamy_mtp.config import ConfigError
from occamy_mtp.families import SHARDED

FSDP_CONFIGS = "configs/accelerate/"


@dataclass(frozen=True)
class Sharding:
    """How the frozen base is placed: its decoder layers sharded over the launch's processes,
    and, with `offload`, each process's shard held in host memory."""

    offload: bool = False


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
        raise ConfigError(f"{command} runs in one process, and this launch started {processes}: launch it with "
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
        raise ConfigError("accelerate config: distributed_type DEEPSPEED is not supported: DeepSpeed would prepare the head "
                          "alone and leave the frozen base whole in every process; shard the base with FSDP2 instead "
                          f"({FSDP_CONFIGS}fsdp2.yaml, or fsdp2-offload.yaml to hold it in host memory)")
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
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    process_group(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    offload = CPUOffloadPolicy(pin_memory=True) if sharding.offload and device.type == "cuda" else OffloadPolicy()
    fully_shard(layer, mesh=mesh, reshard_after_forward=True, offload_policy=offload)


def shard(base, sharding: Sharding, device: torch.device):
    """`base` (frozen, eval mode) with each decoder layer sharded (`shard_layer`; the loader shards
    each as it reads it, `checkpoint.load_base`'s `place_layer`, and those are left as they are)
    and everything else moved to `device` whole. Marks the config (`families.SHARDED`), so that
    the fast paths, which read weights directly, stand aside."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    layers = base.model.layers
    for layer in layers:
        if not isinstance(layer, FSDPModule):
            shard_layer(layer, sharding, device)
    placed = {id(t) for layer in layers for t in (*layer.parameters(), *layer.buffers())}
    for module in base.modules():  # the rest (embedding, final norm, lm_head, rotary tables) whole on the device
        for name, param in module.named_parameters(recurse=False):
            if id(param) not in placed and param.device != device:
                param.data = param.data.to(device)
        for name, buffer in module.named_buffers(recurse=False):
            if id(buffer) not in placed and buffer.device != device:
                module._buffers[name] = buffer.to(device)
    setattr(base.config, SHARDED, dist.get_world_size())
    return base


def shards(model) -> int:
    """Over how many processes `model`'s decoder layers are sharded (`shard`); 0 when not."""
    return int(getattr(getattr(model, "config", None), SHARDED, 0) or 0)


def placement(model) -> dict:
    """Where `model`'s weights are, for a run's record: {"sharded_over": processes (0: whole),
    "offload": whether its decoder layers' shards are in host memory while it computes elsewhere}."""
    processes = shards(model)
    if not processes:
        return {"sharded_over": 0, "offload": False}
    local = next(model.model.layers[0].parameters()).to_local()
    return {"sharded_over": processes, "offload": local.device.type == "cpu" and model.lm_head.weight.device.type != "cpu"}


def described(model) -> str:
    """`placement` in words, for the log."""
    where = placement(model)
    if not where["sharded_over"]:
        return f"whole, on {model.lm_head.weight.device}"
    at = ("in host memory, a layer copied to the card for its forward" if where["offload"]
          else f"on {model.lm_head.weight.device}")
    processes = where["sharded_over"]
    return f"its decoder layers sharded over {processes} process{'es' * (processes != 1)} (FSDP2), {at}"


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
