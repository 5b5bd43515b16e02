"""Autotune spaces for the kernels, and which of them the interpreter gets.

On a GPU each kernel autotunes over its space (keyed on its shape class). Through the interpreter
(no GPU) a program costs Python time per launch, so it gets a couple of large-block configs: enough
to keep the autotuner itself exercised, few enough to stay quick.
"""

from __future__ import annotations

import triton

from ..triton_runtime import INTERPRETER


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
