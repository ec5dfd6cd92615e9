"""Host fast path for launching an already compiled Triton or Gluon kernel (no kernel of its own).

Each launch through ``kernel[grid](...)`` costs 20-35 µs of host time in Triton 3.6's ``JITFunction.run`` before
the driver call, most of it binding the arguments (about 30-45 per expert kernel) and building the kernel cache's
key. The layer's launches add up to about a millisecond per forward+backward, enough for small layers on slow hosts
to time the host (benchmarks/results/2026-11-26_nvidia-h100_session29/). :func:`launch_kernel` keeps, per JIT
function, the compiled kernels it has seen under a key of its own and calls the compiled kernel's launcher directly
on a hit.

The key holds every parameter in the kernel's order (defaults filled in, so a default passed as itself is the same
launch), then the launch options, and is **at least as specific as Triton's** specialisation, so a hit always
launches the binary Triton would have chosen:

* a tensor: its dtype and whether its address is 16-byte aligned (Triton's ``D`` attribute);
* an int: 1 (a constant for Triton), else whether it is a multiple of 16, and its integer type (i32, i64, u64);
* a bool or float runtime argument: its type; ``None``: itself;
* a TMA tensor descriptor (Triton's or Gluon's): its type, element type, block shape, padding and layout;
* every ``constexpr`` argument and every launch option (``num_warps``, ``launch_pdl``, ...): its value, by Python
  equality. That is coarser than Triton's key (its ``str``) where values of different types compare equal: 4 and 4.0,
  1 and True, 0.0 and -0.0 (and a NaN never hits). So a launcher must pass each constexpr with one type; the
  library's launchers do, and ``SONICMOE_FAST_LAUNCH=check`` (the tests) asserts that every hit is Triton's own
  choice. Keying each constexpr with its type cost about 2 µs per launch (16 constexprs), a tenth of the path;
* the device, and Triton's ``debug`` and instrumentation knobs.

Anything else takes Triton's own path, which also compiles and records the kernel on a miss: a value of another
type, an unhashable constexpr, a missing argument, launch hooks installed by a profiler, pre-run hooks, a launch
traced by ``torch.compile``, and every launch on a Triton version outside :data:`CHECKED_TRITON`.
``SONICMOE_FAST_LAUNCH=0`` always takes Triton's path; ``SONICMOE_FAST_LAUNCH=check`` takes it too and asserts that
Triton chose the kernel the fast path would have (tests). Never under the interpreter.
"""

from __future__ import annotations

import torch
import triton
from triton.runtime.autotuner import Heuristics
from triton.runtime.jit import JITFunction

from ..env import env_choice

try:
    from triton import knobs
except ImportError:  # Triton before 3.4
    knobs = None

# the Triton versions whose compiled-kernel launcher (CompiledKernel.run's arguments, function, packed_metadata) and
# specialisation rules this module was checked against; elsewhere every launch takes Triton's path
CHECKED_TRITON = ((3, 6),)


def major_minor(version: str) -> tuple[int, ...]:
    """(major, minor) of a version string such as "3.6.0" or "3.6.0+git1234"; () when it does not parse."""
    try:
        return tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        return ()


SUPPORTED = knobs is not None and major_minor(triton.__version__) in CHECKED_TRITON

try:  # what Triton's CUDA driver uses for the current stream's handle
    from torch._C import _cuda_getCurrentRawStream as _raw_stream
except ImportError:  # a CPU-only torch build: never reached (no CUDA launches)
    def _raw_stream(idx):
        return torch.cuda.current_stream(idx).cuda_stream

_MISSING = object()
_I32 = (-(2**31), 2**31)


class _Slow(Exception):
    """An argument the fast path does not key: use Triton's path."""


def _runtime_key(v):
    """The part of Triton's specialisation a runtime (non-constexpr) argument ``v`` decides, or a finer key."""
    t = type(v)
    if t is torch.Tensor:  # the common case first (a subclass, e.g. a Parameter, is caught by isinstance below)
        return (v.dtype, v.data_ptr() % 16 == 0)
    if t is bool:
        return bool
    if t is int:
        if v == 1:
            return 1
        return (v % 16 == 0, 32 if _I32[0] <= v < _I32[1] else 64 if v < 2**63 else 65)
    if v is None:
        return None
    if t is float:
        return float
    if isinstance(v, torch.Tensor):
        return (v.dtype, v.data_ptr() % 16 == 0)
    base = getattr(v, "base", None)
    block = getattr(v, "block_shape", None)
    if isinstance(base, torch.Tensor) and block is not None:  # a host TMA descriptor (Triton's or Gluon's)
        return (t, base.dtype, tuple(block), getattr(v, "padding", None), getattr(v, "layout", None))
    raise _Slow


class _Launches:
    """The compiled kernels of one JIT function seen so far, by fast-path key."""

    def __init__(self, fn):
        self.fn = fn
        self.names = list(fn.arg_names)
        self.constexpr = frozenset(p.name for p in fn.params if p.is_constexpr)
        self.defaults = [p.default if p.has_default else _MISSING for p in fn.params]
        self.params = frozenset(self.names)
        self.runtime = tuple(name not in self.constexpr for name in self.names)  # keyed by _runtime_key
        self.kernels: dict[tuple, object] = {}


_LAUNCHES: dict[int, _Launches] = {}


def _launches(fn) -> _Launches:
    entry = _LAUNCHES.get(id(fn))
    if entry is None or entry.fn is not fn:
        entry = _LAUNCHES[id(fn)] = _Launches(fn)
    return entry


def _hooked(chain) -> bool:
    """Whether a launch hook is installed (Triton 3.6 keeps them in a ``HookChain``, empty unless a profiler such
    as proton adds one; older versions in a plain attribute, None when unset)."""
    return bool(getattr(chain, "calls", chain))


FAST_LAUNCH_MODES = ("0", "1", "check")


def _mode() -> str:
    """``SONICMOE_FAST_LAUNCH`` (read at each launch): ``1`` (default), ``0`` or ``check``; anything else raises
    ValueError."""
    return env_choice("SONICMOE_FAST_LAUNCH", "1", FAST_LAUNCH_MODES)


def launch_kernel(kernel, grid, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)`` with Triton's argument binding skipped when this exact specialisation was
    launched before (see the module doc); returns what Triton's launch returns on its path, else the compiled
    kernel.

    Args:
        kernel: a ``triton.jit`` / ``gluon.jit`` function, or one wrapped by ``triton.heuristics``.
        grid: a tuple of up to three ints, or a callable of the launch's arguments (a dict) returning one.
        args, kwargs: the kernel's arguments (positional ones first, in the kernel's order) and launch options.
    """
    if torch.compiler.is_compiling():  # dynamo traces ``kernel[grid](...)`` itself (a user-defined Triton kernel)
        return kernel[grid](*args, **kwargs)
    mode = _mode()
    if mode == "0" or not SUPPORTED:
        return kernel[grid](*args, **kwargs)
    if _hooked(knobs.runtime.launch_enter_hook) or _hooked(knobs.runtime.launch_exit_hook):
        return kernel[grid](*args, **kwargs)
    fn, heuristics = kernel, []
    while isinstance(fn, Heuristics):
        heuristics.append(fn)
        fn = fn.fn
    if not isinstance(fn, JITFunction) or fn.pre_run_hooks:  # e.g. the interpreter's functions
        return kernel[grid](*args, **kwargs)
    for (name, _), (val, scope) in fn.used_global_vals.items():
        if scope.get(name, _MISSING) != val:  # a global the kernel reads has changed: Triton raises
            return kernel[grid](*args, **kwargs)
    entry = _launches(fn)
    names = entry.names
    if heuristics:  # their rules read every argument by name
        bound = dict(zip(names, args))
        bound.update(kwargs)
        for h in heuristics:  # outermost first, as Triton runs them
            for name, rule in h.values.items():
                bound[name] = rule(bound)
        given, named = 0, bound
    else:
        given, named = len(args), kwargs
    if given > len(names):  # more positional arguments than parameters: Triton raises
        return kernel[grid](*args, **kwargs)
    # every parameter in the kernel's order (the defaults filled in), then the launch options
    values = list(args[:given])
    for name, default in zip(names[given:], entry.defaults[given:]):
        v = named.get(name, default)
        if v is _MISSING:
            return kernel[grid](*args, **kwargs)
        values.append(v)
    params = entry.params
    try:
        device = torch.cuda.current_device()
        key = (device, knobs.runtime.debug, knobs.compilation.instrumentation_mode,
               *[_runtime_key(v) if r else v for v, r in zip(values, entry.runtime)],
               *[(k, v) for k, v in named.items() if k not in params])
        compiled = entry.kernels.get(key)
    except (_Slow, TypeError):  # TypeError: an unhashable value
        return kernel[grid](*args, **kwargs)
    if compiled is None or mode == "check":
        chosen = kernel[grid](*args, **kwargs)
        if mode == "check" and compiled is not None and chosen is not compiled:
            raise AssertionError(f"fast launch of {fn.__name__}: its key picked another kernel than Triton did")
        if chosen is not None and not hasattr(chosen, "result"):  # a finished compile (not an async future)
            entry.kernels[key] = chosen
        return chosen
    g = grid(dict(zip(names, values))) if callable(grid) else grid  # as Triton: every parameter
    g0 = g[0]
    g1 = g[1] if len(g) > 1 else 1
    g2 = g[2] if len(g) > 2 else 1
    compiled.run(g0, g1, g2, _raw_stream(device), compiled.function, compiled.packed_metadata, None, None, None,
                 *values)
    return compiled
