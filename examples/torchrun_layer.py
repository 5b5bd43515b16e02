"""One MoE layer over several ranks, checked against the dense single-process MoE.

    torchrun --nproc-per-node 2 examples/torchrun_layer.py     (CPU: gloo; GPUs: nccl, one rank per GPU)
    python examples/torchrun_layer.py                          (one process, no process group)

Every rank builds the same full weights from one seed and keeps its own ``num_experts / world`` experts
(``ExpertWeights.from_global``); each rank routes its own tokens. ``MoEEpLayer(..., group=None)`` runs over the
default process group that ``init_process_group`` made, or, in a single process without one, alone (world 1).
"""

from __future__ import annotations

import os

import moe_ep  # noqa: F401  (first: it sets TRITON_INTERPRET=1 when there is no CUDA, before triton is imported)
import torch
import torch.distributed as dist

from moe_ep import Algorithm, EpConfig, ExpertWeights, Layout, MoEEpLayer
from moe_ep.reference import moe_reference

EXPERTS, TOP_K, HIDDEN, INTER, TOKENS = 8, 2, 64, 32, 4  # small: on a CPU the kernels run in Triton's interpreter


def main() -> int:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # started by torchrun
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus:  # more ranks than GPUs share them, over gloo (nccl takes one rank per GPU)
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % gpus)
        dist.init_process_group("nccl" if gpus >= int(os.environ["LOCAL_WORLD_SIZE"]) else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")

    g = torch.Generator().manual_seed(0)  # the same full weights on every rank
    w13_all = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) / HIDDEN ** 0.5  # [E, 2I, H]: gate rows, up rows
    w2_all = torch.randn(EXPERTS, HIDDEN, INTER, generator=g) / INTER ** 0.5        # [E, H, I]
    gx = torch.Generator().manual_seed(1 + rank)  # each rank's own tokens and routing
    x = torch.randn(TOKENS, HIDDEN, generator=gx).bfloat16().to(dev)                 # [B, H] bf16
    idx = torch.rand(TOKENS, EXPERTS, generator=gx).topk(TOP_K, dim=1).indices.to(dev)  # [B, K] global expert ids
    w = torch.rand(TOKENS, TOP_K, generator=gx).softmax(1).to(dev)                   # [B, K] routing weights

    failed = 0
    ref = moe_reference(x, idx, w, w13_all.to(dev), w2_all.to(dev))  # dense fp32 [B, H], all experts here
    for algorithm, layout in [(Algorithm.LOW_LATENCY, Layout.EXPERT_MAJOR), (Algorithm.HIGH_THROUGHPUT, Layout.FLAT)]:
        cfg = EpConfig(num_experts=EXPERTS, top_k=TOP_K, hidden_size=HIDDEN, intermediate_size=INTER,
                       max_tokens_per_rank=TOKENS, algorithm=algorithm, layout=layout)
        weights = ExpertWeights.from_global(w13_all, w2_all, rank, world, device=dev)  # this rank's E / world experts
        layer = MoEEpLayer(cfg, weights)  # group=None: the default group (or one process); transport "torch"
        y = layer(x, idx, w)  # [B, H] bf16, this rank's tokens in their order
        err = torch.tensor([((y.float() - ref).norm() / ref.norm()).item()])
        if dist.is_initialized():
            dist.all_reduce(err, op=dist.ReduceOp.MAX)
        ok = err.item() < 2e-2  # bf16 activations and outputs: ~4e-3 expected
        failed += not ok
        if rank == 0:
            print(f"{algorithm.value}/{layout.value}: {world} rank(s), {TOKENS} tokens each, "
                  f"{EXPERTS // world} experts per rank, worst relative error vs dense {err.item():.2e} "
                  f"({'OK' if ok else 'TOO LARGE'})")
    if dist.is_initialized():
        dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
