"""The training loop: AdamW with warm-up + cosine schedule, clipping, evaluation, checkpoints, metrics.

Host syncs: losses, gradient norms and expert counts stay on the device and are read once per log
interval; the MoE layers are timed (with device syncs) only on the dedicated profiled steps; tokens/s
comes from the other steps, after a few warm-up steps, excluding evaluation and checkpointing.

Started by ``torchrun`` with several processes, the loop trains data-parallel (:mod:`.distributed`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import os
import pickle
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from ..env import interpreting
from . import distributed
from .config import TrainConfig
from .data import VOCAB_SIZE, ByteCorpus
from .distributed import DataParallel
from .model import ModelConfig, MoETransformer
from .profiling import MoEProfiler
from .report import environment, expert_load_summary, peak_memory, plot_losses, write_json

CHECKPOINT = "ckpt.pt"
LOG = "log.json"
PLOT = "loss.png"
CHECKPOINT_FORMAT = 1


def resolve_device(name: str) -> torch.device:
    """``auto`` -> CUDA when available, else CPU. Raises RuntimeError for ``cuda`` without a GPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda, but torch sees no CUDA GPU")
    return torch.device(name)


def check_ranks(cfg, device: torch.device, world: int) -> None:
    """ValueError for a run this device and these ``world`` ranks cannot serve: ``graph_moe`` off CUDA or with
    several ranks; ``expert_parallel`` that does not divide the ranks; token rounding to the nearest multiple of
    ``m_tile`` with fewer than M_tile/2 tokens per expert on average in each rank's batch, or to the lower one with
    fewer than M_tile (most experts would get no token: the MoE layers would train as zeros, while evaluation routes
    by top-k)."""
    tokens = cfg.batch_size * cfg.seq_len // max(world, 1) * cfg.top_k / cfg.experts
    least = {"nearest": cfg.m_tile / 2, "down": cfg.m_tile}.get(cfg.rounding, 0)
    if cfg.routing == "token_rounding" and tokens < least:
        raise ValueError(f"token rounding ({cfg.rounding}) with {tokens:g} tokens per expert on average (batch_size · "
                         f"seq_len / ranks · top_k / experts) rounds most experts' counts to 0 at m_tile={cfg.m_tile}: "
                         f"lower --m-tile (to at most {tokens * cfg.m_tile / least:g}) or raise the batch")
    if cfg.graph_moe and (device.type != "cuda" or world > 1):
        raise ValueError(f"graph_moe needs one process on a CUDA device, got {device.type} with {world} rank(s)")
    if world % cfg.expert_parallel:
        raise ValueError(f"expert_parallel={cfg.expert_parallel} must divide the number of ranks, {world} (start the "
                         f"run with torchrun --nproc-per-node {cfg.expert_parallel} -m sonicmoe train ...)")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """Parameter dtype: ``auto`` -> bfloat16 on CUDA, float32 on CPU; ``amp-bf16`` -> float32 (the forward runs
    under autocast: :func:`autocast_context`)."""
    if name == "auto":
        name = "bfloat16" if device.type == "cuda" else "float32"
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "amp-bf16": torch.float32}[name]


def autocast_context(name: str, device: torch.device):
    """``torch.autocast`` in bfloat16 on ``device`` for ``--dtype amp-bf16`` (the forward passes, training and
    evaluation; the backward and the optimizer run outside it), a no-op context otherwise."""
    if name == "amp-bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def model_config(cfg: TrainConfig) -> ModelConfig:
    """The :class:`ModelConfig` a :class:`TrainConfig` describes (its fields of the same names)."""
    shared = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(ModelConfig) if f.name != "vocab_size"}
    return ModelConfig(vocab_size=VOCAB_SIZE, **shared)


def graph_moe_layers(model: MoETransformer, tokens_shape: tuple[int, int], dtype: torch.dtype) -> None:
    """Each block's MoE layer (``return_router_info=True``) replaced in place by its
    ``torch.cuda.make_graphed_callables`` form: in training mode its forward and backward are CUDA-graph replays
    (the layer's Python and launches gone from the step; eval mode runs the layer as before). One call for all
    layers, so their graphs share a memory pool; the blocks must then run forward in order and backward in reverse,
    as training does.

    Args:
        model: on CUDA, in training mode, parameters of ``dtype``; no hooks on its MoE layers yet.
        tokens_shape: (B, L), the shape of every training batch the layers will see (this rank's).
        dtype: the parameters' dtype (the layers' inputs are of it).

    The capture runs each layer's forward and backward four times on random inputs (``torch.cuda.graphs``'
    warm-up, then the capture); the parameters' ``.grad`` are not touched, and the CUDA generator's state is put
    back afterwards. A replay draws from that generator (graph-safe Philox: each replay advances its offset as the
    eager call would), so stochastic token rounding under ``--graph-moe`` draws what the eager run draws.
    """
    layers = tuple(model.moe_layers())
    device = model.embed.weight.device
    rng = torch.cuda.get_rng_state(device)
    samples = tuple((torch.randn(*tokens_shape, model.cfg.d_model, device=device, dtype=dtype, requires_grad=True),)
                    for _ in layers)
    graphed = torch.cuda.make_graphed_callables(layers, samples)
    torch.cuda.set_rng_state(rng, device)
    for blk, layer in zip(model.blocks, graphed):
        blk.moe = layer


def lr_at(update: int, cfg: TrainConfig) -> float:
    """Learning rate of the ``update``-th optimizer step (0-based): linear warm-up to ``lr`` over
    ``warmup`` steps, then cosine decay to ``min_lr_ratio · lr`` at ``steps``."""
    if update < cfg.warmup:
        return cfg.lr * (update + 1) / cfg.warmup
    progress = min(1.0, (update - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1.0 + math.cos(math.pi * progress))


class Optimizer:
    """AdamW over the model's parameters, with float32 master weights when they are not float32.

    Weight decay applies to the matrices (attention weights, router W_r (E, d), W1 (E, 2n, d),
    W2 (E, d, n)), not to norms, biases (the router's (E,), the experts' b1 (E, 2n) and b2 (E, d)) or the byte
    embedding. With bfloat16 parameters, gradients are copied into float32 masters, AdamW updates the masters and
    the parameters get the rounded result.
    """

    def __init__(self, model: torch.nn.Module, cfg: TrainConfig, device: torch.device,
                 sharding: distributed.ExpertSharding | None = None):
        self.sharding = sharding  # expert parallelism: the gradient norm is the full model's
        named = list(model.named_parameters())
        self.params = [p for _, p in named]
        mixed = any(p.dtype != torch.float32 for p in self.params)
        self.masters = [p.detach().float().clone() for p in self.params] if mixed else None
        owners = self.masters if mixed else self.params
        decayed = [p.dim() >= 2 and not name.startswith("embed") and not name.endswith("bias") for name, p in named]
        decay = [q for q, dec in zip(owners, decayed) if dec]
        keep = [q for q, dec in zip(owners, decayed) if not dec]
        groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": keep, "weight_decay": 0.0}]
        # the model parameter behind each AdamW index (decayed first)
        self.order = [i for i, dec in enumerate(decayed) if dec] + [i for i, dec in enumerate(decayed) if not dec]
        self.adamw = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                       fused=True if device.type == "cuda" else None)

    def step(self, lr: float, max_norm: float) -> torch.Tensor:
        """Clip the gradients to global norm ``max_norm``, take one AdamW step at ``lr``, zero the
        gradients. Returns the global gradient norm before clipping (a device scalar, no sync)."""
        if self.masters is not None:
            for p, m in zip(self.params, self.masters):
                m.grad = None if p.grad is None else p.grad.float()
                p.grad = None
        owners = self.masters if self.masters is not None else self.params
        if self.sharding is not None:
            norm = self.sharding.clip_grad_norm_(owners, max_norm)
        else:
            norm = torch.nn.utils.clip_grad_norm_(owners, max_norm)
        for group in self.adamw.param_groups:
            group["lr"] = lr
        self.adamw.step()
        self.adamw.zero_grad(set_to_none=True)
        if self.masters is not None:
            with torch.no_grad():
                torch._foreach_copy_(self.params, self.masters)
        return norm.detach()

    def state_dict(self) -> dict[str, Any]:
        """AdamW state plus the float32 masters (or ``None``)."""
        return {"adamw": self.adamw.state_dict(), "masters": self.masters}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output. Saved float32 masters restore the parameters too, whether this run
        keeps masters or has float32 parameters (a mixed-precision run resumed in float32 continues from the
        masters, not from their rounded copies). The hyperparameters stay this run's (its config's weight decay and
        betas: AdamW's own load would bring back the saved ones, and a ``--weight-decay`` given on resume was lost);
        the learning rate is set at every step."""
        mine = [{k: g[k] for k in ("weight_decay", "betas", "eps")} for g in self.adamw.param_groups]
        self.adamw.load_state_dict(state["adamw"])
        for g, hyper in zip(self.adamw.param_groups, mine):
            g.update(hyper)
        saved = state.get("masters")
        if saved is None:
            return
        with torch.no_grad():
            if self.masters is None:
                torch._foreach_copy_(self.params, list(saved))
            else:
                torch._foreach_copy_(self.masters, list(saved))
                torch._foreach_copy_(self.params, self.masters)


class Throughput:
    """Tokens and seconds over the measured (unprofiled, post-warm-up) stretches of training."""

    def __init__(self, sync):
        self._sync = sync
        self.tokens = 0
        self.seconds = 0.0
        self._t0: float | None = None
        self._pending = 0

    @property
    def running(self) -> bool:
        """Whether a stretch is being timed."""
        return self._t0 is not None

    def start(self) -> None:
        """Begin a timed stretch (after a device sync)."""
        self._sync()
        self._t0 = time.perf_counter()
        self._pending = 0

    def add(self, tokens: int) -> None:
        """Count a step's tokens in the current stretch."""
        if self._t0 is not None:
            self._pending += tokens

    def stop(self) -> None:
        """End the current stretch, if any (after a device sync)."""
        if self._t0 is None:
            return
        self._sync()
        self.seconds += time.perf_counter() - self._t0
        self.tokens += self._pending
        self._t0 = None

    def rate(self) -> float | None:
        """Tokens per second so far, ``None`` before anything was measured."""
        return self.tokens / self.seconds if self.seconds > 0 else None


class Progress:
    """A tqdm bar when tqdm is installed and wanted, else plain lines printed at log intervals."""

    def __init__(self, total: int, initial: int, enabled: bool, silent: bool = False):
        self.bar = None
        self.silent = silent  # prints nothing at all (data-parallel ranks other than 0)
        if enabled and not silent:
            try:
                from tqdm import tqdm
            except ImportError:
                print("tqdm is not installed: printing log lines instead of a progress bar")
            else:
                self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)

    def update(self) -> None:
        """One step done."""
        if self.bar is not None:
            self.bar.update(1)

    def log(self, step: int, total: int, fields: dict[str, str]) -> None:
        """Show the latest metrics."""
        if self.silent:
            return
        if self.bar is not None:
            self.bar.set_postfix(fields, refresh=False)
        else:
            print(f"step {step:>6}/{total} " + " ".join(f"{k} {v}" for k, v in fields.items()), flush=True)

    def write(self, message: str) -> None:
        """Print a line without breaking the bar."""
        if self.silent:
            return
        if self.bar is not None:
            self.bar.write(message)
        else:
            print(message, flush=True)

    def close(self) -> None:
        """Finish the bar."""
        if self.bar is not None:
            self.bar.close()


@torch.no_grad()
def evaluate(model: MoETransformer, corpus: ByteCorpus, cfg: TrainConfig, device: torch.device,
             dp: DataParallel = distributed.SINGLE, lockstep: bool = False) -> float:
    """Mean cross-entropy (nats/byte) on the fixed validation windows, in eval mode (plain top-k). Data-parallel:
    rank r evaluates the batches b with b mod world = r, and the sum is taken over the ranks (a collective). With
    ``lockstep`` (expert parallelism: every forward is a collective) every rank runs ceil(batches / world) forwards,
    a rank without a batch of its own for one running batch 0 and dropping its loss."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), device=device)
    batches = list(corpus.val_batches(cfg.batch_size, cfg.seq_len, cfg.eval_batches, device))
    mine = range(dp.rank, len(batches), dp.world)
    with autocast_context(cfg.dtype, device):
        for b in mine:
            total += model(*batches[b])
        for _ in range(-(-len(batches) // dp.world) - len(mine) if lockstep else 0):
            model(*batches[0])  # the last round's collectives, without a batch of this rank's
    model.train(was_training)
    return float(dp.sum(total)) / cfg.eval_batches


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Read a checkpoint written by :func:`train` (tensors and plain containers only; CPU tensors).

    Raises:
        FileNotFoundError: no such file. ValueError: not a sonicmoe training checkpoint.
    """
    if not Path(path).is_file():
        raise FileNotFoundError(f"{path}: no such checkpoint file")
    try:
        state = torch.load(Path(path), map_location="cpu", weights_only=True)
    except (RuntimeError, pickle.UnpicklingError, EOFError) as exc:  # not a torch.save file, or not tensors only
        raise ValueError(f"{path} is not a sonicmoe train checkpoint (torch.load failed: {type(exc).__name__})") \
            from exc
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path} is not a sonicmoe train checkpoint (format {CHECKPOINT_FORMAT})")
    return state


def check_resume_corpus(checkpoint: dict[str, Any], digest: str) -> None:
    """ValueError unless the corpus (its :meth:`ByteCorpus.digest`) is the one ``checkpoint`` trained on (a
    checkpoint from before session 89, without a digest, passes)."""
    saved = checkpoint.get("corpus_sha256")
    if saved is not None and saved != digest:
        raise ValueError(f"the corpus (SHA-256 {digest[:12]}) differs from the one the checkpoint trained on "
                         f"({saved[:12]}): a resumed run needs the same bytes (the same --data, --max-bytes and "
                         "--val-fraction; for the default corpus, the same Python's standard library)")


def seed_rank_stream(seed: int, rank: int, device: torch.device) -> None:
    """Give data-parallel rank ``rank`` a random stream of its own, once the ranks have built the same model from
    ``seed``: the generator stochastic token rounding draws its per-expert uniforms from (``device``'s CUDA
    generator, or the CPU's) is reseeded on every rank but rank 0, which keeps the one-process run's stream.

    Each rank rounds its own tokens' counts (SPEC: token rounding, stochastic subroutine); with one stream on every
    rank the ranks drew the same uniforms and padded or dropped the same experts' tiles together, so the errors of
    the global counts added up instead of averaging out. Rank r's seed is ``seed + r * 0x9E3779B9`` mod 2**32 (the
    CPU generator keeps only a seed's low 32 bits): apart for every rank below 2**32, and far from a small ``seed``
    of another run."""
    if rank == 0:
        return
    derived = (seed + rank * 0x9E3779B9) % 2 ** 32
    if device.type == "cuda":
        torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()] \
            .manual_seed(derived)
    else:
        torch.random.default_generator.manual_seed(derived)


def _save_checkpoint(path: Path, *, cfg: TrainConfig, step: int, model: torch.nn.Module, opt: Optimizer,
                     generator: torch.Generator, history: dict[str, Any], dp: DataParallel,
                     device: torch.device, corpus_sha256: str) -> None:
    """Rank 0 writes ``path``; every rank must call it (data-parallel: each rank's CPU and CUDA generator states
    are gathered, as ``rng["torch_ranks"]`` and ``rng["cuda_ranks"]``; expert-parallel: the expert weights and their
    optimizer state are gathered, so the checkpoint is a one-process run's)."""
    model_state, opt_state = model.state_dict(), opt.state_dict()
    if opt.sharding is not None:
        model_state, opt_state = opt.sharding.full(model, model_state, opt_state, opt.order)
    rng = {"torch": torch.get_rng_state(), "data": generator.get_state()}
    if dp.world > 1:  # the CPU generator too: each rank's own since seed_rank_stream
        rng["torch_ranks"] = dp.gather(torch.get_rng_state())
    if dp.world > 1 and device.type == "cuda":
        rng["cuda_ranks"] = [s.cpu() for s in dp.gather(torch.cuda.get_rng_state(device))]
    elif torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    if not dp.main:
        return
    state = {"format": CHECKPOINT_FORMAT, "step": step, "config": cfg.to_dict(), "model": model_state,
             "optimizer": opt_state, "rng": rng, "history": history, "corpus_sha256": corpus_sha256}
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def _fmt_rate(tokens_per_s: float | None) -> str:
    if tokens_per_s is None:
        return "-"
    return f"{tokens_per_s / 1e3:.1f}k" if tokens_per_s < 1e6 else f"{tokens_per_s / 1e6:.2f}M"


def train(cfg: TrainConfig, checkpoint: dict[str, Any] | None = None,
          corpus: ByteCorpus | None = None) -> dict[str, Any]:
    """Train the MoE language model ``cfg`` describes; write ``log.json``, ``loss.png`` and ``ckpt.pt``
    into ``cfg.out`` and return the log.

    Args:
        cfg: the run (``cfg.out`` must be set; ``cfg.resume`` names a checkpoint to continue from).
        checkpoint: that checkpoint already read with :func:`load_checkpoint` (read here otherwise).
        corpus: ``cfg``'s corpus already read with ``ByteCorpus.load`` (read here otherwise).

    Each step: a batch of B = ``batch_size`` windows of L = ``seq_len`` bytes (T = B·L tokens per MoE
    layer), loss = LM cross-entropy + Σ layers (aux_loss + z_loss), backward, AdamW step. The same
    seed gives the same losses on CPU, and a resumed run continues exactly as an uninterrupted one.
    Started as one of several processes by ``torchrun`` (``WORLD_SIZE`` > 1), it trains data-parallel:
    ``batch_size`` stays the global batch, each rank trains on its ``batch_size / ranks`` windows of it, and rank 0
    writes the files (:mod:`sonicmoe.train.distributed`); ValueError if ``batch_size`` does not divide.
    ``torch.use_deterministic_algorithms`` is set for the run (per ``cfg.deterministic``) and restored.
    """
    cfg.validate()
    device = resolve_device(cfg.device)
    dp = distributed.SINGLE
    if distributed.requested():
        dp, device = distributed.setup(device)
        if cfg.batch_size % dp.world:
            dp.close()
            raise ValueError(f"batch_size={cfg.batch_size} must be a multiple of the {dp.world} data-parallel "
                             "ranks (it is the global batch; each rank trains on batch_size / ranks windows)")
    try:
        check_ranks(cfg, device, dp.world)
    except ValueError:
        dp.close()
        raise
    deterministic = cfg.deterministic if cfg.deterministic is not None else device.type == "cpu"
    previous = (torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    try:
        return _train(cfg, checkpoint, device, dp, corpus)
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])
        dp.close()


def _train(cfg: TrainConfig, checkpoint: dict[str, Any] | None, device: torch.device,
           dp: DataParallel, corpus: ByteCorpus | None) -> dict[str, Any]:
    if cfg.out is None:
        raise ValueError("cfg.out (the output directory) must be set")
    wall_t0 = time.perf_counter()
    dtype = resolve_dtype(cfg.dtype, device)
    if checkpoint is None and cfg.resume:
        checkpoint = load_checkpoint(cfg.resume)
    out = Path(cfg.out)
    if dp.main:
        out.mkdir(parents=True, exist_ok=True)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")
        torch.cuda.reset_peak_memory_stats(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    if corpus is None:
        corpus = ByteCorpus.load(cfg.data, cfg.max_bytes, cfg.val_fraction)
    corpus.check_seq_len(cfg.seq_len)
    corpus_sha256 = corpus.digest
    if checkpoint is not None:
        check_resume_corpus(checkpoint, corpus_sha256)
    torch.manual_seed(cfg.seed)
    model = MoETransformer(model_config(cfg)).to(device=device, dtype=dtype)
    if checkpoint is not None:  # the full model (before expert parallelism slices it)
        model.load_state_dict(checkpoint["model"])
    params = model.num_params()
    if cfg.graph_moe:  # before any hook (the profiler's) is registered on the layers (check_ranks: CUDA, one rank)
        graph_moe_layers(model, (cfg.batch_size, cfg.seq_len), dtype)
    forward = model  # what the training steps call: DistributedDataParallel around the model with several ranks
    sharding = None
    device_ids = [device.index] if device.type == "cuda" else None
    if cfg.expert_parallel > 1:
        sharding = distributed.ExpertSharding(cfg.expert_parallel)
        sharding.shard(model)
        forward = sharding.wrap(model, device_ids=device_ids)
    elif dp.world > 1:
        from torch.nn.parallel import DistributedDataParallel

        forward = DistributedDataParallel(model, device_ids=device_ids)
    opt = Optimizer(model, cfg, device, sharding)
    generator = torch.Generator().manual_seed(cfg.seed)
    tokens_per_step = cfg.batch_size * cfg.seq_len  # over all ranks
    if device.type == "cpu" and cfg.backend == "triton" and not interpreting():
        warnings.warn("--backend triton on CPU needs TRITON_INTERPRET=1 (slow); use --backend torch",
                      stacklevel=2)

    history: dict[str, Any] = {"steps": [], "evals": [], "profile": [],
                               "expert_counts": [[0] * cfg.experts for _ in range(cfg.layers)]}
    start_step = 0
    if checkpoint is not None:
        opt_state = checkpoint["optimizer"]
        if device.type == "cpu":  # AdamW keeps the tensors already on the parameters' device and dtype: the
            opt_state = copy.deepcopy(opt_state)  # checkpoint's own on the CPU, which its steps would overwrite
        if opt.masters is not None and opt_state.get("masters") is None:
            # a float32 checkpoint resumed with low-precision parameters: the masters from its float32 weights, not
            # from their rounded copies
            names = [name for name, _ in model.named_parameters()]
            opt_state = {**opt_state, "masters": [checkpoint["model"][name].float() for name in names]}
        if sharding is not None:
            _, opt_state = sharding.local(model, {}, opt_state, opt.order)
        opt.load_state_dict(opt_state)
        generator.set_state(checkpoint["rng"]["data"])
        torch_ranks = checkpoint["rng"].get("torch_ranks")
        if dp.world > 1 and torch_ranks is not None and len(torch_ranks) == dp.world:
            torch.set_rng_state(torch_ranks[dp.rank])
        else:
            torch.set_rng_state(checkpoint["rng"]["torch"])
        cuda_ranks = checkpoint["rng"].get("cuda_ranks")
        if device.type == "cuda" and dp.world > 1 and cuda_ranks is not None and len(cuda_ranks) == dp.world:
            torch.cuda.set_rng_state(cuda_ranks[dp.rank], device)
        elif device.type == "cuda" and dp.world == 1 and "cuda" in checkpoint["rng"]:
            # one state per GPU the saving process saw: as many as this one sees (set_rng_state_all would index past)
            for i, state in enumerate(checkpoint["rng"]["cuda"][:torch.cuda.device_count()]):
                torch.cuda.set_rng_state(state, i)
        start_step = int(checkpoint["step"])
        history = copy.deepcopy(checkpoint["history"])  # appended to below: the caller's checkpoint stays as it was
    elif dp.world > 1:
        seed_rank_stream(cfg.seed, dp.rank, device)
    end_step = min(cfg.steps, cfg.stop_after) if cfg.stop_after else cfg.steps
    if end_step < start_step or (checkpoint is not None and end_step == start_step):
        # a finished run resumed again would rewrite its log.json with an empty throughput meter
        raise ValueError(f"the checkpoint is at step {start_step}, "
                         f"{'past' if end_step < start_step else 'at'} this run's end (steps={cfg.steps}, "
                         f"stop_after={cfg.stop_after}): nothing to train")

    layers = model.moe_layers()
    profiler = MoEProfiler(layers, device)
    # this rank's routed pairs per layer and expert (rank 0's start from the checkpoint's totals); summed over the
    # ranks for the log
    load = torch.tensor(history["expert_counts"], dtype=torch.int64, device=device)
    # and each step's counts sorted in descending order, summed over the steps (the typical step's load curve, which
    # is more uneven than the summed load's: busy experts change from step to step); a checkpoint written before
    # this was logged starts it at zero
    zeros = [[0] * cfg.experts for _ in range(cfg.layers)]
    step_sorted = torch.tensor(history.setdefault("expert_counts_step_sorted", zeros), dtype=torch.int64,
                               device=device)
    if not dp.main:
        load.zero_()
        step_sorted.zero_()
    meter = Throughput(sync)
    warm_steps = min(5, max(0, (end_step - start_step) // 5))
    title = (f"d={cfg.d_model} L={cfg.layers} E={cfg.experts} K={cfg.top_k} n={cfg.expert_size} "
             f"T={tokens_per_step // dp.world}{f' x {dp.world} ranks' if dp.world > 1 else ''} | "
             f"{device.type} {str(dtype).replace('torch.', '')}"
             f"{' (autocast bfloat16)' if cfg.dtype == 'amp-bf16' else ''} | {cfg.routing}")
    progress = Progress(cfg.steps, start_step, cfg.progress, silent=not dp.main)
    progress.write(f"sonicmoe train: {title}; {params['total'] / 1e6:.2f}M params "
                   f"({params['active'] / 1e6:.2f}M active); data {corpus.source} ({corpus.num_files} files, "
                   f"{corpus.train.numel()} train / {corpus.val.numel()} val bytes); out {out}")

    def record_eval(step: int) -> None:
        meter.stop()
        val = evaluate(model, corpus, cfg, device, dp, lockstep=sharding is not None)
        history["evals"].append({"step": step, "val_loss": val, "val_bpb": val / math.log(2)})
        progress.write(f"step {step}: val loss {val:.4f} ({val / math.log(2):.3f} bits/byte)")

    def build_log(step: int) -> dict[str, Any]:
        profile = history["profile"]
        moe_s = sum(p["moe_forward_s"] + p["moe_backward_s"] for p in profile)
        step_s = sum(p["step_s"] for p in profile)
        tail = history["steps"][-cfg.log_every:]
        return {
            "config": cfg.to_dict(),
            "env": environment(device),
            "model": {"params": params, "dtype": str(dtype).replace("torch.", ""),
                      "autocast": "bfloat16" if cfg.dtype == "amp-bf16" else None,
                      "tokens_per_step": tokens_per_step},
            "data_parallel": {**dp.describe(), "tokens_per_rank": tokens_per_step // dp.world},
            "expert_parallel": sharding.describe() if sharding is not None else None,
            "data": {"source": corpus.source, "files": corpus.num_files, "train_bytes": corpus.train.numel(),
                     "val_bytes": corpus.val.numel(), "sha256": corpus_sha256},
            "steps_done": step,
            "resumed_from": start_step if checkpoint is not None else None,
            "steps": history["steps"],
            "evals": history["evals"],
            "profile": profile,
            "final_train_loss": sum(s["loss"] for s in tail) / len(tail) if tail else None,
            "first_nonfinite_step": history.get("first_nonfinite_step"),
            "final_val_loss": history["evals"][-1]["val_loss"] if history["evals"] else None,
            "final_val_bpb": history["evals"][-1]["val_bpb"] if history["evals"] else None,
            "tokens_per_s": meter.rate(),
            "throughput": {"tokens": meter.tokens, "seconds": meter.seconds,
                           "note": "the unprofiled steps after warm-up, timed by rank 0, tokens of all ranks; no "
                                   "eval/checkpoint time"},
            "moe_time_share": moe_s / step_s if step_s > 0 else None,
            "moe_time": {"profiled_steps": len(profile), "moe_s": moe_s, "step_s": step_s},
            "peak_memory": peak_memory(device),
            "expert_load": expert_load_summary(history["expert_counts"], history["expert_counts_step_sorted"]),
            "wall_time_s": time.perf_counter() - wall_t0,
        }

    def flush(pending: list) -> None:
        if not pending:
            return
        values = torch.stack([torch.stack([a.float(), b.float(), c.float()]) for _, _, a, b, c in pending])
        values = dp.sum(values) / dp.world  # the ranks' mean (the gradient norm is the same on every rank)
        for (step, lr, _, _, _), (loss, aux, gnorm) in zip(pending, values.tolist()):
            history["steps"].append({"step": step, "loss": loss, "router_loss": aux, "lr": lr,
                                     "grad_norm": gnorm})
            if not math.isfinite(loss + aux) and history.get("first_nonfinite_step") is None:
                history["first_nonfinite_step"] = step
                if dp.main:
                    print(f"warning: the training loss is {loss} (router loss {aux}) at step {step}: the run has "
                          "diverged (lower --lr, raise --warmup, or use --grad-clip)", file=sys.stderr, flush=True)
        pending.clear()
        history["expert_counts"] = dp.sum(load).tolist()
        history["expert_counts_step_sorted"] = dp.sum(step_sorted).tolist()

    if start_step == 0 and cfg.eval_every:
        record_eval(0)
    model.train()
    pending: list = []
    last_log = (time.perf_counter(), start_step)
    for step in range(start_step + 1, end_step + 1):
        profiled = bool(cfg.profile_every) and step % cfg.profile_every == 0
        measured = not profiled and step > start_step + warm_steps
        if measured and not meter.running:
            meter.start()
        elif not measured:
            meter.stop()
        if profiled:
            sync()
            t0 = time.perf_counter()
            profiler.reset()
            profiler.active = True

        x, y = corpus.train_batch(cfg.batch_size, cfg.seq_len, generator, device)
        x, y = dp.shard(x), dp.shard(y)  # this rank's windows of the global batch
        lr = lr_at(step - 1, cfg)
        with autocast_context(cfg.dtype, device):
            loss = forward(x, y)
            aux = model.router_loss()
        (loss + aux).backward()
        counts = model.expert_counts()  # as the layers returned them (graphed layers leave their attributes)
        load += counts.to(torch.int64)
        step_sorted += counts.to(torch.int64).sort(dim=1, descending=True).values  # on the device: no host sync
        gnorm = opt.step(lr, cfg.grad_clip)
        if cfg.bias_update_rate:  # auxiliary-loss-free balancing: every rank's counts, the same update everywhere
            counts = dp.sum(counts.float())
            for m, c in zip(layers, counts):
                m.update_expert_bias(cfg.bias_update_rate, counts=c)
        pending.append((step, lr, loss.detach(), aux.detach(), gnorm))

        if profiled:
            profiler.active = False
            sync()
            step_s = time.perf_counter() - t0
            moe_s = profiler.forward_s + profiler.backward_s
            history["profile"].append({"step": step, "step_s": step_s, "moe_forward_s": profiler.forward_s,
                                       "moe_backward_s": profiler.backward_s, "moe_share": moe_s / step_s})
        if measured:
            meter.add(tokens_per_step)
        progress.update()

        is_last = step == end_step
        if step % cfg.log_every == 0 or is_last:
            meter.stop()
            flush(pending)
            now = time.perf_counter()
            rate = (step - last_log[1]) * tokens_per_step / max(now - last_log[0], 1e-9)
            last_log = (now, step)
            s = history["steps"][-1]
            fields = {"loss": f"{s['loss']:.3f}", "lr": f"{s['lr']:.2e}", "tok/s": _fmt_rate(rate)}
            if history["profile"]:
                fields["moe%"] = f"{100 * history['profile'][-1]['moe_share']:.0f}"
            progress.log(step, cfg.steps, fields)
        do_eval = (cfg.eval_every and step % cfg.eval_every == 0) or is_last
        do_save = (cfg.save_every and step % cfg.save_every == 0) or is_last
        if do_eval:
            flush(pending)
            record_eval(step)
        if do_save:
            meter.stop()
            flush(pending)
            _save_checkpoint(out / CHECKPOINT, cfg=cfg, step=step, model=model, opt=opt, generator=generator,
                             history=history, dp=dp, device=device, corpus_sha256=corpus_sha256)
            if dp.main:
                write_json(out / LOG, build_log(step))
        if do_eval or do_save:
            last_log = (time.perf_counter(), step)
    meter.stop()
    flush(pending)
    progress.close()
    profiler.remove()
    if end_step == start_step and not history["evals"]:
        record_eval(end_step)

    log = build_log(end_step)
    if dp.main:
        write_json(out / LOG, log)
        plot_losses(out / PLOT, history["steps"], history["evals"], title)
    return log
