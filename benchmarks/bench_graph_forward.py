"""One MoEEpLayer forward, eager vs the layer's CUDA-graph mode (``cuda_graph=True``), for the LOW_LATENCY
layouts over every transport that can be captured here, at any world size (torchrun, one rank per GPU).

Per (transport, layout): device us per forward (CUDA events over back-to-back forwards) and host us to
enqueue one, for the eager layer, the graph mode on the caller's own tensors (input copies + replay) and
the graph mode in place (the caller fills ``graph_inputs(B)``: the replay alone); ``validate=False``
throughout. Every rank runs the same steps in the same order (dispatch and combine are collective).
Default shape: a DeepSeek-V3-like rank (32 local experts, H 7168, I 2048, top-8), 128 tokens per rank.

From the repository root (or with moe-ep installed, without ``PYTHONPATH``):

    PYTHONPATH=$PWD python3 benchmarks/bench_graph_forward.py                                   (world size 1)
    PYTHONPATH=$PWD torchrun --standalone --nproc-per-node 2 benchmarks/bench_graph_forward.py (kits sourced)
"""

from __future__ import annotations

import argparse
import json

import moe_ep  # noqa: F401  (before triton)
import torch
import torch.distributed as dist
from bench_layer import graph_mode_times  # the script beside this one (its folder is first on sys.path)

from moe_ep import EpConfig, ExpertWeights, MoEEpLayer
from moe_ep.commands.common import dist_setup, dist_teardown
from moe_ep.commands.timing import time_loop
from moe_ep.transports.discovery import available_transports


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--local-experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=128, help="tokens per rank")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    assert torch.cuda.is_available(), "bench_graph_forward.py needs a CUDA GPU"
    rank, world = dist_setup()
    if world == 1 and not dist.is_initialized():  # the real transports want a process group, even of one
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29561", rank=0, world_size=1)
    dev = torch.device("cuda", torch.cuda.current_device())
    L, K, H, I, B = args.local_experts, args.top_k, args.hidden, args.inter, args.tokens
    E = L * world
    torch.manual_seed(rank)
    weights = ExpertWeights((torch.randn(L, 2 * I, H, device=dev) / H ** 0.5).bfloat16(),
                            (torch.randn(L, H, I, device=dev) / I ** 0.5).bfloat16())
    x = torch.randn(B, H, device=dev).bfloat16()
    idx = torch.rand(B, E, device=dev).topk(K, dim=1).indices
    w = torch.rand(B, K, device=dev)
    names = [t.name for t in available_transports() if t.available and (t.name != "torch" or world == 1)]
    rows = []
    for name in names:
        for layout in ("expert_major", "rank_major"):
            if name == "nixl_ep" and layout != "expert_major":
                continue  # NIXL-EP has LL expert-major only
            cfg = EpConfig(E, K, H, I, B, "ll", layout)
            eager = MoEEpLayer(cfg, weights, transport=name)
            graphed = MoEEpLayer(cfg, weights, transport=name, cuda_graph=True)
            fwd = lambda: eager(x, idx, w, validate=False)  # noqa: E731
            t_eager = time_loop(fwd)
            r = {"transport": name, "layout": layout, "world": world, "rank": rank, "tokens": B,
                 **graph_mode_times(graphed, x, idx, w, fwd), "eager_us": t_eager.device * 1e6,
                 "eager_host_us": t_eager.host * 1e6}
            rows.append(r)
            for layer in (eager, graphed):
                if name != "torch":
                    layer.transport.close()
            torch.cuda.synchronize()
    if rank == 0:
        cols = ["eager_us", "eager_host_us", "graph_forward_us", "graph_host_us", "graph_inplace_us",
                "graph_inplace_host_us"]
        print(f"\nworld {world}, {B} tokens per rank, {L} local experts, H {H}, I {I}, top-{K} (rank 0; us)")
        print(f"{'transport':<10}{'layout':<14}" + "".join(f"{c.replace('_us', ''):>22}" for c in cols)
              + f"{'graph vs eager':>16}")
        for r in rows:
            print(f"{r['transport']:<10}{r['layout']:<14}" + "".join(f"{r[c]:>22.1f}" for c in cols)
                  + f"{r['graph_rel_err']:>16.1e}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"args": vars(args), "device": torch.cuda.get_device_name(), "results": rows}, f, indent=1)
    dist_teardown()


if __name__ == "__main__":
    main()
