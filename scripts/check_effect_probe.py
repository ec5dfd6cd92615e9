"""Why does `sonicmoe bench` time a slower forward right after its float32 check? (session 31: 7B forward 1.35 ms
after the check against 1.11-1.28 ms without it, on an H200 and an H100; the backward unchanged, the tiles the same)

One process, one bench problem (the 7B shape by default), the triton backend's case. The forward (and the
forward+backward) is timed with the bench's own `bench_ms` (1000 ms warm-up) after each step of the check in turn,
so that the step after which the forward slows down names the cause:

  fresh            nothing before (autotuning happens inside the first timing)
  fwd+bwd call     one forward+backward of the case
  poison           sonicmoe.bench.measure.poison_allocator (1 GiB of 0xFF, freed)
  reference        reference_errors: the float32 per-expert reference and the relative errors
  free_memory      gc.collect() + torch.cuda.empty_cache(), as the runner does after the check
  fresh again      a new case and problem of the same shape (same seed)

usage: python scripts/check_effect_probe.py [--shape T,d,n,E,K] [--backend triton] [--json F]
(CPU smoke run: --device cpu --dtype fp32 --backend torch --shape 64,32,16,4,2)
"""

from __future__ import annotations

import argparse
import json

import torch

from sonicmoe.bench.baselines import REGISTRY
from sonicmoe.bench.measure import bench_ms, free_memory, fwdbwd_fn, poison_allocator, reference_errors
from sonicmoe.bench.problem import make_problem
from sonicmoe.bench.shapes import Shape


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="24576,1536,256,128,8")
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    dims = tuple(int(v) for v in args.shape.split(","))
    shape = Shape("probe", *dims)
    dev = torch.device(args.device)
    rows = []

    def build():
        problem = make_problem(shape, dtype=dtype, device=dev, seed=0)
        return problem, REGISTRY[args.backend].factory(problem, {})

    def timed(label: str, case, problem) -> None:
        fwd = bench_ms(case.forward, device=dev, grad_to_none=case.leaves)["p50"]
        tot = bench_ms(fwdbwd_fn(case.forward, case.leaves, problem.dout), device=dev, grad_to_none=case.leaves)["p50"]
        rows.append({"after": label, "fwd_ms": fwd, "fwdbwd_ms": tot})
        print(f"{label:<16} fwd {fwd:.3f} ms  fwd+bwd {tot:.3f} ms", flush=True)

    problem, case = build()
    timed("fresh", case, problem)
    case.forward().backward(problem.dout)
    timed("fwd+bwd call", case, problem)
    poison_allocator(dev)
    timed("poison", case, problem)
    for t in case.leaves:
        t.grad = None
    out = case.forward()
    out.backward(problem.dout)
    errs = reference_errors(out.detach(), case.ref_spec(), problem.dout)
    del out
    for t in case.leaves:
        t.grad = None
    print("reference errors", {k: f"{v:.2e}" for k, v in errs.items()})
    timed("reference", case, problem)
    free_memory(*case.leaves)
    timed("free_memory", case, problem)
    del case, problem
    free_memory()
    problem, case = build()
    timed("fresh again", case, problem)
    if args.json:
        with open(args.json, "w") as f:
            name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
            json.dump({"device": name, "backend": args.backend, "shape": list(dims), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
