"""GEMM1 -> GEMM2 chaining in the expert MLP (decode shapes): GEMM2's programs start while GEMM1's last ones run.

GEMM1 counts its finished tiles per expert in ``ready [G]`` (zeroed by the launcher; a tile is counted, with release
semantics, after every thread of it has stored its rows). GEMM2 waits, tile by tile, until its expert's count is
complete (acquire) instead of waiting for the whole of GEMM1. On Hopper and newer GEMM2 is launched as a programmatic
dependent of GEMM1 (PDL): every GEMM1 program allows it at its start, so GEMM2's programs take SMs, and stream their
weights, as soon as GEMM1's programs leave them. That cannot deadlock: a dependent grid is launched only once every
GEMM1 program has started, so no GEMM1 tile ever waits for an SM that a waiting GEMM2 program holds. GEMM2 ends with
``griddepcontrol.wait``, so its completion still implies GEMM1's, as with a plain launch.

It pays where the GEMMs wait on DRAM: bf16-weight decode. NVFP4-weight decode is bound by instructions and prefill by
the tensor cores at the power cap (idle SMs in GEMM1's last round cost little), so
:func:`~moe_ep.kernels.expert_mlp` chains decode-sized calls with bf16 weights only, which never take the TMA tiles
(measurements: docs/PERF.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ... import device_facts, options
from ...triton_runtime import COMPILED, INTERPRETER


@triton.jit
def tile_done(ready_ptr, g):
    """GEMM1: one more finished tile of expert g, counted after every thread's stores of it (release)."""
    tl.debug_barrier()
    tl.atomic_add(ready_ptr + g, 1, sem="release", scope="gpu")


@triton.jit
def expert_ready(ready_ptr, g, rows, WAIT_BM, WAIT_NT):
    """GEMM2: whether GEMM1 has written all ``rows`` rows of expert g, i.e. counted its cdiv(rows, WAIT_BM) * WAIT_NT
    tiles of them. On a GPU this waits until it has, so it returns true. Through the interpreter GEMM1 has already
    finished, so it only checks: a short count drops the tile's rows, which a poisoned output shows."""
    need = tl.cdiv(rows, WAIT_BM) * WAIT_NT
    done = tl.atomic_add(ready_ptr + g, 0, sem="acquire", scope="gpu")
    if COMPILED:  # the interpreter runs GEMM1 to its end before GEMM2 starts: nothing to wait for
        while done < need:
            done = tl.atomic_add(ready_ptr + g, 0, sem="acquire", scope="gpu")
    return done >= need


@triton.jit
def allow_dependents(PDL: tl.constexpr, SIGNAL: tl.constexpr):
    """GEMM1 with PDL: let the dependent GEMM2 launch once every program of this grid has started."""
    if PDL and SIGNAL:
        gdc_launch_dependents()


@triton.jit
def finish_dependent(PDL: tl.constexpr, WAIT: tl.constexpr):
    """GEMM2 with PDL: complete only after GEMM1 has completed and its memory operations are visible."""
    if PDL and WAIT:
        gdc_wait()


def enabled() -> bool:
    """Whether the expert MLP chains its GEMMs (the ``gemm_chain`` option: ``MOE_EP_GEMM_CHAIN=off`` turns it off)."""
    return options.current().gemm_chain


def dependent_launch_supported() -> bool:
    """Whether PDL (``griddepcontrol``) is available: a Hopper or newer GPU, not the interpreter."""
    return not INTERPRETER and device_facts.hopper_or_newer()


@dataclass
class Link:
    """One GEMM's part in the chain. ``ready``: the per-expert tile counts (int32 [G], zero before GEMM1; None until
    GEMM1's launcher makes them). ``wait``: None for GEMM1 (it counts); for GEMM2, GEMM1's (BLOCK_M, column tiles),
    which give each expert's tile count. ``pdl``: GEMM1 allows a dependent launch and GEMM2 is launched as one.
    ``launched``: the tensors GEMM1 was launched with, held until GEMM2 is enqueued: a dependent GEMM2 may run while
    GEMM1 still reads them, so the allocator must not hand their memory (contiguous copies among them) to GEMM2."""
    ready: torch.Tensor | None = None
    wait: tuple[int, int] | None = None
    pdl: bool = False
    launched: tuple = ()
