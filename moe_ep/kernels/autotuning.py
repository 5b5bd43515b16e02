"""Autotuning shared by the quantize, decode and bridge kernels: their config space, the size classes they key on,
and the launch that honours ``MOE_EP_AUTOTUNE=off``.

On a GPU each kernel autotunes over its space (keyed on its shape class). Through the interpreter (no GPU) a program
costs Python time per launch, so it gets a couple of large-block configs: enough to keep the autotuner itself
exercised, few enough to stay quick. (The grouped GEMM's own space is ``grouped_gemm/config_space.py``.)
"""

from __future__ import annotations

import triton

from .. import options
from ..triton_runtime import INTERPRETER
from . import launch_cache


def size_bucket(n: int, lo: int = 256) -> int:
    """Power-of-two class of a size (at least ``lo``): autotune keys on it, so a new size in the same
    class reuses the tuned config instead of re-tuning."""
    return max(lo, 1 << max(n - 1, 0).bit_length())


def nvfp4_configs() -> list[triton.Config]:
    """Quantize/dequantize tiles: memory bound, so wide K blocks and enough rows in flight."""
    if INTERPRETER:
        return [triton.Config({"BLOCK_M": 64, "BLOCK_K": 256}), triton.Config({"BLOCK_M": 32, "BLOCK_K": 512})]
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_K": bk}, num_warps=w, num_stages=1)
        for bm, bk, w in [(8, 512, 4), (16, 256, 4), (16, 512, 8), (32, 256, 8), (4, 1024, 4), (8, 1024, 8),
                          (32, 128, 4), (64, 128, 8)]
    ]


def launch(kernel, grid, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)`` for a ``triton.autotune`` kernel (through :mod:`.launch_cache`); under
    ``MOE_EP_AUTOTUNE=off`` (``options.current().autotune`` false) its first config instead, untimed (a fuzz run
    meets hundreds of new keys; timing every config of each would dominate it)."""
    if options.current().autotune:
        return launch_cache.launch(kernel, grid, *args, **kwargs)
    cfg = kernel.configs[0]
    launch_cache.launch(kernel.fn, grid(cfg.kwargs) if callable(grid) else grid, *args, **kwargs, **cfg.all_kwargs())
    return cfg
