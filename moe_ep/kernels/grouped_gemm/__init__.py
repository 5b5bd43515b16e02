"""Grouped GEMM over experts, bf16 or NVFP4 operands, masked or ragged rows, and the expert MLP built from two.

``launcher.py`` (entry points: check -> plan -> launch), ``plan.py`` (:class:`GemmPlan`: every decision of a call),
``kernels.py`` (the ``triton.language`` kernel), ``schedule.py`` (which tile a program takes; grid sizes),
``chain.py`` (GEMM1 -> GEMM2 chaining), ``fp4_decode.py`` (NVFP4 to bf16, in registers and as copies),
``config_space.py`` (tile configs, their prune and shared-memory estimate), ``tuned_files.py`` (``configs/*.json``).
"""

from .launcher import expert_mlp, grouped_gemm, plan_grouped_gemm
from .plan import GemmPlan

__all__ = ["grouped_gemm", "expert_mlp", "plan_grouped_gemm", "GemmPlan"]
