"""Results files, the terminal table and the README markdown table.

A results file (``<date>_<gpu-slug>[_tag].json``) is strict JSON (NaN/Inf written as null)::

    {"schema": "sonicmoe-bench/1", "date": ISO-8601 UTC, "argv": [...], "args": {...},
     "env": {"device", "device_type", "gpu_count", "capability", "memory_bytes", "driver",
             "cuda_driver_api", "cuda", "torch", "triton", "python", "platform", "sonicmoe",
             "switches" {SONICMOE_* environment variables set for the run}, "git_commit", "git_dirty"},
     "timer": "triton.testing.do_bench" | "time.perf_counter",
     "flops": {"fwd": "6*TK*n*d", "bwd": "12*TK*n*d", "total": "18*TK*n*d"},
     "autotune": bool, "tile_configs": {kernel: [{key, dtypes, tile_family, tma_available, config}, ...]},
     "gluon_kernels": [{m, k, E, dtype, transpose_b, config}, ...],
     "gluon_up_kernels": [{d, n, E, dtype, store_h, activation, config}, ...],
     "gluon_wgrad_kernels": [{I, J, E, dtype, p_gather, config}, ...],
     "gluon_dh_kernels": [{d, n, E, dtype, activation, config}, ...],
     "gluon_long_kernels": [{m, k, E, dtype, transpose_b, width, config}, ...],
     "results": [shape record, ...]}

``tile_configs`` lists every tile configuration the autotuners chose during the run
(:func:`sonicmoe.ops.common.tuned_configs`; empty with ``autotune`` false: the pinned configs ran), and
``gluon_kernels`` every shape the Gluon down-projection kernel served (:func:`sonicmoe.ops.grouped_gemm_ws.ws_calls`),
``gluon_up_kernels`` those of the Gluon up-projection (:func:`sonicmoe.ops.up_proj_ws.up_ws_calls`),
``gluon_wgrad_kernels`` those of the Gluon weight gradients (:func:`sonicmoe.ops.weight_grad_ws.wgrad_ws_calls`),
``gluon_dh_kernels`` those of the Gluon dH kernel (:func:`sonicmoe.ops.dh_ws.dh_ws_calls`) and ``gluon_long_kernels``
those of the streamed-B Gluon GEMM (:func:`sonicmoe.ops.varlen_m_ws.long_calls`).

A shape record: ``name, group, T, d, n, E, K, T_preset, G, rho, routing, m_tile, activation (the experts' gated
activation: "swiglu", or "clamped_swiglu" for gpt-oss's; records of files written before it had none and ran SwiGLU),
TK (= R routed pairs), flops {fwd, bwd, total}, spec_held_bytes, dtype, tokens_per_expert {min, mean, max},
padded_rows, status, message, backends {name: row}, ratio_base, ratios {name: {fwd, bwd, total}}``.
A backend row: ``status`` (ok | FAIL | error | oom | skipped), ``message``, ``kind``, ``check``
{errors {out, dx, dw1, dw2, ds, out_rows, dx_rows, dw1_experts, dw2_experts}, tol, passed, worst, T, pairs, router
(the router variant's check, the same fields; ``passed`` null and ``skipped`` its reason where token rounding of the
checked tokens routed no pair)},
``fwd``/``total`` {ms {p20, p50, p80},
tflops, gpu}, ``gpu`` the GPU's state over that timing window {sm_mhz (mean), watts (board, from the energy
counter), temp_c (highest), clock_reasons (hex: NVML's clock-event reasons, 0x4 = the software power cap), samples}
or null without NVML (:mod:`sonicmoe.bench.gpu_state`), ``bwd`` {ms {p50}, tflops} (total − fwd), ``router`` {fwd,
total} (router + metadata included), ``memory`` {held_bytes, fwd_peak_bytes, peak_bytes, grad_bytes, out_bytes},
``info``.
Ratios are other_ms / base_ms (> 1: the base, ours, is faster; vs ``upper``: fraction of the bound).
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from ..provenance import git_commit, git_dirty
from .measure import LOCAL_TOL_FACTOR

SCHEMA = "sonicmoe-bench/1"
FLOP_FORMULAS = {"fwd": "6*TK*n*d", "bwd": "12*TK*n*d", "total": "18*TK*n*d"}


def _run(cmd: list[str], cwd: str | None = None) -> str | None:
    try:
        res = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def git_info() -> dict:
    """Commit of the sonicmoe checkout (SONICMOE_GIT_COMMIT overrides) and whether it has local changes."""
    return {"git_commit": git_commit(), "git_dirty": git_dirty()}


def env_info(device: torch.device) -> dict:
    """Device, driver, library versions, commit: what every results file must name (SPEC §7)."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    from .. import __version__

    info = {
        "device_type": device.type,
        "device": None,
        "gpu_count": 0,
        "capability": None,
        "memory_bytes": None,
        "driver": None,
        "cuda_driver_api": None,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "sonicmoe": __version__,
        # the library switches set for this run (SONICMOE_AGG_CHUNK=0, SONICMOE_GLUON=0, ...): results of A/B runs
        # name what they compared
        "switches": {k: v for k, v in sorted(os.environ.items())
                     if k.startswith("SONICMOE_") and k != "SONICMOE_GIT_COMMIT"},
    }
    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(idx)
        info.update(device=props.name, gpu_count=torch.cuda.device_count(),
                    capability=f"{props.major}.{props.minor}", memory_bytes=int(props.total_memory))
        if shutil.which("nvidia-smi"):
            out = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i", str(idx)])
            info["driver"] = out.splitlines()[0].strip() if out else None
        try:
            v = int(torch._C._cuda_getDriverVersion())
            info["cuda_driver_api"] = f"{v // 1000}.{(v % 1000) // 10}"
        except (AttributeError, RuntimeError, TypeError, ValueError):
            pass
    else:
        info["device"] = (platform.processor() or platform.machine() or "cpu").strip() or "cpu"
    info.update(git_info())
    return info


def slug(text: str) -> str:
    """Lower-case file-name slug: 'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    s = re.sub(r"[^a-z0-9]+", "-", str(text).lower()).strip("-")
    return s or "unknown"


def results_path(out_dir: str | os.PathLike, env: dict, tag: str | None, now: _dt.datetime) -> Path:
    """``<out>/<YYYY-MM-DD>_<gpu-slug>[_tag].json``; the time is added to the date if that file exists."""
    gpu = slug(env.get("device") or "cpu") if env.get("device_type") == "cuda" else "cpu"
    tail = f"_{slug(tag)}" if tag else ""
    out = Path(out_dir)
    path = out / f"{now:%Y-%m-%d}_{gpu}{tail}.json"
    if path.exists():
        path = out / f"{now:%Y-%m-%d-%H%M%S}_{gpu}{tail}.json"
    return path


def sanitize(obj):
    """JSON-safe copy: non-finite floats -> None, tuples -> lists, torch/other scalars -> str/float."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, (bool, int, str)) or obj is None:
        return obj
    if isinstance(obj, dict):
        return {str(k): sanitize(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [sanitize(v) for v in obj]
    if isinstance(obj, torch.dtype):
        return str(obj).replace("torch.", "")
    if isinstance(obj, torch.device):
        return str(obj)
    return str(obj)


def build_results(records: list[dict], env: dict, argv: list[str], args: dict, now: _dt.datetime) -> dict:
    """The whole results document (see the module docstring)."""
    from ..ops.common import autotune_enabled, tuned_configs
    from ..ops.dh_ws import dh_ws_calls
    from ..ops.grouped_gemm_ws import ws_calls
    from ..ops.up_proj_ws import up_ws_calls
    from ..ops.varlen_m_ws import long_calls
    from ..ops.weight_grad_ws import wgrad_ws_calls

    return {
        "schema": SCHEMA,
        "date": now.isoformat(timespec="seconds"),
        "argv": list(argv),
        "command": "sonicmoe bench " + " ".join(argv),
        "args": args,
        "env": env,
        "timer": "triton.testing.do_bench" if env.get("device_type") == "cuda" else "time.perf_counter",
        "flops": dict(FLOP_FORMULAS),
        "autotune": autotune_enabled() and env.get("device_type") == "cuda",
        "tile_configs": tuned_configs(),
        "gluon_kernels": ws_calls(),
        "gluon_up_kernels": up_ws_calls(),
        "gluon_wgrad_kernels": wgrad_ws_calls(),
        "gluon_dh_kernels": dh_ws_calls(),
        "gluon_long_kernels": long_calls(),
        "results": records,
    }


def write_results(doc: dict, path: str | os.PathLike) -> Path:
    """Write strict JSON (``allow_nan=False``) and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(sanitize(doc), f, indent=1, allow_nan=False)
        f.write("\n")
    return path


# what the tables and plots read of every shape record
_RECORD_NUMBERS = ("T", "d", "n", "E", "K", "G")


def _record_problem(rec) -> str | None:
    """Why a shape record cannot be read by the tables and plots (None: it can)."""
    if not isinstance(rec, dict):
        return f"a record is {type(rec).__name__}, not an object"
    if not isinstance(rec.get("name"), str):
        return "a record has no 'name'"
    for k in _RECORD_NUMBERS:
        v = rec.get(k)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return f"record {rec['name']!r} has no number '{k}'"
    for k in ("backends", "ratios"):
        if not isinstance(rec.get(k), (dict, type(None))):
            return f"record {rec['name']!r}: '{k}' is not an object"
    for k, v in (rec.get("backends") or {}).items():
        if not isinstance(v, dict):
            return f"record {rec['name']!r}: backend {k!r} is not an object"
    return None


def load_results(path: str | os.PathLike) -> dict:
    """Read a results file; ValueError if it is not one (no list of shape records the tables and plots can read:
    each an object with ``name``, ``T, d, n, E, K, G`` and object-valued ``backends``, ``ratios`` where present)."""
    with open(path) as f:
        doc = json.load(f)
    if not isinstance(doc, dict) or "results" not in doc:
        raise ValueError(f"{path} is not a sonicmoe bench results file (no 'results' key)")
    if not isinstance(doc["results"], list):
        raise ValueError(f"{path} is not a sonicmoe bench results file ('results' is not a list)")
    for rec in doc["results"]:
        why = _record_problem(rec)
        if why:
            raise ValueError(f"{path} is not a sonicmoe bench results file ({why})")
    return doc


# ---------------------------------------------------------------------------------------------------
# formatting


def _f(v, fmt: str = ".3g", none: str = "-") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return none
    return format(v, fmt)


def _tf(v) -> str:
    """TFLOP/s for tables: integers from 100 up, 3 significant digits below."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"


def _x(v, suffix: str = "") -> str:
    return "-" if v is None else f"{v:.2f}{suffix}"


def _get(d, *keys):
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def _mib(b) -> str:
    return "-" if b is None else f"{b / 2**20:.4g}"


def _gib(b) -> str:
    return "-" if b is None else f"{b / 2**30:.2f}"


def format_table(rows: list[list[str]], header: list[str]) -> str:
    """A plain, left/right-aligned text table (numbers right-aligned)."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]

    def num(s: str) -> bool:
        return bool(re.fullmatch(r"[-+]?[\d.]+(e[-+]?\d+)?x?|-", s))

    def line(cells):
        return "  ".join(c.rjust(w) if num(c) else c.ljust(w) for c, w in zip(cells, widths)).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), sep, *(line([str(c) for c in r]) for r in rows)])


def activations(doc: dict) -> list[str]:
    """The gated activations of a results document's shape records, in order of first appearance ("swiglu" for a
    record without the field: files written before ``--activation``)."""
    out: list[str] = []
    for rec in doc.get("results", []):
        a = rec.get("activation") or "swiglu"
        if a not in out:
            out.append(a)
    return out


def activation_note(doc: dict) -> str | None:
    """A line naming the document's activation where it is not SwiGLU alone (None for SwiGLU: the tables of
    SwiGLU runs read as they always have)."""
    acts = activations(doc)
    if not acts or acts == ["swiglu"]:
        return None
    return f"activation: {', '.join(acts)} (not SwiGLU alone: compare only with results of the same activation)"


def _worst_err(check) -> str:
    """The check's error nearest its bound (``check["worst"]``) and its name, e.g. ``1.2e-03 dx_rows``: the local
    errors (``*_rows``, ``*_experts``) are bounded by ``LOCAL_TOL_FACTOR`` times the norm errors' tol, so the largest
    error is not the one that decides; "nan" for NaN (written as null)."""
    errs = _get(check, "errors") or {}
    key = _get(check, "worst")
    if key not in errs:
        return "-"
    v = errs[key]
    return f"{'nan' if v is None or not math.isfinite(v) else format(v, '.2e')} {key}"


def terminal_table(doc: dict) -> str:
    """One line per (shape, routing, backend): status, error, ms, TFLOP/s, speed-up, memory; headed by the
    activation where it is not SwiGLU (:func:`activation_note`)."""
    header = ["shape", "routing", "backend", "status", "worst err", "fwd ms", "fwd TF/s", "bwd ms",
              "bwd TF/s", "f+b ms", "f+b TF/s", "+router ms", "base/this f", "base/this f+b", "held MiB",
              "spec−X MiB", "peak MiB"]
    rows = []
    for rec in doc.get("results", []):
        backends = rec.get("backends") or {}
        if not backends:
            rows.append([rec["name"], rec.get("routing", ""), "-", rec.get("status", "?"), *["-"] * (len(header) - 4)])
            continue
        for name, b in backends.items():
            ratio = _get(rec, "ratios", name) or {}
            is_base = name == rec.get("ratio_base")
            rows.append([
                rec["name"], rec.get("routing", ""), name, b.get("status", "?"),
                _worst_err(b.get("check")),
                _f(_get(b, "fwd", "ms", "p50"), ".4g"), _f(_get(b, "fwd", "tflops"), ".4g"),
                _f(_get(b, "bwd", "ms", "p50"), ".4g"), _f(_get(b, "bwd", "tflops"), ".4g"),
                _f(_get(b, "total", "ms", "p50"), ".4g"), _f(_get(b, "total", "tflops"), ".4g"),
                _f(_get(b, "router", "total", "ms", "p50") or _get(b, "router", "fwd", "ms", "p50"), ".4g"),
                "base" if is_base else _f(ratio.get("fwd"), ".3g"),
                "base" if is_base else _f(ratio.get("total"), ".3g"),
                _mib(_get(b, "memory", "held_bytes")), _mib(spec_beyond_x_bytes(rec)),
                _mib(_get(b, "memory", "peak_bytes")),
            ])
    text = format_table(rows, header)
    notes = []
    for rec in doc.get("results", []):
        if rec.get("message"):
            notes.append(f"{rec['name']} [{rec.get('routing')}]: {rec['message']}")
        for name, b in (rec.get("backends") or {}).items():
            if b.get("status") != "ok" and b.get("message"):
                notes.append(f"{rec['name']} [{rec.get('routing')}] {name}: {b['status']}: {b['message']}")
            if _get(b, "check", "router", "skipped"):
                notes.append(f"{rec['name']} [{rec.get('routing')}] {name}: router variant not checked: "
                             f"{b['check']['router']['skipped']}")
    env = doc.get("env", {})
    foot = (f"device: {env.get('device')} | driver {env.get('driver')} | torch {env.get('torch')} | "
            f"triton {env.get('triton')} | commit {str(env.get('git_commit'))[:12]} | {doc.get('date')} | "
            f"timer {doc.get('timer')}\nbase/this = this backend's ms / the base's ms (base: ours where it ran, else "
            f"torch; > 1 = "
            f"base faster; vs upper = fraction of the bound). +router = f+b (fwd in fwd mode) including the "
            f"router and routing metadata. worst err = the check's error nearest its bound (tol; "
            f"{LOCAL_TOL_FACTOR:g}·tol for *_rows, *_experts), named. spec−X = 2·TK·n elements in the run's dtype "
            f"(4·TK·n bytes in bf16): SPEC §3's 2·T·d + 4·TK·n bytes less X, an input, which held leaves out.")
    head = activation_note(doc)
    return "\n".join([*([head] if head else []), text, *notes, foot])


def spec_beyond_x_bytes(rec: dict) -> int | None:
    """SPEC §3's held bytes less the input X, 2·TK·n elements (H), from a result record's TK, n and dtype: what the
    measured "held" (which leaves the inputs out, X among them) compares with."""
    elem = {"bfloat16": 2, "float16": 2, "float32": 4}.get(str(rec.get("dtype")))
    if elem is None or rec.get("TK") is None or rec.get("n") is None:
        return None
    return elem * 2 * rec["TK"] * rec["n"]


def _md_text(text, limit: int) -> str:
    """``text`` as (part of) one markdown table cell: its whitespace, newlines included, collapsed to single spaces,
    cut to ``limit`` characters, ``|`` escaped (a raw newline or bar in an error message, such as a Triton compilation
    error's source listing, would end the row or the cell and break the README table)."""
    return " ".join(str(text).split())[:limit].replace("|", "\\|")


def markdown_table(doc: dict) -> str:
    """README table: one row per shape, our numbers and the ratios to torch and to the upper bound. Only our
    (``triton``) timings fill its columns: where ours failed, erred or was skipped the row says so (the results'
    ratio base then fell back to torch, whose numbers must not read as ours). Headed, and its footnote ended, by the
    activation where it is not SwiGLU (:func:`activation_note`)."""
    header = ["shape (T, d, n, E, K)", "routing", "fwd ms", "fwd TFLOP/s", "fwd+bwd ms", "fwd+bwd TFLOP/s",
              "vs torch (fwd / fwd+bwd)", "vs upper bound (fwd / fwd+bwd)", "held / peak GiB"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    bases = set()
    for rec in doc.get("results", []):
        base = rec.get("ratio_base")
        ours = (rec.get("backends") or {}).get("triton")
        b = ours if base == "triton" and ours and ours.get("status", "ok") == "ok" else None
        dims = f"{rec['name']} ({rec['T']}, {rec['d']}, {rec['n']}, {rec['E']}, {rec['K']})"
        if b is None:
            if ours is None:  # the shape itself failed (making the problem: OOM, ...), or ours was not asked for
                status = rec.get("status") if rec.get("status") not in (None, "ok") else "ours: not run"
                msg = None
            else:
                status = f"ours: {ours.get('status') if ours.get('status') != 'ok' else 'no result'}"
                msg = ours.get("message")
            cell = status + (f" ({_md_text(msg, 80)})" if msg else "")
            lines.append(f"| {dims} | {rec.get('routing', '')} | {cell} |" + " |" * (len(header) - 3))
            continue
        bases.add(base)
        rt, ru = _get(rec, "ratios", "torch") or {}, _get(rec, "ratios", "upper") or {}
        cells = [
            dims, rec.get("routing", ""),
            _f(_get(b, "fwd", "ms", "p50"), ".4g"), _tf(_get(b, "fwd", "tflops")),
            _f(_get(b, "total", "ms", "p50"), ".4g"), _tf(_get(b, "total", "tflops")),
            f"{_x(rt.get('fwd'), '×')} / {_x(rt.get('total'), '×')}",
            f"{_x(ru.get('fwd'))} / {_x(ru.get('total'))}",
            f"{_gib(_get(b, 'memory', 'held_bytes'))} / {_gib(_get(b, 'memory', 'peak_bytes'))}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    env = doc.get("env", {})
    who = ", ".join(sorted(bases)) or "- (no timing of ours)"
    lines.append("")
    lines.append(
        f"Backend: {who}. {env.get('device')} (driver {env.get('driver')}), torch {env.get('torch')}, "
        f"triton {env.get('triton')}, commit {str(env.get('git_commit'))[:12]}, {str(doc.get('date'))[:10]}. "
        "TFLOP/s count useful FLOPs (fwd 6·TK·n·d, bwd 12·TK·n·d); \"vs torch\" = torch ms / our ms; "
        "\"vs upper bound\" = upper-bound ms / our ms (fraction of the bound's throughput); memory held "
        "after forward (excluding inputs and output) / peak over forward+backward (incl. weight grads)."
    )
    head = activation_note(doc)
    if head:
        lines[-1] += f" Activation: {', '.join(activations(doc))}."
        lines.insert(0, head[0].upper() + head[1:])
        lines.insert(1, "")
    return "\n".join(lines)


def main_markdown(path: str) -> int:
    """Print the README markdown table of a results file."""
    print(markdown_table(load_results(path)))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main_markdown(sys.argv[1]))
