"""The eager forward's host path without the kernels: the layer at world size 1 with every kernel launch replaced
by a no-op (``launch_cache.launch_kept``, which ``launch_cache.launch`` calls), ``validate=False``. Per layout (and
``fused_moe``): the Python function calls per forward (as cProfile counts them, builtins included), the host
microseconds per forward (this thread's CPU time, best of a few loops), the aten ops outside the kernels, the kernel
launches and the call depth from the entry point to each launch.

A second measurement (the ``+launch`` columns) keeps the launch cache itself and replaces only what it hands
to Triton: each kernel's first call is answered by a stand-in compiled kernel (no Triton, no compile), and later
calls run the launch cache's key, lookup, argument and grid work up to ``compiled.run``, which is the stand-in's
no-op. Its host time is the eager forward's host path with the launch path's own cost included (all but Triton's C
launcher and the driver). The interpreter is taken as off there (no kernel runs either way).

The first two turn ``MOE_EP_FORWARD_PLAN`` off; a third (the ``+plan`` columns, layers only) is the second with it
on (the default): the forward replayed from its recording (``moe_ep/forward_plan.py``), each kept launch again
ending in the stand-in's no-op.

It runs anywhere (CPU included; no kernel runs, so the outputs are garbage and never read) and is the proxy for
the eager host time that ``benchmarks/bench_layer.py`` measures on a GPU: the Python part of it, which is what
the layer's own code decides. Small shapes keep the torch ops' own work out of the way.

    PYTHONPATH=$PWD python3 benchmarks/bench_host_path.py [--out host_path.json] [--profile DIR]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import os
import pstats
import sys
import time

import moe_ep  # noqa: F401  (before triton)
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from moe_ep import EpConfig, ExpertWeights, MoEEpLayer, fused_moe, options
from moe_ep.commands.timing import time_host
from moe_ep.kernels import launch_cache
from moe_ep.testing.stand_in_triton import StandInCompiled, stand_in_triton

CASES = (("ll", "expert_major"), ("ll", "rank_major"), ("ht", "flat"), ("ht", "expert_major"), "fused_moe")
_ENTRY_POINTS = ("forward", "fused_moe")  # the frames the call depth is counted from


class _Launches:
    """A stand-in for ``launch_cache.launch_kept``: launches nothing, records the depth below the entry point of each
    call of ``launch_cache.launch`` / ``launch_kept``.

    It fills every int32 tensor argument with -1 (a route's slots, counts, offsets: "no pick"), so that torch ops
    of the host path that index by a kernel's output stay in bounds; the time and the calls it spends doing that
    are kept apart (``own_s``; the call counter is paused) and not counted as the forward's."""

    def __init__(self, counter=None):
        self.depths, self.own_s, self.counter = [], 0.0, counter

    def __call__(self, kernel, grid, args, kwargs, kwargs_items):
        self.pause()
        self.launched(args, 2)
        return None  # "not autotuned": callers then keep their plan as it is

    def pause(self):
        """Stop counting calls (before :meth:`launched`, so that its own call is not counted)."""
        if self.counter is not None:
            self.counter.paused = True

    def launched(self, args, up: int):
        """A launch with these arguments, made ``up`` frames above this call: depth recorded, int32 tensors
        filled (calls paused: :meth:`pause`)."""
        t0 = time.thread_time()
        f, depth = sys._getframe(up), 1
        while f.f_code.co_filename == launch_cache.__file__:  # the depth of the launch_cache.launch call
            f = f.f_back
        while f is not None and f.f_code.co_name not in _ENTRY_POINTS:
            f, depth = f.f_back, depth + 1
        self.depths.append(depth if f is not None else -1)
        with _disable_current_modes():  # (a recording forward's dispatch mode does not see the stand-in's fills)
            for a in args:
                if type(a) is torch.Tensor and a.dtype is torch.int32:
                    a.fill_(-1)
        if self.counter is not None:
            self.counter.paused = False
        self.own_s += time.thread_time() - t0


class _LaunchPath:
    """The launch cache as it is, on a stand-in Triton (module doc; ``moe_ep.testing.stand_in_triton``): while
    entered, its calls through Triton return a :class:`StandInCompiled` (the autotuner's first config for an
    autotuned kernel) whose launches are recorded; its kept kernels are put back on exit."""

    def __init__(self, launches: _Launches):
        self.compiled = StandInCompiled(self.run)
        self.launches = launches
        self.stand_in = stand_in_triton(self.through_triton)

    def run(self, gx, values):
        self.launches.pause()
        self.launches.launched(values, 4)  # through StandInCompiled.run, from launch_kept

    def through_triton(self, info, kernel, grid, args, kwargs):
        self.launches.pause()
        self.launches.launched(args, 4)  # through _first_call (or launch) in launch_cache
        return (kernel.configs[0] if info.autotuner is not None else None), self.compiled

    def __enter__(self):
        self.stand_in.__enter__()
        return self

    def __exit__(self, *exc):
        return self.stand_in.__exit__(*exc)


class _Calls:
    """Python and builtin function calls (``sys.setprofile`` events, as cProfile counts them) while not paused."""

    def __init__(self):
        self.n, self.paused = 0, False

    def _event(self, frame, event, arg):
        if (event == "call" or event == "c_call") and not self.paused:
            self.n += 1

    def run(self, fn):
        sys.setprofile(self._event)
        try:
            fn()
        finally:
            sys.setprofile(None)


class _AtenOps(TorchDispatchMode):
    """The aten ops of the host path (not the stand-in's own fills)."""

    def __init__(self, counter):
        super().__init__()
        self.count, self.counter = collections.Counter(), counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.counter.paused:
            self.count[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def forward_of(case, E: int, K: int, H: int, I: int, B: int):
    g = torch.Generator().manual_seed(0)
    w = ExpertWeights(torch.randn(E, 2 * I, H, generator=g).bfloat16(), torch.randn(E, H, I, generator=g).bfloat16())
    x = torch.randn(B, H, generator=g).bfloat16()
    idx = torch.rand(B, E, generator=g).topk(K, dim=1).indices
    wts = torch.rand(B, K, generator=g)
    if case == "fused_moe":
        return lambda: fused_moe(x, idx, wts, w, validate=False)
    layer = MoEEpLayer(EpConfig(E, K, H, I, B, *case), w)
    return lambda: layer(x, idx, wts, validate=False)


def _time_and_count(fwd, launches: _Launches, counter: _Calls, args) -> tuple[float, float]:
    """(Python calls, host seconds) per forward; the stand-in's own time taken out of each loop's."""
    fwd()  # buffers, plans (and in the +launch measurement the launch cache's entries)
    counter.n = 0
    counter.run(lambda: [fwd() for _ in range(args.iters)])
    calls = counter.n / args.iters
    best = float("inf")
    for _ in range(args.repeats):
        launches.own_s = 0.0
        t = time_host(fwd, iters=args.iters, repeats=1, clock=time.thread_time)
        best = min(best, t - launches.own_s / (args.iters + 1))
    return calls, best


def measure(case, args) -> dict:
    B = args.ll_tokens if case[0] == "ll" else args.ht_tokens
    fwd = forward_of(case, args.experts, args.top_k, args.hidden, args.inter, B)
    name = case if isinstance(case, str) else "/".join(case)
    counter = _Calls()
    launches = _Launches(counter)
    real = launch_cache.launch_kept
    launch_cache.launch_kept = launches
    try:
        with options.override(forward_plan=False):  # the whole host path on every forward
            fwd()  # buffers, plans
            launches.depths.clear()
            with _AtenOps(counter) as ops:
                fwd()
            depths = list(launches.depths)
            calls, host = _time_and_count(fwd, launches, counter, args)
            if args.profile:
                _profile(fwd, args, name)
    finally:
        launch_cache.launch_kept = real
    with _LaunchPath(launches), options.override(forward_plan=False):
        launch_calls, launch_host = _time_and_count(fwd, launches, counter, args)
        if args.profile:
            _profile(fwd, args, name + "+launch")
    plan_calls = plan_host = float("nan")
    if case != "fused_moe":  # a layer: its forward replayed from a recording (forward_plan.py), launches kept as above
        with _LaunchPath(launches), options.override(forward_plan=True):
            fwd()  # (the first forward of the signature runs as it is; _time_and_count's warm-up one records)
            plan_calls, plan_host = _time_and_count(fwd, launches, counter, args)
            if args.profile:
                _profile(fwd, args, name + "+plan")
    return {"case": name, "tokens": B, "python_calls": calls, "host_us": host * 1e6,
            "launch_python_calls": launch_calls, "launch_host_us": launch_host * 1e6,
            "plan_python_calls": plan_calls, "plan_host_us": plan_host * 1e6,
            "aten_ops": sum(ops.count.values()), "launches": len(depths), "launch_depths": depths,
            "aten_detail": dict(ops.count.most_common())}


def _profile(fwd, args, name: str) -> None:
    prof = cProfile.Profile()
    prof.runcall(lambda: [fwd() for _ in range(args.iters)])
    with open(os.path.join(args.profile, f"host_path_{name.replace('/', '_')}.txt"), "w") as f:
        pstats.Stats(prof, stream=f).sort_stats("tottime").print_stats(30)
        pstats.Stats(prof, stream=f).sort_stats("cumulative").print_stats(40)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--inter", type=int, default=16)
    p.add_argument("--ll-tokens", type=int, default=128)
    p.add_argument("--ht-tokens", type=int, default=1024, help="(8192 picks at top-8: the route takes three "
                   "launches, as at the GPU benchmark's 4096 tokens)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--cases", default=None, help="comma-separated, e.g. ll/expert_major,fused_moe (default: all)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: a torch op's own work stays small "
                   "and steady; several threads on a busy machine wake late and swamp the host path)")
    p.add_argument("--out", default=None)
    p.add_argument("--profile", default=None, help="folder for cProfile reports of the forward's host path")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    cases = CASES if args.cases is None else [c if c == "fused_moe" else tuple(c.split("/"))
                                              for c in args.cases.split(",")]
    results = [measure(c, args) for c in cases]
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    print(f"{'case':<18}{'tokens':>7}{'py calls':>10}{'host us':>10}{'+launch calls':>15}{'+launch us':>12}"
          f"{'+plan calls':>13}{'+plan us':>10}{'aten ops':>10}{'launches':>10}  call depth")
    for r in results:
        d = r["launch_depths"]
        depth = f"{min(d)}-{max(d)}" if d else "-"
        print(f"{r['case']:<18}{r['tokens']:>7}{r['python_calls']:>10.0f}{r['host_us']:>10.1f}"
              f"{r['launch_python_calls']:>15.0f}{r['launch_host_us']:>12.1f}{r['plan_python_calls']:>13.0f}"
              f"{r['plan_host_us']:>10.1f}{r['aten_ops']:>10}{r['launches']:>10}  {depth}")


if __name__ == "__main__":
    main()
