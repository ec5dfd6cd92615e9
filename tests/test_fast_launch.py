"""The host fast path for kernel launches (sonicmoe/ops/fast_launch.py).

CPU: the key of each kind of argument is at least as fine as Triton's specialisation, unknown kinds go to
Triton's path, and under the interpreter every launch takes Triton's path with the same result. GPU: a hit
launches the kernel Triton would have chosen (``SONICMOE_FAST_LAUNCH=check`` asserts it on every hit) for
aligned and unaligned tensors, ints 1 / multiples of 16 / others / past int32, and the layer's outputs and
gradients have the same bits with the fast path on and off.
"""

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

import sonicmoe
from sonicmoe.ops import fast_launch
from sonicmoe.ops.fast_launch import _runtime_key, _Slow, launch_kernel
from sonicmoe.testing import random_problem


@triton.jit
def _axpy_kernel(x_ptr, y_ptr, out_ptr, n, alpha, stride, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs * stride, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, x * alpha + y, mask=mask)


def test_runtime_keys_separate_what_triton_specialises():
    """Ints: 1 apart, multiples of 16 apart from others, int32 apart from int64 and uint64; tensors: dtype and
    16-byte alignment; bool and float by type only; None by itself; an unknown kind is refused."""
    keys = [_runtime_key(v) for v in (1, 16, 17, 2**31, 2**31 + 1, 2**63, -16, -17)]
    assert len({keys[0], keys[1], keys[2], keys[3], keys[4], keys[5]}) == 6
    assert keys[1] == keys[6] and keys[2] == keys[7] and keys[2] == _runtime_key(33)
    buf = torch.zeros(64, dtype=torch.float16)
    assert _runtime_key(buf) == _runtime_key(buf[8:]) != _runtime_key(buf[1:])
    assert _runtime_key(buf) != _runtime_key(buf.float())
    assert _runtime_key(True) == _runtime_key(False) != _runtime_key(1)
    assert _runtime_key(0.5) == _runtime_key(2.0) and _runtime_key(None) is None
    with pytest.raises(_Slow):
        _runtime_key("text")


def test_runtime_keys_at_the_edges_of_tritons_classes():
    """The classes' edges: a pointer 8 bytes off 16 is unaligned (as one 2 bytes off); an int divisible by 8 but not
    16 is in the class of odd ints; -2^31 is the lowest int32 (a multiple of 16, with -32), -2^31 - 16 an int64; a
    Parameter (a Tensor subclass) is keyed by dtype and alignment as its data; a TMA descriptor by its type, element
    dtype, block shape and padding."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    buf = torch.zeros(64, dtype=torch.float16)
    assert _runtime_key(buf[4:]) == _runtime_key(buf[1:]) != _runtime_key(buf) == _runtime_key(buf[8:])
    assert _runtime_key(8) == _runtime_key(24) == _runtime_key(17) != _runtime_key(16) == _runtime_key(32)
    assert _runtime_key(-(2**31)) == _runtime_key(-32) != _runtime_key(-(2**31) - 16)
    base = torch.zeros(64)
    for data in (base, base[1:], base[2:], base[4:]):
        param = torch.nn.Parameter(data, requires_grad=False)
        assert type(param) is not torch.Tensor and param.data_ptr() == data.data_ptr()
        assert _runtime_key(param) == _runtime_key(data)
    assert _runtime_key(torch.nn.Parameter(base[1:])) != _runtime_key(torch.nn.Parameter(base[4:]))
    x = torch.zeros(64, 32, dtype=torch.float16)
    desc = TensorDescriptor.from_tensor(x, [16, 32])
    assert _runtime_key(desc) == _runtime_key(TensorDescriptor.from_tensor(x.clone(), [16, 32]))
    for other in (TensorDescriptor.from_tensor(x, [32, 32]), TensorDescriptor.from_tensor(x, [16, 16]),
                  TensorDescriptor.from_tensor(x.float(), [16, 32]),
                  TensorDescriptor(x, list(x.shape), list(x.stride()), [16, 32], padding="nan")):
        assert _runtime_key(other) != _runtime_key(desc)


def test_version_gate_parses_any_version_string():
    assert fast_launch.major_minor("3.6.0") == (3, 6) == fast_launch.major_minor("3.6.0+git1a2b3c")
    assert fast_launch.major_minor("3.5.1") == (3, 5) and fast_launch.major_minor("3.x") == ()


def test_interpreter_or_unset_takes_tritons_path(device, monkeypatch):
    """Every switch value gives the kernel's result (under the interpreter all of them take Triton's path)."""
    x = torch.randn(100, device=device)
    y = torch.randn(100, device=device)
    want = 2.5 * x + y
    for mode in ("1", "0", "check"):
        monkeypatch.setenv("SONICMOE_FAST_LAUNCH", mode)
        out = torch.full_like(x, float("nan"))
        launch_kernel(_axpy_kernel, lambda m: (triton.cdiv(100, m["BLOCK"]),), x, y, out, 100, 2.5, 1, BLOCK=32)
        torch.testing.assert_close(out, want)


def _plain_axpy(x_ptr, y_ptr, out_ptr, n, alpha, stride, BLOCK: tl.constexpr, EXTRA: tl.constexpr = 3):
    pass


class _Compiled:
    """Stands in for a compiled kernel: records the launches made on it."""

    function, packed_metadata = "fn-handle", "meta"

    def __init__(self, kwargs):
        self.kwargs = kwargs  # the keyword arguments Triton's path was given
        self.launches = []

    def run(self, *args):
        self.launches.append(args)


def _stub_tritons_path(monkeypatch, fn: JITFunction) -> list[_Compiled]:
    """``fn``'s own launch path (Triton's) stubbed to make a new :class:`_Compiled` per call, with the device, the
    stream and the version gate stubbed too and the fast path on: returns the list of the kernels made."""
    made = []

    def tritons_path(*args, grid, warmup, **kwargs):
        made.append(_Compiled(kwargs))
        return made[-1]

    monkeypatch.setattr(fn, "run", tritons_path)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(fast_launch, "_raw_stream", lambda device: 1234)
    monkeypatch.setattr(fast_launch, "SUPPORTED", True)
    monkeypatch.setenv("SONICMOE_FAST_LAUNCH", "1")
    return made


def test_keys_hits_and_misses_without_a_gpu(monkeypatch):
    """With Triton's path and the device stubbed: the first launch of each specialisation takes Triton's path and
    records its kernel; a repeat hits and launches it directly with every parameter in the kernel's order (the
    defaults filled in), the grid evaluated on every parameter and no hooks; a change Triton specialises on (an
    unaligned pointer, an int becoming 1, a constexpr, a launch option) misses; mode 0 and a Triton version the
    fast path was not checked against never hit."""
    fn = JITFunction(_plain_axpy)  # a compiled-kernel function even where triton.jit gives the interpreter's
    made = _stub_tritons_path(monkeypatch, fn)
    buf = torch.zeros(64)
    y = torch.zeros(64)
    grid = lambda m: (m["n"] // m["BLOCK"], m["EXTRA"])  # noqa: E731  (EXTRA: a default, filled in as Triton does)

    def go(x, n=32, stride=2, block=16, **opts):
        return launch_kernel(fn, grid, x, y, buf, n=n, alpha=0.5, stride=stride, BLOCK=block, **opts)

    first = go(buf)
    assert len(made) == 1 and not first.launches
    assert go(buf) is first and len(made) == 1
    assert first.launches[-1] == (2, 3, 1, 1234, "fn-handle", "meta", None, None, None,
                                  buf, y, buf, 32, 0.5, 2, 16, 3)
    assert go(buf[4:]) is first  # 16 bytes further: the same alignment class
    for other in (dict(x=buf[1:]), dict(x=buf, n=33), dict(x=buf, stride=1), dict(x=buf, block=32),
                  dict(x=buf, num_warps=8)):
        before = len(made)
        assert go(**other) is made[-1] and len(made) == before + 1
    assert go(buf, n=48) is first and first.launches[-1][:3] == (3, 3, 1)  # 48 % 16 == 0: first's class
    # the key is the parameters in the kernel's order: a default passed as itself, or all arguments by name, is
    # the same launch; another value of it, or a positional argument too many, is not
    assert go(buf, EXTRA=3) is first
    assert launch_kernel(fn, grid, x_ptr=buf, y_ptr=y, out_ptr=buf, n=32, alpha=0.5, stride=2, BLOCK=16) is first
    before = len(made)
    assert go(buf, EXTRA=4) is made[-1] and len(made) == before + 1 and made[-1].launches == []
    assert launch_kernel(fn, grid, buf, y, buf, 32, 0.5, 2, 16, 3, 9) is made[-1] and len(made) == before + 2
    for switch in (lambda: monkeypatch.setenv("SONICMOE_FAST_LAUNCH", "0"),
                   lambda: monkeypatch.setattr(fast_launch, "SUPPORTED", False)):  # e.g. an unchecked Triton
        monkeypatch.setenv("SONICMOE_FAST_LAUNCH", "1")
        switch()
        before = len(made)
        go(buf)
        assert len(made) == before + 1


def test_check_mode_pending_compiles_and_changed_globals_without_a_gpu(monkeypatch):
    """With Triton's path stubbed: every parameter passed positionally hits like a keyed call; under
    SONICMOE_FAST_LAUNCH=check a hit still takes Triton's path and raises where Triton chose another kernel than the
    key's; a launch that hands back an unfinished compile (an async future, with ``result``) records nothing; a
    kernel whose global changed since it compiled always takes Triton's path (which raises there)."""
    fn = JITFunction(_plain_axpy)
    made = _stub_tritons_path(monkeypatch, fn)
    buf, y = torch.zeros(64), torch.zeros(64)

    def go():
        return launch_kernel(fn, (1,), buf, y, buf, 32, 0.5, 2, 16, 3)  # all 8 parameters, by position

    first = go()
    assert go() is first and len(made) == 1 and len(first.launches) == 1
    monkeypatch.setenv("SONICMOE_FAST_LAUNCH", "check")  # Triton's path gives a new kernel: not the key's
    with pytest.raises(AssertionError, match="picked another kernel"):
        go()
    monkeypatch.setenv("SONICMOE_FAST_LAUNCH", "1")
    fn2 = JITFunction(_plain_axpy)
    pending = _stub_tritons_path(monkeypatch, fn2)
    _Compiled.result = None  # what an async compile's future has
    try:
        for _ in range(2):
            launch_kernel(fn2, (1,), buf, y, buf, 32, 0.5, 2, 16, 3)
    finally:
        del _Compiled.result
    assert len(pending) == 2 and not any(k.launches for k in pending)
    fn3 = JITFunction(_plain_axpy)
    made3 = _stub_tritons_path(monkeypatch, fn3)
    monkeypatch.setattr(fn3, "used_global_vals", {("SCALE", 0): (2, {"SCALE": 2})})
    for _ in range(2):
        launch_kernel(fn3, (1,), buf, y, buf, 32, 0.5, 2, 16, 3)
    assert len(made3) == 1  # the global as compiled: hits
    monkeypatch.setattr(fn3, "used_global_vals", {("SCALE", 0): (2, {"SCALE": 3})})
    for _ in range(2):
        launch_kernel(fn3, (1,), buf, y, buf, 32, 0.5, 2, 16, 3)
    assert len(made3) == 3  # changed: Triton's path each time


def _even_axpy(x_ptr, y_ptr, out_ptr, n, alpha, stride, BLOCK: tl.constexpr, EVEN: tl.constexpr = False):
    pass


def test_heuristic_values_are_keyed_without_a_gpu(monkeypatch):
    """A kernel wrapped by ``triton.heuristics`` (as ``common.with_even_flags`` wraps the GEMMs): the value each rule
    derives is part of the key and of the launched arguments. n = 32 and n = 48 share every runtime key (both
    multiples of 16) but not EVEN = n % BLOCK == 0, so the second misses instead of launching the first's binary,
    which has no bounds mask."""
    fn = JITFunction(_even_axpy)
    kernel = triton.heuristics({"EVEN": lambda a: a["n"] % a["BLOCK"] == 0})(fn)
    made = _stub_tritons_path(monkeypatch, fn)
    buf = torch.zeros(64)

    def go(n):
        return launch_kernel(kernel, (1,), buf, buf, buf, n, 0.5, 1, BLOCK=32)

    even = go(32)
    assert even.kwargs["EVEN"] is True and go(32) is even and even.launches[-1][-2:] == (32, True)
    odd = go(48)
    assert odd is not even and odd.kwargs["EVEN"] is False and len(made) == 2
    assert go(48) is odd and odd.launches[-1][-2:] == (32, False)


def _flagged_axpy(x_ptr, n, BLOCK: tl.constexpr, EVEN: tl.constexpr = False, HALF: tl.constexpr = False):
    pass


def test_nested_heuristics_run_outermost_first_without_a_gpu(monkeypatch):
    """Two ``triton.heuristics`` wrappers, the inner rule reading the outer one's value (as Triton runs them: the
    outermost first, each seeing the values set before it): both values are derived in that order, keyed and
    launched; n = 64 and n = 48 share every runtime key and EVEN but not HALF, so the second misses."""
    fn = JITFunction(_flagged_axpy)
    inner = triton.heuristics({"HALF": lambda a: a["EVEN"] and a["n"] % (2 * a["BLOCK"]) == 0})(fn)
    kernel = triton.heuristics({"EVEN": lambda a: a["n"] % a["BLOCK"] == 0})(inner)
    made = _stub_tritons_path(monkeypatch, fn)
    buf = torch.zeros(64)

    def go(n):
        return launch_kernel(kernel, (1,), buf, n, BLOCK=16)

    both = go(64)
    assert (both.kwargs["EVEN"], both.kwargs["HALF"]) == (True, True)
    assert go(64) is both and len(made) == 1 and both.launches[-1][-3:] == (16, True, True)
    even = go(48)
    assert even is not both and (even.kwargs["EVEN"], even.kwargs["HALF"]) == (True, False) and len(made) == 2
    assert go(48) is even and even.launches[-1][-4:] == (48, 16, True, False)


def test_hooks_and_tracing_take_tritons_path_without_a_gpu(monkeypatch):
    """A launch hook (enter or exit: a profiler's), a pre-run hook on the function, or a launch traced by
    torch.compile: every launch takes Triton's path (which runs them), never a direct one; with the hook removed
    the same launch is keyed and hits again."""
    from triton import knobs

    fn = JITFunction(_plain_axpy)
    made = _stub_tritons_path(monkeypatch, fn)
    buf, y = torch.zeros(64), torch.zeros(64)

    def go():
        return launch_kernel(fn, (1,), buf, y, buf, 32, 0.5, 2, 16)

    first = go()
    assert go() is first and len(first.launches) == 1
    hooks = (lambda: monkeypatch.setattr(knobs.runtime.launch_enter_hook, "calls", [print]),
             lambda: monkeypatch.setattr(knobs.runtime.launch_exit_hook, "calls", [print]),
             lambda: monkeypatch.setattr(fn, "pre_run_hooks", [print]),
             lambda: monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True))
    for i, install in enumerate(hooks):
        install()
        before = len(made)
        for _ in range(2):
            assert go() is made[-1]
        assert len(made) == before + 2 and len(first.launches) == 1, i
        monkeypatch.undo()
        made = _stub_tritons_path(monkeypatch, fn)  # undo also took the stubs back
        assert go() is first and len(first.launches) == 2 and not made, i
        first.launches.pop()


def test_key_holds_device_and_debug_and_odd_launches_without_a_gpu(monkeypatch):
    """The key holds the current device and Triton's debug knob (a kernel compiled for another device or without
    debug checks is not launched there); a one-dimensional grid launches (g0, 1, 1) programs; an unhashable
    constexpr takes Triton's path without error; and a stale entry left at a reused ``id`` (a function collected
    and another made at its address) is not used for the new function."""
    from triton import knobs

    fn = JITFunction(_plain_axpy)
    made = _stub_tritons_path(monkeypatch, fn)
    buf, y = torch.zeros(64), torch.zeros(64)

    def go(**opts):
        return launch_kernel(fn, (5,), buf, y, buf, 32, 0.5, 2, **{"BLOCK": 16, **opts})

    first = go()
    assert go() is first and first.launches[-1][:4] == (5, 1, 1, 1234)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    other = go()
    assert other is not first and go() is other and len(made) == 2
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert go() is first
    monkeypatch.setattr(knobs.runtime, "debug", True)
    debug = go()
    assert debug is not first and go() is debug and len(made) == 3
    monkeypatch.setattr(knobs.runtime, "debug", False)
    assert go() is first and len(made) == 3
    for _ in range(2):
        assert go(BLOCK=[16]) is made[-1]
    assert len(made) == 5
    fn2 = JITFunction(_plain_axpy)
    made2 = _stub_tritons_path(monkeypatch, fn2)
    monkeypatch.setitem(fast_launch._LAUNCHES, id(fn2), fast_launch._LAUNCHES[id(fn)])
    launches = len(first.launches)
    got = launch_kernel(fn2, (5,), buf, y, buf, 32, 0.5, 2, BLOCK=16)
    assert got is made2[0] and len(first.launches) == launches
    assert launch_kernel(fn2, (5,), buf, y, buf, 32, 0.5, 2, BLOCK=16) is got and got.launches


def test_hits_launch_every_grid_axis_without_a_gpu(monkeypatch):
    """A hit launches the grid Triton's path was given on all three axes: a 3-tuple as it is, a 2-tuple from a
    callable with (g0, g1, 1), a 1-tuple with (g0, 1, 1)."""
    fn = JITFunction(_plain_axpy)
    made = _stub_tritons_path(monkeypatch, fn)
    buf, y = torch.zeros(64), torch.zeros(64)
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    a, b, c = (int(v) for v in torch.randint(2, 50, (3,), generator=g))
    for grid, want in (((a, b, c), (a, b, c)), (lambda m: (a, m["BLOCK"]), (a, 16, 1)), ((c,), (c, 1, 1))):
        for _ in range(2):
            first = launch_kernel(fn, grid, buf, y, buf, 32, 0.5, 2, BLOCK=16)
        assert first is made[0] and first.launches[-1][:4] == (*want, 1234)
    assert len(made) == 1 and len(made[0].launches) == 5


@pytest.mark.gpu
def test_gpu_hits_launch_tritons_kernel(monkeypatch):
    """Aligned and unaligned operands and ints of every specialisation class, in turn and repeated: each launch is
    right, every hit picks Triton's kernel (check mode), each class got its own entry, and the direct launches of
    the hits that follow are right."""
    fast_launch._LAUNCHES.clear()
    base = torch.randn(4096 + 1, device="cuda", dtype=torch.float16)
    other = torch.randn(4096, device="cuda", dtype=torch.float16)
    cases = []
    for offset in (0, 1, 8):
        for n in (1, 16, 1000, 2048):
            cases.append((offset, n, 1))
    cases.append((0, 1000, 2))
    for mode in ("check", "check", "1"):  # a miss records, a checked hit compares, then direct launches
        monkeypatch.setenv("SONICMOE_FAST_LAUNCH", mode)
        for offset, n, stride in cases:
            x = base[offset:offset + n * stride]
            out = torch.full((n,), float("nan"), device="cuda", dtype=torch.float16)
            launch_kernel(_axpy_kernel, (triton.cdiv(n, 256),), x, other, out, n, 0.5, stride, BLOCK=256)
            torch.testing.assert_close(out, x[::stride] * 0.5 + other[:n])
    entry = fast_launch._LAUNCHES[id(_axpy_kernel)]
    # offsets 0 and 8 (16 bytes) share a specialisation; n = 1, 16, other; stride 1 / 2
    assert len(entry.kernels) >= 2 * 3 + 1
    assert len(set(map(id, entry.kernels.values()))) >= 6


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(300, 256, 128, 8, 2), (1000, 768, 256, 64, 8), (77, 136, 40, 5, 5)])
def test_gpu_layer_bits_with_and_without_fast_path(shape, monkeypatch):
    """bf16, the whole layer (router, experts, aggregation, every gradient): the fast path on, off and checked
    give the same bits, and the checked run asserts every hit picked Triton's kernel."""
    t, d, n, e, k = shape
    p = random_problem(t, d, n, e, device="cuda", dtype=torch.bfloat16, seed=3)
    dout = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)

    def run():
        leaves = [v.detach().clone().requires_grad_(True) for v in (p["x"], p["router_weight"], p["w1"], p["w2"])]
        out = sonicmoe.moe(*leaves, top_k=k, backend="triton").out
        out.backward(dout)
        return [out.detach()] + [v.grad for v in leaves]

    results = {}
    for mode in ("0", "1", "check", "1"):
        monkeypatch.setenv("SONICMOE_FAST_LAUNCH", mode)
        results.setdefault(mode, []).append(run())
    ref = results["0"][0]
    for runs in results.values():
        for got in runs:
            for a, b in zip(ref, got):
                assert not a.isnan().any()
                assert torch.equal(a, b)
