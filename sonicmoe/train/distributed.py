"""Data parallelism for ``sonicmoe train``: one process per GPU (or CPU rank), started by ``torchrun``.

``torchrun --nproc-per-node N -m sonicmoe train ...`` starts N processes with ``WORLD_SIZE``, ``RANK`` and
``LOCAL_RANK`` set. Every rank builds the same model from the seed and draws the same global batch of ``batch_size``
windows from the same generator, then trains on its own ``batch_size / N`` of them (rank r: windows
[r·B/N, (r+1)·B/N)), so a run over N ranks sees the data a one-process run with the same options sees. Gradients are
averaged by ``DistributedDataParallel``; each rank's MoE layers route, and compute their load-balancing and z-losses
over, its own B/N·L tokens (as in any data-parallel MoE training without expert parallelism). Rank 0 alone prints,
writes the log, the plot and the checkpoint; losses and expert loads in the log are over all ranks.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class DataParallel:
    """This process's place in a data-parallel run.

    Attributes:
        rank: global rank in [0, world).
        world: number of processes (ranks).
        backend: the process group's backend (``"nccl"``, or ``"gloo"`` on the CPU and where ranks share a GPU).
        owns_group: whether :func:`setup` created the process group (and :meth:`close` destroys it).
    """

    rank: int
    world: int
    backend: str
    owns_group: bool

    @property
    def main(self) -> bool:
        """Rank 0: the one process that prints and writes files."""
        return self.rank == 0

    def shard(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's rows [rank·B/world, (rank+1)·B/world) of a global batch (B, ...); B must divide by world."""
        b = batch.shape[0] // self.world
        return batch[self.rank * b:(self.rank + 1) * b]

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the ranks (a new tensor; every rank gets it). A collective: all ranks must call it."""
        t = t.clone()
        if self.world > 1:
            dist.all_reduce(t)
        return t

    def gather(self, obj) -> list:
        """The list of every rank's ``obj`` (picklable), in rank order, on every rank. A collective."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def close(self) -> None:
        """Destroy the process group if :func:`setup` created it."""
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()

    def describe(self) -> dict:
        """For the log."""
        return {"world_size": self.world, "backend": self.backend}


SINGLE = DataParallel(rank=0, world=1, backend="none", owns_group=False)
"""A run of one process (no process group)."""


def requested() -> bool:
    """Whether this process was started as one of several (``WORLD_SIZE`` > 1, as ``torchrun`` sets), or joins a
    process group of several that the caller has already initialised."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size() > 1
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def setup(device: torch.device) -> tuple[DataParallel, torch.device]:
    """Join (or create, from torchrun's environment) the default process group; returns this rank's
    :class:`DataParallel` and its device: ``cuda:LOCAL_RANK`` (made current; without ``LOCAL_RANK``, the current
    CUDA device) for a CUDA ``device``, else ``device``.

    The backend is NCCL on CUDA with one GPU per local rank, gloo on the CPU or where local ranks outnumber the GPUs
    (several ranks on one GPU, which NCCL refuses).

    Raises:
        RuntimeError: torch.distributed is not available, or the environment lacks ``RANK`` / ``LOCAL_RANK``.
    """
    if not dist.is_available():
        raise RuntimeError("data-parallel training needs torch.distributed, which this torch build lacks")
    owns = not dist.is_initialized()
    if device.type == "cuda":
        gpus = torch.cuda.device_count()
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        # torchrun's LOCAL_RANK picks the GPU; a caller that made the group without it has made its GPU current
        local_rank = os.environ.get("LOCAL_RANK")
        device = torch.device("cuda", int(local_rank) % gpus if local_rank is not None else torch.cuda.current_device())
        torch.cuda.set_device(device)
        backend = "nccl" if local_world <= gpus else "gloo"
    else:
        backend = "gloo"
    if owns:
        for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            if name not in os.environ:
                raise RuntimeError(f"data-parallel training: {name} is not set; start the ranks with torchrun")
        dist.init_process_group(backend)
    else:
        backend = dist.get_backend()
    return DataParallel(rank=dist.get_rank(), world=dist.get_world_size(), backend=backend, owns_group=owns), device
