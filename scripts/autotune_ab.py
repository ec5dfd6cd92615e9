"""The 7B layer's forward and forward+backward timed in one process with autotuned tiles, pinned tiles, and
autotuned tiles with one kernel's config pinned, in alternating rounds (GPU).

usage: python scripts/autotune_ab.py [--shape T,d,n,E,K] [--rounds N] [--pin-one aggregation,varlen_m,up_proj]

Each mode switches through SONICMOE_AUTOTUNE (read at each launch) and, for ``autotuned+pinned <name>``, by
passing that launcher its pinned config. The timer is the layer benchmark's (do_bench median, L2 flushed);
the same inputs throughout. Used to find which kernel's choice makes an autotuned layer slower than the
pinned one when the kernels' summed times agree.
"""

from __future__ import annotations

import argparse
import os
import statistics

from host_overhead import layer_calls  # scripts/ is on sys.path when run as a script
from triton.testing import do_bench

from sonicmoe.ops import aggregation, grouped_gemm, up_proj

# name -> (module, launcher): "varlen_m" pins the down-projection and dX~ (both go through varlen_m_gemm)
_PINNABLE = {"aggregation": (aggregation, "gather_sum"), "varlen_m": (grouped_gemm, "varlen_m_gemm"),
             "up_proj": (up_proj, "up_proj")}


def _pin(name: str):
    """Patch the launcher ``name`` to pass its pinned config; returns the undo function."""
    mod, attr = _PINNABLE[name]
    orig = getattr(mod, attr)

    def pinned(*args, **kwargs):
        if kwargs.get("config") is None:
            os.environ["SONICMOE_AUTOTUNE"] = "0"
            try:
                return orig(*args, **kwargs)
            finally:
                os.environ["SONICMOE_AUTOTUNE"] = "1"
        return orig(*args, **kwargs)

    # the layer's module imports the launchers by name: its reference is patched too, where it has one
    from sonicmoe.ops import library

    modules = (mod, library) if getattr(library, attr, None) is orig else (mod,)
    for m in modules:
        setattr(m, attr, pinned)

    def undo():
        for m in modules:
            setattr(m, attr, orig)

    return undo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="24576,1536,256,128,8")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pin-one", default="aggregation,varlen_m,up_proj")
    args = ap.parse_args()
    t, d, n, e, k = (int(v) for v in args.shape.split(","))
    _, _, _, leaves, fwd, fwd_bwd = layer_calls(args.shape)

    modes = ["autotuned", "pinned"] + [f"autotuned+pinned {m}" for m in args.pin_one.split(",") if m]
    times: dict[str, dict[str, list[float]]] = {m: {"fwd": [], "fwd+bwd": []} for m in modes}
    flops = {"fwd": 6 * t * k * n * d, "fwd+bwd": 18 * t * k * n * d}
    for rnd in range(args.rounds):
        for mode in modes:
            os.environ["SONICMOE_AUTOTUNE"] = "0" if mode == "pinned" else "1"
            undo = _pin(mode.split()[-1]) if "+" in mode else None
            for phase, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
                fn()  # the first call of a mode tunes
                ms = do_bench(fn, warmup=25, rep=100, grad_to_none=leaves, return_mode="median")
                times[mode][phase].append(ms)
            if undo:
                undo()
            print(f"round {rnd} {mode:28s} fwd {times[mode]['fwd'][-1]:.4f} ms  fwd+bwd "
                  f"{times[mode]['fwd+bwd'][-1]:.4f} ms", flush=True)
    print("== medians over rounds")
    for mode in modes:
        f, fb = (statistics.median(times[mode][ph]) for ph in ("fwd", "fwd+bwd"))
        print(f"{mode:28s} fwd {f:.4f} ms ({flops['fwd'] / f / 1e9:.1f} TFLOP/s)   fwd+bwd {fb:.4f} ms "
              f"({flops['fwd+bwd'] / fb / 1e9:.1f} TFLOP/s)")


if __name__ == "__main__":
    main()
