"""The host side every expert kernel shares: tile configurations and autotuning, launch grids, launch checks.

The Triton device functions the kernels call (the tile schedule's scan, the step loops, operand loads, the gated
activations) are in :mod:`.kernel_lib`.

Tile schedule (varlen-M grouped GEMM, SPEC §3): expert e owns rows [off[e], off[e+1]) and
cdiv(T_e, BLOCK_M) M-tiles; M-tiles are numbered expert after expert. Program ``pid_m`` finds its
expert from an inclusive scan of the tile counts, computed in-kernel from ``expert_offsets`` (E+1
int32; :func:`.kernel_lib.tile_schedule`) — no host sync, no extra launch, and any BLOCK_M works (autotuning may
change it). The grid (:func:`varlen_m_grid`) holds ``cdiv(R, BLOCK_M) + E`` M-tiles, an upper bound of
Σ_e cdiv(T_e, BLOCK_M); the extra programs exit at once.

Environment (documented in the README; read at each call through :mod:`sonicmoe.env`, and a value outside a
switch's documented ones raises ValueError):
    SONICMOE_AUTOTUNE=0        use the pinned tile configuration instead of autotuning (the default
                               on GPU is to autotune once per (d, n, E, dtype)); the interpreter pins.
    SONICMOE_TILE_FAMILY=tma|mma
                               the Triton kernels' tile configs for every GPU (default: by compute capability,
                               :func:`tile_family`); ``mma`` runs the portable configs on a Hopper GPU (tests).
    SONICMOE_POISON_OUTPUTS=1  fill every kernel output with NaN before the kernel writes it (tests),
                               so an element no program writes shows up as NaN.
    SONICMOE_FAST_LAUNCH=0     launch every kernel through Triton's ``kernel[grid](...)`` instead of the host fast path
                               of :mod:`.fast_launch` (``check``: both, asserting they pick the same kernel).
    SONICMOE_PDL=0             launch the expert kernels without programmatic dependent launch (default on
                               sm_90 and newer: see :func:`pdl_enabled`).
    SONICMOE_GLUON=0           never use the Gluon (warp-specialised, Hopper-only) kernels: the ping-pong
                               varlen-M GEMM of grouped_gemm_ws (down-projection and dX̃), the up-projection's
                               up_proj_ws, the dH kernel's dh_ws and the weight gradients' weight_grad_ws; the
                               Triton kernels then serve every shape.
    SONICMOE_GLUON_DXT=0       the dX̃ GEMM alone back on the Triton kernel.
    SONICMOE_GLUON_UP=0        the up-projection alone back on the Triton kernel (its Gluon kernel serves d = 4096,
                               and d <= 2048 on H200s, and on H100s with over 384 rows per expert:
                               up_proj_ws.up_ws_preferred; =all at every width).
    SONICMOE_UP_EPI=0|1        the Gluon up-projection's storer partition off / on at every width (default: on for
                               d <= 2048, up_proj_ws.up_ws_config; for A/Bs).
    SONICMOE_GLUON_DH=0        the dH kernel alone back on the Triton kernel (its Gluon kernel serves n a multiple
                               of 256 and n = 128: dh_ws.dh_ws_preferred; =all at every n).
    SONICMOE_GLUON_WGRAD=0     the weight gradients alone back on the Triton kernel (the layer's Gluon ones serve
                               n >= 128: library.gluon_wgrad_preferred; =all at every n).
    SONICMOE_AGG_CHUNK=W       column width of the backward's dX̃ GEMM blocks, each block's dX aggregation beside
                               the next block's GEMM (gather_chunk_width; default 2048, 0 off; a multiple of 8).
    SONICMOE_AGG_RESERVE=S     multiprocessors left to each column block's aggregation beside the next block's
                               streamed-B Gluon GEMM (agg_reserve; default 12, 0: the blocks on the Triton kernel).
    SONICMOE_AGG_RESERVE_CONFIG=BLOCK_T:BLOCK_D:num_warps:UNROLL
                               that aggregation's config (aggregation.reserve_config; default RESERVE_CONFIG).
"""

from __future__ import annotations

import ctypes
import functools
import os
import statistics
import threading

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from ..env import env_choice, env_count, env_switch, interpreting  # noqa: F401 (env_switch, interpreting: re-exported)
from .fast_launch import launch_kernel


def autotune_enabled(interp: bool | None = None) -> bool:
    """Autotuning is on unless SONICMOE_AUTOTUNE=0 or under the interpreter (read at each launch; ``interp``:
    :func:`interpreting` when the caller has it already).

    Raises:
        ValueError: SONICMOE_AUTOTUNE set to anything but ``0`` or ``1``.
    """
    tune = env_switch("SONICMOE_AUTOTUNE", True)
    if interp is None:
        interp = interpreting()
    return not interp and tune


def tile_config(bm: int, bn: int, bk: int, warps: int, stages: int, pps: int = 0, flatten: bool = False,
                names: tuple[str, str, str] = ("BLOCK_M", "BLOCK_N", "BLOCK_K"), tma: bool = False,
                **extra) -> triton.Config:
    """A triton.Config of block sizes, warps, pipeline stages, persistence (PROGS_PER_SM > 0: that many
    programs per multiprocessor loop over the tiles; FLATTEN: pipeline across tiles), for the varlen-M
    kernels W_TMA (load the weight operand through a TMA tensor descriptor), and any kernel-specific
    ``extra`` meta-parameters."""
    meta = dict(zip(names, (bm, bn, bk)))
    if names[0] == "BLOCK_M":
        meta.update(PROGS_PER_SM=pps, FLATTEN=flatten, W_TMA=tma)
    meta.update(extra)
    return triton.Config(meta, num_warps=warps, num_stages=stages)


def tma_descriptor(w: torch.Tensor) -> TensorDescriptor | None:
    """A TMA tensor descriptor over the (strided) view ``w`` — a weight (E, rows, cols) or an activation
    (R, cols) — or None where the copy engine cannot address it (base or leading strides not 16-byte
    aligned, inner stride not 1).

    Its block shape is set per tile configuration (:func:`set_descriptor_blocks`) before each launch.
    """
    elem = w.element_size()
    strides = w.stride()
    if w.data_ptr() % 16 or strides[-1] != 1 or any((s * elem) % 16 for s in strides[:-1]) or w.numel() == 0:
        return None
    # the checks above are those of TensorDescriptor's constructor (alignment, unit inner stride, positive
    # extents; our tensors have rank 2 or 3): built without re-running them, which costs host time per launch
    desc = TensorDescriptor.__new__(TensorDescriptor)
    desc.base, desc.shape, desc.strides, desc.padding = w, list(w.shape), list(strides), "zero"
    desc.block_shape = [1] * (w.dim() - 1) + [max(16 // elem, 1)]  # the smallest valid box
    return desc


# meta-parameters that ask for TMA descriptors: weight loads (W_TMA), loads of contiguous activation rows
# (A_TMA), stores of full output tiles (C_TMA), the varlen-K GEMM's contiguous operand (P_TMA, Q_TMA)
TMA_FLAGS = ("W_TMA", "A_TMA", "C_TMA", "P_TMA", "Q_TMA")

_THREAD = threading.local()


@functools.lru_cache(maxsize=1)
def _libcuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def ensure_cuda_context(device: torch.device) -> None:
    """Make the device's primary CUDA context current in this thread (once per thread).

    Triton encodes TMA descriptors with the driver before its launcher binds a context, and threads
    that PyTorch starts (the autograd engine's backward threads) may have none current yet: the
    encode then fails with "invalid device context". No stream work and no sync: safe in CUDA-graph
    capture.
    """
    idx = device.index if device.index is not None else torch.cuda.current_device()
    done = getattr(_THREAD, "ctx_devices", None)
    if done is None:
        done = _THREAD.ctx_devices = set()
    if idx in done:
        return
    cuda = _libcuda()
    ctx = ctypes.c_void_p()
    if cuda.cuCtxGetCurrent(ctypes.byref(ctx)) != 0 or not ctx.value:
        dev = ctypes.c_int()
        if cuda.cuDeviceGet(ctypes.byref(dev), idx) != 0:
            raise RuntimeError(f"cuDeviceGet({idx}) failed")
        if cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) != 0 or cuda.cuCtxSetCurrent(ctx) != 0:
            raise RuntimeError(f"could not make the primary CUDA context of device {idx} current")
    done.add(idx)


def set_descriptor_blocks(desc_blocks, nargs: dict) -> None:
    """Give each descriptor named by ``desc_blocks(meta)`` (a dict name -> block shape) its block shape."""
    for name, block in desc_blocks(nargs).items():
        if nargs.get(name) is not None:
            nargs[name].block_shape = list(block)


def bind_descriptors(args: dict, meta: dict, desc_blocks, flag_descs: dict[str, tuple[str, ...]]) -> dict:
    """``args`` for a launch with config ``meta``: the TMA descriptors it reads (those of its TMA flags that
    are on, among the ones ``desc_blocks`` names for it) get its block shapes; every other descriptor is None,
    since Triton's launcher encodes each descriptor it is passed on every launch, used or not (host time)."""
    blocks = desc_blocks({**args, **meta})
    used = {name for flag, names in flag_descs.items() if meta.get(flag) for name in names if name in blocks}
    for name in used:
        if args.get(name) is not None:
            args[name].block_shape = list(blocks[name])
    return {**args, **{name: None for names in flag_descs.values() for name in names if name not in used}}


def available_flags(flag_descs: dict[str, tuple[str, ...]], args: dict) -> frozenset[str]:
    """The TMA flags whose descriptors (``flag_descs``: flag -> descriptor argument names) all exist."""
    return frozenset(flag for flag, names in flag_descs.items() if all(args.get(n) is not None for n in names))


def restrict_config(meta: dict, available: frozenset[str], known=TMA_FLAGS) -> dict:
    """``meta`` with every TMA flag that is not ``available`` switched off (pointer loads / stores instead)
    and the TMA flags the kernel does not take (not in ``known``) removed.

    ``C_TMA`` (pipelined TMA stores) is also switched off under ``FLATTEN``: Triton 3.6's nested-loop
    fusion fails on the store's branch (full tile: TMA store, last tile of an expert: masked store).
    """
    out = dict(meta)
    for flag in TMA_FLAGS:
        if flag not in known:
            out.pop(flag, None)
        elif out.get(flag) and (flag not in available or (flag == "C_TMA" and out.get("FLATTEN"))):
            out[flag] = False
    return out


# Autotuning times every config of a space in TUNE_ROUNDS rounds, the configs in turn within each round, and
# keeps the config with the least median. One pass, config after config (Triton's autotuner), let the GPU's clock
# drift and run-to-run noise decide near-ties: in session 14 it chose, for the 7B up-projection on an H200, the
# config that alternating rounds put last (0.659 ms median against 0.626 for the best;
# benchmarks/results/2026-11-24_nvidia-h200_session14/).
TUNE_ROUNDS = 3
TUNE_WARMUP_MS, TUNE_REP_MS = 5, 25


def _bench_ms(call) -> float:
    """Median time of ``call`` in ms (do_bench: events, the L2 flushed before each run)."""
    from triton.testing import do_bench

    return do_bench(call, warmup=TUNE_WARMUP_MS, rep=TUNE_REP_MS, return_mode="median")


class Tuners:
    """The autotuning of one kernel: per key (the key arguments, the tensor dtypes, the available TMA
    flags and the GPU's :func:`tile_family`) the fastest config of the family's space, timed in TUNE_ROUNDS
    round-robin rounds (median per config).

    ``space`` is the ``"tma"`` family's (Hopper, datacenter Blackwell), ``portable`` the ``"mma"`` family's
    (:func:`tile_family`), and ``portable_default`` the config the ``"mma"`` family pins (SONICMOE_AUTOTUNE=0).
    Configs asking for a flag whose descriptors are missing (a weight or an output TMA cannot address, a
    layout with no box shape) are tuned with that flag off. Each launch gives the descriptors it reads the
    config's block shapes (:func:`bind_descriptors`).
    """

    def __init__(self, kernel, space: list[triton.Config], key: list[str], desc_blocks=None,
                 portable: list[triton.Config] | None = None, portable_default: dict | None = None):
        self.kernel, self.space, self.key, self.desc_blocks = kernel, space, key, desc_blocks
        self.portable = portable if portable is not None else space
        self.portable_default = portable_default
        self._by_flags: dict[tuple[frozenset[str], str], list[triton.Config]] = {}
        self._chosen: dict[tuple, triton.Config] = {}
        fn = kernel
        while hasattr(fn, "fn"):  # heuristics wrap the JITFunction, which wraps the Python function
            fn = fn.fn
        self.name = getattr(fn, "__name__", type(fn).__name__)
        _ALL_TUNERS.append(self)

    def run(self, available: frozenset[str], grid, args: dict, flag_descs: dict | None = None,
            extra: dict | None = None, family: str = "tma") -> None:
        """Launch with the tuned config. The first call of a key (the key values, the dtypes of the tensor
        arguments, the available flags and the ``family``) times the family's space (:meth:`tune`); every call
        then launches the choice directly, with None for the TMA descriptors it does not read
        (:func:`bind_descriptors`; ``flag_descs`` as in :func:`launch`): no per-call bookkeeping (host time: the
        layer's launches are host-bound on slow hosts otherwise). ``extra``: launch options added to every
        launch, tuning included (the programmatic-dependent-launch pair of :func:`launch`). The choices are keyed
        by tile family, not by GPU model (a per-launch query costs host time): one process driving two models of
        one family, e.g. an H100 and an H200, or sm_90 beside sm_100, shares them (tiles tuned on the other, and
        on sm_100 possibly a config that does not compile there)."""
        key = (available, *(args[k] for k in self.key),
               *(v.dtype for v in args.values() if isinstance(v, torch.Tensor)), family)
        cfg = self._chosen.get(key)
        if cfg is None:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"{self.name}: a new shape key {key[1:1 + len(self.key)]} would be autotuned inside CUDA graph "
                    "capture, which cannot time kernels; run the same call once eagerly before capturing (a "
                    "warm-up step, as torch.cuda.make_graphed_callables does), or set SONICMOE_AUTOTUNE=0")
            cfg = self._chosen[key] = self.tune(available, grid, args, flag_descs, extra, family)
        self._launch(cfg, grid, args, flag_descs, extra)

    def _launch(self, cfg: triton.Config, grid, args: dict, flag_descs: dict | None, extra: dict | None = None) -> None:
        meta = cfg.all_kwargs() | (extra or {})
        if flag_descs and self.desc_blocks is not None:
            args = bind_descriptors(args, meta, self.desc_blocks, flag_descs)
        elif self.desc_blocks is not None:
            set_descriptor_blocks(self.desc_blocks, {**args, **meta})
        launch_kernel(self.kernel, grid, **args, **meta)

    def tune(self, available: frozenset[str], grid, args: dict, flag_descs: dict | None = None,
             extra: dict | None = None, family: str = "tma") -> triton.Config:
        """The fastest config of the space for these arguments: each config compiled and launched once
        (configs that do not compile or do not fit, e.g. in shared memory, are skipped), then timed in
        TUNE_ROUNDS rounds, all configs in turn within a round; the least median wins (the first on a tie).
        The kernel's outputs are overwritten by every launch; the caller's launch afterwards writes them."""
        from triton.compiler.errors import CompileTimeAssertionFailure
        from triton.runtime.errors import OutOfResources, PTXASError

        calls = []
        for cfg in self.get(available, family):
            call = functools.partial(self._launch, cfg, grid, args, flag_descs, extra)
            try:
                call()
            except (OutOfResources, CompileTimeAssertionFailure, PTXASError):
                continue
            calls.append((cfg, call, []))
        if not calls:
            raise RuntimeError(f"{self.name}: no config of the tuning space compiles for these arguments")
        for _ in range(TUNE_ROUNDS if len(calls) > 1 else 0):
            for _cfg, call, times in calls:
                times.append(_bench_ms(call))
        return min(calls, key=lambda c: statistics.median(c[2]) if c[2] else 0.0)[0]

    def chosen(self) -> list[triton.Config]:
        """The configs the autotuner chose so far in this process, one per key."""
        return list(self._chosen.values())

    def described(self) -> list[dict]:
        """The choices so far as JSON-friendly dicts (see :func:`tuned_configs`), read off their keys."""
        n = len(self.key)
        return [{"key": {k: (v if isinstance(v, (int, float, bool, str)) else str(v))
                         for k, v in zip(self.key, key[1:1 + n])},
                 "dtypes": [str(v).removeprefix("torch.") for v in key[1 + n:-1]], "tile_family": key[-1],
                 "tma_available": sorted(key[0]), "config": config_dict(cfg)} for key, cfg in self._chosen.items()]

    def get(self, available: frozenset[str], family: str = "tma") -> list[triton.Config]:
        """The ``family``'s space (:func:`tile_family`) with the TMA flags that are not ``available`` switched
        off, duplicates dropped."""
        if (available, family) not in self._by_flags:
            configs, seen = [], set()
            for cfg in self.space if family == "tma" else self.portable:
                meta = restrict_config(cfg.kwargs, available)
                sig = (tuple(sorted(meta.items())), cfg.num_warps, cfg.num_stages)
                if sig in seen:
                    continue
                seen.add(sig)
                configs.append(triton.Config(meta, num_warps=cfg.num_warps, num_stages=cfg.num_stages))
            self._by_flags[available, family] = configs
        return self._by_flags[available, family]


_ALL_TUNERS: list[Tuners] = []


def tuned_configs() -> dict[str, list[dict]]:
    """Every tile configuration the autotuners chose so far in this process, by kernel name: a list of
    {"key": the autotuner's key arguments (shape letters of that kernel), "dtypes": of its tensor arguments,
    "tile_family": the GPU's (:func:`tile_family`), "tma_available": the TMA flags whose descriptors existed,
    "config": block sizes, flags, warps, stages}.
    Empty when nothing was autotuned (SONICMOE_AUTOTUNE=0, the interpreter). Benchmarks record it next to
    their timings, so a result names the tiles that produced it."""
    return {t.name: t.described() for t in _ALL_TUNERS if t._chosen}


def autotuners(kernel, space: list[triton.Config], key: list[str], desc_blocks=None,
               portable: list[triton.Config] | None = None, portable_default: dict | None = None) -> Tuners:
    """The :class:`Tuners` of ``kernel`` over ``space`` (and ``portable`` on the ``"mma"`` family's GPUs, with
    ``portable_default`` pinned there) keyed on ``key``."""
    return Tuners(kernel, space, key, desc_blocks, portable, portable_default)


def config_dict(cfg: triton.Config) -> dict:
    """A triton.Config as the keyword dict ``launch(config=...)`` takes."""
    return {**cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}


def launch(kernel, tuned, grid, args: dict, pinned: dict, gpu_default: dict, config: dict | None = None,
           desc_blocks=None, flag_descs: dict[str, tuple[str, ...]] | None = None,
           pdl_device: torch.device | None = None):
    """Launch ``kernel`` with the pinned config (interpreter / SONICMOE_AUTOTUNE=0) or autotuned.

    ``tuned`` is the kernel's :class:`Tuners`. ``grid`` is a callable of the meta-parameters.
    ``pinned`` is the interpreter's config (small blocks); ``gpu_default`` the pinned GPU config, a dict
    with block sizes plus num_warps/num_stages, on the ``"tma"`` family's GPUs (:func:`tile_family`; on the
    others the ``tuned.portable_default``, where the kernel has one, and autotuning times ``tuned.portable``).
    ``config``, when given, is used as is (tuning sweeps).
    ``desc_blocks(meta)`` names the TMA descriptors among ``args`` with their block shapes, and
    ``flag_descs`` maps each TMA flag of the kernel (among W_TMA, A_TMA, C_TMA, P_TMA, Q_TMA) to the
    descriptors it needs: a flag whose descriptors are None (the tensor cannot be described) falls back to
    pointer loads / stores alone, TMA flags the kernel does not take are dropped, and descriptors no flag
    of the launch uses are passed as None. ``pdl_device``: the device of a kernel that starts with
    :func:`pdl_prologue` (its ``PDL`` meta-parameter); where :func:`pdl_enabled`, it is launched with
    programmatic dependent launch and ``PDL=True``.
    """
    flag_descs = flag_descs or {}
    extra = {"PDL": True, "launch_pdl": True} if pdl_device is not None and pdl_enabled(pdl_device) else {}
    available = available_flags(flag_descs, args)
    if desc_blocks is not None and available:
        base = args[next(iter(flag_descs[next(iter(available))]))].base
        if base.is_cuda:
            ensure_cuda_context(base.device)
    interp = interpreting()
    family = "tma" if interp or pdl_device is None else tile_family(pdl_device)
    if config is None and autotune_enabled(interp):
        tuned.run(available, grid, args, flag_descs, extra, family)
        return
    if family == "mma" and tuned.portable_default is not None:
        gpu_default = tuned.portable_default
    meta = dict(config if config is not None else pinned if interp else gpu_default)
    if config is None and not interp:
        meta = sized_for_operands(meta, _operand_bytes(args))
    if desc_blocks is not None:
        meta = restrict_config(meta, available, tuple(flag_descs))
        args = bind_descriptors(args, meta, desc_blocks, flag_descs)
    # the config's values win over same-named launcher defaults
    launch_kernel(kernel, grid(meta), **{**args, **meta, **extra})


def sized_for_operands(meta: dict, operand_bytes: int) -> dict:
    """A pinned GPU tile config, sized for 2-byte operands, adapted to ``operand_bytes``-byte ones. For 4 bytes
    (float32) the reduction block (BLOCK_K or BLOCK_R) is halved, to at least 16, and at most three pipeline
    stages are kept, so the stages and a TMA store buffer fit in shared memory. Otherwise the config is returned
    as it is. :func:`launch` applies it to the pinned configs; an explicit ``config`` is used as given."""
    out = dict(meta)
    if operand_bytes >= 4:
        for key in ("BLOCK_K", "BLOCK_R"):
            if key in out:
                out[key] = max(16, out[key] // 2)
        out["num_stages"] = min(out.get("num_stages", 3), 3)
    return out


def _operand_bytes(args: dict) -> int:
    """Element size of the first floating-point tensor among a kernel's arguments (its A operand)."""
    for v in args.values():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v.element_size()
    return 2


def new_output(shape, *, device, dtype) -> torch.Tensor:
    """``torch.empty`` for kernel outputs; NaN-filled (or int-min) when SONICMOE_POISON_OUTPUTS=1 (0 or 1; read at
    each call)."""
    if env_switch("SONICMOE_POISON_OUTPUTS", False):
        # one op, not torch.empty + fill_: with the in-place fill the layer compiled (aot_eager) under CUDA autocast got
        # a zero router-weight gradient (H100, torch 2.11; test_autocast.py::test_gpu_compiled_layer_under_cuda_autocast
        # fails with that form and passes with this one, A/B in one call, session 88)
        poison = float("nan") if dtype.is_floating_point else torch.iinfo(dtype).min
        return torch.full(shape if isinstance(shape, (tuple, list)) else (shape,), poison, device=device, dtype=dtype)
    return torch.empty(shape, device=device, dtype=dtype)


def output_or_new(out: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """A kernel's output: ``out`` where the caller gave one (checked: ``shape``, ``like``'s dtype and device, a unit
    inner stride; a view into a wider tensor is fine), else :func:`new_output` of ``shape`` like ``like``.

    Raises:
        ValueError: ``out`` of another shape, dtype or device, or with a non-unit inner stride.
    """
    if out is None:
        return new_output(shape, device=like.device, dtype=like.dtype)
    if tuple(out.shape) != tuple(shape) or out.dtype != like.dtype or out.device != like.device or out.stride(-1) != 1:
        raise ValueError(f"out: expected a {tuple(shape)} {like.dtype} tensor or view on {like.device} with a unit "
                         f"inner stride, got {tuple(out.shape)} {out.dtype} on {out.device} with strides "
                         f"{tuple(out.stride())}")
    return out


def per_expert_gemm_ref(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, expert_offsets: torch.Tensor,
                        transpose_b: bool) -> torch.Tensor:
    """Float32 per-expert loop of a varlen-M grouped GEMM, output in a's dtype (the ``*_ref`` twins' core):
    rows [off[e], off[e+1]) of A (R, k) times B[e] ((E, m, k) used transposed, or (E, k, m)), plus bias[e]. C has
    A's R rows, as the kernels' (a padded routing's rows past off[E], which no kernel writes, are zero here; they
    were left out, and C came back shorter than the kernels')."""
    offsets = expert_offsets.tolist()
    outs = []
    for i in range(b.shape[0]):
        bi = b[i].float().t() if transpose_b else b[i].float()
        y = a[offsets[i]:offsets[i + 1]].float() @ bi
        outs.append(y + bias[i].float() if bias is not None else y)
    m = b.shape[1] if transpose_b else b.shape[2]
    outs.append(a.new_zeros((a.shape[0] - offsets[-1], m), dtype=torch.float32))  # padding rows, if any
    return torch.cat(outs, 0).to(a.dtype)


def dot_precision(dtype: torch.dtype) -> str:
    """float32 operands use exact fp32 products ("ieee"); bf16/fp16 use the tensor cores."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_device(name: str, t: torch.Tensor) -> None:
    """Kernels need CUDA tensors, or CPU tensors under the interpreter."""
    if t.is_cuda or (interpreting() and t.device.type == "cpu"):
        return
    raise ValueError(
        f"{name} is on {t.device}; the triton backend needs CUDA tensors (or CPU tensors with "
        "TRITON_INTERPRET=1). Use backend='torch' elsewhere."
    )


def kernel_backward(what: str, instead: str):
    """Decorator for the ``backward`` of an autograd Function whose gradients come from Triton kernels, which build no
    graph of their own. Under ``create_graph=True`` (double backward: a gradient penalty, a Hessian-vector product,
    ``torch.func.grad``, which always asks for it) it raises at once, naming ``what`` and the differentiable
    alternative ``instead``. Eager only: under torch.compile the custom operators' registered backward runs, and
    torch itself refuses double backward through a compiled graph. ``once_differentiable`` alone raised only where a
    later backward reached its error node: ``torch.autograd.grad`` with explicit inputs returned the first-order
    terms only, silently (session 87 audit)."""

    def wrap(backward):
        once = torch.autograd.function.once_differentiable(backward)  # a second guard: runs only with grad off here

        @functools.wraps(backward)
        def checked(ctx, *grads):
            if torch.is_grad_enabled():  # the autograd engine enables grad mode in backward only for create_graph
                raise RuntimeError(
                    f"{what}: the backward runs Triton kernels and is not differentiable, so create_graph=True "
                    "(double backward: gradient penalties, Hessian-vector products, torch.func.grad) is not "
                    f"supported; {instead}")
            return once(ctx, *grads)

        return checked

    return wrap


def next_pow2(x: int) -> int:
    """The least power of two >= max(x, 1) (plain Python: ``triton.next_power_of_2`` is a constexpr function,
    several µs of host time per call outside a kernel)."""
    return 1 << (max(int(x), 1) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host ints (plain Python, like :func:`next_pow2`)."""
    return -(-a // b)


def max_m_tiles(num_rows: int, num_experts: int, block_m: int) -> int:
    """Upper bound of Σ_e cdiv(T_e, BLOCK_M): the M-tiles of the varlen-M grid."""
    return cdiv(num_rows, block_m) + num_experts


_SM_COUNT: dict[int, int] = {}
_PDL_OK: dict[int, bool] = {}
_FAMILY: dict[int, str] = {}
TILE_FAMILIES = ("tma", "mma")
# compute-capability majors whose GPUs run the "tma" family's tile configs
TMA_FAMILY_MAJORS = (9, 10)


def tile_family(device: torch.device) -> str:
    """Which tile configs the Triton expert kernels use on ``device``: ``"tma"`` or ``"mma"`` (queried once per
    device, at the first launch; never at import).

    ``"tma"``: GPUs of compute capability 9.x and 10.x (Hopper; datacenter Blackwell, compiled for but not run
    here). Their configs read operands through TMA descriptors and use up to 227 KiB of shared memory per block;
    they were measured on H100s and H200s. ``"mma"``: every other GPU (Ampere, Ada, consumer Blackwell: warp-level
    ``mma.sync``, 99-163 KiB of shared memory per block). Each Triton GEMM kernel's
    ``PORTABLE_SPACE`` serves them, its first config pinned: pointer loads, at most 99 KiB of shared memory, and no
    register spills when compiled offline for sm_80, sm_86, sm_89 and sm_120 (``benchmarks/resource_report.py
    --space portable --arch A``, checked by tests/test_portable_configs.py; the tuning spaces of the ``"tma"``
    family spill there, heavily in the up-projection and dH). They have not been timed on such a GPU. The family
    changes the tiles, so the bits of a result, not what it computes. ``SONICMOE_TILE_FAMILY=tma|mma`` sets the
    family for every GPU (read at each call): ``mma`` runs the portable configs on a Hopper GPU (the GPU tests do).

    Raises:
        ValueError: SONICMOE_TILE_FAMILY set to anything but ``tma`` or ``mma``.
    """
    forced = env_choice("SONICMOE_TILE_FAMILY", "", TILE_FAMILIES)
    if forced:
        return forced
    if device.type != "cuda":
        return "tma"
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _FAMILY:
        _FAMILY[idx] = "tma" if torch.cuda.get_device_capability(idx)[0] in TMA_FAMILY_MAJORS else "mma"
    return _FAMILY[idx]


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with programmatic dependent launch (PDL): a CUDA GPU of compute
    capability 9.0 or newer (queried once per device, at the first launch), unless SONICMOE_PDL=0; never
    under the interpreter.

    With PDL a kernel may be scheduled while the kernel before it in the stream drains its last tiles; its
    programs wait (:func:`pdl_prologue`) for that kernel to finish and its writes to be visible before they
    touch memory, so results are unchanged: only the launch latency between the layer's kernels is hidden.
    """
    if not env_switch("SONICMOE_PDL", True) or device.type != "cuda" or interpreting():
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _PDL_OK:
        _PDL_OK[idx] = torch.cuda.get_device_capability(idx)[0] >= 9
    return _PDL_OK[idx]


_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def overlap_mode(device: torch.device) -> int:
    """Programs per multiprocessor of the backward's dX aggregation when it runs on a side stream beside the
    dW1 GEMM on ``device`` (SONICMOE_OVERLAP, default 2), or 0: no side stream (always on CPU and under the
    interpreter; SONICMOE_OVERLAP=0).

    Raises:
        ValueError: SONICMOE_OVERLAP set to anything but an integer 0..16 (read at each call, on CPU too).

    Why a persistent grid: the block scheduler dispatches a grid's programs before those of a grid queued
    after it, so a kernel of many programs only shares the machine at its tail. The aggregation's few
    programs (registers only, no shared memory) all become resident at once, queued first on a
    high-priority stream, and dW1's programs (one per multiprocessor: shared memory) fill the room beside them.
    """
    mode = env_count("SONICMOE_OVERLAP", 2, most=16)
    if device.type != "cuda" or interpreting():
        return 0
    return mode


# the column width of the blocks in which the backward's dX̃ GEMM runs with each block's dX aggregation beside the
# next block's GEMM (gather_chunk_width; SONICMOE_AGG_CHUNK): of 1024 and 2048, 2048 measured best at
# (32768, 4096, 1024, 128, 8) on H100s (session 27); on H200s with 12 multiprocessors reserved (session 63), 1024 was
# level (35.07 against 35.09 ms, 5 rounds) and 2048 + 1024 + 1024 slower (35.50 against 35.065)
AGG_CHUNK = 2048


# multiprocessors the column-block form of the backward's dX̃ leaves to each block's dX aggregation beside the next
# block's streamed-B Gluon GEMM (agg_reserve). Session 53 (benchmarks/results/2026-11-28_nvidia-h100_session53/, one
# H100, scripts/reserve_probe.py, settled 1 s windows) at (32768, 4096, 1024, 128, 8): dX̃ and the dX aggregation in
# two 2048-column blocks took 7.67 ms with 16 left to the aggregation, 7.85 with 24, 8.04 with 32, against 8.05 for
# the Triton kernel's blocks with the aggregation beside them as a grid of 2 programs per multiprocessor (the form
# before) and 8.15 for one Gluon GEMM, then one aggregation. 12 since session 62
# (benchmarks/results/2026-12-02_nvidia-h200_session62/), with the reserved aggregation's config of twice the bytes in
# flight (aggregation.RESERVE_CONFIG): 120B-n1024 forward+backward on an H200, fresh-process A/Bs in two calls,
# 36.005 and 35.935 ms against 36.165 and 36.175 for 16 with the former config (7 of 8 rounds faster); 8: 36.745
AGG_RESERVE = 12


def agg_reserve(device: torch.device) -> int:
    """Multiprocessors that the column-block form of a varlen-M GEMM and its aggregation
    (:func:`sonicmoe.ops.library.gemm_then_gather_sum`) leaves to each block's aggregation, which runs as that many
    programs of :data:`sonicmoe.ops.aggregation.RESERVE_CONFIG` (each fills a multiprocessor) beside the next
    block's streamed-B Gluon GEMM on the others (:func:`sonicmoe.ops.varlen_m_ws.long_gemm` with ``num_programs``), or
    0: the blocks keep the Triton kernel with the aggregation's persistent grid of :func:`overlap_mode` programs per
    multiprocessor beside them.

    Why: the Gluon GEMM's persistent programs take every multiprocessor's shared memory and registers, so an
    aggregation queued beside it runs between its programs, not beside them; under the power cap a GEMM on fewer
    multiprocessors runs at a higher clock and loses less than their share (:data:`AGG_RESERVE`).

    ``SONICMOE_AGG_RESERVE`` (read at each call): a count below the device's multiprocessors, default
    :data:`AGG_RESERVE`. Always 0 off CUDA, under the interpreter and without the side stream
    (``SONICMOE_OVERLAP=0``).

    Raises:
        ValueError: SONICMOE_AGG_RESERVE set to anything but a count (on CPU too), or, on CUDA with the side
            stream, to a count not below the device's multiprocessors.
    """
    value = env_count("SONICMOE_AGG_RESERVE", -1)  # -1: unset
    if not overlap_mode(device):
        return 0
    if value < 0:
        return AGG_RESERVE
    if value >= sm_count(device):
        raw = os.environ["SONICMOE_AGG_RESERVE"]
        raise ValueError(f"SONICMOE_AGG_RESERVE={raw!r}: expected a count below the device's {sm_count(device)} "
                         f"multiprocessors (unset for the default, {AGG_RESERVE})")
    return value


def gather_chunk_width(d: int, device: torch.device) -> int:
    """Column width of the chunks of a varlen-M GEMM Y (R, d) whose gather-and-sum runs chunk by chunk on the side
    stream beside the GEMM's next chunk (:func:`sonicmoe.ops.library.gemm_then_gather_sum`), or 0: one GEMM, then
    one aggregation.

    ``SONICMOE_AGG_CHUNK``: a width in columns (a multiple of 8; 0 turns chunking off), default :data:`AGG_CHUNK`.
    The default applies on CUDA with the side stream on (:func:`overlap_mode`) and d of at least two chunks; an
    explicit width also applies on CPU and under the interpreter (the chunks then run one after the other: tests).
    d must be a multiple of 8 (16-byte aligned column blocks for the TMA descriptors).

    Raises:
        ValueError: SONICMOE_AGG_CHUNK set to anything but 0 or a positive multiple of 8.
    """
    width = env_count("SONICMOE_AGG_CHUNK", -1, multiple=8)
    explicit = width >= 0
    if not explicit:
        width = AGG_CHUNK
    if not explicit and overlap_mode(device) == 0:
        return 0
    if width <= 0 or width % 8 or d % 8 or d < 2 * width:
        return 0
    return width


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The high-priority side CUDA stream of ``device`` (one per device, created at first use, never at import)
    for work that runs beside the current stream's kernels: its pending programs are dispatched first."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SIDE_STREAMS:
        _SIDE_STREAMS[idx] = torch.cuda.Stream(idx, priority=-1)
    return _SIDE_STREAMS[idx]


def sm_count(device: torch.device) -> int:
    """Multiprocessors of ``device`` (cached; queried at the first launch, never at import)."""
    if device.type != "cuda":
        return 1
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def programs(tiles: int, progs_per_sm: int, device: torch.device) -> int:
    """Programs of a grid over ``tiles`` tiles: one per tile, or for a persistent config (``progs_per_sm``
    > 0) that many per multiprocessor, looping over the tiles (never more programs than tiles)."""
    return min(tiles, progs_per_sm * sm_count(device)) if progs_per_sm else tiles


# Mean rows per expert at or below which the pinned GPU configs treat experts as "few-row" (short reduction
# loops in the weight gradients, many partly used weight tiles in the grouped GEMMs); measured in session 9,
# benchmarks/results/2026-11-24_nvidia-h100_varlen-k-steps/, at 256 rows per expert. Session 36
# (benchmarks/results/2026-11-27_nvidia-h100_session36/ and ..._nvidia-h200_session36/, `tune_sweep.py`, 3 rounds
# each) moved it from 512 to 384: at (16384, 1536, 256, 256, 8), 512 rows per expert, every kernel it decides
# ran faster with the many-row configs, on an H100 and an H200, under top-k and under token rounding. H100,
# top-k / token rounding, ms, many-row against few-row config: dW1 0.575 / 0.525 against 0.598 / 0.563, dW2
# 0.299 / 0.261 against 0.318 / 0.277, dX~ 0.438 / 0.389 against 0.457 / 0.417, down-projection 0.272 / 0.265
# against 0.291 / 0.274, up-projection 0.468 / 0.428 against 0.473 / 0.439 (5 rounds). H200: dW1 0.545 / 0.486
# against 0.621 / 0.594, dW2 0.275 / 0.240 against 0.308 / 0.268. At 256 rows per expert (E = 512) the few-row
# configs still lead on the H100 (token rounding: dW1 0.643 against 0.722, dX~ 0.480 against 0.570)
FEW_ROWS_PER_EXPERT = 384


def few_rows_per_expert(num_rows: int, num_experts: int) -> bool:
    """Whether R routed rows over E experts average at most FEW_ROWS_PER_EXPERT (host values: no sync)."""
    return num_rows <= FEW_ROWS_PER_EXPERT * num_experts


def varlen_m_grid(num_rows: int, num_experts: int, n: int, device: torch.device):
    """Grid of a varlen-M kernel: one program per (M-tile, N-tile) upper bound, or, for persistent
    configs (PROGS_PER_SM > 0), PROGS_PER_SM programs per multiprocessor looping over the tiles."""

    def grid(meta):
        upper = max_m_tiles(num_rows, num_experts, meta["BLOCK_M"]) * cdiv(n, meta["BLOCK_N"])
        return (programs(upper, meta.get("PROGS_PER_SM", 0), device),)

    return grid


def with_even_flags(kernel, **flags: tuple[str, str]):
    """``kernel`` wrapped so that each ``EVEN_X=(dim, block)`` flag is set per launch to
    ``dim % block == 0`` and ``dim > 0``: a nonzero dimension that is a multiple of its block needs no bounds mask."""
    rules = {name: functools.partial(_divides, dim, block) for name, (dim, block) in flags.items()}
    return triton.heuristics(rules)(kernel)


def _divides(dim: str, block: str, args: dict) -> bool:
    # a zero extent is not "even": the step loops' one K-block at K = 0 (first_step) must be masked off entirely
    return args[dim] > 0 and args[dim] % args[block] == 0


# the kernels' ACT codes of the gated activations (sonicmoe.config.ACTIVATIONS; SPEC §2)
ACT_CODES = {"swiglu": 0, "clamped_swiglu": 1}


def act_code(activation: str) -> int:
    """The ``ACT`` constexpr of the up-projection and dH kernels for ``activation``.

    Raises:
        ValueError: an activation that is not one of :data:`sonicmoe.config.ACTIVATIONS` (a non-string, a list, too).
    """
    if not isinstance(activation, str) or activation not in ACT_CODES:
        raise ValueError(f"activation must be one of {tuple(ACT_CODES)}, got {activation!r}")
    return ACT_CODES[activation]
