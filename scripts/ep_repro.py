"""The experts call of each rank of the two-rank expert-parallel test, replayed in one process without collectives.

usage: python scripts/ep_repro.py dump DIR    (any machine: two gloo ranks on the CPU, torch backend; DIR/rankR_S.pt)
       python scripts/ep_repro.py replay DIR  (a GPU: each rank's received rows through sonicmoe.experts, triton, bf16)
       python scripts/ep_repro.py live DIR    (a GPU: the two ranks on it over gloo, triton, bf16, every step
                                               synchronised and logged with the local call's tensor layouts)

Session 71: the two-rank GPU test of tests/test_expert_parallel.py (both ranks sharing one H200 over gloo) stopped
with an illegal memory access in the experts' backward on rank 1. ``dump`` records what each rank's local
:func:`sonicmoe.experts` call got in each of the test's routings (the received rows X_recv, their scores, their local
experts, this rank's weights and biases, and the output gradient its backward got); ``replay`` runs those calls on
the GPU in bf16, one process, no process group, and checks each against the float32 reference; ``live`` runs the
two ranks on the GPU, synchronising and logging each step with the layouts of the local call's tensors.

Session 72: the crash was the local call of the rank that received no row (X_recv of 0 rows; the routing where every
pair goes to rank 0's experts): the varlen-K GEMM's step without a whole chunk loaded the clamped row 0 of an empty
operand. The experts now launch nothing without rows (test_kernels.py::test_experts_without_rows).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _describe(name: str, v) -> str:
    if not isinstance(v, torch.Tensor):
        return f"{name}={v!r}"
    return (f"{name}{tuple(v.shape)}:{str(v.dtype).removeprefix('torch.')} stride={v.stride()} "
            f"offset={v.storage_offset()} ptr%16={v.data_ptr() % 16} contiguous={v.is_contiguous()}")


def _dump_worker(rank: int, world: int, out_dir: str, device_type: str = "cpu", dtype_name: str = "float32",
                 backend: str = "torch") -> None:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
    import test_expert_parallel as t

    import sonicmoe.expert_parallel as ep

    live = device_type == "cuda"  # live: both ranks on GPU 0 over gloo, each step synchronised and logged
    device, dtype = torch.device(device_type), getattr(torch, dtype_name)
    if live:
        torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/init", rank=rank, world_size=world)

    def log(msg: str) -> None:
        if live:
            torch.cuda.synchronize()
        print(f"[rank {rank}] {msg}", flush=True)

    calls = []
    plain = ep.experts

    def recording(x, w1, w2, routing, pair_scores, b1=None, b2=None, **kw):
        log("local experts call: " + "; ".join(_describe(k, v) for k, v in dict(
            x=x, w1=w1, w2=w2, b1=b1, b2=b2, pair_scores=pair_scores, kw=kw, **{f: getattr(routing, f) for f in (
                "expert_offsets", "row_token", "row_pair", "pair_row", "token_offsets", "token_rows",
                "tile_rows")}).items()))
        out = plain(x, w1, w2, routing, pair_scores, b1, b2, **kw)
        log("local experts forward done")
        record = {"x": x.detach().clone(), "w1": w1.detach().clone(), "w2": w2.detach().clone(),
                  "b1": None if b1 is None else b1.detach().clone(), "b2": None if b2 is None else b2.detach().clone(),
                  "scores": pair_scores.detach().clone(),
                  "row_expert": routing.row_expert()[routing.pair_row.long()].clone()}  # in received (token) order
        calls.append(record)
        def hook(g):
            log("local experts backward starts: " + _describe("dout", g))
            record["dout"] = g.detach().clone()

        out.register_hook(hook)
        return out

    ep.experts = recording
    try:
        for name, (tokens, k, choice) in t._scenarios().items():
            calls.clear()
            log(f"scenario {name}")
            p = t._problem(tokens, k, choice, dtype, device)
            lo, e_loc = sum(tokens[:rank]), t.E // world
            own = slice(rank * e_loc, (rank + 1) * e_loc)
            pt, pe, scores, pad = p["pairs"][rank]
            routing = t.routing_from_pairs(pt, pe, tokens[rank], t.E, token_major=True, padding=pad > 0)
            for _ in range(2 if live else 1):  # the test calls it twice (a bitwise rerun check)
                x = p["x"][lo:lo + tokens[rank]].clone().requires_grad_(True)
                out = ep.expert_parallel_experts(x, p["w1"][own], p["w2"][own], routing, scores, p["b1"][own],
                                                 p["b2"][own], backend=backend)
                log("forward done")
                out.backward(p["dout"][lo:lo + tokens[rank]])
                log("backward done")
            calls[0].setdefault("dout", torch.zeros_like(calls[0]["x"]))
            if not live:
                torch.save(calls[0], f"{out_dir}/rank{rank}_{name}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def replay(out_dir: str, device: str, dtype: torch.dtype) -> None:
    import sonicmoe
    from sonicmoe.testing import rel_err

    for path in sorted(pathlib.Path(out_dir).glob("rank*.pt")):
        c = torch.load(path)
        counts = torch.bincount(c["row_expert"], minlength=c["w1"].shape[0]).tolist()
        print(f"{path.name}: M={c['x'].shape[0]} rows, per expert {counts}", flush=True)
        routing = sonicmoe.routing_from_topk(c["row_expert"][:, None].to(device), c["w1"].shape[0])
        results = {}
        for name, dt, backend in (("triton", dtype, "triton"), ("ref_fp32", torch.float32, "torch")):
            leaves = {key: v.to(device=device, dtype=dt).clone().requires_grad_(True) for key, v in c.items()
                      if key not in ("row_expert", "dout") and v is not None}
            out = sonicmoe.experts(leaves["x"], leaves["w1"], leaves["w2"], routing, leaves["scores"],
                                   leaves.get("b1"), leaves.get("b2"), backend=backend)
            out.backward(c["dout"].to(device=device, dtype=dt))
            if out.is_cuda:
                torch.cuda.synchronize()
            results[name] = {"out": out.detach(), **{key: v.grad for key, v in leaves.items()}}
        errs = {key: rel_err(results["triton"][key], v) for key, v in results["ref_fp32"].items()}
        print("  " + ", ".join(f"{key} {v:.1e}" for key, v in errs.items()), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=["dump", "replay", "live"])
    p.add_argument("dir")
    p.add_argument("--device", default="cuda", help="replay: where (cpu: the Triton interpreter, float32)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = p.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    if args.mode == "dump":
        mp.spawn(_dump_worker, args=(2, os.path.abspath(args.dir)), nprocs=2, join=True)
    elif args.mode == "live":
        mp.spawn(_dump_worker, args=(2, os.path.abspath(args.dir), "cuda", args.dtype, "triton"), nprocs=2, join=True)
    else:
        replay(args.dir, args.device, getattr(torch, args.dtype))


if __name__ == "__main__":
    main()
