"""PNG plots made only from a results file (``sonicmoe bench --plot-from FILE.json``).

* ``<stem>_granularity_tflops.png``: TFLOP/s (forward, forward+backward) vs granularity G = d/n, one
  panel per group of shapes that varies G (the granularity and iso-FLOPs presets), a line per backend.
* ``<stem>_granularity_memory.png``: activation memory held after forward (solid) and peak over
  forward+backward (dashed) vs G, with SPEC §3's 2·T·d + 4·TK·n (dotted).
* ``<stem>_speedup.png``: per shape, ours (the ratio base) over each other backend (base/this ms > 1 =
  ours faster; for the upper bound, the fraction of its throughput).
* ``<stem>_token_rounding.png``: our forward / forward+backward time vs E, top-k vs token rounding.

matplotlib is optional (``pip install sonicmoe[bench]``); without it the plots are skipped with a message.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

from .report import activations, load_results, spec_beyond_x_bytes

GiB = 2**30



def _finish(plt, fig, doc, path, drawn: bool) -> Path | None:
    """Title, lay out and save ``fig`` to ``path`` (or drop it when nothing was drawn)."""
    if not drawn:
        plt.close(fig)
        return None
    fig.suptitle(_title(doc), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _ok(b: dict | None) -> bool:
    return bool(b) and b.get("status") == "ok"


def _val(d, *keys):
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d if not (isinstance(d, float) and not math.isfinite(d)) else None


def _backend_names(records: list[dict]) -> list[str]:
    names: list[str] = []
    for r in records:
        for n in (r.get("backends") or {}):
            if n not in names:
                names.append(n)
    return names


def granularity_groups(records: list[dict]) -> dict[str, list[dict]]:
    """Top-k records grouped by ``group``, keeping the granularity sweeps — groups at one (T, d) with at least two
    different G — sorted by G. Groups of unrelated shapes (the real-model preset, whose d differ) are left to the
    speed-up chart: a line through them would read as a trend in G."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        if r.get("routing", "topk") == "topk" and r.get("backends"):
            groups[r.get("group", "custom")].append(r)
    return {g: sorted(rs, key=lambda r: r["G"]) for g, rs in groups.items()
            if len({r["G"] for r in rs}) >= 2 and len({(r["T"], r["d"]) for r in rs}) == 1}


def _setup():
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _title(doc: dict) -> str:
    env = doc.get("env", {})
    acts = activations(doc)
    act = "" if not acts or acts == ["swiglu"] else f" | activation {', '.join(acts)}"
    return (f"{env.get('device')} | torch {env.get('torch')} | triton {env.get('triton')} | "
            f"{str(env.get('git_commit'))[:10]} | {str(doc.get('date'))[:10]}{act}")


def _plot_granularity(plt, doc, groups, names, path) -> Path | None:
    phases = [("fwd", "forward"), ("total", "forward+backward")]
    fig, axes = plt.subplots(len(phases), len(groups), figsize=(4.2 * len(groups), 3.6 * len(phases)),
                             squeeze=False)
    drawn = False
    for j, (g, recs) in enumerate(groups.items()):
        for i, (phase, label) in enumerate(phases):
            ax = axes[i][j]
            for name in names:
                pts = [(r["G"], _val(r["backends"].get(name), phase, "tflops")) for r in recs
                       if _ok(r["backends"].get(name))]
                pts = [(x, y) for x, y in pts if y is not None]
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=name)
                    drawn = True
            ax.set_xscale("log", base=2)
            ax.set_xticks([r["G"] for r in recs], [f"{r['G']:g}\n(n={r['n']})" for r in recs])
            ax.set_title(f"{g}: {label}")
            ax.set_xlabel("granularity G = d/n")
            ax.set_ylabel("TFLOP/s")
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=7)
    return _finish(plt, fig, doc, path, drawn)


def _plot_memory(plt, doc, groups, names, path) -> Path | None:
    fig, axes = plt.subplots(1, len(groups), figsize=(4.2 * len(groups), 3.8), squeeze=False)
    drawn = False
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for j, (g, recs) in enumerate(groups.items()):
        ax = axes[0][j]
        for k, name in enumerate(names):
            c = colors[k % len(colors)]
            for key, style, suffix in (("held_bytes", "-", "held"), ("peak_bytes", "--", "peak")):
                pts = [(r["G"], _val(r["backends"].get(name), "memory", key)) for r in recs
                       if _ok(r["backends"].get(name))]
                pts = [(x, y / GiB) for x, y in pts if y is not None]
                if pts:
                    ax.plot(*zip(*pts), style, marker="o", color=c, label=f"{name} {suffix}")
                    drawn = True
        # held leaves the inputs out, X among them: the line is SPEC §3's 2Td + 4TKn less X
        spec = [(r["G"], spec_beyond_x_bytes(r) / GiB) for r in recs if spec_beyond_x_bytes(r)]
        if spec and drawn:
            ax.plot(*zip(*spec), ":", color="black", label="4TKn (SPEC §3 less the input X)")
        ax.set_xscale("log", base=2)
        ax.set_xticks([r["G"] for r in recs], [f"{r['G']:g}" for r in recs])
        ax.set_title(f"{g}: activation memory")
        ax.set_xlabel("granularity G = d/n")
        ax.set_ylabel("GiB")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=6, loc="best")
    return _finish(plt, fig, doc, path, drawn)


def _plot_speedup(plt, doc, records, path) -> Path | None:
    recs = [r for r in records if r.get("ratios")]
    if not recs:
        return None
    others = []
    for r in recs:
        for n in r["ratios"]:
            if n not in others:
                others.append(n)
    phases = [p for p in ("fwd", "total") if any(_val(r, "ratios", n, p) for r in recs for n in others)]
    if not phases:
        return None
    fig, axes = plt.subplots(len(phases), 1, figsize=(max(6.0, 1.1 * len(recs) + 2), 3.4 * len(phases)),
                             squeeze=False)
    width = 0.8 / max(1, len(others))
    labels = [r["name"] + ("" if r.get("routing", "topk") == "topk" else f"\n[{r['routing']}]") for r in recs]
    for i, phase in enumerate(phases):
        ax = axes[i][0]
        for k, n in enumerate(others):
            xs, ys = [], []
            for idx, r in enumerate(recs):
                v = _val(r, "ratios", n, phase)
                if v is not None:
                    xs.append(idx + (k - (len(others) - 1) / 2) * width)
                    ys.append(v)
            if ys:
                ax.bar(xs, ys, width=width, label=f"vs {n}")
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks(range(len(recs)), labels, rotation=30, ha="right", fontsize=7)
        base = ", ".join(sorted({r.get("ratio_base") for r in recs if r.get("ratio_base")}))
        ax.set_ylabel(f"{base} speed-up ({'fwd' if phase == 'fwd' else 'fwd+bwd'})")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    return _finish(plt, fig, doc, path, True)


def _plot_token_rounding(plt, doc, records, path) -> Path | None:
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        groups[r.get("group", "custom")].append(r)
    groups = {g: rs for g, rs in groups.items() if {"topk", "token_rounding"} <= {r.get("routing") for r in rs}}
    if not groups:
        return None
    fig, axes = plt.subplots(1, len(groups), figsize=(4.4 * len(groups), 3.6), squeeze=False)
    drawn = False
    for j, (g, rs) in enumerate(groups.items()):
        ax = axes[0][j]
        for mode, style in (("topk", "-"), ("token_rounding", "--")):
            for phase in ("fwd", "total"):
                pts = []
                for r in sorted((r for r in rs if r.get("routing") == mode), key=lambda r: r["E"]):
                    b = (r.get("backends") or {}).get("triton")  # ours only: never torch's timings as ours
                    v = _val(b, phase, "ms", "p50") if _ok(b) else None
                    if v is not None:
                        pts.append((r["E"], v))
                if pts:
                    ax.plot(*zip(*pts), style, marker="o", label=f"{mode} {phase}")
                    drawn = True
        ax.set_xscale("log", base=2)
        ax.set_title(g)
        ax.set_xlabel("E (experts)")
        ax.set_ylabel("ms (ours)")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    return _finish(plt, fig, doc, path, drawn)


def plot_from_file(results_file: str, out_dir: str | None = None, log=print) -> list[Path]:
    """Regenerate every applicable PNG from ``results_file`` into ``out_dir`` (default: next to it).

    Returns the written paths ([] when matplotlib is missing or nothing applies).
    """
    doc = load_results(results_file)
    plt = _setup()
    if plt is None:
        log("plots skipped: matplotlib is not installed (pip install matplotlib)")
        return []
    src = Path(results_file)
    out = Path(out_dir) if out_dir else src.parent
    out.mkdir(parents=True, exist_ok=True)
    stem = src.stem
    records = doc.get("results", [])
    names = _backend_names(records)
    groups = granularity_groups(records)
    written = []
    if groups:
        written.append(_plot_granularity(plt, doc, groups, names, out / f"{stem}_granularity_tflops.png"))
        written.append(_plot_memory(plt, doc, groups, names, out / f"{stem}_granularity_memory.png"))
    written.append(_plot_speedup(plt, doc, records, out / f"{stem}_speedup.png"))
    written.append(_plot_token_rounding(plt, doc, records, out / f"{stem}_token_rounding.png"))
    written = [p for p in written if p is not None]
    for p in written:
        log(f"wrote {p}")
    if not written:
        log("no plot applies to these results (need timings; granularity plots need >= 2 G in a group)")
    return written
