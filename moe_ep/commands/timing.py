"""How long a call takes, measured one of three ways, and the read floor of a set of tensors: the timing of
``moe-ep bench``, ``moe-ep tune`` and every script in ``benchmarks/``.

* :func:`time_call`: median of ``triton.testing.do_bench`` (L2 flushed between calls): eager GPU time.
* :func:`time_graph` / :func:`time_pair`: median of CUDA-graph replays (``do_bench_cudagraph``): the GPU time
  without the host's launches in the way, which eager timing of a small kernel would measure instead.
* :func:`time_loop`: a fixed number of back-to-back calls, device time by CUDA events and host time to enqueue
  them: what a user's eager forward costs, and the way to time collectives (every rank makes the same calls).
  :func:`time_host_idle`: the host time of one call onto an idle GPU (median), free of the driver's back-pressure.
* :func:`time_read`: a plain streaming read of the same bytes, the practical byte ceiling of a memory-bound
  kernel in the same run (DESIGN.md: a floor is measured, not assumed).

Every function returns seconds per call. Without a GPU (the Triton interpreter) a call costs seconds of Python:
each function then times a single call by the wall clock, so a CPU run says that the code ran, not how fast.
"""

from __future__ import annotations

import time
import warnings
from typing import NamedTuple

import torch

from ..triton_runtime import INTERPRETER  # (first: it picks the interpreter before triton is imported)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


def _on_gpu() -> bool:
    return not INTERPRETER and torch.cuda.is_available()


def sync() -> None:
    """Wait for the GPU (no-op without one)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _wall_once(fn) -> float:
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def time_call(fn, *, rep_ms: float = 100.0, warmup_ms: float = 25.0) -> float:
    """Median seconds per eager call of ``fn`` (``triton.testing.do_bench``, L2 flushed between calls)."""
    if not _on_gpu():
        return _wall_once(fn)
    import triton.testing
    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median") * 1e-3


def _syncs(fn) -> bool:
    """Whether ``fn`` makes a host sync (which a CUDA graph cannot capture; a failed capture would leave the
    CUDA generator mid-capture), found by running it once under ``torch.cuda`` sync debug mode "error"."""
    torch.cuda.synchronize()
    with warnings.catch_warnings():  # torch warns that the debug mode is a prototype: noise in a user's bench output
        warnings.simplefilter("ignore", UserWarning)
        torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    except RuntimeError:
        return True
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return False


def _graph_times(fns, rep_ms: float) -> list[float] | None:
    """Median seconds per call of each of ``fns`` replayed from a CUDA graph, or None when one of them cannot be
    captured."""
    if not _on_gpu() or any(_syncs(fn) for fn in fns):
        return None
    import triton.testing
    try:
        return [triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median") * 1e-3 for fn in fns]
    except RuntimeError:  # a host-dependent shape or another capture failure the sync check did not see
        torch.cuda.synchronize()
        return None


def time_graph(fn, *, rep_ms: float = 100.0) -> float:
    """Median seconds per call of ``fn`` replayed from a CUDA graph where it can be captured, else eagerly
    (:func:`time_call`)."""
    t = _graph_times([fn], rep_ms)
    return t[0] if t else time_call(fn, rep_ms=rep_ms)


def time_pair(ours, peer, *, rep_ms: float = 100.0) -> tuple[float, float, str]:
    """Median seconds per call of ``ours`` and of ``peer``, timed the same way: replayed from a CUDA graph when
    both can be captured, else eagerly (:func:`time_call`). Returns ``(ours, peer, "graph" | "eager")``."""
    t = _graph_times([ours, peer], rep_ms)
    if t:
        return t[0], t[1], "graph"
    return time_call(ours, rep_ms=rep_ms), time_call(peer, rep_ms=rep_ms), "eager"


class LoopTime(NamedTuple):
    """Seconds per call of a loop of back-to-back calls: on the device (CUDA events around the loop, gaps between
    kernels included) and on the host (enqueueing the calls, no sync)."""

    device: float
    host: float


def time_loop(fn, *, iters: int = 20, warmup: int = 1, barrier: bool = False) -> LoopTime:
    """``fn`` called ``warmup`` times, then ``iters`` times back to back. ``barrier``: all ranks of the default
    process group start the timed calls together (every rank must call this the same way)."""
    if not _on_gpu():
        t = _wall_once(fn)
        return LoopTime(t, t)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if barrier:
        import torch.distributed as dist
        dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    host = time.perf_counter() - t0
    end.record()
    torch.cuda.synchronize()
    return LoopTime(start.elapsed_time(end) * 1e-3 / iters, host / iters)


def time_host_idle(fn, *, iters: int = 20, warmup: int = 1) -> float:
    """Median host seconds of one call of ``fn`` enqueued onto an idle GPU (synchronized before each call, the sync
    not timed): what a call costs the host before it can go on, with no queue of earlier work for the driver to
    push back with (which :func:`time_loop`'s back-to-back host time can meet when the GPU time per call is long).
    Without a GPU: one call by the wall clock."""
    if not _on_gpu():
        return _wall_once(fn)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return sorted(times)[len(times) // 2]


# --- the read floor ----------------------------------------------------------------------------------------

_READ_TILINGS = ((2048, 4), (4096, 8), (8192, 8))  # (words per program, warps): the best of these is the floor


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def _read_kernel(p, out, n, BLOCK: tl.constexpr):
    """Stream one block of int32 words, store their xor (so the loads cannot be dropped)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(p + offs, mask=offs < n, other=0)
    tl.store(out + tl.program_id(0), tl.reduce(v, 0, _xor))


def read_once(*tensors: torch.Tensor, block: int = 4096, warps: int = 8) -> None:
    """Read every byte of ``tensors`` once with the floor kernel (one launch each; sizes a multiple of 4 bytes):
    untimed, for a profiler."""
    for t in tensors:
        words = t.reshape(-1).view(torch.int32)
        out = torch.empty(triton.cdiv(words.numel(), block), dtype=torch.int32, device=t.device)
        _read_kernel[(out.numel(),)](words, out, words.numel(), BLOCK=block, num_warps=warps)


def time_read(*tensors: torch.Tensor, rep_ms: float = 100.0) -> float:
    """The practical byte ceiling in this run: the best seconds, over a few tilings, of a plain streaming read of
    ``tensors`` (:func:`read_once`), graph-timed."""
    return min(time_graph(lambda b=b, w=w: read_once(*tensors, block=b, warps=w), rep_ms=rep_ms)
               for b, w in _READ_TILINGS)


def time_host(fn, *, iters: int = 100, repeats: int = 5, clock=time.perf_counter) -> float:
    """Host seconds per call of ``fn`` on any machine: the best of ``repeats`` means over ``iters`` back-to-back
    calls, no sync (what enqueueing costs; on a CPU-only machine with no-op kernel launches, the Python host path
    of a forward alone). ``clock``: e.g. ``time.thread_time``, this thread's CPU time, which a machine busy with
    other work disturbs less than the wall clock."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = clock()
        for _ in range(iters):
            fn()
        best = min(best, (clock() - t0) / iters)
    return best
