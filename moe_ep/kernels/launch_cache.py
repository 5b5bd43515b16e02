"""Kernel launches without Triton's per-call Python dispatch: once a compiled kernel is found, it is launched directly.

``kernel[grid](*args)`` binds and specializes every argument, looks up Triton's compile cache, checks the kernel's
globals, and for a ``triton.heuristics`` / ``triton.autotune`` kernel also builds argument dicts, evaluates each
heuristic and computes the tuning key: tens of microseconds of host time per launch, more than many of our kernels
run for. :func:`launch` makes the first call of each *key* through Triton (which compiles and autotunes as usual)
and keeps what that call decided (the compiled kernel and the autotuner's config); later calls with the same key
launch the compiled kernel through its C launcher alone.

The key covers everything the compiled kernel was specialized on, by Triton's rules: each tensor's dtype and 16-byte
alignment, each int's class (1, a multiple of 16, 32 or 64 bits), bools, floats and None, each TMA descriptor's
dtype, block shape and base alignment, the keyword arguments (constexprs and compile options), the current device,
Triton's debug and instrumentation knobs, the autotuner's key values (its pick depends on them) and every
heuristic's value, evaluated on each call as Triton would. Under the interpreter, with a launch hook installed
(profilers), for an argument of a type the key does not know, or when the kernel has a parameter the call leaves to
its default, every call goes through Triton.
"""

from __future__ import annotations

import torch
import triton
from triton.compiler import CompiledKernel
from triton.knobs import HookChain
from triton.runtime.autotuner import Autotuner, Heuristics
from triton.runtime.driver import driver as triton_driver
from triton.tools.tensor_descriptor import TensorDescriptor

from ..triton_runtime import INTERPRETER

_MAX_ENTRIES = 512  # per kernel; a caller meeting more keys than this starts over (the cache stays bounded)
_I32 = (-2 ** 31, 2 ** 31)
_I64 = (-2 ** 63, 2 ** 63)


def _int_class(v: int):
    if v == 1:
        return 1
    size = 32 if _I32[0] <= v < _I32[1] else 64 if _I64[0] <= v < _I64[1] else 65
    return size, v % 16 == 0


def _spec(a):
    """What Triton specializes a positional argument on (a hashable value), or raise TypeError for an unknown type."""
    t = type(a)
    if t is torch.Tensor or isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if t is int:
        return _int_class(a)
    if t is bool or t is float or a is None:
        return t
    if isinstance(a, TensorDescriptor):
        return "desc", a.base.dtype, a.base.data_ptr() % 16 == 0, tuple(a.block_shape), a.padding
    raise TypeError(type(a).__name__)


class _Entry:
    __slots__ = ("config", "compiled")

    def __init__(self, config):
        self.config = config  # the autotuner's pick for this key (None: not autotuned)
        self.compiled = {}    # heuristic values -> CompiledKernel


class _Kernel:
    """How a (possibly autotuned, possibly heuristics-wrapped) kernel unwraps, and its cache."""
    __slots__ = ("autotuner", "heuristics", "jit", "names", "tune_keys", "entries")

    def __init__(self, kernel):
        self.autotuner = kernel if isinstance(kernel, Autotuner) else None
        inner = kernel.fn if self.autotuner is not None else kernel
        self.heuristics = inner if isinstance(inner, Heuristics) else None
        self.jit = inner.fn if self.heuristics is not None else inner
        self.names = tuple(self.jit.arg_names)
        # the autotuner's key arguments, with their positions (its pick depends on their values)
        self.tune_keys = tuple((k, self.names.index(k)) for k in (self.autotuner.keys if self.autotuner else ()))
        self.entries = {}


_KERNELS: dict[int, tuple[object, _Kernel]] = {}


def _kernel(kernel) -> _Kernel:
    found = _KERNELS.get(id(kernel))
    if found is None or found[0] is not kernel:
        found = _KERNELS[id(kernel)] = (kernel, _Kernel(kernel))
    return found[1]


def _hooks_installed(info: _Kernel) -> bool:
    """Whether anything watches launches (a profiler's launch hooks, a JIT pre-run hook): then Triton launches."""
    rt = triton.knobs.runtime
    for hook in (rt.launch_enter_hook, rt.launch_exit_hook):
        if hook is not None and (not isinstance(hook, HookChain) or hook.calls):
            return True
    return getattr(rt, "add_stages_inspection_hook", None) is not None or bool(info.jit.pre_run_hooks)


def launch(kernel, grid, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)``, the first call of a key through Triton and later ones directly (module
    doc). Returns the ``triton.Config`` the autotuner picked for this call (None when ``kernel`` is not autotuned)."""
    info = _kernel(kernel)
    if INTERPRETER or _hooks_installed(info):
        return _through_triton(info, kernel, grid, args, kwargs)[0]
    device = _driver().get_current_device()
    try:
        knobs = triton.knobs
        key = (device, knobs.runtime.debug, knobs.compilation.instrumentation_mode, tuple(map(_spec, args)),
               tuple(kwargs.items()), tuple(args[i] if i < len(args) else kwargs.get(k) for k, i in info.tune_keys))
        entry = info.entries.get(key)
    except (TypeError, ValueError):  # an argument of a type the key does not know, or an unhashable one
        return _through_triton(info, kernel, grid, args, kwargs)[0]
    if entry is None:
        return _first_call(info, kernel, grid, args, kwargs, key)
    full = dict(zip(info.names, args))
    full.update(kwargs)
    config = entry.config
    if config is not None:
        full.update(config.all_kwargs())
    heur = _heuristic_values(info, full)
    compiled = entry.compiled.get(heur)
    if compiled is None:  # a heuristic came out another way: Triton compiles that variant
        return _first_call(info, kernel, grid, args, kwargs, key)
    try:
        values = [full[n] for n in info.names]
    except KeyError:  # a parameter left to its default: Triton binds it
        return _through_triton(info, kernel, grid, args, kwargs)[0]
    if config is not None and config.pre_hook is not None:
        config.pre_hook(full)
    g = grid(full) if callable(grid) else grid
    n = len(g)
    compiled.run(g[0], g[1] if n > 1 else 1, g[2] if n > 2 else 1, _driver().get_current_stream(device),
                 compiled.function, compiled.packed_metadata, None, None, None, *values)
    return config


def _driver():
    """Triton's active GPU driver: the current device and stream exactly as its own launches take them."""
    return triton_driver.active


def _heuristic_values(info: _Kernel, full: dict) -> tuple:
    """Each heuristic's value on these arguments (Triton evaluates them per call; written into ``full``)."""
    if info.heuristics is None:
        return ()
    out = []
    for name, fn in info.heuristics.values.items():
        full[name] = v = fn(full)
        out.append(v)
    return tuple(out)


def _through_triton(info: _Kernel, kernel, grid, args, kwargs):
    """(the autotuner's pick or None, what Triton's launch returned: the compiled kernel)."""
    compiled = kernel[grid](*args, **kwargs)
    return info.autotuner.best_config if info.autotuner is not None else None, compiled


def _first_call(info: _Kernel, kernel, grid, args, kwargs, key):
    config, compiled = _through_triton(info, kernel, grid, args, kwargs)
    if not isinstance(compiled, CompiledKernel) or hasattr(compiled, "result"):
        return config  # nothing to keep (Triton 3.6's asynchronous compiles hand back a future)
    full = dict(zip(info.names, args))
    full.update(kwargs)
    if config is not None:
        full.update(config.all_kwargs())
    heur = _heuristic_values(info, full)
    if len(info.entries) >= _MAX_ENTRIES:
        info.entries.clear()
    entry = info.entries.setdefault(key, _Entry(config))
    if entry.config is config:
        entry.compiled[heur] = compiled
    return config
