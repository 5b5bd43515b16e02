"""How moe-ep runs its Triton kernels: compiled on a GPU, through Triton's interpreter without one.

Every module that runs a kernel imports this one first. Without CUDA, ``TRITON_INTERPRET=1`` is set before
triton is imported (:mod:`moe_ep.kernel_mode`; ``@triton.jit`` reads it at decoration time), and this module
patches the interpreter's known traps in Triton 3.6-3.9, so the same kernel code gives the GPU's answers on a CPU:

* bf16 ``tl.dot`` and bf16 add/multiply/compare work on the raw uint16 bits (triton issue #11584):
  bf16 operands are upcast to fp32 first, and arithmetic results rounded back to bf16 (RNE). fp8 ``tl.dot``
  operands are raw uint8 bits there too: they are upcast to fp32 the same way (the products of two e4m3 values
  are exact in fp32, as in the tensor cores).
* fp32 -> bf16 / fp8 casts truncate or round half-up there; the GPU rounds to nearest even
  (and saturates fp8 with ``satfinite``): casts are done through torch, which rounds like the GPU.
* a comparison's handle keeps its operands' type (int32 for ``i < n``) around numpy bools, so a splat of a
  scalar comparison into a block mask became int32, which Triton 3.9's load/store refuse: comparisons are
  tagged int1 (a no-op where the interpreter already does so).
* ``@triton.autotune`` asks the (absent) driver for a benchmarker ("0 active drivers"): it gets a
  wall-clock one.

``tl.sum`` on bf16 is still wrong in the interpreter: kernels reduce in fp32. None of this touches the
compiled GPU path: the patches are applied only when the interpreter is on.
"""

from __future__ import annotations

import time

import torch

from .errors import fail
from .kernel_mode import decide

_CUDA = torch.cuda.is_available()

INTERPRETER: bool = decide()
"""True when kernels run through Triton's interpreter (no GPU, or asked for)."""

import numpy as np  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

COMPILED = tl.constexpr(not INTERPRETER)
"""The kernels' branch for what only a compiled kernel runs (inline PTX, a wait on another kernel's progress, a
single-rounding fma); the interpreter takes plain ops that give the same values."""


def triton_minor() -> str:
    """The Triton release in use as "major.minor" (e.g. "3.6"): what a fast path's list of checked Tritons holds."""
    return ".".join(triton.__version__.split(".")[:2])


def device() -> torch.device:
    """The device moe-ep kernels run on: the current CUDA device, else the CPU (interpreter)."""
    return torch.device("cuda", torch.cuda.current_device()) if _CUDA else torch.device("cpu")


def check_on_kernel_device(t: torch.Tensor, name: str) -> None:
    """Raise :class:`~moe_ep.MoEEpInputError` unless tensor ``name`` is on the kind of device the kernels run on
    (checked by every launcher: a CPU tensor given to a CUDA kernel, or a meta tensor, is the caller's mistake)."""
    kind = "cuda" if _CUDA else "cpu"  # (only the kind: this runs for every tensor of every launch)
    if t.device.type != kind:
        fail(f"{name}.device", str(t.device), f"{kind} (where the kernels run here)")


_TORCH_OF = {}  # triton scalar type -> torch dtype, for the casts done through torch


def _torch_dtype(tt):
    if not _TORCH_OF:
        _TORCH_OF.update({
            tl.bfloat16: torch.bfloat16, tl.float16: torch.float16, tl.float32: torch.float32,
            tl.float64: torch.float64, tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2,
        })
    return _TORCH_OF.get(tt)


_FP8_MAX = {tl.float8e4nv: 448.0, tl.float8e5: 57344.0}
_LOW = (tl.bfloat16, tl.float8e4nv, tl.float8e5)  # the interpreter holds these as raw bits
_BITS = {16: np.int16, 8: np.uint8}


def _torch_cast(data: np.ndarray, src, dst):
    """Cast numpy-held triton values from scalar type src to dst through torch (RNE, fp8 satfinite)."""
    data = np.ascontiguousarray(data)
    if src in _LOW:  # stored as raw bits: reinterpret as the torch dtype
        t = torch.from_numpy(data.view(_BITS[src.primitive_bitwidth])).view(_torch_dtype(src))
    else:
        t = torch.from_numpy(data)
    t = t.to(torch.float32)
    if dst in _FP8_MAX:
        t = t.clamp(-_FP8_MAX[dst], _FP8_MAX[dst])  # NaN stays NaN, as with cvt.satfinite
    out = t.to(_torch_dtype(dst))
    if dst in _LOW:
        out = out.view(torch.int16 if dst.primitive_bitwidth == 16 else torch.uint8)
    return out.numpy().view(_np_dtype_of(dst))


def _np_dtype_of(tt):
    from triton.runtime.interpreter import _get_np_dtype
    return _get_np_dtype(tt)


def _handled_by_torch(src, dst) -> bool:
    floats = (tl.float16, tl.float32, tl.float64) + _LOW
    return src in floats and dst in floats and (src in _LOW or dst in _LOW)


def _to_f32(handle):
    """A bf16 or fp8 handle's values as fp32 numpy (other handles unchanged)."""
    if handle.dtype.scalar in _LOW:
        return _torch_cast(handle.data, handle.dtype.scalar, tl.float32)
    return handle.data


def _patch_interpreter() -> None:
    from triton.runtime import interpreter as interp
    from triton.runtime.autotuner import Autotuner

    builder = interp.InterpreterBuilder
    if getattr(builder, "_moe_ep_patched", False):
        return
    TensorHandle = interp.TensorHandle
    orig_binary, orig_cast, orig_fp_to_fp, orig_dot = (
        builder.binary_op, builder.cast_impl, builder.create_fp_to_fp, builder.create_dot)

    def binary_op(self, lhs, rhs, op):
        if tl.bfloat16 not in (lhs.dtype.scalar, rhs.dtype.scalar):
            out = orig_binary(self, lhs, rhs, op)
            # a comparison's handle carries its operands' type (int32 for ``i < n``) around numpy bools; a splat
            # of it (scalar & block) then turns the bools into int32, a mask that Triton 3.9's load/store refuse
            if out.data.dtype == np.bool_ and out.dtype != tl.int1:
                return TensorHandle(out.data, tl.int1)
            return out
        out = op(_to_f32(lhs), _to_f32(rhs))
        if out.dtype == np.bool_:
            return TensorHandle(out, tl.int1)
        return TensorHandle(_torch_cast(out.astype(np.float32), tl.float32, tl.bfloat16), tl.bfloat16)

    def cast_impl(self, src, dst_type):
        s, d = src.dtype.scalar, dst_type.scalar
        if _handled_by_torch(s, d):
            return TensorHandle(_torch_cast(src.data, s, d), d)
        return orig_cast(self, src, dst_type)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        s, d = src.dtype.scalar, dst_type.scalar
        if _handled_by_torch(s, d) and rounding_mode in (None, interp._ir.ROUNDING_MODE.RTNE):
            return TensorHandle(_torch_cast(src.data, s, d), d)
        return orig_fp_to_fp(self, src, dst_type, rounding_mode)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar in _LOW or b.dtype.scalar in _LOW:  # bf16 and fp8 (e4m3 / e5m2) are raw bits here
            a32, b32 = _to_f32(a), _to_f32(b)
            acc = d.data if d.dtype.scalar != tl.bfloat16 else _to_f32(d)
            out = np.matmul(a32.astype(np.float32), b32.astype(np.float32)) + acc
            if d.dtype.scalar == tl.bfloat16:
                return TensorHandle(_torch_cast(out.astype(np.float32), tl.float32, tl.bfloat16), tl.bfloat16)
            return TensorHandle(out.astype(d.data.dtype), d.dtype.scalar)
        return orig_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    # numpy >= 2.4 refuses int() of a 1-element 1-D array, which is how the interpreter holds scalar
    # kernel arguments: ``range(0, K, BLOCK_K)`` over a runtime K would raise TypeError
    orig_patch_tensor = interp._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        orig_patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interp._patch_lang_tensor = patch_lang_tensor
    _patch_lang_once_per_launch(interp)

    builder.binary_op = binary_op
    builder.cast_impl = cast_impl
    builder.create_fp_to_fp = create_fp_to_fp
    builder.create_dot = create_dot
    builder._moe_ep_patched = True

    def wall_clock_bench(fn, quantiles=None, **_):
        t0 = time.perf_counter()
        fn()
        ms = (time.perf_counter() - t0) * 1e3
        return [ms] * len(quantiles) if quantiles else ms

    # a property, so an autotuner built before or after this sees it; the real one asks the driver
    Autotuner.do_bench = property(lambda self: wall_clock_bench)


def _patch_lang_once_per_launch(interp) -> None:
    """A launch patches triton.language (every builtin, found by ``inspect.getmembers``) for its duration, and
    then every call of a ``@triton.jit`` helper inside it patches the same modules again, unrestored, with the
    same values: most of an interpreted kernel's time when its helpers are small. A helper's call skips that
    when the launch in progress, or a helper within it, has patched every language module the helper sees. (Nothing
    to do where the interpreter has no such functions.)"""
    grid_executor = getattr(interp, "GridExecutor", None)
    orig_patch_lang = getattr(interp, "_patch_lang", None)
    if grid_executor is None or orig_patch_lang is None or not hasattr(interp, "_LangPatchScope"):
        return
    orig_run = grid_executor.__call__
    launches = []  # per launch in progress: the language modules it patched (None before it has)
    lang_modules = {}  # jit function -> the triton.language modules among its globals

    def modules_of(fn):
        if fn not in lang_modules:
            lang_modules[fn] = frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)
        return lang_modules[fn]

    def patch_lang(fn):
        langs = modules_of(fn)
        if launches and launches[-1] is not None and langs <= launches[-1]:
            return interp._LangPatchScope()  # nothing to restore
        scope = orig_patch_lang(fn)
        if launches:  # (a helper's patch is not restored at its return: it holds for the rest of the launch)
            launches[-1] = langs if launches[-1] is None else launches[-1] | langs
        return scope

    def run(self, *args, **kwargs):
        launches.append(None)
        try:
            return orig_run(self, *args, **kwargs)
        finally:
            launches.pop()

    interp._patch_lang = patch_lang
    grid_executor.__call__ = run


if INTERPRETER:
    _patch_interpreter()
