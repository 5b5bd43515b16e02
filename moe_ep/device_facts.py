"""Facts about the current CUDA device that the kernels' launchers decide by (cached: a property query costs tens
of microseconds, too much per kernel call). Without CUDA, or under Triton's interpreter, each has a stated answer."""

from __future__ import annotations

import re
from functools import lru_cache

import torch

from .triton_runtime import INTERPRETER


@lru_cache(maxsize=16)
def _props(index: int):
    return torch.cuda.get_device_properties(index)


@lru_cache(maxsize=1)
def _has_cuda() -> bool:
    return torch.cuda.is_available()


def properties():
    """The current CUDA device's properties, read once per device (None without CUDA)."""
    return _props(torch.cuda.current_device()) if _has_cuda() else None


def device_index() -> int:
    """The current CUDA device's index (-1 without CUDA): what caches of per-device decisions key on."""
    return torch.cuda.current_device() if _has_cuda() else -1


def plan_key() -> tuple:
    """(index, TMA supported, shared memory limit, SMs) of the current device: what the grouped GEMM's plan cache
    keys on. Kept per device index and per the functions it is read from (each reads the device's properties: a few
    microseconds per expert MLP); a caller that replaces one of them (a test's stand-in device) gets a key of its
    own."""
    index = device_index()
    made_of = (tma_supported, smem_limit, sm_count, properties, hopper_or_newer)
    kept = _PLAN_KEYS.get(index)
    if kept is not None and kept[0] == made_of:
        return kept[1]
    key = (index, tma_supported(), smem_limit(), sm_count())
    _PLAN_KEYS[index] = (made_of, key)
    return key


_PLAN_KEYS: dict = {}  # device index -> (the functions the key was read from, the key)


def hopper_or_newer() -> bool:
    """Whether the current CUDA device is Hopper (compute capability 9.0) or newer; False without CUDA."""
    props = properties()
    return props is not None and props.major >= 9


def sm90_unavailable_reason() -> str | None:
    """Why a Hopper-only kernel (sm_90a: wgmma, TMA; the Gluon fast paths) cannot run here: the interpreter, no CUDA
    device, or a GPU of another capability; None where it can. Asked afresh on every call (not cached)."""
    if INTERPRETER or not torch.cuda.is_available():
        return "needs an sm_90 GPU (Hopper: wgmma, TMA); none here"
    cap = torch.cuda.get_device_capability()
    if cap != (9, 0):
        return f"needs an sm_90 GPU (Hopper: wgmma, TMA); this one is sm_{cap[0]}{cap[1]}"
    return None


def tma_supported() -> bool:
    """Whether bf16 tiles can be loaded by TMA here: Hopper or newer (or the interpreter, which runs the same
    tensor-descriptor code)."""
    return INTERPRETER or hopper_or_newer()


def sm_count() -> int:
    """Streaming multiprocessors of the current device (1 without CUDA)."""
    props = properties()
    return props.multi_processor_count if props is not None else 1


def smem_per_sm() -> int:
    """Shared memory of one multiprocessor in bytes (1 without CUDA)."""
    props = properties()
    return props.shared_memory_per_multiprocessor if props is not None else 1


def smem_limit() -> int | None:
    """Shared memory one program may use on the current GPU (the opt-in maximum, which Triton checks a compiled kernel
    against: 227 KB on H100/H200/B200, 99 KB on sm_89/sm_120 cards); None without one (the interpreter has none)."""
    props = properties()
    return None if INTERPRETER or props is None else props.shared_memory_per_block_optin


def device_name() -> str:
    """File-name form of the current device's name, e.g. ``NVIDIA_H200`` (``cpu`` without CUDA)."""
    props = properties()
    return _file_name(props.name if props is not None else "cpu")


@lru_cache(maxsize=16)
def _file_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name.strip())


SM100_SMEM_PER_BLOCK = 232448
"""Shared memory one program may use on a compute capability 10.0 GPU (B200 / GB200: the opt-in maximum, 227 KB),
what the sm_100 W4A4 space is pruned by wherever it is pruned (its kernel runs on such a GPU alone)."""
SM100_TMEM_COLUMNS = 512
"""Tensor-memory columns (32-bit, 128 lanes) of one sm_100 CTA: the tcgen05 accumulator and the MMA's scales."""


def sm100_smem_limit() -> int:
    """Shared memory one program of the sm_100 W4A4 kernel may use: this GPU's opt-in maximum where it is of
    capability 10.x, else :data:`SM100_SMEM_PER_BLOCK` (the B200's: the space is pruned for it on any machine)."""
    props = properties()
    if props is not None and props.major == 10 and getattr(props, "shared_memory_per_block_optin", None):
        return int(props.shared_memory_per_block_optin)
    return SM100_SMEM_PER_BLOCK
