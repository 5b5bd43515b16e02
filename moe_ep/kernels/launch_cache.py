"""Kernel launches without Triton's per-call Python dispatch: once a compiled kernel is found, it is launched directly.

``kernel[grid](*args)`` binds and specializes every argument, looks up Triton's compile cache, checks the kernel's
globals, and for a ``triton.heuristics`` / ``triton.autotune`` kernel also builds argument dicts, evaluates each
heuristic and computes the tuning key: tens of microseconds of host time per launch, more than many of our kernels
run for. :func:`launch` makes the first call of each *key* through Triton (which compiles and autotunes as usual)
and keeps what that call decided (the compiled kernel and the autotuner's config); later calls with the same key
launch the compiled kernel through its C launcher alone.

The key covers everything the compiled kernel was specialized on, by Triton's rules: each tensor's dtype and 16-byte
alignment, each int's class (1, a multiple of 16, 32 or 64 bits), bools, floats and None, each TMA descriptor's
dtype, block shape and base alignment, the value of each constexpr passed positionally (Triton compiles a variant
per value), the keyword arguments (constexprs and compile options), the current device, Triton's debug and
instrumentation knobs, the autotuner's key values (its pick depends on them) and every heuristic's value, evaluated
on each call as Triton would. Under the interpreter, with a launch hook installed
(profilers), for an argument of a type the key does not know, or when the kernel has a parameter the call leaves to
its default, every call goes through Triton.

The key is computed by a function generated once per kernel and per tuple of argument types (as Triton generates
its binder): one call with the specialization of every argument written out inline, instead of one call per
argument. What a kept kernel is launched with past the positional arguments (keyword arguments, the autotuner's
config, the heuristics' values) is fixed by the key and kept with it (the config's keyword arguments too), so a
launch of a kernel without heuristics and with a tuple grid (or a :class:`BlockGrid`, from the kept config) builds no
argument dict and evaluates nothing.
"""

from __future__ import annotations

import contextlib
import inspect

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
_UNKNOWN = object()  # a type tuple with a type the key does not know: such calls go through Triton


class BlockGrid:
    """The grid of a row kernel tiled by its config: ``(cdiv(rows, BLOCK_M), cdiv(cols, <col_block>))`` programs.
    Callable as a Triton grid function; a kept launch evaluates it from the config it kept, without the argument dict
    a grid function is given (module doc)."""
    __slots__ = ("rows", "cols", "col_block")

    def __init__(self, rows: int, cols: int, col_block: str = "BLOCK_H"):
        self.rows, self.cols, self.col_block = rows, cols, col_block

    def __call__(self, meta) -> tuple[int, int]:
        return -(-self.rows // meta["BLOCK_M"]), -(-self.cols // meta[self.col_block])


def _spec_source(t: type, a: str) -> str | None:
    """Python source of what Triton specializes an argument ``a`` of type ``t`` on (with the type itself, which the
    key holds), or None for a type the key does not know."""
    if issubclass(t, torch.Tensor):
        return f"{a}.dtype, {a}.data_ptr() % 16 == 0"
    if t is int:  # 1; a multiple of 16; 32 or 64 bits (or past them: unsigned 64)
        return f"{a} == 1, {a} % 16 == 0, {_I32[0]} <= {a} < {_I32[1]}, {_I64[0]} <= {a} < {_I64[1]}"
    if t is bool or t is float or t is type(None):
        return ""  # the type alone
    if issubclass(t, TensorDescriptor):
        return f"{a}.base.dtype, {a}.base.data_ptr() % 16 == 0, tuple({a}.block_shape), {a}.padding"
    return None


def _key_function(types: tuple, value_positions: tuple):
    """``f(*args) -> tuple``: the specialization of arguments of these types (Triton's rules, module doc) and the
    values of the arguments at ``value_positions`` (constexprs, autotuning keys); :data:`_UNKNOWN` when a type is
    not one the key knows."""
    names = [f"a{i}" for i in range(len(types))]
    parts = [_spec_source(t, a) for t, a in zip(types, names)]
    if None in parts:
        return _UNKNOWN
    parts += [names[i] for i in value_positions if i < len(names)]
    body = ", ".join(p for p in parts if p)
    source = f"def key({', '.join(names)}):\n    return ({body}{',' if body else ''})\n"
    namespace = {}
    exec(source, namespace)  # noqa: S102  (source built above from argument positions alone)
    return namespace["key"]


def _spec(a):
    """What the key holds for one positional argument ``a`` (its type and its specialization); TypeError for a type
    the key does not know (the tests compare it with Triton's own specialization)."""
    f = _key_function((type(a),), ())
    if f is _UNKNOWN:
        raise TypeError(type(a).__name__)
    return type(a), f(a)


class _Entry:
    __slots__ = ("config", "config_kwargs", "pre_hook", "compiled")

    def __init__(self, config):
        self.config = config  # the autotuner's pick for this key (None: not autotuned)
        self.config_kwargs = config.all_kwargs() if config is not None else None  # (made once, not per launch)
        self.pre_hook = config.pre_hook if config is not None else None
        self.compiled = {}    # heuristic values -> (C launcher, function, packed metadata, values past the args)


class _Kernel:
    """How a (possibly autotuned, possibly heuristics-wrapped) kernel unwraps, and its cache."""
    __slots__ = ("kernel", "autotuner", "heuristics", "jit", "names", "value_positions", "entries",
                 "key_functions")

    def __init__(self, kernel):
        self.kernel = kernel
        self.autotuner = kernel if isinstance(kernel, Autotuner) else None
        inner = kernel.fn if self.autotuner is not None else kernel
        self.heuristics = inner if isinstance(inner, Heuristics) else None
        self.jit = inner.fn if self.heuristics is not None else inner
        self.names = tuple(self.jit.arg_names)
        # the parameters whose values the key holds, not just their class: the constexprs (a call may pass them
        # positionally; Triton compiles one variant per value) and the autotuner's keys (its pick depends on them)
        tune = {self.names.index(k) for k in (self.autotuner.keys if self.autotuner else ())}
        self.value_positions = tuple(sorted(tune | _constexpr_positions(self.jit.fn)))
        self.entries = {}
        self.key_functions = {}  # argument types -> key function (_key_function)


def _constexpr_positions(fn) -> set[int]:
    """The positions of ``fn``'s ``tl.constexpr`` parameters, by Triton's rule (the annotation names constexpr;
    read from the signature: the interpreter's functions have no parsed parameters)."""
    def named(a):
        return a if isinstance(a, str) else getattr(a, "__name__", "")
    return {i for i, p in enumerate(inspect.signature(fn).parameters.values()) if "constexpr" in named(p.annotation)}


_KERNELS: dict[int, _Kernel] = {}


def _kernel(kernel) -> _Kernel:
    info = _KERNELS.get(id(kernel))
    if info is None or info.kernel is not kernel:
        info = _KERNELS[id(kernel)] = _Kernel(kernel)
    return info


def launch(kernel, grid, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)``, the first call of a key through Triton and later ones directly (module
    doc). Returns the ``triton.Config`` the autotuner picked for this call (None when ``kernel`` is not autotuned)."""
    return launch_kept(kernel, grid, args, kwargs, None)


def launch_kept(kernel, grid, args: tuple, kwargs: dict, kwargs_items: tuple | None):
    """:func:`launch` for a caller that keeps its keyword arguments between calls: ``kwargs`` is read, never
    changed, and ``kwargs_items`` is ``tuple(kwargs.items())`` (None: computed here), made once with the dict."""
    info = _KERNELS.get(id(kernel))
    if info is None or info.kernel is not kernel:
        info = _kernel(kernel)
    rt = triton.knobs.runtime
    enter, exit_ = rt.launch_enter_hook, rt.launch_exit_hook
    # anything watching launches (a profiler's launch hooks, a JIT pre-run hook): Triton launches (written out here,
    # not as a function: this runs on every launch)
    if INTERPRETER or (enter is not None and (type(enter) is not HookChain or (enter.calls and not _recording_hook(
            enter)))) or (exit_ is not None and (type(exit_) is not HookChain or exit_.calls)) or \
            info.jit.pre_run_hooks or getattr(rt, "add_stages_inspection_hook", None) is not None:
        return _not_kept(info, kernel, grid, args, kwargs, "a launch hook or the interpreter")[0]
    types = tuple(map(type, args))
    key_of = info.key_functions.get(types)
    if key_of is None:
        key_of = info.key_functions[types] = _key_function(types, info.value_positions)
    if key_of is _UNKNOWN:
        return _not_kept(info, kernel, grid, args, kwargs, "an argument type the key does not know")[0]
    drv = _driver()
    device = drv.get_current_device()
    knobs = triton.knobs
    try:
        key = (device, knobs.runtime.debug, knobs.compilation.instrumentation_mode, types, key_of(*args),
               tuple(kwargs.items()) if kwargs_items is None else kwargs_items)
        entry = info.entries.get(key)
    except (TypeError, ValueError):  # an unhashable keyword argument, a tensor without storage
        return _not_kept(info, kernel, grid, args, kwargs, "an unhashable key")[0]
    if entry is None:
        return _first_call(info, kernel, grid, args, kwargs, key)
    # a BlockGrid of an autotuned kernel reads the kept config alone
    block_grid = type(grid) is BlockGrid and entry.config_kwargs is not None
    full = None  # the argument dict: only for heuristics, a grid function or a config's pre-hook to read
    if info.heuristics is not None or (callable(grid) and not block_grid) or entry.pre_hook is not None:
        full = dict(zip(info.names, args))
        full.update(kwargs)
        if entry.config_kwargs is not None:
            full.update(entry.config_kwargs)
    # without heuristics one variant per key; else per their values (another one: Triton compiles that variant)
    kept = entry.compiled.get(() if info.heuristics is None else _heuristic_values(info, full))
    if kept is None:
        return _first_call(info, kernel, grid, args, kwargs, key)
    if entry.pre_hook is not None:
        if _recording is not None and entry.pre_hook not in _BOX_HOOKS:
            _recording.fail("a config pre-hook (host code per launch)")
        entry.pre_hook(full)
    run, function, metadata, tail = kept
    g = grid(entry.config_kwargs) if block_grid else grid(full) if callable(grid) else grid
    n = len(g)
    g = (g[0], g[1] if n > 1 else 1, g[2] if n > 2 else 1)
    if _recording is not None:
        _recording.launch(run, g, function, metadata, args, tail)
    run(*g, drv.get_current_stream(device), function, metadata, None, None, None, *args, *tail)
    return entry.config


def launches_watched() -> bool:
    """Whether a launch hook or a stages-inspection hook is installed (a profiler): :func:`launch_kept` then
    launches through Triton, and a recorded forward (``forward_plan``) is not replayed past it."""
    rt = triton.knobs.runtime
    enter, exit_ = rt.launch_enter_hook, rt.launch_exit_hook
    return (enter is not None and (type(enter) is not HookChain or bool(enter.calls))) or \
        (exit_ is not None and (type(exit_) is not HookChain or bool(exit_.calls))) or \
        getattr(rt, "add_stages_inspection_hook", None) is not None


_recording = None  # the forward being recorded (forward_plan._Recording), while one is
_BOX_HOOKS: set = set()  # config pre-hooks that set their launch's TMA descriptor boxes and nothing else


def sets_descriptor_boxes(hook):
    """Declare ``hook``, a config pre-hook, as one whose only effect is the block shapes of its launch's own TMA
    descriptor arguments (a function of the config): a recording (``forward_plan``) keeps those descriptors as the
    hook left them, so a replay needs no hook. Any other pre-hook fails a recording. Returns ``hook`` (a decorator)."""
    _BOX_HOOKS.add(hook)
    return hook


def _recording_hook(chain: HookChain) -> bool:
    """Whether a launch-enter hook chain holds only the recording's own hook (it watches launches made through
    Triton, not the kept ones)."""
    return _recording is not None and chain.calls == [_recording.triton_launch]


@contextlib.contextmanager
def recording(rec):
    """While entered, kept launches are reported to ``rec.launch(run, grid, function, metadata, args, tail)`` and
    every other launch (through Triton: first calls, hooks, kernels launched outside this module) fails the recording
    (``rec.fail(why)``; ``rec.triton_launch`` is installed as a launch-enter hook to see the last kind)."""
    global _recording
    if _recording is not None:
        raise RuntimeError("a forward is being recorded already")
    hook = triton.knobs.runtime.launch_enter_hook
    chained = type(hook) is HookChain
    if not chained:  # someone's own hook: every launch goes through Triton
        rec.fail("a launch hook")
    _recording = rec
    if chained:
        hook.add(rec.triton_launch)
    try:
        yield rec
    finally:
        if chained:
            hook.remove(rec.triton_launch)
        _recording = None


def _not_kept(info, kernel, grid, args, kwargs, why: str):
    """:func:`_through_triton`: a launch through Triton, not a kept one (``why``), which fails a recording."""
    if _recording is not None:
        _recording.fail(why)
    return _through_triton(info, kernel, grid, args, kwargs)


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
    config, compiled = _not_kept(info, kernel, grid, args, kwargs, "a first launch of a key or heuristics variant")
    if not isinstance(compiled, CompiledKernel) or hasattr(compiled, "result"):
        return config  # nothing to keep (Triton 3.6's asynchronous compiles hand back a future)
    full = dict(zip(info.names, args))
    full.update(kwargs)
    if config is not None:
        full.update(config.all_kwargs())
    heur = _heuristic_values(info, full)
    try:  # the values past the positional arguments, as Triton bound them (fixed by the key, the config, heur)
        tail = tuple(full[n] for n in info.names[len(args):])
    except KeyError:  # a parameter left to its default: every call goes through Triton
        return config
    if len(info.entries) >= _MAX_ENTRIES:
        info.entries.clear()
    entry = info.entries.setdefault(key, _Entry(config))
    if entry.config is config:
        run = compiled.run  # (loads the launcher: Triton's own launch has, but only through this property)
        entry.compiled[heur] = (run, compiled.function, compiled.packed_metadata, tail)
    return config
