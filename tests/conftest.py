"""Test set-up: on a machine without CUDA, Triton kernels run through the interpreter.

TRITON_INTERPRET must be set before triton is imported; nothing above this file imports it.
The interpreter's tl.dot is wrong on bfloat16 (triton-lang/triton#11584), so interpreter tests use
float32/float16 and bf16 is tested on the GPU (tests marked ``gpu``). On a machine with CUDA, the tests of the
Triton kernels' CPU path (CPU tensors, which only the interpreter runs) are skipped with that reason; the tests
that take the ``device`` fixture run natively there (marked ``gpu`` there too, so that ``-m gpu`` selects them), and the
``gpu``-marked ones only there.
"""

import os

# pytest-xdist on a machine of several GPUs (`gpu_check.sh splitx`): SONICMOE_TEST_GPUS="0,1,2,3" gives worker gwI
# the I-th of them (modulo their number) as its only visible GPU, before anything here asks CUDA for devices
_TEST_GPUS = [g for g in os.environ.get("SONICMOE_TEST_GPUS", "").split(",") if g.strip()]
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _TEST_GPUS and _WORKER.startswith("gw") and _WORKER[2:].isdigit():
    os.environ["CUDA_VISIBLE_DEVICES"] = _TEST_GPUS[int(_WORKER[2:]) % len(_TEST_GPUS)].strip()

import torch  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
# tests use each kernel's pinned tile configuration (fast to compile); autotuned configurations are
# checked against the float32 reference by `sonicmoe bench` before it times them
os.environ.setdefault("SONICMOE_AUTOTUNE", "0")
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # the CPU tests use tiny tensors: one intra-op thread avoids thread-pool churn on small machines
    torch.set_num_threads(1)

import pytest  # noqa: E402


def _cpu_path_only(item) -> bool:
    """A test of the Triton kernels' CPU path: marked ``interpreter`` or run with ``backend="triton"``, not marked
    ``gpu``, and without the ``device`` fixture (which puts a test on CUDA where there is one). Such tests build
    CPU tensors, which only Triton's interpreter runs."""
    if "gpu" in item.keywords or "device" in getattr(item, "fixturenames", ()):
        return False
    params = getattr(getattr(item, "callspec", None), "params", {})
    return "interpreter" in item.keywords or params.get("backend") == "triton"


@pytest.hookimpl(tryfirst=True)  # before pytest's own hook deselects by -m
def pytest_collection_modifyitems(config, items):
    for item in items:
        if "device" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.device_fixture)
    if HAS_CUDA:
        # the tests of the device fixture run natively here: `-m gpu` (gpu_check.sh) selects them too. Before session
        # 74 it did not, and the GPU suite left out these 213 tests
        for item in items:
            if "device_fixture" in item.keywords:
                item.add_marker(pytest.mark.gpu)
        skip_cpu = pytest.mark.skip(reason="the Triton kernels' CPU path (the interpreter, used without CUDA); on "
                                    "this machine the gpu-marked tests run the kernels natively")
        for item in items:
            if _cpu_path_only(item):
                item.add_marker(skip_cpu)
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    """Where kernel tests run: CUDA when present, else CPU through the Triton interpreter."""
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture(scope="module")
def poisoned_outputs():
    """SONICMOE_POISON_OUTPUTS=1 for a whole module (hypothesis tests, which cannot take function-scoped fixtures):
    every kernel output starts as NaN, so an element no program writes fails the comparison."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SONICMOE_POISON_OUTPUTS", "1")
        yield


class _OnCuda:
    """A CPU tensor's stand-in that reports itself on cuda:0 (everything else is the tensor's): for the Gluon kernels'
    host rules, which read only metadata (dtype, shape, contiguity, the address's alignment, the device)."""

    is_cuda = True
    device = torch.device("cuda", 0)

    def __init__(self, t: torch.Tensor):
        self._t = t

    def __getattr__(self, name):
        return getattr(self._t, name)


class FakeSm90:
    """What the ``fake_sm90`` fixture gives: call it on CPU tensors for their stand-ins on cuda:0; set
    ``capability`` to make torch.cuda.get_device_capability answer another one."""

    def __init__(self):
        self.capability = (9, 0)

    def __call__(self, *tensors):
        wrapped = [None if t is None else _OnCuda(t) for t in tensors]
        return wrapped[0] if len(wrapped) == 1 else wrapped


@pytest.fixture
def fake_sm90(monkeypatch):
    """The Gluon kernels' host rules (``*_supported``) on CPU as on an sm_90 GPU: Gluon present on its Triton release,
    not interpreting (the SONICMOE_GLUON* switches still read), torch.cuda.get_device_capability answering
    ``fake.capability`` (default (9, 0)), and ``fake(t, ...)`` CPU tensors' stand-ins on cuda:0. Without this the
    rules' shape, dtype and capability checks run on a GPU only (sm_90 ones: never the capability check's other
    side)."""
    from sonicmoe.ops import grouped_gemm_ws

    fake = FakeSm90()
    monkeypatch.setattr(grouped_gemm_ws, "HAVE_GLUON", True)
    monkeypatch.setattr(grouped_gemm_ws, "interpreting", lambda: False)
    monkeypatch.setattr(grouped_gemm_ws, "triton_release", lambda: grouped_gemm_ws.GLUON_TRITON)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: fake.capability)
    for name in ("SONICMOE_GLUON", "SONICMOE_GLUON_DXT", "SONICMOE_GLUON_UP", "SONICMOE_GLUON_DH",
                 "SONICMOE_GLUON_WGRAD", "SONICMOE_GLUON_LONG"):
        monkeypatch.delenv(name, raising=False)
    return fake
