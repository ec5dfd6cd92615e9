"""``sonicmoe bench``: timings, memory and correctness of the MoE expert layer (SPEC §6-§7).

Modules: :mod:`.shapes` (presets and FLOP counting), :mod:`.problem` (random inputs and routing),
:mod:`.baselines` (the registry of timed backends: ours, torch, loop, the cuBLAS upper bound,
competitor libraries), :mod:`.measure` (reference check, do_bench, memory), :mod:`.runner`,
:mod:`.report` (results JSON, terminal and markdown tables), :mod:`.plots`, :mod:`.cli`.
Importing this package imports torch but queries no GPU.
"""

from .cli import main

__all__ = ["main"]
