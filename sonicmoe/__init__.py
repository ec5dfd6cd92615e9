"""sonicmoe: fast, activation-memory-lean fine-grained Mixture-of-Experts training (SonicMoE method).

Public API: :class:`MoE` (the layer; :class:`MoELayerOutput` with ``return_router_info=True``), :func:`moe`
and :func:`experts` (functional), the router and routing metadata (:func:`router_topk`,
:func:`routing_from_topk`, :func:`routing_from_pairs`, :func:`routing_dense`, :class:`Routing`), the float32
ground truth (:func:`moe_ref`, :func:`experts_ref`), :class:`MoEConfig`, and per-expert Hugging Face checkpoints
in and out (:func:`load_hf_experts`, :func:`hf_experts_state_dict`; gpt-oss's: :func:`load_gpt_oss_experts`,
:func:`gpt_oss_state_dict` with the layer options :data:`GPT_OSS_OPTIONS`). Importing queries no GPU.
"""

from .checkpoints import (
    GPT_OSS_OPTIONS,
    gpt_oss_state_dict,
    hf_experts_state_dict,
    load_gpt_oss_experts,
    load_hf_experts,
)
from .config import MoEConfig
from .functional import MoEOutput, experts, moe
from .modules import MoE, MoELayerOutput
from .reference import experts_ref, moe_ref
from .routing import (
    RouterOutput,
    Routing,
    load_balancing_loss,
    router_topk,
    routing_dense,
    routing_from_pairs,
    routing_from_topk,
    z_loss,
)

__version__ = "0.1.0"

__all__ = [
    "GPT_OSS_OPTIONS",
    "MoE",
    "MoEConfig",
    "MoELayerOutput",
    "MoEOutput",
    "RouterOutput",
    "Routing",
    "experts",
    "experts_ref",
    "gpt_oss_state_dict",
    "hf_experts_state_dict",
    "load_balancing_loss",
    "load_gpt_oss_experts",
    "load_hf_experts",
    "moe",
    "moe_ref",
    "router_topk",
    "routing_dense",
    "routing_from_pairs",
    "routing_from_topk",
    "z_loss",
]
