"""What ``eyas train`` checks of its drafter options before it reads the target's weights, and ``eyas run`` before its
first stage: that the options' family can build the drafter beside the target (:meth:`eyas.families.Family.validate`),
and that the drafter's training state — weights, gradients, AdamW's moments — fits the device's free memory
(:meth:`eyas.families.Family.training_bytes`). Both read the target's config alone (a GGUF's header, unconverted); an
option only other families read was refused when the options were built (:class:`eyas.train.options.TrainOptions`).
"""

from __future__ import annotations

import torch

from eyas import families
from eyas.errors import EyasError
from eyas.outputs import human_bytes


def check_drafter(options, device: torch.device, world: int = 1) -> None:
    """Refuse ``options`` (``eyas train``'s) whose drafter cannot be built beside ``options.target``, or whose training
    state cannot fit ``device`` (spread over ``world`` processes when --fsdp shards it)."""
    from eyas.target.loading import read_target_config

    family = families.named(options.drafter, "--drafter")
    config = read_target_config(options.target, options.trust_remote_code)
    family.validate(options, config)
    check_memory(family, options, config, device, world if options.fsdp else 1)


def check_memory(family, options, target_config, device: torch.device, shards: int = 1) -> None:
    """Refuse, in one line saying what the drafter needs, what ``device`` has free and what fits, a drafter whose
    training state (:meth:`eyas.families.Family.training_bytes`, over ``shards`` processes) exceeds the free memory."""
    needed = family.training_bytes(options, target_config)
    if needed is None:
        return
    free = free_memory(device)
    if free is None or -(-needed // shards) <= free:
        return
    raise EyasError(f"--drafter {family.name} with these options trains a drafter whose weights, gradients and AdamW "
                    f"states need at least {human_bytes(-(-needed // shards))}{' per process' if shards > 1 else ''}, "
                    f"but {device.type} has {human_bytes(free)} free: {family.fitting(options, target_config, free * shards)}")


def free_memory(device: torch.device) -> int | None:
    """Bytes free on ``device``: a GPU's as CUDA reports them, on the CPU the RAM that can be allocated without
    swapping (:func:`eyas.outputs.available_ram`); None when the system does not say."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    from eyas.outputs import available_ram

    return available_ram()


def training_device() -> torch.device:
    """The device a plain (not torchrun) ``eyas train`` trains on: :func:`eyas.distributed.init_distributed`'s."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
