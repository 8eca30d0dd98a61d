"""torchrun support shared by the stages: join the process group, rank/world, barriers, reductions.

Launched by ``torchrun`` (``WORLD_SIZE`` > 1) a stage joins the default process group — NCCL when
CUDA is present (one GPU per local rank), gloo on CPU. A plain launch is a world of one and none of
these calls communicate.
"""

from __future__ import annotations

import atexit
import os

import torch


def init_distributed() -> tuple[int, int, torch.device]:
    """(rank, world size, this rank's device); joins the process group when launched by torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    if world == 1:
        return 0, 1, torch.device("cuda" if cuda else "cpu")
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        if cuda:  # bound to its GPU at once: NCCL need not guess which device the rank uses
            dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        else:
            dist.init_process_group("gloo")
        # left to interpreter shutdown, NCCL warns that its resources may leak
        atexit.register(_leave_process_group)
    return dist.get_rank(), dist.get_world_size(), torch.device(f"cuda:{local}" if cuda else "cpu")


def _leave_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def world_size() -> int:
    """Processes in the job (1 without torchrun)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank_and_world() -> tuple[int, int]:
    """(this process's rank, processes in the job): (0, 1) without torchrun."""
    import torch.distributed as dist

    if world_size() == 1:
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def barrier() -> None:
    """Wait for every rank (no-op in a world of one)."""
    if world_size() > 1:
        import torch.distributed as dist

        dist.barrier()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over ranks in place (no-op in a world of one); returns it. NCCL reduces only
    GPU tensors, so a host tensor (a step's tallies) makes a round trip through the current GPU."""
    if world_size() > 1:
        import torch.distributed as dist

        if tensor.device.type == "cpu" and dist.get_backend() == "nccl":
            on_gpu = tensor.to(torch.device("cuda", torch.cuda.current_device()))
            dist.all_reduce(on_gpu)
            tensor.copy_(on_gpu)
        else:
            dist.all_reduce(tensor)
    return tensor
