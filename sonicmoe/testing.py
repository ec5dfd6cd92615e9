"""Helpers shared by tests and benchmarks: relative error, poisoned buffers, random problems and routings."""

from __future__ import annotations

import torch


class OnCuda(torch.Tensor):
    """A CPU tensor that says it lives on ``cuda:INDEX`` (``torch.Tensor._make_subclass(OnCuda, t)``): for testing
    device logic (guards, refusals) on a machine without CUDA."""

    INDEX = 1

    @property
    def is_cuda(self):
        return True

    @property
    def device(self):
        return torch.device("cuda", self.INDEX)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ computed in float64; NaN if ``out`` holds any NaN or Inf."""
    out, ref = out.detach().double(), ref.detach().double()
    if not torch.isfinite(out).all():
        return float("nan")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def random_problem(t: int, d: int, n: int, e: int, *, dtype=torch.float32, device="cpu", bias=False,
                   seed: int = 0, scale: float = 1.0):
    """Fresh random x (T, d), router weight (E, d), W1 (E, 2n, d), W2 (E, d, n) and biases.

    Weights are scaled by 1/sqrt(fan_in) so activations stay O(1). Values are drawn in float64 for a float64
    problem (so its tests can see a computation that drops to float32) and in float32 otherwise, then cast.
    Returns a dict.
    """
    g = torch.Generator(device="cpu").manual_seed(seed)
    draw = torch.float64 if dtype == torch.float64 else torch.float32

    def rnd(*shape, s=1.0):
        return (torch.randn(*shape, generator=g, dtype=draw) * s * scale).to(device=device, dtype=dtype)

    out = {
        "x": rnd(t, d),
        "router_weight": rnd(e, d, s=d**-0.5),
        "w1": rnd(e, 2 * n, d, s=d**-0.5),
        "w2": rnd(e, d, n, s=n**-0.5),
        "b1": rnd(e, 2 * n, s=0.1) if bias else None,
        "b2": rnd(e, d, s=0.1) if bias else None,
    }
    return out


def random_topk_routing(t: int, e: int, k: int, *, seed: int, device="cuda"):
    """Top-k routing (:func:`sonicmoe.routing_from_topk`) of T tokens over E experts from random logits drawn on
    ``device`` with a generator seeded ``seed``: K distinct experts per token, uneven counts."""
    from .routing import routing_from_topk

    g = torch.Generator(device=device).manual_seed(seed)
    ids = torch.randn(t, e, device=device, generator=g).topk(k, dim=1).indices.to(torch.int32)
    return routing_from_topk(ids, e)


def layer_grads(p: dict, dout: torch.Tensor, top_k: int, *, dtype=torch.bfloat16, backend: str = "triton"):
    """The layer's output and the gradients of all its inputs: :func:`sonicmoe.moe` on ``p``
    (:func:`random_problem`'s dict, biases if present) cast to ``dtype``, backward from ``dout`` (T, d).
    Returns (out (T, d), {name: grad})."""
    from .functional import moe

    ins = {key: v.to(dtype).clone().requires_grad_(True) for key, v in p.items() if v is not None}
    res = moe(ins["x"], ins["router_weight"], ins["w1"], ins["w2"], ins.get("b1"), ins.get("b2"), top_k=top_k,
              backend=backend)
    res.out.backward(dout)
    return res.out.detach(), {key: v.grad for key, v in ins.items()}


def reference_grads(p: dict, dout: torch.Tensor, top_k: int, *, rounded_to=torch.float64,
                    gate_up_layout: str = "concat"):
    """The float64 twin of :func:`layer_grads`: :func:`sonicmoe.moe_ref` on ``p``'s tensors rounded to ``rounded_to``
    first (so that routing near-ties choose as the layer under test does), then held in float64; backward from
    ``dout`` (T, d). ``gate_up_layout`` as in :class:`sonicmoe.MoEConfig`.
    Returns (out (T, d) float64, {name: grad})."""
    from .reference import moe_ref

    ins = {key: v.to(rounded_to).double().clone().requires_grad_(True) for key, v in p.items() if v is not None}
    out, _, _ = moe_ref(ins["x"], ins["router_weight"], ins["w1"], ins["w2"], ins.get("b1"), ins.get("b2"),
                        top_k=top_k, gate_up_layout=gate_up_layout)
    out.backward(dout.double())
    return out.detach(), {key: v.grad for key, v in ins.items()}
