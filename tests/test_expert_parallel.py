"""Expert parallelism (:mod:`sonicmoe.expert_parallel`) over two processes against one process holding everything.

Each rank has its own tokens (a different T on each) and half of the E experts. Its output, the gradients of its x
and scores, and those of the experts it holds must equal what one process computes for all ranks' tokens with all
E experts (the float32 reference, :func:`sonicmoe.experts_ref`): a token's output and x-gradient are its own, an
expert weight's gradient sums every rank's tokens. Routings: random top-k; every pair on rank 0's experts (rank 1's
receive no row) with a single token on rank 1; no token at all on rank 1; K = E. The layer
(:class:`~sonicmoe.expert_parallel.ExpertParallelMoE` loaded from a full ``MoE``, wrapped by
:func:`~sonicmoe.expert_parallel.expert_parallel_ddp`) must give every parameter the gradient of the mean of the
ranks' losses. Each rank's local experts must get every token once per source rank, however many of its pairs
are there, and every pair. A deep copy of the layer shares its process group. On the CPU over gloo: the torch
backend, and the Triton kernels through the interpreter; on CUDA in bf16 (two GPUs over NCCL, or both ranks on one
GPU over gloo).
"""

from __future__ import annotations

import copy
import functools
import os
import pickle
import re
import traceback
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import sonicmoe
from sonicmoe import MoE, experts_ref, routing_from_pairs, routing_from_topk
from sonicmoe.testing import rel_err

D, N, E = 48, 40, 8

TOKENS = (37, 29)  # T of rank 0 and rank 1


@pytest.fixture(autouse=True)
def _poison_outputs(monkeypatch):
    """Every Triton kernel output starts as NaN (SONICMOE_POISON_OUTPUTS=1): an element no program writes fails."""
    monkeypatch.setenv("SONICMOE_POISON_OUTPUTS", "1")


def _scenarios(world: int = 2):
    """name -> (T of each rank, K (0: general routing), how the experts are chosen: "low" only those of the lower
    half of the ranks)."""
    if world == 4:  # E_loc = 2: a token's pairs often meet on one rank, and every rank hears from three others
        return {"random": ((37, 29, 5, 11), 3, "random"), "low_half_experts_only": ((13, 1, 7, 9), 2, "low"),
                "no_tokens_on_rank1": ((37, 0, 29, 5), 2, "random"), "k_equals_e": ((5, 3, 1, 4), E, "random"),
                "general_padded": ((17, 9, 6, 12), 0, "general")}
    return {"random": (TOKENS, 2, "random"), "rank0_experts_only": ((37, 1), 2, "low"),
            "no_tokens_on_rank1": ((37, 0), 2, "random"), "k_equals_e": ((5, 3), E, "random"),
            "general_padded": (TOKENS, 0, "general")}


def _problem(tokens, k, choice, dtype, device, bias=True):
    """All ranks' tokens, output gradients and all E experts' weights (the same on every rank), and each rank's
    pairs: (pair_token, pair_expert, pair_scores, padding pairs at the end)."""
    g = torch.Generator().manual_seed(7 + sum(tokens) + k)
    t = sum(tokens)
    rnd = {"x": torch.randn(t, D, generator=g), "dout": torch.randn(t, D, generator=g),
           "w1": torch.randn(E, 2 * N, D, generator=g) * D ** -0.5, "w2": torch.randn(E, D, N, generator=g) * N ** -0.5,
           "b1": torch.randn(E, 2 * N, generator=g) * 0.1 if bias else None,
           "b2": torch.randn(E, D, generator=g) * 0.1 if bias else None}
    out = {key: None if v is None else v.to(device=device, dtype=dtype) for key, v in rnd.items()}
    out["pairs"] = []
    for tr in tokens:
        logits = torch.randn(tr, E, generator=g)
        if choice == "low":  # only experts [0, E/2): those of rank 0
            logits[:, E // 2:] = -1e4
        if choice == "general":  # 0 to 3 experts per token (token 0 none), then 5 padding pairs (token T, expert E)
            per = torch.randint(0, 4, (tr,), generator=g)
            per[0] = 0
            chosen = logits.argsort(dim=1)
            pt = torch.cat([torch.repeat_interleave(torch.arange(tr), per), torch.full((5,), tr)])
            pe = torch.cat([torch.cat([chosen[i, :c] for i, c in enumerate(per.tolist())]), torch.full((5,), E)])
            pad = 5
        else:
            pt = torch.arange(tr * k) // k
            pe = logits.topk(k, dim=1).indices.reshape(-1)
            pad = 0
        scores = torch.rand(pt.shape[0], generator=g) + 0.1
        out["pairs"].append((pt.to(device), pe.to(device), scores.to(device=device, dtype=dtype), pad))
    return out


def _grads_of(fn, inputs: dict, dout: torch.Tensor):
    """fn(**leaves) backward from dout: (output, {name: gradient}) in float64 on the CPU."""
    leaves = {key: v.detach().clone().requires_grad_(True) for key, v in inputs.items()}
    out = fn(**leaves)
    out.backward(dout)
    return out.detach().double().cpu(), {key: v.grad.double().cpu() for key, v in leaves.items()}


def _recording(experts_fn, received: list):
    """experts_fn, which also appends what it gets to ``received``: (tokens, rows) of each call."""
    def run(x, w1, w2, routing, *args, **kwargs):
        received.append((x.shape[0], routing.num_rows))
        return experts_fn(x, w1, w2, routing, *args, **kwargs)
    return run


def _functional_errors(rank, world, backend, dtype, device) -> dict:
    """Relative errors of expert_parallel_experts against the one-process reference, per scenario and tensor; the
    padding pairs' score gradients (must be zero); whether a second run differs (must not)."""
    import sonicmoe.expert_parallel as ep_module
    from sonicmoe.expert_parallel import expert_parallel_experts, expert_parallel_experts_ref

    errs, e_loc = {}, E // world
    for name, (tokens, k, choice) in _scenarios(world).items():
        p = _problem(tokens, k, choice, dtype, device)
        lo = sum(tokens[:rank])
        mine = slice(lo, lo + tokens[rank])
        own = slice(rank * e_loc, (rank + 1) * e_loc)
        pt, pe, scores, pad = p["pairs"][rank]
        routing = routing_from_pairs(pt, pe, tokens[rank], E, token_major=True, padding=pad > 0)
        local = {"x": p["x"][mine], "pair_scores": scores, "w1": p["w1"][own], "w2": p["w2"][own],
                 "b1": p["b1"][own], "b2": p["b2"][own]}
        results, received = [], []
        real_experts = ep_module.experts
        ep_module.experts = _recording(real_experts, received)
        try:
            for fn in (expert_parallel_experts, expert_parallel_experts, expert_parallel_experts_ref):
                b = "torch" if fn is expert_parallel_experts_ref else backend
                results.append(_grads_of(lambda fn=fn, b=b, r=routing, **kw: fn(routing=r, backend=b, **kw), local,
                                         p["dout"][mine]))
        finally:
            ep_module.experts = real_experts
        # a token comes once from each rank with any pair on this rank's experts, however many it has here
        to_me = [q[1][:len(q[1]) - q[3]] // e_loc == rank for q in p["pairs"]]
        expected = (sum(int(q[0][:len(q[0]) - q[3]][m].unique().numel()) for q, m in zip(p["pairs"], to_me)),
                    sum(int(m.sum()) for m in to_me))
        errs[f"{name}/received_tokens_rows_flag"] = float(received[0] != expected)
        # the float32 reference: one process, every rank's tokens and real pairs, all E experts
        full = {key: p[key].float() for key in ("x", "w1", "w2", "b1", "b2")}
        real = [(q[0][:len(q[0]) - q[3]] + sum(tokens[:j]), q[1][:len(q[1]) - q[3]], q[2][:len(q[2]) - q[3]])
                for j, q in enumerate(p["pairs"])]
        full["pair_scores"] = torch.cat([q[2] for q in real]).float()
        ref_routing = routing_from_pairs(torch.cat([q[0] for q in real]), torch.cat([q[1] for q in real]),
                                         sum(tokens), E, check=True)
        ref_out, ref = _grads_of(lambda r=ref_routing, **kw: experts_ref(routing=r, **kw), full, p["dout"].float())
        first = sum(len(q[0]) for q in real[:rank])
        n_real = len(pt) - pad
        ref_mine = {"x": ref["x"][mine], "pair_scores": ref["pair_scores"][first:first + n_real]}
        ref_mine.update({key: ref[key][own] for key in ("w1", "w2", "b1", "b2")})
        out, grads = results[0]
        # two runs: bitwise the same output and gradients
        errs[f"{name}/rerun_differs_flag"] = float(not (torch.equal(out, results[1][0]) and all(
            torch.equal(g, results[1][1][key]) for key, g in grads.items())))
        grads = dict(grads)
        if pad:
            errs[f"{name}/padding_score_grads_flag"] = float(grads["pair_scores"][n_real:].abs().sum())
            grads["pair_scores"] = grads["pair_scores"][:n_real]
        errs[f"{name}/out"] = rel_err(out, ref_out[mine]) if tokens[rank] else float(out.numel())
        for key, g in grads.items():
            errs[f"{name}/d{key}"] = rel_err(g, ref_mine[key]) if ref_mine[key].abs().sum() else float(g.abs().sum())
        ref_fn_out, ref_fn = results[2]
        errs[f"{name}/ref_fn_out"] = rel_err(ref_fn_out, ref_out[mine]) if tokens[rank] else 0.0
        errs[f"{name}/ref_fn_dw1"] = rel_err(ref_fn["w1"], ref_mine["w1"]) if ref_mine["w1"].abs().sum() else 0.0
    return errs


def _layer_errors(rank, world, backend, dtype, device) -> dict:
    """ExpertParallelMoE loaded from a full MoE, under expert_parallel_ddp, against the full MoE run on each rank's
    tokens in turn (token rounding rounds each rank's own counts), with the default options and DeepSeek-V3's
    (sigmoid router, selection bias, scaling 2.5, groups or token rounding; interleaved gate/up): the output, and each
    parameter's gradient against the sum over the ranks' tokens divided by P (the mean of the ranks' losses)."""
    from sonicmoe.expert_parallel import ExpertParallelMoE, expert_parallel_ddp

    p = _problem(TOKENS, 2, "random", dtype, device)
    errs = {}
    deepseek = dict(router_order="sigmoid_then_topk", renormalize=True, routed_scaling_factor=2.5,
                    gate_up_layout="interleaved")
    configs = {"topk": dict(routing="topk"), "token_rounding": dict(routing="token_rounding"),
               # DeepSeek-V3's router (with a selection bias), groups under top-k; exact-length balance rounding
               "deepseek_groups": dict(routing="topk", n_group=4, topk_group=2, **deepseek),
               "deepseek_token_rounding": dict(routing="token_rounding", rounding="balance", static_pairs=False,
                                               **deepseek),
               # a shared expert with Qwen2-MoE's gate: replicated like the router, averaged by DDP
               "shared_gated": dict(routing="topk", shared_intermediate_size=12, shared_expert_gate=True)}
    for routing, config in configs.items():
        opts = dict(bias=True, backend=backend, aux_loss_coef=0.0, m_tile=16, **config)
        torch.manual_seed(0)
        full = MoE(D, N, E, 2, **opts).to(device=device, dtype=dtype)
        if full.e_score_correction_bias is not None:
            full.e_score_correction_bias.copy_(torch.randn(E, generator=torch.Generator().manual_seed(5)) * 0.3)
        layer = ExpertParallelMoE(D, N, E, 2, **opts).to(device=device, dtype=dtype)
        layer.load_full_state_dict(full.state_dict())
        model = expert_parallel_ddp(layer)
        outs = []
        for j in range(world):
            chunk = slice(sum(TOKENS[:j]), sum(TOKENS[:j + 1]))
            outs.append(full(p["x"][chunk]))
            outs[-1].backward(p["dout"][chunk])
            if j == rank:
                out = model(p["x"][chunk])
                out.backward(p["dout"][chunk])
        r = layer.expert_range
        errs[f"layer_{routing}/out"] = rel_err(out, outs[rank])
        full_params = dict(full.named_parameters())
        for name, q in layer.named_parameters():
            ref = full_params[name].grad
            ref = ref[r.start:r.stop] if name.startswith("experts.") else ref
            errs[f"layer_{routing}/d{name}"] = rel_err(q.grad, ref / world)
    torch.manual_seed(0)  # every rank seeded alike: the same router, different experts
    fresh = ExpertParallelMoE(D, N, E, 2, shared_intermediate_size=4,
                              device=device if dist.get_backend() == "nccl" else "cpu")
    for name, q in (("experts.gate_up_proj", fresh.experts.gate_up_proj), ("gate.weight", fresh.gate.weight),
                    ("shared_experts.gate_up_proj", fresh.shared_experts.gate_up_proj)):
        parts = [torch.empty_like(q.detach()) for _ in range(world)]
        dist.all_gather(parts, q.detach())
        errs[f"layer/fresh_{name}_{'alike' if name.startswith('experts') else 'differs'}_flag"] = float(
            torch.equal(parts[0], parts[1]) == name.startswith("experts"))
    try:  # E = 7 does not split over two ranks
        ExpertParallelMoE(D, N, 7, 2)
        errs["layer/odd_num_experts_accepted_flag"] = 1.0
    except ValueError:
        errs["layer/odd_num_experts_accepted_flag"] = 0.0
    return errs


def _rank_worker(body):
    """An ``mp.spawn`` target around ``body(rank, world, init_file, *args) -> dict`` (it starts its own process
    group): saves the dict to ``out_file`` (the last argument; ``{rank}`` in it), or writes the rank's traceback
    beside it (every rank's, for the failure message: mp.spawn reports one rank's), destroys the group, and leaves
    with ``os._exit(0)`` (as in test_multi_device: skip the interpreter teardown, where gloo threads have aborted a
    rank)."""

    @functools.wraps(body)
    def target(rank: int, world: int, init_file: str, *args) -> None:
        *args, out_file = args
        try:
            errs = body(rank, world, init_file, *args)
            torch.save(errs, out_file.format(rank=rank))
            dist.barrier()
        except BaseException:
            with open(out_file.format(rank=rank) + ".err", "w") as f:
                f.write(traceback.format_exc())
            raise
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        os._exit(0)

    return target


def _spawn(target, world: int, tmp_path, *args) -> list[dict]:
    """Run ``target`` (a :func:`_rank_worker`) on ``world`` processes; every rank's dict, or an AssertionError
    carrying every failed rank's traceback."""
    out_file = str(tmp_path / "rank{rank}.pt")
    try:
        mp.spawn(target, args=(world, str(tmp_path / "init"), *args, out_file), nprocs=world, join=True)
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        logs = [p.read_text() for p in sorted(tmp_path.glob("rank*.pt.err"))]
        raise AssertionError("\n".join(["a rank failed; the tracebacks of every rank:", *logs])) from e
    return [torch.load(out_file.format(rank=r)) for r in range(world)]


@_rank_worker
def _worker(rank: int, world: int, init_file: str, backend: str, device_type: str, dtype: torch.dtype) -> dict:
    cuda = device_type == "cuda"
    two_gpus = cuda and torch.cuda.device_count() >= world
    device = torch.device("cuda", rank if two_gpus else 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if two_gpus else "gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    warnings.filterwarnings("ignore", message="token rounding with")  # few tokens per expert, on purpose
    errs = _functional_errors(rank, world, backend, dtype, device)
    if world == 2:  # the layer's check splits TOKENS
        errs.update(_layer_errors(rank, world, backend, dtype, device))
    return errs


def _run(tmp_path, backend: str, device_type: str, dtype: torch.dtype, world: int = 2) -> list[dict]:
    return _spawn(_worker, world, tmp_path, backend, device_type, dtype)


def _check(results: list[dict], tol: float) -> None:
    for rank, errs in enumerate(results):
        assert len(errs) == len(results[0]) > 40
        bad = {key: v for key, v in errs.items() if not v <= (0.0 if key.endswith("_flag") else tol)}
        assert not bad, f"rank {rank}: {bad}"


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_expert_parallel_on_cpu_matches_one_process(tmp_path, backend):
    """Two gloo ranks on the CPU, float32 (the Triton backend through the interpreter)."""
    if torch.cuda.is_available() and backend == "triton":
        pytest.skip("the Triton kernels' CPU path (the interpreter, used without CUDA)")
    _check(_run(tmp_path, backend, "cpu", torch.float32), 1e-5)


def test_expert_parallel_four_ranks_on_cpu(tmp_path):
    """Four gloo ranks on the CPU, float32, the torch backend: E_loc = 2, so a token's pairs often share a rank (sent
    once, its local pairs summed there) and each rank merges the pairs of four sources into its local routing."""
    _check(_run(tmp_path, "torch", "cpu", torch.float32, world=4), 1e-5)


@pytest.mark.gpu
def test_expert_parallel_on_gpu_matches_one_process(tmp_path):
    """bf16 on the Triton kernels: two GPUs over NCCL, or both ranks on one GPU over gloo. (Session 71's crash here,
    an illegal memory access on the rank that received no row, was the experts' T = 0 case: see
    test_kernels.py::test_experts_without_rows.)"""
    _check(_run(tmp_path, "triton", "cuda", torch.bfloat16), 1e-2)


def test_expert_parallel_refuses_bad_setups(tmp_path):
    """Without a process group: RuntimeError (expert_parallel_ddp too: torch's ValueError before session 89). In a
    group of one rank: E = 0, a routing of other E or T, scores and weights of the wrong shape are refused, naming
    the argument (E not a multiple of P: in the two-rank runs); numpy sizes are taken, as MoE takes them;
    expert_parallel_groups(0) is refused by name (not a ZeroDivisionError from W % 0), and so are a float and a bool
    size, while a numpy integer is taken."""
    import numpy as np

    from sonicmoe.expert_parallel import (
        ExpertParallelMoE,
        expert_parallel_ddp,
        expert_parallel_experts,
        expert_parallel_groups,
    )

    with pytest.raises(RuntimeError, match="init_process_group"):
        ExpertParallelMoE(D, N, E, 2)
    with pytest.raises(RuntimeError, match="init_process_group"):
        expert_parallel_ddp(torch.nn.Linear(2, 2))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match=r"num_experts must be a positive multiple of the group's size P=1 "
                                             r"\(E_loc = E/P experts per rank\), got 0"):
            ExpertParallelMoE(D, N, 0, 1)  # the layer's message, before MoEConfig's
        with pytest.raises(ValueError, match="num_experts must be a positive int, got True"):
            ExpertParallelMoE(D, N, True, 1)  # a bool is not a count (not taken as E = 1)
        assert ExpertParallelMoE(D, N, np.int64(E), np.int64(2)).config.num_experts == E
        x, w1, w2 = torch.randn(4, D), torch.randn(2, 2 * N, D), torch.randn(2, D, N)
        routing = routing_from_topk(torch.tensor([[0, 1]] * 4), 2)
        with pytest.raises(ValueError, match=r"routing is for E=2 experts but the group's P=1 ranks hold "
                                             r"E = E_loc·P = 1 \(w1 has E_loc=1\)"):
            expert_parallel_experts(x, w1[:1], w2[:1], routing, torch.rand(8))
        with pytest.raises(ValueError, match=r"pair_scores must have shape \(R=8,\)"):
            expert_parallel_experts(x, w1, w2, routing, torch.rand(7))
        with pytest.raises(ValueError, match="routing is for T=4 tokens but x has T=3"):
            expert_parallel_experts(x[:3], w1, w2, routing, torch.rand(8))
        with pytest.raises(ValueError, match="w2"):
            expert_parallel_experts(x, w1, w2[:, :, :3], routing, torch.rand(8))
        # the options are checked before the exchange (a bad one on one rank would leave the others waiting)
        with pytest.raises(ValueError, match="gate_up_layout"):
            expert_parallel_experts(x, w1, w2, routing, torch.rand(8), gate_up_layout="split")
        with pytest.raises(ValueError, match="backend"):
            expert_parallel_experts(x, w1, w2, routing, torch.rand(8), backend="cuda")
        with pytest.raises(ValueError, match=r"ep_size must be a positive divisor of the world size W=1, got 0"):
            expert_parallel_groups(0)
        # a float or a bool is not a group size (True made groups of one before the ep15_ mutation audit; 1.0 past
        # the check fails in range() with a TypeError), a numpy integer is, as the layer takes its sizes (refused
        # before)
        for bad in (1.0, True):
            with pytest.raises(ValueError, match=rf"ep_size must be a positive divisor .* got {bad!r}"):
                expert_parallel_groups(bad)
        ep_group, dp_group = expert_parallel_groups(np.int64(1))
        assert dist.get_process_group_ranks(ep_group) == dist.get_process_group_ranks(dp_group) == [0]
    finally:
        dist.destroy_process_group()


def test_expert_parallel_checks_before_any_exchange():
    """The checks expert_parallel_experts runs on every rank before the first exchange (a bad input on one rank would
    otherwise leave the others waiting in a collective, or pass the exchange and fail in sonicmoe.experts on the
    ranks receiving rows), each naming what is wrong: w1 holding no expert, scores of shape (R, 1) (R rows, but not
    a vector), scores on another device than x, integer scores, an unknown gate/up layout or activation (P passed
    in: no group)."""
    from sonicmoe.expert_parallel import _check_ep_inputs

    world = int(torch.randint(1, 4, ()))
    x, w1, w2 = torch.randn(4, D), torch.randn(2, 2 * N, D), torch.randn(2, D, N)
    routing = routing_from_topk(torch.tensor([[0, 1]] * 4), 2 * world)
    _check_ep_inputs(x, w1, w2, None, None, routing, torch.rand(8), world, "torch", "concat")  # good inputs
    bad = {"no expert": ((x, w1[:0], w2[:0], routing, torch.rand(8)), "w1 must hold at least one expert"),
           "scores (R, 1)": ((x, w1, w2, routing, torch.rand(8, 1)), r"pair_scores must have shape \(R=8,\), got "
                                                                    r"\(8, 1\)"),
           "scores on meta": ((x, w1, w2, routing, torch.rand(8, device="meta")), "pair_scores is on meta but x is "
                                                                                 "on cpu")}
    for args, message in bad.values():
        with pytest.raises(ValueError, match=message):
            _check_ep_inputs(*args[:3], None, None, *args[3:], world, "torch", "concat")
    with pytest.raises(TypeError, match=r"pair_scores must be bfloat16, float16 or float32 .*got torch.int64"):
        _check_ep_inputs(x, w1, w2, None, None, routing, torch.randint(0, 9, (8,)), world, "torch", "concat")
    with pytest.raises(ValueError, match=r"gate_up_layout must be one of .*got 'split'"):
        _check_ep_inputs(x, w1, w2, None, None, routing, torch.rand(8), world, "torch", "split")
    with pytest.raises(ValueError, match=r"activation must be one of .*got 'gelu'"):
        _check_ep_inputs(x, w1, w2, None, None, routing, torch.rand(8), world, "torch", "concat", "gelu")
    # float64 is the torch backend's alone: the Triton kernels' x or scores in float64 are refused here too (on the CPU
    # through the interpreter), not by the experts after the exchange (and never on a rank whose experts get no row)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    x, w1, w2, routing = x.to(dev), w1.to(dev), w2.to(dev), routing_from_topk(torch.tensor([[0, 1]] * 4, device=dev),
                                                                              2 * world)
    s64 = torch.rand(8, dtype=torch.float64, device=dev)
    _check_ep_inputs(x.double(), w1.double(), w2.double(), None, None, routing, s64, world, "torch", "concat")
    with pytest.raises(TypeError, match=r"x is float64, which only backend='torch' runs"):
        _check_ep_inputs(x.double(), w1.double(), w2.double(), None, None, routing, s64, world, "triton", "concat")
    with pytest.raises(TypeError, match=r"pair_scores is float64, which only backend='torch' runs"):
        _check_ep_inputs(x, w1, w2, None, None, routing, s64, world, "triton", "concat")


def test_expert_parallel_one_rank_float64_from_moe_and_full_state(tmp_path):
    """In a group of one rank: float64 with the torch backend, as sonicmoe.experts and MoE take it (the functional
    form and the layer); from_moe keeps the source's eval mode and frozen parameters; load_full_state_dict refuses
    a state dict whose experts are not all E, naming the entry."""
    from sonicmoe.expert_parallel import ExpertParallelMoE, expert_parallel_experts

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        g = torch.Generator().manual_seed(7)
        x, w1, w2 = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((5, D), (3, 2 * N, D), (3, D, N)))
        routing = routing_from_topk(torch.tensor([[0, 1], [1, 2], [2, 0], [0, 2], [1, 0]]), 3)
        scores = torch.rand(10, generator=g, dtype=torch.float64)
        out = expert_parallel_experts(x, w1, w2, routing, scores, backend="torch")
        assert out.dtype == torch.float64
        assert rel_err(out, sonicmoe.experts(x, w1, w2, routing, scores, backend="torch")) < 1e-12
        torch.manual_seed(0)
        full = MoE(D, N, 4, 2, routing="token_rounding", m_tile=4, shared_intermediate_size=6, backend="torch",
                   dtype=torch.float64).eval()
        full.gate.weight.requires_grad_(False)
        layer = ExpertParallelMoE.from_moe(full)
        assert not layer.training and not layer.gate.weight.requires_grad
        assert repr(layer).count("experts [0, 4) of rank 0/1") == 1  # the half-open range of all E = 4
        assert layer.experts.gate_up_proj.requires_grad and layer.experts.gate_up_proj.dtype == torch.float64
        xs = torch.randn(9, D, generator=g, dtype=torch.float64)
        assert rel_err(layer(xs), full(xs)) < 1e-12
        shard = {**full.state_dict(), "experts.down_proj": full.experts.down_proj[:2]}
        with pytest.raises(ValueError, match=r"experts.down_proj must hold all E=4 experts"):
            layer.load_full_state_dict(shard)
    finally:
        dist.destroy_process_group()


def test_expert_parallel_one_rank_options_reach_the_experts(tmp_path):
    """In a group of one rank (a subgroup given explicitly), float32, the torch backend: the clamped SwiGLU and the
    interleaved gate/up layout reach the experts of expert_parallel_experts, of expert_parallel_experts_ref and of
    the layer (each against sonicmoe.experts_ref or MoE with the same options, which the default options miss by
    far: a dropped option fails); general routing on a rank with no token but padding pairs (nothing sent, O (0, d),
    zero score gradients); expert_parallel_ddp(process_group=) with the layer's own group, as in the world's case:
    the expert gradients scaled by 1/P (here 1), not refused as those of a group other than DDP's."""
    from sonicmoe.expert_parallel import (
        ExpertParallelMoE,
        expert_parallel_ddp,
        expert_parallel_experts,
        expert_parallel_experts_ref,
    )

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        sub = dist.new_group([0])
        g = torch.Generator().manual_seed(int(torch.randint(0, 2 ** 31, ())))
        t, e, k = 11, 4, 2
        x = torch.randn(t, D, generator=g)
        w1, w2 = torch.randn(e, 2 * N, D, generator=g) * D ** -0.5, torch.randn(e, D, N, generator=g) * N ** -0.5
        b1, b2 = torch.randn(e, 2 * N, generator=g) * 0.1, torch.randn(e, D, generator=g) * 0.1
        routing = routing_from_topk(torch.rand(t, e, generator=g).topk(k, dim=1).indices, e)
        scores = torch.rand(t * k, generator=g) + 0.1
        default = experts_ref(x, w1, w2, routing, scores, b1, b2)
        for options in ({"activation": "clamped_swiglu"}, {"gate_up_layout": "interleaved"}):
            ref = experts_ref(x, w1, w2, routing, scores, b1, b2, **options)
            assert rel_err(default, ref) > 0.05, options  # the option matters
            for fn in (expert_parallel_experts, expert_parallel_experts_ref):
                out = fn(x, w1, w2, routing, scores, b1, b2, group=sub, backend="torch", **options)
                assert rel_err(out, ref) < 1e-6, (fn.__name__, options)

        # no token, three padding pairs (token T = 0, expert E)
        x0 = torch.randn(0, D, requires_grad=True)
        s0 = torch.rand(3, generator=g).requires_grad_(True)
        padded = routing_from_pairs(torch.zeros(3, dtype=torch.long), torch.full((3,), e), 0, e, padding=True)
        out = expert_parallel_experts(x0, w1, w2, padded, s0, b1, b2, group=sub, backend="torch")
        assert out.shape == (0, D)
        out.sum().backward()
        assert torch.equal(s0.grad, torch.zeros(3))

        torch.manual_seed(0)
        full = MoE(D, N, e, k, bias=True, activation="clamped_swiglu", backend="torch", aux_loss_coef=0.0)
        model = expert_parallel_ddp(ExpertParallelMoE.from_moe(full, group=sub), process_group=sub)
        xs, dout = torch.randn(9, D, generator=g), torch.randn(9, D, generator=g)
        out, ref = model(xs), full(xs)
        assert rel_err(out, ref) < 1e-6
        out.backward(dout)
        ref.backward(dout)
        full_params = dict(full.named_parameters())
        for name, q in model.module.named_parameters():
            assert rel_err(q.grad, full_params[name].grad) < 1e-6, name
    finally:
        dist.destroy_process_group()


def test_expert_parallel_wrapping_keeps_what_the_user_set(tmp_path, monkeypatch):
    """In a group of one rank: from_moe keeps each parameter's dtype (a float32 router beside bf16 experts, not
    everything in the router's); expert_parallel_ddp wraps a model whose experts are frozen (router-only fine-tuning)
    and adds to, not replaces, the parameters the model already keeps out of DDP; backend="triton" on CPU tensors
    without the interpreter is refused before any exchange (a rank whose experts get no row would otherwise wait in
    the all-to-all)."""
    from torch.nn.parallel import DistributedDataParallel

    import sonicmoe.expert_parallel as ep_module
    from sonicmoe.expert_parallel import ExpertParallelMoE, expert_parallel_ddp, expert_parallel_experts

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        full = MoE(D, N, 4, 2, backend="torch", dtype=torch.bfloat16)
        full.gate.float()
        layer = ExpertParallelMoE.from_moe(full)
        assert {n: p.dtype for n, p in layer.named_parameters()} == {n: p.dtype for n, p in full.named_parameters()}
        xs = torch.randn(9, D, dtype=torch.bfloat16)
        assert torch.equal(layer(xs), full(xs))

        full = MoE(D, N, 4, 2, backend="torch")
        full.experts.requires_grad_(False)
        local = torch.nn.Linear(D, D)
        model = torch.nn.Sequential(local, ExpertParallelMoE.from_moe(full))
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ["0.weight"])
        ddp = expert_parallel_ddp(model)
        assert sorted(model._ddp_params_and_buffers_to_ignore) == [
            "0.weight", "1.experts.down_proj", "1.experts.gate_up_proj"]
        ddp(torch.randn(5, D)).sum().backward()
        assert model[1].gate.weight.grad is not None and model[1].experts.gate_up_proj.grad is None

        def exchanged(*args, **kwargs):
            raise AssertionError("exchanged before the backend was checked")

        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        monkeypatch.setattr(ep_module, "_all_to_all", exchanged)
        x, w1, w2 = torch.randn(4, D), torch.randn(2, 2 * N, D), torch.randn(2, D, N)
        with pytest.raises(ValueError, match="x is on cpu; the triton backend needs CUDA tensors"):
            expert_parallel_experts(x, w1, w2, routing_from_topk(torch.tensor([[0, 1]] * 4), 2), torch.rand(8),
                                    backend="triton")
    finally:
        dist.destroy_process_group()


def test_expert_parallel_deepcopy_shares_the_group(tmp_path):
    """In a group of one rank, with an explicit group (a subgroup, and the world's passed as such): copy.deepcopy of
    the layer (after a training-mode forward) and of a model holding it copies the weights and shares the group, and
    the copy computes what the layer computes; pickling keeps the world's group as None (the default) and refuses
    another, naming state_dict. Before the fix deepcopy raised torch's "cannot pickle ... ProcessGroup" for any
    explicit group."""
    from sonicmoe.expert_parallel import ExpertParallelMoE

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        sub = dist.new_group([0])
        torch.manual_seed(0)
        full = MoE(D, N, 4, 2, bias=True, backend="torch")
        xs = torch.randn(9, D)
        for group in (sub, dist.group.WORLD):
            layer = ExpertParallelMoE.from_moe(full, group=group)
            layer(xs).sum().backward()  # a training-mode forward: aux_loss holds a graph
            twin = copy.deepcopy(layer)
            model = torch.nn.Sequential(torch.nn.Linear(D, D), layer)
            assert copy.deepcopy(model)[1].ep_group is group
            assert twin.ep_group is group and (twin.ep_size, twin.ep_rank) == (1, 0)
            for (name, a), b in zip(layer.state_dict().items(), twin.state_dict().values()):
                assert torch.equal(a, b) and a.data_ptr() != b.data_ptr(), name
            assert torch.equal(twin(xs), layer(xs))
            with torch.no_grad():
                twin.experts.down_proj.add_(1.0)
            assert torch.equal(layer.experts.down_proj, full.experts.down_proj), "the copy's weights are its own"
        world = pickle.loads(pickle.dumps(layer))  # the world's group, given explicitly: the default once loaded
        assert world.ep_group is None and torch.equal(world(xs), layer(xs))
        with pytest.raises(TypeError, match="other than the default one cannot be pickled.*state_dict"):
            pickle.dumps(ExpertParallelMoE.from_moe(full, group=sub))
    finally:
        dist.destroy_process_group()


def test_expert_parallel_load_full_state_dict_is_all_or_nothing(tmp_path):
    """In a group of one rank: load_full_state_dict checks every entry before copying any, so a failed load leaves
    every parameter and buffer bitwise unchanged, and the error names the entry (with the expected and the got
    shape where the shape is wrong). Before the fix torch's load_state_dict copied entry by entry and raised at the
    end: a router of the wrong shape left the experts loaded. A good load casts to the layer's dtype."""
    from sonicmoe.expert_parallel import ExpertParallelMoE

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        options = {"bias": True, "shared_intermediate_size": 6, "shared_expert_gate": True,
                   "router_order": "sigmoid_then_topk", "backend": "torch"}
        torch.manual_seed(0)
        layer = ExpertParallelMoE.from_moe(MoE(D, N, 4, 2, **options))
        torch.manual_seed(1)
        other = MoE(D, N, 4, 2, **options).state_dict()

        def bits(module):
            return {name: t.detach().clone().view(torch.uint8) for name, t in module.state_dict().items()}

        before = bits(layer)
        bad = {  # state dict -> (error, message)
            "router shape": ({**other, "gate.weight": torch.randn(4, D + 1)},
                             (ValueError, rf"gate.weight must have shape \(4, {D}\), got \(4, {D + 1}\)")),
            "last entry shape": ({**other, "shared_expert_gate.weight": torch.randn(2, D)},
                                 (ValueError, rf"shared_expert_gate.weight must have shape \(1, {D}\), got "
                                              rf"\(2, {D}\)")),
            "expert inner shape": ({**other, "experts.down_proj": torch.randn(4, D, N + 1)},
                                   (ValueError, rf"experts.down_proj must have shape \(4, {D}, {N}\), got "
                                                rf"\(4, {D}, {N + 1}\)")),
            "integer codes": ({**other, "shared_experts.down_proj": torch.ones(1, D, 6, dtype=torch.int32)},
                              (ValueError, "shared_experts.down_proj must be a floating-point tensor.*int32")),
            "float8 codes": ({**other, "experts.down_proj": torch.randn(4, D, N).to(torch.float8_e4m3fn)},
                             (ValueError, "experts.down_proj must be a floating-point tensor of 16 bits.*float8")),
            "meta": ({**other, "shared_expert_gate.weight": torch.empty(1, D, device="meta")},
                     (ValueError, "shared_expert_gate.weight must be a dense tensor with data")),
            "0-dim expert entry": ({**other, "experts.down_proj": torch.tensor(1.5)},
                                   (ValueError, r"experts.down_proj must hold all E=4 experts \(a full MoE's state "
                                                r"dict\), got \(\)")),
            "sparse": ({**other, "gate.weight": torch.randn(4, D).to_sparse()},
                       (ValueError, "gate.weight must be a dense tensor with data, got layout torch.sparse_coo")),
            "not a tensor": ({**other, "e_score_correction_bias": [0.0] * 4},
                             (ValueError, "e_score_correction_bias must be a tensor, got list")),
            "missing": ({k: v for k, v in other.items() if k != "shared_experts.down_proj"},
                        (KeyError, "missing shared_experts.down_proj")),
            "unexpected": ({**other, "extra.weight": torch.randn(3)}, (ValueError, "no place for: extra.weight")),
        }
        for case, (state, (error, message)) in bad.items():
            with pytest.raises(Exception) as info:
                layer.load_full_state_dict(state)
            after = bits(layer)
            for name, b in before.items():  # first: the old code raised too, after copying
                assert torch.equal(after[name], b), f"{case}: {name} changed by a failed load"
            assert info.type is error and re.search(message, str(info.value)), (case, info.value)
        layer.load_full_state_dict({k: v.double() for k, v in other.items()})  # cast to the layer's float32
        for name, t in layer.state_dict().items():
            assert t.dtype == torch.float32 and torch.equal(t, other[name]), name
    finally:
        dist.destroy_process_group()


def test_expert_parallel_memory_contract(tmp_path, device):
    """In a group of one rank (the exchange is then a copy): what backward keeps is the experts' contract on the
    received tokens, X_recv (T_recv, d) with one row per token however many of its experts the rank holds (here
    T_recv = T), H (R, 2n), the received scores (R,) and the weights; not the caller's x, no (R, d) tensor (no
    per-pair copy of X, no output rows before the combine), no A (R, n)."""
    from sonicmoe.expert_parallel import expert_parallel_experts

    t, d, n, e, k = 33, 48, 16, 4, 2  # d != n, 2n so (R, d), (R, n), (R, 2n) are told apart
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        g = torch.Generator().manual_seed(5)
        x = torch.randn(t, d, generator=g).to(device).requires_grad_(True)
        w1 = (torch.randn(e, 2 * n, d, generator=g) * d ** -0.5).to(device).requires_grad_(True)
        w2 = (torch.randn(e, d, n, generator=g) * n ** -0.5).to(device).requires_grad_(True)
        routing = routing_from_topk(torch.randn(t, e, generator=g).topk(k, dim=1).indices.to(device), e)
        r = routing.num_rows
        scores = torch.rand(r, generator=g).to(device).requires_grad_(True)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda s: saved.append(s) or s, lambda s: s):
            out = expert_parallel_experts(x, w1, w2, routing, scores, backend="triton")
        float_shapes = sorted(tuple(s.shape) for s in saved if s.dtype.is_floating_point)
        assert float_shapes == sorted([(t, d), (r, 2 * n), (r,), (e, 2 * n, d), (e, d, n)])
        assert not any(s.data_ptr() == x.data_ptr() for s in saved), "the caller's x is not kept"
        out.backward(torch.randn_like(out))
        ref = sonicmoe.experts(x.detach(), w1.detach(), w2.detach(), routing, scores.detach(), backend="triton")
        assert rel_err(out, ref) < 1e-5
        assert x.grad is not None and w1.grad is not None and scores.grad is not None
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
def test_expert_parallel_syncs_once(tmp_path):
    """bf16 on CUDA, a group of one rank over NCCL: the forward synchronises with the device once (the all-to-all's
    split sizes), the backward never (``torch.cuda.set_sync_debug_mode``). Before the fix, marking the (rank, token)
    pairs to send with ``need[key] = True`` synced too: a second drain of the device's queue, after which the host's
    planning ran with the device idle."""
    from sonicmoe.expert_parallel import expert_parallel_experts

    dev = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1, device_id=dev)
    try:
        t, d, n, e, k = 300, 64, 32, 8, 3
        x = torch.randn(t, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
        w1 = (torch.randn(e, 2 * n, d, device=dev) * d ** -0.5).bfloat16().requires_grad_(True)
        w2 = (torch.randn(e, d, n, device=dev) * n ** -0.5).bfloat16().requires_grad_(True)
        routing = routing_from_topk(torch.randn(t, e, device=dev).topk(k, dim=1).indices, e)
        scores = torch.rand(t * k, device=dev, requires_grad=True)
        dout = torch.randn(t, d, device=dev, dtype=torch.bfloat16)
        expert_parallel_experts(x, w1, w2, routing, scores, backend="triton").backward(dout)  # compiled, warm
        torch.cuda.synchronize()
        sites = {"forward": [], "backward": []}
        for phase, found in sites.items():
            def record(message, *args, found=found, **kwargs):
                if "called a synchronizing" in str(message):  # where: the innermost frames of sonicmoe and torch
                    found.append("".join(traceback.format_stack(limit=8)[:-2]))
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = record
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    if phase == "forward":
                        out = expert_parallel_experts(x, w1, w2, routing, scores, backend="triton")
                    else:
                        out.backward(dout)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
        counts = [len(found) for found in sites.values()]
        assert counts == [1, 0], f"host syncs in forward, backward: {counts}; where:\n" + "\n".join(
            sum(sites.values(), []))
        ref = sonicmoe.experts(x.detach(), w1.detach(), w2.detach(), routing, scores.detach(), backend="triton")
        assert rel_err(out, ref) < 1e-2
    finally:
        dist.destroy_process_group()


def test_expert_parallel_layer_under_autocast(tmp_path):
    """float32 parameters under ``torch.autocast`` (bf16, the CPU, torch backend), in a group of one rank: the experts
    run in bf16 as ``MoE``'s do (x and the weights cast, the output bf16, float32 gradients for the float32
    parameters), and output and gradients match ``MoE``'s under the same autocast to a bf16 rounding. Before the fix
    the expert-parallel call saw bf16 x with float32 weights and raised TypeError."""
    from sonicmoe.expert_parallel import ExpertParallelMoE

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        full = MoE(D, N, E, 2, bias=True, backend="torch", aux_loss_coef=0.0)
        layer = ExpertParallelMoE(D, N, E, 2, bias=True, backend="torch", aux_loss_coef=0.0)
        layer.load_full_state_dict(full.state_dict())
        x = torch.randn(3, 11, D)
        dout = torch.randn(3, 11, D)
        outs = []
        for m in (full, layer):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = m(x)
            out.float().backward(dout)
            outs.append(out)
        assert outs[1].dtype == torch.bfloat16
        assert torch.equal(outs[1], outs[0])  # the same per-expert ops in the same sum order (equal bits since 71)
        full_params = dict(full.named_parameters())
        for name, q in layer.named_parameters():
            assert q.grad.dtype == torch.float32, name
            assert rel_err(q.grad, full_params[name].grad) < 1e-6, name  # 0 measured in session 83
    finally:
        dist.destroy_process_group()


TOKENS4 = (37, 29, 11, 20)  # T of ranks 0-3 in the expert-parallel-inside-data-parallel runs


@_rank_worker
def _ep_dp_worker(rank: int, world: int, init_file: str) -> dict:
    """Rank ``rank`` of 4: expert parallelism over 2 ranks inside data parallelism over 2 (expert_parallel_groups(2):
    EP groups {0, 1}, {2, 3}; expert-data-parallel groups {0, 2}, {1, 3}). Its layer, loaded from a full MoE and wrapped
    by expert_parallel_ddp(expert_dp_group=...), against that MoE run on every rank's tokens in turn: the output, and
    every parameter's gradient against the sum over the 4 ranks' tokens divided by 4; fresh layers (replicas start
    equal); then the refusals."""
    from sonicmoe.expert_parallel import ExpertParallelMoE, expert_parallel_ddp, expert_parallel_groups

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    ep_group, dp_group = expert_parallel_groups(2)
    errs = {"ep_ranks_flag": float(dist.get_process_group_ranks(ep_group) != [rank // 2 * 2, rank // 2 * 2 + 1]),
            "dp_ranks_flag": float(dist.get_process_group_ranks(dp_group) != [rank % 2, rank % 2 + 2])}
    p = _problem(TOKENS4, 2, "random", torch.float32, torch.device("cpu"))
    opts = dict(bias=True, backend="torch", aux_loss_coef=0.0)
    torch.manual_seed(0)
    full = MoE(D, N, E, 2, **opts)
    layer = ExpertParallelMoE(D, N, E, 2, group=ep_group, **opts)
    layer.load_full_state_dict(full.state_dict())
    model = expert_parallel_ddp(layer, expert_dp_group=dp_group)
    for j in range(world):
        chunk = slice(sum(TOKENS4[:j]), sum(TOKENS4[:j + 1]))
        ref_out = full(p["x"][chunk])
        ref_out.backward(p["dout"][chunk])
        if j == rank:
            out = model(p["x"][chunk])
            out.backward(p["dout"][chunk])
            errs["out"] = rel_err(out, ref_out)
    r = layer.expert_range
    full_params = dict(full.named_parameters())
    for name, q in layer.named_parameters():
        ref = full_params[name].grad
        errs[f"d{name}"] = rel_err(q.grad, (ref[r.start:r.stop] if name.startswith("experts.") else ref) / world)
    for bad in ({}, {"expert_dp_group": dist.group.WORLD}):  # no expert_dp_group; sizes 2·4 != 4
        try:
            expert_parallel_ddp(ExpertParallelMoE(D, N, E, 2, group=ep_group, **opts), **bad)
            errs[f"accepted_{sorted(bad)}_flag"] = 1.0
        except ValueError:
            errs[f"accepted_{sorted(bad)}_flag"] = 0.0
    torch.manual_seed(0)  # ranks seeded alike: replicas of the same experts start equal, the two splits differ
    w = ExpertParallelMoE(D, N, E, 2, group=ep_group).experts.gate_up_proj.detach()
    parts = [torch.empty_like(w) for _ in range(world)]
    dist.all_gather(parts, w)
    errs["fresh_init_flag"] = float(not (torch.equal(parts[0], parts[2]) and torch.equal(parts[1], parts[3])
                                         and not torch.equal(parts[0], parts[1])))
    try:
        expert_parallel_groups(3)
        errs["ep_size_3_accepted_flag"] = 1.0
    except ValueError:
        errs["ep_size_3_accepted_flag"] = 0.0
    outside = dist.new_group([0])  # every rank creates it; ranks 1-3 are not members
    try:
        if rank:
            ExpertParallelMoE(D, N, E, 2, group=outside)
        errs["non_member_accepted_flag"] = float(bool(rank))
    except ValueError as e:
        errs["non_member_accepted_flag"] = float("is not a member" not in str(e))
    return errs


def test_expert_parallel_inside_data_parallel(tmp_path):
    """Four gloo ranks on the CPU: experts split over 2 ranks, replicated over 2 (see _ep_dp_worker); float32, torch
    backend, to 1e-5."""
    for rank, errs in enumerate(_spawn(_ep_dp_worker, 4, tmp_path)):
        assert len(errs) == 13, errs
        bad = {key: v for key, v in errs.items() if not v <= (0.0 if key.endswith("_flag") else 1e-5)}
        assert not bad, f"rank {rank}: {bad}"


@_rank_worker
def _reset_worker(rank: int, world: int, init_file: str, seed: int) -> dict:
    """Rank ``rank`` of 2: a layer built on the meta device, moved with ``to_empty`` and re-initialised with
    ``reset_parameters`` (the way large models are built), against one built directly from the same seed."""
    from sonicmoe.expert_parallel import ExpertParallelMoE

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    opts = dict(shared_intermediate_size=4, bias=True, router_bias=True)
    torch.manual_seed(seed)
    eager = ExpertParallelMoE(D, N, E, 2, **opts)
    torch.manual_seed(seed)
    meta = ExpertParallelMoE(D, N, E, 2, device="meta", **opts).to_empty(device="cpu")
    meta.reset_parameters()
    errs = {f"{name}_differs_from_eager_flag": float(not torch.equal(a, b))
            for (name, a), b in zip(eager.state_dict().items(), meta.state_dict().values())}
    for name in ("experts.gate_up_proj", "experts.down_proj_bias", "gate.weight"):
        t = meta.state_dict()[name]
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.contiguous())
        # the router is replicated (equal on every rank), the experts are each rank's own (different)
        errs[f"{name}_across_ranks_flag"] = float(torch.equal(parts[0], parts[1]) != name.startswith("gate"))
    return errs


def test_expert_parallel_reset_parameters_after_meta(tmp_path):
    """Two gloo ranks: ``reset_parameters`` after building on ``device="meta"`` gives what ``__init__`` gives from the
    same seed, each rank's experts drawn from its own stream. Before the fix it was MoE's, drawing every rank's
    experts from the one stream the ranks share: rank 1's experts were rank 0's."""
    for rank, errs in enumerate(_spawn(_reset_worker, 2, tmp_path, int(torch.randint(0, 2 ** 31, ())))):
        assert len(errs) == 11, errs
        bad = {key: v for key, v in errs.items() if v != 0.0}
        assert not bad, f"rank {rank}: {bad}"


def test_expert_parallel_routing_over_local_experts_is_named():
    """A routing over this rank's E_loc experts instead of all E = E_loc·P (a likely mistake): the message gives P,
    E_loc and E. Before the fix it was sonicmoe.experts', "routing is for E=2 experts but w1 has E=4", of a w1
    holding 2. The check is the one expert_parallel_experts runs before any exchange (P passed in: no group)."""
    from sonicmoe.expert_parallel import _check_ep_inputs

    e_loc, world = int(torch.randint(1, 4, ())), 2
    x, w1, w2 = torch.randn(5, D), torch.randn(e_loc, 2 * N, D), torch.randn(e_loc, D, N)
    ids = torch.stack([torch.randperm(e_loc)[:1] for _ in range(5)])
    local = routing_from_topk(ids, e_loc)
    with pytest.raises(ValueError, match=rf"routing is for E={e_loc} experts but the group's P=2 ranks hold "
                                         rf"E = E_loc·P = {2 * e_loc} \(w1 has E_loc={e_loc}\)"):
        _check_ep_inputs(x, w1, w2, None, None, local, torch.rand(5), world, "torch", "concat")
    _check_ep_inputs(x, w1, w2, None, None, routing_from_topk(ids, e_loc * world), torch.rand(5), world, "torch",
                     "concat")


def _gloo_or_skip() -> None:
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with the gloo backend is not available")


@_rank_worker
def _bias_worker(rank: int, world: int, init_file: str, seed: int) -> dict:
    """Rank ``rank`` of 2: the same sigmoid_then_topk layer on every rank (one seed) updates its selection bias with
    ``group=`` a real process group of both ranks, twice: from its last forward's counts (each rank's own tokens),
    then from int64 counts chosen so that the summed counts order the experts differently from this rank's alone.
    Against the same layer in one process updated from the counts summed by hand; both ranks' biases gathered."""
    from datetime import timedelta

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    group = dist.new_group(list(range(world)))
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(t, D, generator=g) for t in TOKENS]  # every rank draws every rank's tokens
    mine = torch.randint(0, 50, (E,), generator=g)
    other = torch.randint(0, 50, (E,), generator=g)
    other[int(mine.argmin())] += 1000  # rank 0's least loaded expert is the group's busiest
    explicit = [mine, other]
    rates = (0.125, 0.25)

    def layer() -> MoE:
        torch.manual_seed(seed)
        return MoE(D, N, E, 2, router_order="sigmoid_then_topk", backend="torch")

    m, ref = layer(), layer()
    m(xs[rank])
    local = m.expert_counts.clone()
    m.update_expert_bias(rates[0], group=group)
    counts = explicit[rank].clone()
    m.update_expert_bias(rates[1], counts=counts, group=group)
    forward_counts = torch.zeros(E)
    for x in xs:  # counts by hand: each rank's tokens alone, summed
        ref(x)
        forward_counts += ref.expert_counts.to(torch.float32)
    ref.update_expert_bias(rates[0], counts=forward_counts)
    ref.update_expert_bias(rates[1], counts=mine + other)
    solo = layer()
    solo.update_expert_bias(rates[1], counts=explicit[rank])
    b = m.e_score_correction_bias
    parts = [torch.empty_like(b) for _ in range(world)]
    dist.all_gather(parts, b)
    return {"ranks_differ_flag": float(not all(torch.equal(p, parts[0]) for p in parts)),
            "not_one_process_flag": float(not torch.equal(b, ref.e_score_correction_bias)),
            "bias_not_float32_flag": float(b.dtype != torch.float32),
            "own_counts_changed_flag": float(not (torch.equal(m.expert_counts, local)
                                                  and torch.equal(counts, explicit[rank]))),
            # the check has teeth: rank 0's own counts alone would step its least loaded expert the other way
            "summed_like_local_flag": float(rank == 0 and solo.e_score_correction_bias[int(mine.argmin())] <= 0),
            "summed_step_flag": float(ref.e_score_correction_bias[int(mine.argmin())] >= 0)}


def test_update_expert_bias_over_two_gloo_ranks(tmp_path):
    """update_expert_bias(group=...) in two real processes over gloo (not a stood-in all_reduce): both ranks end with
    the same float32 bias, equal to one process's update from the counts summed over the ranks (last forward's
    counts, then given int64 ones), and the caller's counts and the layer's expert_counts are left as they were."""
    _gloo_or_skip()
    results = _spawn(_bias_worker, 2, tmp_path, int(torch.randint(0, 2 ** 31, ())))
    for rank, errs in enumerate(results):
        assert len(errs) == 6, errs
        bad = {key: v for key, v in errs.items() if v != 0.0}
        assert not bad, f"rank {rank}: {bad}"
