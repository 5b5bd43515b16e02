"""Time the bridge's route (``route_experts``: counts, offsets and a slot per pick) against torch doing the
same (stable sort of the ids, ``index_add_`` histogram, cumsum), for several id counts and launch widths.

Both sides are graph-timed (``do_bench_cudagraph``: device time, no launch overhead); every variant's
counts, offsets, slots and rows are compared with ``reference.route_experts_ref`` in the same run.

From the repository root (or with moe-ep installed, without ``PYTHONPATH``):

    PYTHONPATH=$PWD python3 benchmarks/bench_route.py [--tokens 128,4096] [--top-k 8] [--experts 32] [--warps 4,8,16]
"""

from __future__ import annotations

import argparse
import sys

import moe_ep  # noqa: F401  (before triton)
import torch
from bench_layer import torch_route  # the script beside this one (its folder is first on sys.path)

from moe_ep.commands.timing import time_graph
from moe_ep.kernels import bridge
from moe_ep.reference import route_experts_ref


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="128,4096")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--experts", type=int, default=32, help="local experts (ids past them: not here)")
    ap.add_argument("--warps", default="4,8,16")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    dev, L, K = torch.device("cuda"), args.experts, args.top_k
    print(f"{'ids':>6} {'warps':>5} {'ours us':>8} {'torch us':>8} {'x torch':>7} exact", flush=True)
    for M in (int(t) for t in args.tokens.split(",")):
        # ids of a 256-expert model: 1/8 of them local, the rest (and -1 padding) skipped
        ids = torch.rand(M, 256, device=dev).topk(K, dim=1).indices.to(torch.int32) % (L + 8) - 4
        ids = torch.where(ids < L, ids, -1).to(torch.int32)
        want = route_experts_ref(ids.cpu(), L)
        t_torch = time_graph(lambda: torch_route(ids, L), rep_ms=50) * 1e6
        for warps in (int(w) for w in args.warps.split(",")):
            out = bridge.route_experts(ids, L)  # buffers of the right shapes

            def run():
                bridge._launch_route(ids, None, 1, L, out, warps=warps)
            run()
            got = (out.counts, out.offsets, out.slot, out.row_of_slot)
            exact = all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(got, want))
            t = time_graph(run, rep_ms=50) * 1e6
            print(f"{M * K:6d} {warps:5d} {t:8.2f} {t_torch:8.2f} {t_torch / t:7.2f} {exact}", flush=True)


if __name__ == "__main__":
    main()
