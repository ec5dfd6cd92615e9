"""Per-kernel floors of the expert kernels: each kernel's FLOPs and compulsory DRAM bytes against a GPU's peaks.

usage: python benchmarks/roofline.py --breakdown B.json [B2.json ...]
                                     (--measure-peaks [--peaks-out P.json] | --peaks P.json | --tflops X --dram-tbs Y)
                                     [--json OUT] [--plot OUT.png]
       python benchmarks/roofline.py --plot-from R.json --plot OUT.png    (redraw from a --json file)

For every (shape, routing) record of a ``benchmarks/kernel_breakdown.py --json`` file, and for each of its eight
kernels: the useful FLOPs (SPEC §6 counts), the bytes that must cross DRAM at least once (every operand read once,
every output written once: gathered rows counted once per token, weights once per expert), the two floors
FLOPs / peak FLOP rate and bytes / peak bandwidth, which of the two binds, and the measured time over the larger
floor. A kernel whose DRAM floor is near its measured time cannot get much faster by doing less arithmetic, which
is what token rounding saves (padded rows of partly filled tiles), so at such shapes its kernel-time speed-up
stays small.

The peaks are measured on the GPU at hand with ``--measure-peaks`` (a bf16 ``torch.matmul`` of 8192³ and a copy
of 2 GiB, do_bench medians, under whatever power and clock limits hold at that moment), read from a JSON file
that such a run wrote (``--peaks``), or given. Only compare floors with timings taken on the same machine.
``--plot`` draws, per (shape, routing), each kernel's measured time beside its two floors (matplotlib).
"""

from __future__ import annotations

import argparse
import json

# the kernel rows of kernel_breakdown.py, forward first
UP, DOWN, AGG, DH, DW2, DXT, DW1, DX_AGG = (
    "up-proj (gather+SwiGLU)", "down-proj", "aggregation", "dH (dA', dS, dH, A')", "dW2 (varlen-K)", "dX~ = dH W1",
    "dW1 (varlen-K)", "dX aggregation")
FORWARD = (UP, DOWN, AGG)
KERNELS = (UP, DOWN, AGG, DH, DW2, DXT, DW1, DX_AGG)


def kernel_costs(t: int, d: int, n: int, e: int, r: int, elem_bytes: int = 2) -> dict[str, tuple[float, float]]:
    """(useful FLOPs, compulsory DRAM bytes) of each expert kernel for T tokens of width d, E experts of
    intermediate size n and R routed rows (T·K under top-k), with ``elem_bytes``-byte activations and weights.

    FLOPs: 2·R·d·2n for the up-projection, dX̃ and dW1, 2·R·n·d for the down-projection, dH and dW2 (their sum is
    18·R·n·d, SPEC §6); the aggregations count none. Bytes: X or dO (T, d) once, W1 (E, 2n, d) and W2 (E, d, n) once,
    and each (R, ·) activation once per read or write: H, A, Y, dH, A′, dX̃, plus dS (R,) float32 written once by
    dH (what the Gluon dH kernel writes where its tiles span all n channels; elsewhere its partials are one per
    N-tile and row, the Triton kernel's one per 16 channels) and the weight gradients written once.
    """
    b = elem_bytes
    x = t * d * b
    w1, w2 = e * 2 * n * d * b, e * d * n * b
    h, a, y = r * 2 * n * b, r * n * b, r * d * b
    ds = 4 * r
    return {
        UP: (4.0 * r * d * n, x + w1 + h + a),
        DOWN: (2.0 * r * n * d, a + w2 + y),
        AGG: (0.0, y + x),
        DH: (2.0 * r * n * d, x + w2 + 2 * h + a + ds),
        DW2: (2.0 * r * n * d, x + a + w2),
        DXT: (4.0 * r * d * n, h + w1 + y),
        DW1: (4.0 * r * d * n, h + x + w1),
        DX_AGG: (0.0, y + x),
    }


def floors(costs: dict[str, tuple[float, float]], tflops: float, dram_tbs: float) -> dict[str, dict]:
    """Per kernel: the FLOP floor and the DRAM floor in ms at ``tflops`` TFLOP/s and ``dram_tbs`` TB/s, the larger
    of the two, and which one it is ("compute" or "memory")."""
    out = {}
    for name, (flops, nbytes) in costs.items():
        f_ms = flops / (tflops * 1e9)
        m_ms = nbytes / (dram_tbs * 1e9)
        out[name] = {"flops": flops, "bytes": nbytes, "flop_floor_ms": f_ms, "dram_floor_ms": m_ms,
                     "floor_ms": max(f_ms, m_ms), "bound": "compute" if f_ms >= m_ms else "memory"}
    return out


def analyse(record: dict, tflops: float, dram_tbs: float) -> dict:
    """One kernel_breakdown record (shape, routing, R, rows) against the floors: per kernel the measured ms, the
    floors and measured / floor; and the forward and forward+backward sums of both."""
    t, d, n, e, _ = record["shape"]
    fl = floors(kernel_costs(t, d, n, e, record["R"]), tflops, dram_tbs)
    measured = {row["kernel"]: row["ms"] for row in record["rows"]}
    kernels = {}
    for name in KERNELS:
        if name in measured:
            kernels[name] = {**fl[name], "ms": measured[name], "over_floor": measured[name] / fl[name]["floor_ms"]}
    sums = {}
    for phase, names in (("fwd", FORWARD), ("fwd+bwd", KERNELS)):
        present = [k for k in names if k in kernels]
        sums[phase] = {"ms": sum(kernels[k]["ms"] for k in present),
                       "floor_ms": sum(kernels[k]["floor_ms"] for k in present)}
    return {"shape": record["shape"], "routing": record["routing"], "R": record["R"], "kernels": kernels,
            "sums": sums}


def table(res: dict) -> str:
    """A text table of :func:`analyse`'s result."""
    t, d, n, e, k = res["shape"]
    lines = [f"shape T={t} d={d} n={n} E={e} K={k} routing={res['routing']} R={res['R']}",
             f"  {'kernel':<26} {'ms':>7} {'FLOP floor':>10} {'DRAM floor':>10}  {'bound':<7} {'ms/floor':>8}"]
    for name, row in res["kernels"].items():
        lines.append(f"  {name:<26} {row['ms']:7.3f} {row['flop_floor_ms']:10.3f} {row['dram_floor_ms']:10.3f}  "
                     f"{row['bound']:<7} {row['over_floor']:8.2f}")
    for phase, s in res["sums"].items():
        lines.append(f"  {'sum ' + phase:<26} {s['ms']:7.3f} {'floor':>10} {s['floor_ms']:10.3f}  {'':<7} "
                     f"{s['ms'] / s['floor_ms']:8.2f}")
    return "\n".join(lines)


def plot(doc: dict, path: str) -> None:
    """One panel per (shape, routing) of :func:`analyse` results (``doc["results"]``): per kernel a bar of the
    measured ms and, over it, ticks at the FLOP floor and the DRAM floor; the title gives measured / floor summed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = doc["results"]
    cols = min(2, len(results))
    rows = (len(results) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6.4 * cols, 3.2 * rows), squeeze=False)
    short = {UP: "up", DOWN: "down", AGG: "agg", DH: "dH", DW2: "dW2", DXT: "dX~", DW1: "dW1", DX_AGG: "dX agg"}
    for ax, res in zip(axes.flat, results):
        names = list(res["kernels"])
        xs = range(len(names))
        ms = [res["kernels"][k]["ms"] for k in names]
        ax.bar(xs, ms, color="#8fb3d9", label="measured")
        for key, style, label in (("flop_floor_ms", "k_", "FLOP floor"), ("dram_floor_ms", "r_", "DRAM floor")):
            ax.plot(xs, [res["kernels"][k][key] for k in names], style, markersize=18, mew=2, label=label)
        ax.set_xticks(list(xs), [short.get(k, k) for k in names], fontsize=8)
        ax.set_ylabel("ms")
        t, d, n, e, k = res["shape"]
        s = res["sums"]["fwd+bwd"]
        ax.set_title(f"({t}, {d}, {n}, {e}, {k}) {res['routing']}: sum {s['ms']:.2f} ms = "
                     f"{s['ms'] / s['floor_ms']:.2f}x floor", fontsize=8)
    for ax in axes.flat[len(results):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    peaks = doc["peaks"]
    fig.suptitle(f"expert kernels against their floors: {peaks['tflops']:.0f} TFLOP/s, {peaks['dram_tbs']:.2f} TB/s"
                 + (f" ({peaks['device']})" if "device" in peaks else ""), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def measure_peaks() -> dict:
    """bf16 dense GEMM TFLOP/s (8192³ ``torch.matmul``) and DRAM TB/s (a 2 GiB device copy: read + write), do_bench
    medians on the current GPU."""
    import torch
    from triton.testing import do_bench

    from sonicmoe.bench.measure import SETTLED_WARMUP_MS

    m = 8192
    a = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    gemm_ms = do_bench(lambda: a @ b, warmup=SETTLED_WARMUP_MS, rep=300, return_mode="median")
    src = torch.randn(2**30, device="cuda", dtype=torch.bfloat16)  # 2 GiB
    dst = torch.empty_like(src)
    copy_ms = do_bench(lambda: dst.copy_(src), warmup=SETTLED_WARMUP_MS, rep=300, return_mode="median")
    return {"device": torch.cuda.get_device_name(), "gemm_8192_ms": gemm_ms, "tflops": 2 * m**3 / gemm_ms / 1e9,
            "copy_2gib_ms": copy_ms, "dram_tbs": 2 * src.numel() * src.element_size() / copy_ms / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--breakdown", nargs="+", default=None, help="kernel_breakdown.py --json files")
    ap.add_argument("--plot", default=None, help="draw the kernels against their floors to this PNG")
    ap.add_argument("--plot-from", default=None, help="a --json file of an earlier run: only draw --plot from it")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--measure-peaks", action="store_true", help="measure the peaks on this GPU")
    src.add_argument("--peaks", default=None, help="a JSON file with 'tflops' and 'dram_tbs'")
    src.add_argument("--tflops", type=float, default=None, help="peak bf16 TFLOP/s (with --dram-tbs)")
    ap.add_argument("--dram-tbs", type=float, default=None)
    ap.add_argument("--peaks-out", default=None, help="write the measured peaks here")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.plot_from:
        if not args.plot:
            ap.error("--plot-from needs --plot")
        with open(args.plot_from) as f:
            plot(json.load(f), args.plot)
        return
    if not args.breakdown:
        ap.error("--breakdown is required (or --plot-from)")
    if args.measure_peaks:
        peaks = measure_peaks()
        if args.peaks_out:
            with open(args.peaks_out, "w") as f:
                json.dump(peaks, f, indent=1)
    elif args.peaks:
        with open(args.peaks) as f:
            peaks = json.load(f)
    else:
        if args.tflops is None or args.dram_tbs is None:
            ap.error("give the peaks: --measure-peaks, --peaks or --tflops with --dram-tbs")
        peaks = {"tflops": args.tflops, "dram_tbs": args.dram_tbs}
    print(f"peaks: {peaks['tflops']:.1f} TFLOP/s, {peaks['dram_tbs']:.2f} TB/s"
          + (f" ({peaks['device']})" if "device" in peaks else ""))
    results = []
    for path in args.breakdown:
        with open(path) as f:
            data = json.load(f)
        if not (isinstance(data, dict) and isinstance(data.get("records"), list)):
            bench = isinstance(data, dict) and "results" in data  # `sonicmoe bench`'s, the likely mix-up
            ap.error(f"--breakdown {path}: {'a sonicmoe bench results file, ' if bench else ''}not a "
                     "kernel_breakdown.py --json file (no 'records' list)")
        for rec in data["records"]:
            if rec["routing"] in ("routing", "dense"):
                continue
            res = analyse(rec, peaks["tflops"], peaks["dram_tbs"])
            res["breakdown"] = path
            results.append(res)
            print(table(res))
    doc = {"peaks": peaks, "results": results}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    if args.plot:
        plot(doc, args.plot)


if __name__ == "__main__":
    main()
