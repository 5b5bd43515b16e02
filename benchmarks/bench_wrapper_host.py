"""The NCCL-EP / NIXL-EP wrappers' own host time on any machine (CPU included): a proxy for the "own host" column
of ``bench_transports.py``, which needs the libraries and a GPU.

Each wrapper at world size 1 over the repository's contract stand-ins of the libraries (``tests/fake_nccl_ep.py``,
``tests/fake_nixl_ep.py``: CPU tensors), one dispatch + combine made for real, then the library object replaced by
``bench_transports.Replay`` (every call a no-op that returns what the real one returned, as ``own_host_us`` does
there): dispatch + combine timed by this thread's CPU time, best of 5 means, as ``moe_ep.commands.timing.time_host``
times (a copy of it here: ``--repo`` may name a checkout older than that module). Small shapes keep
torch's own work out of the way; what is left is the wrappers' Python. Compare runs on one machine only (e.g. this
checkout against an older one: ``python3 benchmarks/bench_wrapper_host.py --repo OTHER_CHECKOUT``).

    PYTHONPATH=$PWD python3 benchmarks/bench_wrapper_host.py
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import types

CASES = [("nccl_ep", "ll", "expert_major", 128), ("nccl_ep", "ll", "rank_major", 128),
         ("nccl_ep", "ht", "flat", 128), ("nccl_ep", "ht", "expert_major", 128),
         ("nixl_ep", "ll", "expert_major", 2048)]  # (transport, algorithm, layout, hidden: each one's hidden rule)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repo", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                   help="the checkout whose moe_ep, stand-ins and bench_transports are timed (default: this one)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each case; each one's best mean is printed")
    args = p.parse_args()
    # the stand-ins live with the tests, and bench_transports beside this script: both of the checkout asked for
    sys.path[:0] = [args.repo, os.path.join(args.repo, "tests"), os.path.join(args.repo, "benchmarks")]
    import torch
    import bench_transports
    import fake_nccl_ep
    import fake_nixl_ep
    from moe_ep.config import Algorithm, EpConfig, Layout
    from moe_ep.transports.nccl_ep import NcclEpTransport
    from moe_ep.transports.nixl_ep import NixlEpTransport
    try:
        from moe_ep.testing.toy_transport import toy_compute
    except ImportError:  # (an older checkout's place for it)
        from moe_ep.transports.toy import toy_compute

    def best_mean(fn, iters=200):  # (time_host's loop, clock=time.thread_time: see the module doc)
        fn()
        best = float("inf")
        for _ in range(5):
            t0 = time.thread_time()
            for _ in range(iters):
                fn()
            best = min(best, (time.thread_time() - t0) / iters)
        return best
    # bench_transports.own_host_us times with time_loop (a GPU's); here the CPU clock above
    bench_transports.time_loop = lambda fn, iters=None, warmup=None, **_: types.SimpleNamespace(host=best_mean(fn))
    import moe_ep
    print(f"moe_ep from {os.path.dirname(os.path.dirname(moe_ep.__file__))}: wrapper's own host us per dispatch + "
          f"combine (best of {args.repeats} runs)")
    T, E, K = 8, 8, 3
    for name, alg, lay, H in CASES:
        c = EpConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=64, max_tokens_per_rank=T,
                     algorithm=Algorithm(alg), layout=Layout(lay))
        g = torch.Generator().manual_seed(1)
        x = torch.randn(T, H, generator=g).bfloat16()
        idx = torch.rand(T, E, generator=g).topk(K, -1).indices
        w = torch.rand(T, K, generator=g)
        times = []
        for _ in range(args.repeats):
            if name == "nccl_ep":
                t = NcclEpTransport(c, group=(1, 0), ep=fake_nccl_ep.make_module(), rank=0, world_size=1,
                                    device="cpu")
            else:
                t = NixlEpTransport(c, nixl=fake_nixl_ep.make_module(), store=object(), rank=0, world_size=1,
                                    device="cpu")
            y = toy_compute(t.dispatch(x, idx, w), c, 0, 1)
            t.combine(y)
            t._x, t._y, t._idx_in, t._w_in = x, y, idx, w  # (what own_host_us reads back, as bench_transports sets)

            def step():
                t.dispatch(x, idx, w)
                t.combine(y)
            times.append(bench_transports.own_host_us(t, step, 200))
            t.close()
        print(f"{name:8} {alg}/{lay:13} {min(times):6.1f}")


if __name__ == "__main__":
    main()
