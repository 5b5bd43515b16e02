"""The eager launch path stays thin: an eager forward at world size 1 issues at most a known number of torch (aten)
operations outside the kernels and a known number of kernel launches. Each costs about 11 us (op) / 5-19 us
(launch) of host time on the H200 host (docs/PERF.md, "Layer: host time"), so a change that adds any shows up here
before it shows up in a benchmark. Lower a bound when you remove ops; raise one only with the reason in the commit."""

import collections
import os
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import moe_ep
from moe_ep import EpConfig, ExpertWeights, MoEEpLayer, fused_moe
from moe_ep.kernels import launch_cache
from moe_ep.testing.stand_in_triton import StandInCompiled, stand_in_triton
from moe_ep.triton_runtime import INTERPRETER

# (aten ops, kernel launches) per eager forward, bf16, world size 1, validate=False
BOUNDS = {("ll", "expert_major"): (4, 5), ("ll", "rank_major"): (9, 5), ("ht", "flat"): (4, 5),
          ("ht", "expert_major"): (5, 5), "fused_moe": (7, 5),
          ("ll", "rank_major", 3): (10, 5)}  # a batch of 3 of the layout's 4 rows: copied into kept buffers

pytestmark = pytest.mark.skipif(not INTERPRETER, reason="the counts are taken on the interpreter's host path (the "
                                "compiled one is timed by benchmarks/bench_layer.py); the kernels' own ops are "
                                "told apart by their frames there")


def _in_kernel() -> bool:
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if "triton/runtime" in name or "triton/language" in name or name.endswith("moe_ep/triton_runtime.py"):
            return True  # an op the interpreter runs for a kernel, not the host path's
        f = f.f_back
    return False


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not _in_kernel():
            self.count[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _measure(monkeypatch, call):
    call()  # first call: compiles, autotunes, allocates buffers
    launches = []
    real = launch_cache.launch_kept  # (launch_cache.launch calls it too)
    monkeypatch.setattr(launch_cache, "launch_kept", lambda k, g, a, kw, items: launches.append(k) or
                        real(k, g, a, kw, items))
    with _Ops() as ops:
        call()
    return sum(ops.count.values()), len(launches), ops.count


def _inputs(E=8, K=2, H=64, I=32, B=4):
    g = torch.Generator().manual_seed(0)
    w = ExpertWeights(torch.randn(E, 2 * I, H, generator=g) / 8, torch.randn(E, H, I, generator=g) / 6)
    x = torch.randn(B, H, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(B)])
    return w, x, idx, torch.rand(B, K, generator=g)


def _id(case) -> str:
    return case if isinstance(case, str) else "-".join(map(str, case))


def _forward(case):
    """One eager forward of ``case`` (a layout pair, with a batch size below T = 4, or "fused_moe") on small
    inputs, validate=False."""
    w, x, idx, wts = _inputs(B=case[2] if isinstance(case, tuple) and len(case) == 3 else 4)
    if case == "fused_moe":
        return lambda: fused_moe(x, idx, wts, w, validate=False)
    layer = MoEEpLayer(EpConfig(8, 2, 64, 32, 4, *case[:2]), w)
    return lambda: layer(x, idx, wts, validate=False)


@pytest.mark.parametrize("case", list(BOUNDS), ids=_id)
def test_eager_forward_ops_and_launches_stay_bounded(monkeypatch, case):
    call = _forward(case)
    ops, launches, detail = _measure(monkeypatch, call)
    max_ops, max_launches = BOUNDS[case]
    assert ops <= max_ops, f"{ops} aten ops per forward (bound {max_ops}): {dict(detail.most_common(10))}"
    assert launches <= max_launches, f"{launches} kernel launches per forward (bound {max_launches})"


# Python function calls in moe_ep per eager forward (world size 1, validate=False) with launch_cache's own path up to
# compiled.run, Triton stood in for below it (benchmarks/bench_host_path.py's +launch columns): each costs host time
# on every forward (about 1 us at the H200 host's speed). Lower a bound when you remove calls. (The layer's include
# its read of the options, for MOE_EP_FORWARD_PLAN: turned off here, so every forward runs the whole host path.)
CALL_BOUNDS = {("ll", "expert_major"): 84, ("ll", "rank_major"): 97, ("ht", "flat"): 90, ("ht", "expert_major"): 90,
               "fused_moe": 80, ("ll", "rank_major", 3): 102}
_MOE_EP = os.path.dirname(moe_ep.__file__)
_STAND_IN = os.path.join(_MOE_EP, "testing")  # the stand-in Triton's own calls are not the forward's


def _fill(values):  # int32 outputs (routes, counts, offsets) as "no pick", so host ops indexing by them stay in bounds
    for v in values:
        if type(v) is torch.Tensor and v.dtype is torch.int32:
            v.fill_(-1)


def _through_triton(info, kernel, grid, args, kwargs):
    _fill(args)
    config = kernel.configs[0] if info.autotuner is not None else None
    return config, StandInCompiled(lambda gx, values: _fill(values))


def _moe_ep_calls(fn) -> int:
    n = 0

    def count(frame, event, arg):
        nonlocal n
        name = frame.f_code.co_filename
        if event == "call" and name.startswith(_MOE_EP) and not name.startswith(_STAND_IN):
            n += 1

    sys.setprofile(count)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return n


@pytest.mark.parametrize("case", list(CALL_BOUNDS), ids=_id)
def test_launch_path_python_calls_stay_bounded(case):
    with stand_in_triton(_through_triton), moe_ep.options.override(forward_plan=False):
        call = _forward(case)
        call()  # first calls through the stand-in "Triton": kept kernels
        calls = _moe_ep_calls(call)
    assert calls <= CALL_BOUNDS[case], f"{calls} Python calls in moe_ep per forward (bound {CALL_BOUNDS[case]})"


# The same count for a forward replayed from its recording (MOE_EP_FORWARD_PLAN, moe_ep/forward_plan.py): the
# layer's input checks, the signature and one call per recorded op and launch.
PLAN_CALL_BOUNDS = {("ll", "expert_major"): 42, ("ll", "rank_major"): 49, ("ht", "flat"): 42,
                    ("ht", "expert_major"): 34, ("ll", "rank_major", 3): 50}


@pytest.mark.parametrize("case", list(PLAN_CALL_BOUNDS), ids=_id)
def test_replayed_forward_python_calls_stay_bounded(case):
    with stand_in_triton(_through_triton), moe_ep.options.override(forward_plan=True):
        call = _forward(case)
        call()  # the signature's first forward
        call()  # recorded
        calls = _moe_ep_calls(call)
    bound = PLAN_CALL_BOUNDS[case]
    assert calls <= bound, f"{calls} Python calls in moe_ep per replay (bound {bound})"
