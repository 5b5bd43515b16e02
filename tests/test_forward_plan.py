"""The eager forward replayed from a recording (``moe_ep/forward_plan.py``, ``MOE_EP_FORWARD_PLAN``).

On the CPU, below the launch cache Triton is stood in for (``moe_ep.testing.stand_in_triton``): no kernel runs, but
every launch the forward makes reaches the stand-in with its grid and arguments, so a replay's launches can be
compared with the ones the forward itself makes on the same new inputs, argument by argument. On a GPU (marked
``gpu``) the replayed layer's outputs are compared with the layer's own, bit for bit."""

import pytest
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from moe_ep import EpConfig, ExpertWeights, MoEEpLayer, forward_plan, options
from moe_ep.forward_plan import ForwardPlan, ForwardPlans, signature
from moe_ep.kernels import launch_cache
from moe_ep.testing.stand_in_triton import StandInCompiled, stand_in_triton
from moe_ep.triton_runtime import INTERPRETER

LAYOUTS = [("ll", "expert_major"), ("ll", "rank_major"), ("ht", "flat"), ("ht", "expert_major")]
# The layers below take CPU tensors, which only the interpreter's kernels accept: on a GPU the replayed layer is
# compared with the layer itself instead (test_replayed_layer_equals_the_layer_on_the_gpu).
cpu_layers = pytest.mark.skipif(not INTERPRETER, reason="a layer on CPU tensors (the interpreter's machine)")
E, K, H, I, T = 8, 2, 64, 32, 4


class _Launches:
    """The stand-in's launches: (kernel, grid x, values) each, in order."""

    def __init__(self):
        self.log = []
        self.compiled = {}

    def through_triton(self, info, kernel, grid, args, kwargs):
        self.log.append((kernel, None, args))
        c = self.compiled.get(id(kernel))
        if c is None:
            c = self.compiled[id(kernel)] = StandInCompiled(
                lambda gx, values, k=kernel: self.log.append((k, gx, values)))
        return (kernel.configs[0] if info.autotuner is not None else None), c

    def take(self, fn):
        self.log.clear()
        out = fn()
        return out, list(self.log)


def _inputs(seed, B=T):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, H, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(B)])
    return x, idx, torch.rand(B, K, generator=g)


def _layer(alg, layout, weight_format="bf16", activation_format="bf16"):
    g = torch.Generator().manual_seed(1)
    w = ExpertWeights(torch.randn(E, 2 * I, H, generator=g) / 8, torch.randn(E, H, I, generator=g) / 6, weight_format)
    return MoEEpLayer(EpConfig(E, K, H, I, T, alg, layout, weight_format, activation_format), w)


def _plans(layer):
    return [p for p in layer._plans.plans.values() if type(p) is ForwardPlan]


@cpu_layers
@pytest.mark.parametrize("formats", [("bf16", "bf16"), ("nvfp4", "bf16"), ("bf16", "nvfp4"), ("fp8", "fp8")],
                         ids=lambda f: "-".join(f))
@pytest.mark.parametrize("alg,layout", LAYOUTS)
def test_a_replay_launches_what_the_forward_launches_on_new_inputs(alg, layout, formats):
    """Recorded on one batch, replayed on another of the same signature: the same kernels with the same grids and
    values, the new inputs where the forward itself passes them, the same kept buffers and weights, and new tensors
    (the forward's own allocations) of the same dtype, shape and strides everywhere else."""
    launches = _Launches()
    a, b = _inputs(2), _inputs(3)
    with stand_in_triton(launches.through_triton):
        layer = _layer(alg, layout, *formats)
        layer(*a, validate=False)  # first launches: kept kernels, kept buffers
        layer(*a, validate=False)
        out_ref, ref = launches.take(lambda: layer(*b, validate=False))
        with options.override(forward_plan=True):
            layer(*a, validate=False)  # the signature's first forward: as it is
            layer(*a, validate=False)  # recorded
            assert layer._plans.last_failure is None and len(_plans(layer)) == 1
            out, got = launches.take(lambda: layer(*b, validate=False))  # replayed
    assert [(k, gx) for k, gx, _ in got] == [(k, gx) for k, gx, _ in ref] and all(gx is not None for _, gx, _ in got)
    inputs = {id(t) for t in b}
    for (kernel, _, want), (_, _, have) in zip(ref, got):
        assert len(have) == len(want), kernel
        for i, (w, h) in enumerate(zip(want, have)):
            where = f"{getattr(kernel, '__name__', kernel)} argument {i}"
            if isinstance(w, torch.Tensor):
                if id(w) in inputs or w.data_ptr() in {t.data_ptr() for t in b}:
                    assert h.data_ptr() == w.data_ptr(), where  # the new batch's own tensor (or a view of it)
                assert (h.dtype, h.shape, h.stride()) == (w.dtype, w.shape, w.stride()), where
            else:
                assert type(h) is type(w) and h == w, where
    assert (out.dtype, out.shape) == (out_ref.dtype, out_ref.shape)


@cpu_layers
def test_kept_tensors_are_the_forwards_own_and_new_ones_are_new():
    """A replay passes the layer's kept buffers and weights themselves, and fresh tensors where the forward allocates
    (never the recording's, which a caller may still hold)."""
    launches = _Launches()
    a, b = _inputs(2), _inputs(3)
    with stand_in_triton(launches.through_triton), options.override(forward_plan=True):
        layer = _layer("ll", "expert_major")
        layer(*a, validate=False)
        out_a, rec = launches.take(lambda: layer(*a, validate=False))
        out_b, rep = launches.take(lambda: layer(*b, validate=False))
    assert out_b is not out_a and out_b.data_ptr() != out_a.data_ptr()
    weights = {layer.weights.w13.data_ptr(), layer.weights.w2.data_ptr()}
    seen_weights = 0
    for (_, _, r), (_, _, p) in zip(rec, rep):
        for u, v in zip(r, p):
            if isinstance(u, torch.Tensor) and u.data_ptr() in weights:
                assert v is u
                seen_weights += 1
    assert seen_weights == 2  # GEMM1 and GEMM2


@cpu_layers
def test_a_new_signature_is_recorded_apart_and_the_old_plan_is_not_used_for_it():
    launches = _Launches()
    with stand_in_triton(launches.through_triton), options.override(forward_plan=True):
        layer = _layer("ht", "flat")
        for _ in range(3):
            layer(*_inputs(2), validate=False)
        assert len(_plans(layer)) == 1
        small = _inputs(4, B=3)
        with options.override(forward_plan=False):
            layer(*small, validate=False)
            _, want = launches.take(lambda: layer(*small, validate=False))
        _, got = launches.take(lambda: layer(*small, validate=False))  # a new signature: runs as it is
        assert len(_plans(layer)) == 1
        assert [(k, gx, len(v)) for k, gx, v in got] == [(k, gx, len(v)) for k, gx, v in want]
        layer(*small, validate=False)  # recorded
        _, replayed = launches.take(lambda: layer(*small, validate=False))
        assert len(_plans(layer)) == 2
        assert [(k, gx) for k, gx, _ in replayed] == [(k, gx) for k, gx, _ in want]


def test_the_signature_holds_metadata_alignment_options_and_flags():
    with stand_in_triton(_Launches().through_triton):  # (its driver: the current device)
        _check_signature()


def _check_signature():
    x, idx, w = _inputs(2)
    base = signature((x, idx, w), (False,))
    assert signature(_inputs(3), (False,)) == base  # other values, same metadata
    assert signature((x, idx, w), (True,)) != base
    assert signature((x.float(), idx, w), (False,)) != base
    assert signature((x[:2], idx[:2], w[:2]), (False,)) != base
    assert signature((x.t().contiguous().t(), idx, w), (False,)) != base  # strides
    wide = torch.zeros(T * H + 1, dtype=torch.bfloat16)
    assert signature((wide[1:].view(T, H), idx, w), (False,)) != signature((wide[:-1].view(T, H), idx, w), (False,))
    with options.override(gemm_chain=False):
        assert signature((x, idx, w), (False,)) != base
    hook = triton.knobs.runtime.launch_enter_hook
    hook.add(_watch)
    try:
        assert signature((x, idx, w), (False,)) != base  # a profiler's launch hook
    finally:
        hook.remove(_watch)
    assert signature((x, idx, w), (False,)) == base


def _watch(*args):  # a profiler's launch hook
    pass


def test_with_a_launch_hook_installed_a_recorded_forward_runs_as_it_is():
    """A profiler installing a launch hook after a forward was recorded sees every launch: the forward runs as it
    is, through Triton, and replays again once the hook is gone."""
    launches = _Launches()
    calls = []
    forward = _probe_forward(calls)
    hook = triton.knobs.runtime.launch_enter_hook
    with stand_in_triton(launches.through_triton):
        plans = _record_twice(forward, torch.ones(16))
        assert plans.last_failure is None
        hook.add(_watch)
        try:
            for _ in range(3):
                _, log = launches.take(lambda: plans.run(forward, (torch.ones(16),), ()))
                assert log and log[0][1] is None  # through Triton (the stand-in's first-call path)
        finally:
            hook.remove(_watch)
        assert len(calls) == 5
        plans.run(forward, (torch.ones(16),), ())
    assert len(calls) == 5  # replayed


@triton.jit
def _probe_kernel(x_ptr, n):
    tl.store(x_ptr + tl.arange(0, 16), tl.zeros([16], tl.float32) + n)


def _probe_forward(calls: list):
    """A forward of one kept launch (the probe kernel into a new tensor) that appends each input's length to
    ``calls``."""
    def forward(x):
        calls.append(x.shape[0])
        y = torch.empty_like(x)
        launch_cache.launch(_probe_kernel, (1,), y, 7)
        return y
    return forward


def _record_twice(forward, *inputs):
    """ForwardPlans over ``forward``: the signature's first call, then the recorded one; the plans."""
    plans = ForwardPlans()
    for _ in range(2):
        plans.run(forward, inputs, ())
    return plans


@pytest.mark.parametrize("fault", ["host read", "data-dependent shape", "launch through Triton", "first launch"])
def test_a_forward_that_cannot_be_replayed_is_not_recorded_and_runs_as_it_is(fault):
    """A host read of device values, an op whose output shape depends on them, a launch made through Triton (here:
    a kernel launched outside the launch cache) or a launch-cache key met for the first time: no plan, and every
    later forward runs the forward itself (its results are its own, not a replay's)."""
    launches = _Launches()
    calls = []
    n = [1]

    def forward(x):
        calls.append(1)
        y = x * 2
        if fault == "host read":
            y = y + float(x.sum().item())
        elif fault == "data-dependent shape":
            y = y[: int(torch.nonzero(x > 0).shape[0])]
        elif fault == "launch through Triton":
            _probe_kernel[(1,)](y, 3)
        else:
            n[0] = 16 * (n[0] + 1)  # a new multiple of 16 -> 1: another specialization each call
            launch_cache.launch(_probe_kernel, (1,), y, n[0] if len(calls) % 2 else 1)
        return y

    x = torch.ones(16)
    with stand_in_triton(launches.through_triton):
        if fault == "launch through Triton":  # (a stand-in for Triton's JIT launch, calling the launch hook as it does)
            hook = triton.knobs.runtime.launch_enter_hook
            _probe_kernel.run = lambda *a, **k: hook(None)
        try:
            plans = _record_twice(forward, x)
            assert not [p for p in plans.plans.values() if type(p) is ForwardPlan], fault
            assert plans.last_failure, fault
            before = len(calls)
            plans.run(forward, (x,), ())
            assert len(calls) == before + 1  # the forward itself ran
        finally:
            if fault == "launch through Triton":
                del _probe_kernel.run


def test_a_replayable_forward_records_and_replays_its_ops():
    launches = _Launches()
    calls = []
    probe = _probe_forward(calls)

    def forward(x):
        return (probe(x).view(4, 4) + x.view(4, 4)).clamp(-1, 1)

    with stand_in_triton(launches.through_triton):
        plans = _record_twice(forward, torch.ones(16))
        assert plans.last_failure is None and len(calls) == 2
        x = torch.full((16,), 0.25)
        out, log = launches.take(lambda: plans.run(forward, (x,), ()))
    assert len(calls) == 2  # replayed, the forward not called
    assert [(k, gx) for k, gx, _ in log] == [(_probe_kernel, 1)] and log[0][2][1] == 7
    assert out.shape == (4, 4)  # (the stand-in wrote nothing: y's values are garbage, out is finite or not)


@cpu_layers
def test_on_by_default_off_records_nothing_and_on_the_interpreter_the_forward_is_its_own():
    """The option is on by default; turned off, nothing is recorded; on, on Triton's interpreter (no kept launches)
    every forward runs as it is and gives the layer's results."""
    assert options.Options().forward_plan
    layer = _layer("ll", "expert_major")
    a = _inputs(2)
    with options.override(forward_plan=False):
        want = layer(*a, validate=False)
        for _ in range(3):
            assert torch.equal(layer(*a, validate=False), want)
    assert not layer._plans.plans
    with options.override(forward_plan=True):
        for _ in range(3):
            got = layer(*a, validate=False)
            assert torch.equal(got, want)
    if launch_cache.INTERPRETER:
        assert not _plans(layer)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("formats", [("bf16", "bf16"), ("nvfp4", "bf16"), ("bf16", "nvfp4"), ("fp8", "fp8")],
                         ids=lambda f: "-".join(f))
@pytest.mark.parametrize("alg,layout", LAYOUTS)
def test_replayed_layer_equals_the_layer_on_the_gpu(alg, layout, formats):
    """Every layout and format at world size 1 on cuda: forwards replayed from the recording on new batches (and on
    the recorded batch again) equal the layer's own forwards bit for bit, with a plan recorded."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    Ed, Kd, Hd, Id, Td = 16, 4, 256, 128, 64
    wf, af = formats
    w = ExpertWeights(torch.randn(Ed, 2 * Id, Hd, device=dev, generator=g) / Hd ** 0.5,
                      torch.randn(Ed, Hd, Id, device=dev, generator=g) / Id ** 0.5, wf)
    layer = MoEEpLayer(EpConfig(Ed, Kd, Hd, Id, Td, alg, layout, wf, af), w)

    def batch(B):
        x = torch.randn(B, Hd, device=dev, generator=g).bfloat16()
        idx = torch.rand(B, Ed, device=dev, generator=g).topk(Kd, dim=1).indices
        idx[::7, 0] = -1
        return x, idx, torch.rand(B, Kd, device=dev, generator=g)

    for B in (Td, 37):
        batches = [batch(B) for _ in range(4)]
        with options.override(forward_plan=False):
            want = [layer(*b).clone() for b in batches]
        with options.override(forward_plan=True):
            got = [layer(*b).clone() for b in batches + batches[:1]]
            assert layer._plans.last_failure is None
        torch.cuda.synchronize()
        for i, (o, e) in enumerate(zip(got, want + want[:1])):
            assert torch.equal(o, e), (B, i, (o.float() - e.float()).abs().max().item())
    assert len(_plans(layer)) == 2


def test_a_full_cache_keeps_its_plans_and_runs_new_signatures_as_they_are(monkeypatch):
    """A caller meeting more signatures than MAX_PLANS (a batch size per step, say) never records on every forward:
    signatures met once make room for new ones; once every kept one is a plan, a new signature runs as it is,
    unrecorded, and the plans keep replaying."""
    monkeypatch.setattr(forward_plan, "MAX_PLANS", 3)
    launches = _Launches()
    calls = []
    forward = _probe_forward(calls)

    def n_plans():
        return sum(type(p) is ForwardPlan for p in plans.plans.values())

    def run(n, times=1):
        for _ in range(times):
            plans.run(forward, (torch.ones(n),), ())

    with stand_in_triton(launches.through_triton):
        plans = ForwardPlans()
        run(8, 3)  # a plan
        run(16)
        run(24)  # met once each: the cache is full
        calls.clear()
        run(32, 3)  # room made (16 and 24 dropped): as it is, recorded, then replayed
        assert calls == [32, 32] and n_plans() == 2 and len(plans.plans) == 2
        run(40, 3)
        assert n_plans() == 3
        calls.clear()
        run(48, 4)  # full of plans: as it is, every time, never recorded (nothing kept for it)
        assert calls == [48] * 4 and len(plans.plans) == 3 and plans.last_failure is None
        calls.clear()
        run(8, 2)
        run(32)
        assert calls == []  # replayed


def _box_hook(nargs):  # a TMA box per config, as the grouped GEMM's set_tma_blocks sets it
    nargs["x_desc"].block_shape = [nargs["BLOCK"], 16]
    nargs["w_desc"].block_shape = [nargs["BLOCK"], 16]


def _other_hook(nargs):  # host code of any other kind
    nargs["x_desc"].block_shape = [nargs["BLOCK"], 16]


launch_cache.sets_descriptor_boxes(_box_hook)


def _descriptor_kernel(hook):
    @triton.autotune([triton.Config({"BLOCK": 8}, pre_hook=hook)], key=[])
    @triton.jit
    def kernel(x_desc, w_desc, n, BLOCK: tl.constexpr):
        pass
    return kernel


@pytest.mark.parametrize("hook", ["boxes only", "other"])
def test_a_config_pre_hook_is_recorded_only_where_it_sets_descriptor_boxes(hook):
    """The grouped GEMM's autotuned TMA configs set their descriptors' boxes in a pre-hook on every launch: declared
    (launch_cache.sets_descriptor_boxes), the recording keeps each descriptor as the hook left it (one over the
    forward's tensor made anew on the replay's, one over an older tensor frozen, whatever later launches set on
    it); any other pre-hook fails the recording."""
    launches = _Launches()
    kernel = _descriptor_kernel(_box_hook if hook == "boxes only" else _other_hook)
    w = torch.zeros(32, 16)
    w_desc = TensorDescriptor.from_tensor(w, [16, 16])  # over a tensor older than the forward (a weight)

    def forward(x):
        y = x * 2
        launch_cache.launch(kernel, (1,), TensorDescriptor.from_tensor(y, [16, 16]), w_desc, 5)
        return y

    with stand_in_triton(launches.through_triton):
        for _ in range(2):  # kept from here (the hook runs on the second launch, setting w_desc's box: a new key)
            launch_cache.launch(kernel, (1,), TensorDescriptor.from_tensor(w, [16, 16]), w_desc, 5)
        plans = _record_twice(forward, torch.ones(32, 16))
        if hook == "other":
            assert not [p for p in plans.plans.values() if type(p) is ForwardPlan]
            assert "pre-hook" in plans.last_failure
            return
        assert plans.last_failure is None
        w_desc.block_shape = [32, 16]  # (what a launch with another config would leave on it)
        x = torch.full((32, 16), 3.0)
        out, log = launches.take(lambda: plans.run(forward, (x,), ()))
    assert torch.equal(out, x * 2)
    [(k, gx, values)] = log
    x_d, w_d, n = values[:3]
    assert k is kernel and n == 5
    assert x_d.base.data_ptr() == out.data_ptr() and x_d.block_shape == [8, 16]  # the replay's own tensor
    assert w_d.base is w and w_d.block_shape == [8, 16]  # the box the hook set when recorded


@cpu_layers
def test_forwards_on_two_threads_record_only_their_own_launches():
    """Two layers forwarding at once on two threads (one recording at a time in a process; a launch reaches only
    the recording of its own thread): afterwards each layer's replay launches what its own forward launches."""
    import threading
    launches = _Launches()
    cases = [("ll", "expert_major"), ("ht", "flat")]
    with stand_in_triton(launches.through_triton):
        layers = [_layer(*c) for c in cases]
        batches = [_inputs(5), _inputs(6)]
        want = []
        for layer, b in zip(layers, batches):
            layer(*b, validate=False)
            want.append([(k, gx) for k, gx, _ in launches.take(lambda: layer(*b, validate=False))[1]])
        errors = []
        start = threading.Barrier(2)

        def run(layer, b):
            try:
                start.wait()
                for _ in range(40):
                    layer(*b, validate=False)
            except Exception as e:  # noqa: BLE001  (reported by the assertion below)
                errors.append(e)

        with options.override(forward_plan=True):
            threads = [threading.Thread(target=run, args=(layer, b)) for layer, b in zip(layers, batches)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert not errors, errors
            # a forward that found the other thread recording ran as it is: at least one layer recorded meanwhile
            recorded = [bool(_plans(layer)) for layer in layers]
            assert any(recorded), [layer._plans.last_failure for layer in layers]
            for layer, b, w in zip(layers, batches, want):
                for _ in range(2):  # (a layer that never got to record: now, alone)
                    layer(*b, validate=False)
                assert _plans(layer), layer._plans.last_failure
                _, got = launches.take(lambda: layer(*b, validate=False))
                assert [(k, gx) for k, gx, _ in got] == w
