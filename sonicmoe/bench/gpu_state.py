"""The GPU's SM clock, board power and temperature during a measurement, read through NVML.

An H100 or H200 running an MoE layer sits at its 700 W power cap, so a timing is only as good as the clock it ran
at: the power limiter lowers the SM clock from 1980 MHz to 1.3-1.7 GHz, and lower still as the chip warms (session 50:
the 120B-n1024 layer on an H100 ran 3% slower after 6 s of load than in its first 3 s, 65 → 72 °C, at 700 W
throughout). ``sonicmoe bench`` therefore records, beside each timing, the mean SM clock, the mean board power and the
temperature over its window (:class:`GpuWatch`).

NVML is loaded from the driver's ``libnvidia-ml.so.1`` with ctypes (no Python dependency). Where it is missing
(CPU machines, other vendors' GPUs, a driver without NVML) :func:`open_nvml` returns None and :class:`GpuWatch`
records nothing: a measurement never fails for want of it.
"""

from __future__ import annotations

import ctypes
import statistics
import threading
import time

import torch

NVML_CLOCK_SM = 1
NVML_TEMPERATURE_GPU = 0


class Nvml:
    """One GPU's NVML handle: SM clock (MHz), energy counter (mJ since the driver loaded), temperature (°C) and the
    active clock-event reasons (bit mask; 0x4 = software power cap). Raises OSError or RuntimeError where NVML or
    the device's handle is not there (use :func:`open_nvml`)."""

    def __init__(self, device: torch.device | int | None = None) -> None:
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        if self.lib.nvmlInit_v2():
            raise RuntimeError("nvmlInit_v2 failed")
        if isinstance(device, int):
            index = device
        elif device is not None and device.index is not None:
            index = device.index
        else:
            index = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        self.handle = ctypes.c_void_p()
        found = False
        if hasattr(props, "pci_bus_id"):  # the CUDA device's own board, whatever CUDA_VISIBLE_DEVICES says
            bus = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0".encode()
            found = not self.lib.nvmlDeviceGetHandleByPciBusId_v2(ctypes.c_char_p(bus), ctypes.byref(self.handle))
        if not found and self.lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index), ctypes.byref(self.handle)):
            raise RuntimeError(f"no NVML handle for CUDA device {index}")
        self._reasons = getattr(self.lib, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            self.lib.nvmlDeviceGetCurrentClocksThrottleReasons

    def _uint(self, fn, *args) -> int:
        value = ctypes.c_uint()
        fn(self.handle, *args, ctypes.byref(value))
        return value.value

    def sm_mhz(self) -> int:
        return self._uint(self.lib.nvmlDeviceGetClockInfo, ctypes.c_uint(NVML_CLOCK_SM))

    def temperature_c(self) -> int:
        return self._uint(self.lib.nvmlDeviceGetTemperature, ctypes.c_uint(NVML_TEMPERATURE_GPU))

    def energy_mj(self) -> int:
        value = ctypes.c_ulonglong()
        if self.lib.nvmlDeviceGetTotalEnergyConsumption(self.handle, ctypes.byref(value)):
            raise RuntimeError("nvmlDeviceGetTotalEnergyConsumption failed")
        return value.value

    def clock_reasons(self) -> int:
        value = ctypes.c_ulonglong()
        self._reasons(self.handle, ctypes.byref(value))
        return value.value


def open_nvml(device: torch.device | int | None = None) -> Nvml | None:
    """:class:`Nvml` for a CUDA ``device``, or None (a CPU device, no NVML, no handle)."""
    if isinstance(device, torch.device) and device.type != "cuda":
        return None
    try:
        return Nvml(device)
    except (OSError, RuntimeError, AttributeError, AssertionError):
        return None


class GpuWatch:
    """Samples a GPU's state on a thread of its own while a ``with`` block runs (or between :meth:`start` and
    :meth:`stop`): every ``period`` s, (host time from ``time.perf_counter``, SM MHz, energy mJ, °C, clock-event
    reasons) in :attr:`samples`. ctypes releases the GIL during each NVML call, so the launching thread is barely
    disturbed. Without NVML (:func:`open_nvml` None) it samples nothing and :meth:`between` / :meth:`last` return
    None."""

    def __init__(self, device: torch.device | int | None = None, period: float = 0.02,
                 nvml: Nvml | None = None) -> None:
        self.nvml = nvml if nvml is not None else open_nvml(device)
        self.period = period
        self.samples: list[tuple[float, int, int, int, int]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.stopped_at: float | None = None

    def _run(self) -> None:
        nv = self.nvml
        while True:
            try:
                self.samples.append((time.perf_counter(), nv.sm_mhz(), nv.energy_mj(), nv.temperature_c(),
                                     nv.clock_reasons()))
            except (OSError, RuntimeError):  # e.g. a board without an energy counter: record what came so far
                return
            if self._stop.wait(self.period):
                break

    def start(self) -> GpuWatch:
        """Start sampling (again, after :meth:`stop`: the stop event is cleared, else the new thread would take one
        sample and end; the samples taken so far are kept)."""
        if self.nvml is not None and self._thread is None:
            self._stop.clear()
            self.stopped_at = None
            self._thread = threading.Thread(target=self._run, daemon=True, name="sonicmoe-gpu-watch")
            self._thread.start()
        return self

    def stop(self) -> None:
        """End the sampling at this host time (:attr:`stopped_at`). A sample the thread took after it, before it saw
        the stop, lies outside the block and is dropped (the ``with`` block's samples are exactly those before)."""
        self.stopped_at = time.perf_counter()
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            while self.samples and self.samples[-1][0] > self.stopped_at:
                self.samples.pop()

    def __enter__(self) -> GpuWatch:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def between(self, t0: float, t1: float) -> dict | None:
        """Over host times [t0, t1]: ``sm_mhz`` (mean of the samples), ``watts`` (energy counter, first to last
        sample), ``temp_c`` (the highest), ``clock_reasons`` (hex OR of the samples' reasons) and ``samples``. None
        with fewer than two samples there."""
        s = [x for x in self.samples if t0 <= x[0] <= t1]
        if len(s) < 2:
            return None
        dt = s[-1][0] - s[0][0]
        reasons = 0
        for x in s:
            reasons |= x[4]
        return {"sm_mhz": round(statistics.fmean(x[1] for x in s), 1),
                "watts": round((s[-1][2] - s[0][2]) / 1e3 / dt, 1) if dt > 0 else None,
                "temp_c": max(x[3] for x in s), "clock_reasons": hex(reasons), "samples": len(s)}

    def last(self, seconds: float) -> dict | None:
        """:meth:`between` over the last ``seconds`` before :meth:`stop` (a timing window that ended there)."""
        end = self.stopped_at if self.stopped_at is not None else time.perf_counter()
        return self.between(end - seconds, end)
