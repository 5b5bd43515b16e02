"""A layer's eager forward recorded once per input signature and replayed: its GPU work without its Python.

An eager forward at world size 1 spends most of its host time in Python that decides the same things every time the
inputs look the same: the transport's layout code, the expert MLP's checks and plans, the launch cache's key
(``benchmarks/bench_host_path.py`` measures it). :class:`ForwardPlans` records what one forward did on the GPU, in
order: each aten op (the allocations, the views, the small torch ops) and each kernel launch that the launch cache made
through a kept compiled kernel (``launch_cache``: Triton's C launcher with its compiled function and metadata), each
tensor argument traced to where it came from (a forward input, the output of an earlier op of the same forward, or a
tensor that existed before the forward: a kept buffer, a weight). A later forward with the same signature replays
that list with its own inputs: the same ops and launches, in the same order, on the tensors they came from.

**Why a replay computes what the forward would.** A forward's host decisions depend on its inputs' metadata, never
on their values (no host sync: a recorded op that reads device values on the host, or whose output shape depends on
them, makes the recording fail), so they are functions of the signature: each input's type, dtype, shape, strides,
device and 16-byte alignment, the layer's weights, the options, the tuned files' versions, the device's plan key,
the current device, Triton's debug and instrumentation knobs, grad and inference mode, and the forward's flags; and
whether a launch hook is installed (a profiler must see every launch: with one, nothing is replayed). The signature
therefore also fixes every launch-cache key (dtypes, alignment: new allocations come from the caching
allocator, 512-byte aligned, and views sit at offsets fixed by shapes; int arguments: shapes) that the replay skips.

**What is not recorded, so never replayed.** The first forward of a signature (it autotunes, compiles, makes the kept
buffers) runs as it is; the second is recorded (and runs as it is); from the third on, it replays. A recording fails,
and the signature keeps running as it is, if anything in it went past the two recorded channels or could differ in a
replay: a launch through Triton (a first call, an autotune, a launch hook, a kernel launched outside the launch cache:
seen by a launch hook installed for the recording), a config pre-hook other than one that only sets its launch's TMA
descriptor boxes (``launch_cache.sets_descriptor_boxes``: the recording keeps the descriptors as it left them), an
aten op outside :data:`_REPLAYABLE` (host reads such as ``item`` / ``tolist`` / copies to the host, data-dependent
shapes such as ``nonzero``) or one with an output off the GPU. A transport that moves data through a library
(NCCL-EP, NIXL-EP) or collectives is never recorded: the layer asks only a transport that says ``replayable``.

The replay holds each forward's new tensors until its last launch is enqueued (as the eager forward's locals are),
and the plan holds the tensors that existed before (kept buffers, weights), which the layer keeps anyway.
"""

from __future__ import annotations

import copy
import threading

import torch
import triton
from torch.utils._python_dispatch import TorchDispatchMode
from triton.tools.tensor_descriptor import TensorDescriptor

from . import device_facts, options
from .kernels import launch_cache
from .kernels.grouped_gemm import tuned_files

_aten = torch.ops.aten
_REPLAYABLE = frozenset({
    # allocations and fills (values from the host: fixed by the signature)
    _aten.empty.memory_format, _aten.empty_strided.default, _aten.zeros.default, _aten.full.default,
    _aten.fill_.Scalar, _aten.zero_.default, _aten.ones.default, _aten.arange.default, _aten.arange.start,
    _aten.arange.start_step, _aten.empty_like.default, _aten.zeros_like.default, _aten.ones_like.default,
    _aten.full_like.default,
    # views (shapes fixed by the signature)
    _aten.view.default, _aten._unsafe_view.default, _aten.unsqueeze.default, _aten.squeeze.dim, _aten.slice.Tensor,
    _aten.select.int, _aten.as_strided.default, _aten.expand.default, _aten.split_with_sizes.default,
    _aten.split.Tensor, _aten.t.default, _aten.transpose.int, _aten.permute.default, _aten.alias.default,
    _aten.detach.default, _aten.view.dtype,
    # elementwise device work, copies and conversions on the device
    _aten.clamp.default, _aten.copy_.default, _aten._to_copy.default, _aten.clone.default, _aten.masked_fill.Scalar,
    _aten.lt.Scalar, _aten.ge.Scalar, _aten.gt.Scalar, _aten.le.Scalar, _aten.eq.Scalar, _aten.ne.Scalar,
    _aten.eq.Tensor, _aten.bitwise_or.Tensor, _aten.bitwise_and.Tensor, _aten.reciprocal.default,
    _aten.logical_or.default, _aten.mul.Tensor, _aten.mul.Scalar, _aten.add.Tensor, _aten.sub.Tensor,
    _aten.div.Tensor, _aten.where.self, _aten.cat.default, _aten.stack.default, _aten.gather.default,
    _aten.index_select.default, _aten.amax.default, _aten.abs.default, _aten.maximum.default,
})
"""The aten ops a recording may hold: each one's output shapes follow from its inputs' shapes and its arguments
(no data-dependent shape), and none reads device values on the host."""

_RECORDING = threading.Lock()  # one recording at a time in a process (the launch cache reports to one)
# Signatures a layer keeps (plans, failed ones and ones met before): one per batch size a caller uses is the common
# case. When full, those not yet decided (met once, or failed fewer than _TRIES times) make room; a layer full of
# plans and failures runs a new signature as it is, unrecorded: a caller cycling through more batch sizes than this
# never pays a recording (about twice an eager forward's host time) per forward.
MAX_PLANS = 128
_TRIES = 3  # recordings per signature before it keeps running as it is (a failed one may have met a first launch)


def signature(inputs: tuple, extra: tuple, opts: options.Options | None = None, device: int | None = None) -> tuple:
    """What a forward's host decisions depend on besides the layer (module doc): each input's metadata, the options,
    the tuned files' versions, the device's plan key, the current device, Triton's knobs and launch hooks, grad /
    inference mode, and ``extra`` (the forward's own flags). ``opts`` / ``device``: the options and the current
    device (as Triton's driver gives it), when the caller has read them already (None: read here)."""
    parts = [(type(t), t.dtype, t.shape, t.stride(), t.device, t.data_ptr() % 16) for t in inputs]
    knobs = triton.knobs
    return (*parts, extra, options.current() if opts is None else opts, tuned_files.file_versions(),
            device_facts.plan_key(), launch_cache._driver().get_current_device() if device is None else device,
            knobs.runtime.debug, knobs.compilation.instrumentation_mode, launch_cache.launches_watched(),
            torch.is_grad_enabled(), torch.is_inference_mode_enabled())


class _Recording(TorchDispatchMode):
    """The aten ops (as a dispatch mode) and the kept launches (``launch_cache`` calls :meth:`launch`) of one forward,
    each tensor argument as an index into the replay's tensor list or a tensor that existed before (module doc)."""

    def __init__(self, inputs: tuple):
        super().__init__()
        self.device = inputs[0].device  # where the forward runs: every op's output is there
        self.thread = threading.get_ident()  # the forward's own launches (other threads' are not this forward's)
        self.index = {id(t): i for i, t in enumerate(inputs)}  # id -> place in the replay's list of tensors
        self.alive = list(inputs)  # (held: a freed tensor's id could come back for another)
        self.n = len(inputs)  # the replay's tensors so far: the inputs, then each op's outputs
        self.steps = []
        self.failed = None

    def fail(self, why: str) -> None:
        if self.failed is None and threading.get_ident() == self.thread:
            self.failed = why

    def triton_launch(self, *args) -> None:  # a launch hook: Triton called it for a launch not kept
        self.fail("a kernel launched through Triton")

    def _arg(self, a):
        """``a`` with each tensor as ``_Slot(index)`` (made by this forward, or an input) or itself (older)."""
        if isinstance(a, torch.Tensor):
            i = self.index.get(id(a))
            return a if i is None else _Slot(i)
        if isinstance(a, (list, tuple)):
            return type(a)(self._arg(v) for v in a)
        if isinstance(a, TensorDescriptor):  # as the launch takes it: a config's pre-hook may set its box per launch
            i = self.index.get(id(a.base))
            return _frozen(a) if i is None else _DescriptorSlot(a, i)
        return a

    def _outputs(self, out) -> None:
        for t in (out if isinstance(out, (list, tuple)) else (out,)):
            if not isinstance(t, torch.Tensor):
                self.fail(f"an output of type {type(t).__name__}")
                return
            if t.device != self.device:
                self.fail(f"an output on {t.device} (the forward runs on {self.device})")
            self.index[id(t)] = self.n
            self.n += 1
            self.alive.append(t)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _aten.detach.default and not kwargs:  # the mode's own step after a factory op (not the forward's)
            out = func(*args)
            i = self.index.get(id(args[0]))
            if i is not None:  # the replay's tensor stands for both: same storage and metadata, no autograd
                self.index[id(out)] = i
                self.alive.append(out)
            return out
        if func not in _REPLAYABLE:
            self.fail(f"aten op {func}")
        step = _Op(func, self._arg(args), self._arg(kwargs))
        out = func(*args, **kwargs)
        if self.failed is None:
            self.steps.append(step)
            self._outputs(out)
        return out

    def launch(self, run, grid: tuple, function, metadata, args: tuple, tail: tuple) -> None:
        if threading.get_ident() != self.thread:
            return
        self.steps.append(_Launch(run, grid, function, metadata, self._arg(args), tail))

    def plan(self, out) -> "ForwardPlan | None":
        """The plan of this recording with ``out`` as the forward's result (None if it failed)."""
        if self.failed is not None:
            return None
        return ForwardPlan(self.steps, self._arg(out))


class _Slot:
    """A tensor argument: the replay's tensor number ``i``."""
    __slots__ = ("i",)

    def __init__(self, i: int):
        self.i = i


def _frozen(d: TensorDescriptor) -> TensorDescriptor:
    """A copy of ``d`` with its box as it is now (a later launch's pre-hook may set the original's)."""
    d = copy.copy(d)
    d.block_shape = list(d.block_shape)
    return d


class _DescriptorSlot:
    """A TMA descriptor argument whose base is the replay's tensor number ``i`` (its box and shape recorded)."""
    __slots__ = ("fields", "i")

    def __init__(self, recorded: TensorDescriptor, i: int):
        # The recorded fields but the base (the recording's tensor: not held past it). A replay builds the descriptor
        # from them without the dataclass's __init__ and its checks (they held when recorded; the replay's tensor has
        # the recorded shape, strides and dtype) and without copy.copy, a few times slower per forward.
        self.fields, self.i = dict(vars(_frozen(recorded)), base=None), i

    def make(self, tensors: list) -> TensorDescriptor:
        d = TensorDescriptor.__new__(TensorDescriptor)
        d.__dict__.update(self.fields)
        d.base = tensors[self.i]
        return d


def _resolve(a, tensors: list):
    if type(a) is _Slot:
        return tensors[a.i]
    if type(a) is _DescriptorSlot:
        return a.make(tensors)
    if isinstance(a, (list, tuple)):
        return type(a)(_resolve(v, tensors) for v in a)
    if isinstance(a, dict):
        return {k: _resolve(v, tensors) for k, v in a.items()}
    return a


def _template(args: tuple) -> tuple[list, tuple]:
    """(the arguments with each top-level slot left as it is, the slots' (position, slot)); nested slots stay for
    :func:`_resolve` (``_Op.nested``)."""
    return list(args), tuple((p, a) for p, a in enumerate(args) if type(a) in (_Slot, _DescriptorSlot))


def _nested(a) -> bool:
    if isinstance(a, (list, tuple)):
        return any(type(v) in (_Slot, _DescriptorSlot) or _nested(v) for v in a)
    if isinstance(a, dict):
        return any(type(v) in (_Slot, _DescriptorSlot) or _nested(v) for v in a.values())
    return False


class _Op:
    __slots__ = ("func", "args", "kwargs", "slots", "nested")

    def __init__(self, func, args: tuple, kwargs: dict):
        self.func, self.kwargs = func, kwargs
        self.args, self.slots = _template(args)
        self.nested = any(_nested(a) for a in args) or _nested(kwargs)

    def run(self, tensors: list):
        if self.nested:
            out = self.func(*_resolve(tuple(self.args), tensors), **_resolve(self.kwargs, tensors))
        else:
            a = self.args.copy()
            for p, s in self.slots:
                a[p] = tensors[s.i] if type(s) is _Slot else s.make(tensors)
            out = self.func(*a, **self.kwargs)
        if isinstance(out, (list, tuple)):
            tensors.extend(out)
        else:
            tensors.append(out)


class _Launch:
    __slots__ = ("run_", "grid", "function", "metadata", "args", "slots", "tail")

    def __init__(self, run, grid, function, metadata, args: tuple, tail: tuple):
        self.run_, self.grid, self.function, self.metadata, self.tail = run, grid, function, metadata, tail
        self.args, self.slots = _template(args)

    def run(self, tensors: list, stream) -> None:
        a = self.args.copy()
        for p, s in self.slots:
            a[p] = tensors[s.i] if type(s) is _Slot else s.make(tensors)
        gx, gy, gz = self.grid
        self.run_(gx, gy, gz, stream, self.function, self.metadata, None, None, None, *a, *self.tail)


class ForwardPlan:
    """One recorded forward (module doc): ``replay(inputs, device)`` enqueues its ops and launches on ``inputs``."""

    def __init__(self, steps: list, out):
        self.steps, self.out = steps, out

    def replay(self, inputs: tuple, device: int):
        """Enqueue the recording on ``inputs`` on the current stream of ``device`` (the current device); returns the
        forward's result."""
        tensors = list(inputs)
        stream = launch_cache._driver().get_current_stream(device)
        for s in self.steps:
            if type(s) is _Launch:
                s.run(tensors, stream)
            else:
                s.run(tensors)
        return _resolve(self.out, tensors)


class ForwardPlans:
    """A layer's plans, one per forward signature (module doc). ``run(forward, inputs, extra, opts)``:
    ``forward(*inputs)``, recorded or replayed where it can be (``opts``: the options, if the caller has them)."""

    def __init__(self):
        self.plans: dict = {}  # signature -> ForwardPlan, or the number of recordings tried so far
        self.last_failure: str | None = None  # why the last recording failed, None if it did not (tests, benchmarks)

    def run(self, forward, inputs: tuple, extra: tuple, opts: options.Options | None = None):
        if launch_cache.INTERPRETER:  # (no kept launches: nothing to replay)
            return forward(*inputs)
        device = launch_cache._driver().get_current_device()  # (read once: for the signature and the stream)
        sig = signature(inputs, extra, opts, device)
        p = self.plans.get(sig)
        if type(p) is ForwardPlan:
            return p.replay(inputs, device)
        if p is None:  # the first forward of this signature: as it is (it makes the kept buffers, compiles)
            if len(self.plans) >= MAX_PLANS and not self._make_room():
                return forward(*inputs)
            self.plans[sig] = 0
            return forward(*inputs)
        if p >= _TRIES:
            return forward(*inputs)
        if not _RECORDING.acquire(blocking=False):  # another thread is recording a forward: this one runs as it is
            return forward(*inputs)
        try:
            rec = _Recording(inputs)
            with launch_cache.recording(rec), rec:
                out = forward(*inputs)
        finally:
            _RECORDING.release()
        plan = rec.plan(out)
        self.plans[sig] = plan if plan is not None else p + 1
        self.last_failure = rec.failed
        return out

    def _make_room(self) -> bool:
        """Drop the signatures not yet decided (:data:`MAX_PLANS`); whether there is room now."""
        self.plans = {s: p for s, p in self.plans.items() if type(p) is ForwardPlan or p >= _TRIES}
        return len(self.plans) < MAX_PLANS
