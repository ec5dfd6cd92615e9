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



class ExpertSharding:
    """Expert parallelism inside the data-parallel run: each MoE layer's experts split over groups of P consecutive
    ranks (:func:`sonicmoe.expert_parallel.expert_parallel_groups`), each split replicated over the W/P groups.

    :meth:`shard` swaps the model's MoE layers for :class:`~sonicmoe.expert_parallel.ExpertParallelMoE` layers
    holding this rank's slice of the experts; :meth:`wrap` is DDP for the result. The sharded model's parameters
    come in the full model's order, so checkpoints stay those of a one-process run: :meth:`full` gathers the
    expert slices of a state (model or optimizer) and :meth:`local` slices them again. :meth:`clip_grad_norm_`
    clips to the full model's gradient norm. Every method is a collective of the EP group or of the whole world.
    """

    def __init__(self, size: int):
        from sonicmoe.expert_parallel import expert_parallel_groups

        self.size = size
        self.group, self.dp_group = expert_parallel_groups(size)
        self.rank = dist.get_rank(self.group)
        self.sharded: list[bool] = []  # per parameter of the model, in order: an expert weight (split on dim 0)

    def shard(self, model: torch.nn.Module) -> None:
        """Replace every :class:`~sonicmoe.MoE` submodule of ``model`` (the same on every rank) in place."""
        from sonicmoe import MoE
        from sonicmoe.expert_parallel import ExpertParallelMoE

        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, MoE) and not isinstance(child, ExpertParallelMoE):
                    setattr(parent, name, ExpertParallelMoE.from_moe(child, self.group))
        experts = {id(p) for m in model.modules() if isinstance(m, ExpertParallelMoE) for p in m.experts.parameters()}
        self.sharded = [id(p) in experts for p in model.parameters()]

    def wrap(self, model: torch.nn.Module, **ddp_kwargs) -> torch.nn.Module:
        """:func:`~sonicmoe.expert_parallel.expert_parallel_ddp` over the world."""
        from sonicmoe.expert_parallel import expert_parallel_ddp

        return expert_parallel_ddp(model, expert_dp_group=self.dp_group, **ddp_kwargs)

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts)

    def _slice(self, t: torch.Tensor) -> torch.Tensor:
        return t.chunk(self.size)[self.rank].clone()

    def _map(self, fn, model_state: dict, names: list[str], opt_state: dict | None, order: list[int]):
        model_state = {k: fn(v) if k in names else v for k, v in model_state.items()}
        if opt_state is None:
            return model_state, None
        adamw = dict(opt_state["adamw"])
        adamw["state"] = {i: ({k: fn(v) if torch.is_tensor(v) and v.dim() else v for k, v in st.items()}
                              if self.sharded[order[i]] else st) for i, st in adamw["state"].items()}
        masters = opt_state.get("masters")
        if masters is not None:
            masters = [fn(m) if sh else m for m, sh in zip(masters, self.sharded)]
        return model_state, {**opt_state, "adamw": adamw, "masters": masters}

    def full(self, model: torch.nn.Module, model_state: dict, opt_state: dict | None = None,
             order: list[int] | None = None) -> tuple[dict, dict | None]:
        """This rank's model state dict (and optimizer state, whose AdamW indices map to model parameters through
        ``order``) with every expert tensor gathered over the EP group: the full model's."""
        return self._map(self._gather, model_state, self._expert_names(model), opt_state, order or [])

    def local(self, model: torch.nn.Module, model_state: dict, opt_state: dict | None = None,
              order: list[int] | None = None) -> tuple[dict, dict | None]:
        """The inverse of :meth:`full`: a full model's states with this rank's slice of every expert tensor."""
        return self._map(self._slice, model_state, self._expert_names(model), opt_state, order or [])

    def _expert_names(self, model: torch.nn.Module) -> list[str]:
        names = [name for name, _ in model.named_parameters()]
        return [name for name, sh in zip(names, self.sharded) if sh]

    def clip_grad_norm_(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the full model: ``params`` (the model's order, or float32
        masters in it) hold this rank's slice of the expert weights, whose squared norms are summed over the EP
        group. Returns the full model's gradient norm (the same on every rank)."""
        grads = [p.grad for p in params if p.grad is not None]
        device = grads[0].device

        def squares(sharded: bool) -> torch.Tensor:
            gs = [p.grad for p, sh in zip(params, self.sharded) if p.grad is not None and sh == sharded]
            return torch.stack([torch.linalg.vector_norm(g) ** 2 for g in gs]).sum() if gs else \
                torch.zeros((), device=device)

        experts = squares(True)
        dist.all_reduce(experts, group=self.group)
        norm = (squares(False) + experts).sqrt()
        torch._foreach_mul_(grads, (max_norm / (norm + 1e-6)).clamp(max=1.0))
        return norm

    def describe(self) -> dict:
        """For the log."""
        return {"size": self.size, "groups": dist.get_world_size() // self.size}
