"""torchrun entry for tests/test_multigpu.py: one rank per GPU (nccl), the layer over every available
transport vs the portable one and vs the dense reference, every layout. Prints one line per case and
'MULTIGPU OK' on rank 0 when all cases pass."""

import os
import sys

import torch
import torch.distributed as dist

import moe_ep
from moe_ep import EpConfig, ExpertWeights, MoEEpLayer
from moe_ep.config import SUPPORTED_LAYOUTS
from moe_ep.reference import moe_reference
from moe_ep.transports.discovery import available_transports

LAYOUTS = [(a.value, lay.value) for a, lay in SUPPORTED_LAYOUTS]
E, K, H, I, T = 16, 4, 2048, 256, 64


def main() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.02).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) * 0.02).bfloat16()
    d13, d2 = w13.float().to(dev), w2.float().to(dev)
    names = [t.name for t in available_transports() if t.available and t.name != "torch"]
    fails = 0
    for alg, lay in LAYOUTS:
        cfg = EpConfig(E, K, H, I, T, algorithm=alg, layout=lay)
        weights = ExpertWeights.from_global(w13, w2, rank, world, "bf16", device=dev)
        layers = {"torch": MoEEpLayer(cfg, weights)}
        for n in names:
            if n == "nixl_ep" and (alg, lay) != ("ll", "expert_major"):
                continue
            layers[n] = MoEEpLayer(cfg, weights, transport=n)
            if alg == "ll":  # CUDA-graph mode: every rank captures the same sizes first (the warm-ups are collective)
                layers[n + "+graph"] = graphed = MoEEpLayer(cfg, weights, transport=n, cuda_graph=True)
                for B in (T, 5, 3):
                    graphed.graph_inputs(B)
        for step, B in enumerate((T, 5, 0 if rank == 0 else 3)):
            gs = torch.Generator().manual_seed(100 * step + rank)
            x = torch.randn(B, H, generator=gs).bfloat16().to(dev)
            idx = torch.stack([torch.randperm(E, generator=gs)[:K] for _ in range(B)]) if B else \
                torch.empty(0, K, dtype=torch.long)
            if B:
                idx[torch.rand(B, K, generator=gs) < 0.2] = -1
            idx, w = idx.to(dev), torch.rand(B, K, generator=gs).to(dev)
            ref = moe_reference(x, idx, w, d13, d2)
            base = None
            for n, layer in layers.items():  # every rank runs the transports in the same order
                out = layer(x, idx, w).clone()  # a graphed layer's output buffer is overwritten by its next replay
                err = ((out.float() - ref).norm() / ref.norm().clamp(min=1e-6)).item() if B else 0.0
                same = base is None or torch.equal(out, base)
                base = out if base is None else base
                ok = err < 2e-2
                fails += not ok
                print(f"rank {rank}/{world} {n:14} {alg}/{lay:13} B={B:3}: rel err vs dense {err:.2e}, "
                      f"bit-identical to torch transport: {same} {'ok' if ok else 'FAIL'}", flush=True)
        for n, layer in layers.items():
            if n != "torch":
                layer.transport.close()
        torch.cuda.synchronize()
    t = torch.tensor([fails], device=dev)
    dist.all_reduce(t)
    dist.destroy_process_group()
    if rank == 0 and int(t) == 0:
        print(f"MULTIGPU OK ({world} ranks, transports: torch, {', '.join(names) or 'none else'})")
    return int(int(t) > 0)


if __name__ == "__main__":
    assert moe_ep.__version__
    sys.exit(main())
