"""``sonicmoe train``: a small byte-level language model with :class:`sonicmoe.MoE` MLPs, trained on
real text (the CPython standard library's sources by default), reporting loss, tokens/s, the MoE
layers' share of step time, peak memory and the expert-load distribution.

Modules: ``config`` (:class:`TrainConfig`, presets), ``data`` (:class:`ByteCorpus`), ``model``
(:class:`MoETransformer`), ``loop`` (:func:`train`), ``profiling``, ``report``, ``cli``.
"""

from .config import PRESETS, TrainConfig, make_config
from .data import ByteCorpus
from .loop import load_checkpoint, train
from .model import ModelConfig, MoETransformer

__all__ = ["PRESETS", "ByteCorpus", "ModelConfig", "MoETransformer", "TrainConfig", "load_checkpoint",
           "make_config", "train"]
