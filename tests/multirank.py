"""Helpers for the multi-rank tests: spawn R ranks (gloo) that loop over every case inside: the layer's matrix,
then the converted HF models (one spawn per R serves both: the ranks' start-up is much of their time)."""

from __future__ import annotations

import os
import tempfile
import traceback
from datetime import timedelta

import torch

from moe_ep.config import SUPPORTED_LAYOUTS
from moe_ep.testing.properties import FP8_DENSE_TOL

CFG = dict(num_experts=8, top_k=2, hidden_size=32, intermediate_size=32, max_tokens_per_rank=4)
LAYOUTS = [(a.value, lay.value) for a, lay in SUPPORTED_LAYOUTS]
ROUTINGS = ["random", "one_expert", "one_rank", "zero_tokens", "all_minus1", "full"]


def case_id(case: tuple) -> str:
    """A test id of a :func:`matrix` case: ``alg-layout-weights-activations``."""
    return "-".join(case)


def matrix():
    """(algorithm, layout, weight format, activation format): every layout x weight format, plus NVFP4
    activations for one layout per algorithm; FP8 (W8A8) in every layout, its tokens quantized before dispatch
    (FP8 activations) or after it (bf16 activations)."""
    cases = [(a, l, wf, "bf16") for a, l in LAYOUTS for wf in ("bf16", "nvfp4")]
    fp8 = [("ll", "expert_major", "fp8", "fp8"), ("ll", "rank_major", "fp8", "bf16"), ("ht", "flat", "fp8", "fp8"),
           ("ht", "expert_major", "fp8", "fp8")]
    return cases + [("ll", "rank_major", "nvfp4", "nvfp4"), ("ht", "expert_major", "bf16", "nvfp4"),
                    ("ll", "expert_major", "bf16", "nvfp4")] + fp8


def routing(kind: str, rank: int, world: int, seed: int):
    """(B, topk_idx) for this rank: distinct ids per row, -1 allowed."""
    E, K, T = CFG["num_experts"], CFG["top_k"], CFG["max_tokens_per_rank"]
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    B = T if kind == "full" else int(torch.randint(1, T + 1, (1,), generator=g))
    if kind == "zero_tokens" and rank == 0:
        B = 0
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(B)]) if B else torch.empty(0, K, dtype=torch.long)
    if kind in ("random", "full", "zero_tokens") and B:
        idx[torch.rand(B, K, generator=g) < 0.2] = -1
    if kind == "one_expert":
        idx[:, 0], idx[:, 1:] = E - 1, -1
    if kind == "one_rank":  # only the last rank's experts
        L = E // world
        idx = torch.stack([torch.randperm(L, generator=g)[:K] + (world - 1) * L for _ in range(B)]) if B else idx
    if kind == "all_minus1" and B:
        idx[: max(1, B // 2)] = -1
        if rank == world - 1:
            idx[:] = -1
    return B, idx


# relative error bound per (weight format, activation format) against the dense reference, which uses the
# weights' own dequantization (so NVFP4 weights add no error of their own: only the bf16 arithmetic differs,
# ~4e-3 per GEMM); NVFP4 activations are quantized to e2m1 on the way into both GEMMs
BOUNDS = {("bf16", "bf16"): 1.5e-2, ("nvfp4", "bf16"): 1.5e-2, ("bf16", "nvfp4"): 0.3, ("nvfp4", "nvfp4"): 0.3,
          ("fp8", "bf16"): FP8_DENSE_TOL, ("fp8", "fp8"): FP8_DENSE_TOL}  # FP8: tokens and intermediate in e4m3


def bound(wf: str, af: str) -> float:
    """The bound for these formats; a format pair without one raises KeyError rather than borrow another's."""
    return BOUNDS[(wf, af)]


def run_cases(rank: int, world: int, group, dev: torch.device, cases=None, routings=None,
              first_index: int = 0) -> list[str]:
    """Run every case on this rank; return failure messages (empty = all passed). ``first_index``: the index in
    :func:`matrix` of ``cases[0]`` (a case's routings are seeded by its index, wherever it runs)."""
    from moe_ep import EpConfig, ExpertWeights, MoEEpLayer
    from moe_ep.reference import moe_reference

    g = torch.Generator().manual_seed(0)
    E, H, I, K = CFG["num_experts"], CFG["hidden_size"], CFG["intermediate_size"], CFG["top_k"]
    w13 = torch.randn(E, 2 * I, H, generator=g) / H ** 0.5
    w2 = torch.randn(E, H, I, generator=g) / I ** 0.5
    fails, dense = [], {}
    for ci, (alg, lay, wf, af) in enumerate(cases or matrix(), start=first_index):
        cfg = EpConfig(**CFG, algorithm=alg, layout=lay, weight_format=wf, activation_format=af)
        layer = MoEEpLayer(cfg, ExpertWeights.from_global(w13, w2, rank, world, wf, device=dev), group=group)
        if wf not in dense:  # the reference's operands depend on the format alone (all experts, quantized once)
            dense[wf] = ExpertWeights(w13.to(dev), w2.to(dev), wf).dense()
        d13, d2 = dense[wf]
        for ri, kind in enumerate(routings or ROUTINGS):
            try:
                B, idx = routing(kind, rank, world, seed=ci * 10 + ri)
                x = torch.randn(B, H, generator=g).bfloat16().to(dev)
                w = torch.rand(B, K, generator=g).to(dev)
                idx = idx.to(dev).to(torch.int32 if ri % 2 else torch.int64)
                out = layer(x, idx, w)
                ref = moe_reference(x, idx, w, d13, d2)
                assert out.shape == (B, H) and out.dtype == torch.bfloat16, (out.shape, out.dtype)
                err = ((out.float() - ref).norm() / ref.norm().clamp(min=1e-6)).item() if B else 0.0
                if not ref.abs().sum():
                    err = out.float().abs().max().item() if B else 0.0
                if not err <= bound(wf, af):
                    fails.append(f"R={world} rank={rank} {alg}/{lay} w={wf} a={af} routing={kind}: rel err {err:.4f}")
            except Exception:  # the ranks' collectives are out of step now: stop here
                fails.append(f"R={world} rank={rank} {alg}/{lay} w={wf} a={af} routing={kind}:\n"
                             + traceback.format_exc())
                return fails
    return fails


def _worker(rank: int, world: int, store_path: str, out_dir: str, use_cuda: bool, with_hf: bool):
    import torch.distributed as dist

    import moe_ep  # noqa: F401  (interpreter setup before triton)
    torch.set_num_threads(1)  # tiny tensors, and R ranks share the cores
    dev = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        fails = run_cases(rank, world, None, dev)
        in_step = not any("Traceback" in f for f in fails)  # a rank that raised left the collectives out of step
        if with_hf and in_step:  # the converted HF models on the same ranks (tests/test_hf.py): one spawn for both
            from test_hf import rank_cases
            fails += rank_cases(rank, world)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.write("\n".join(fails))


def spawn_and_check(world: int, use_cuda: bool = False, with_hf: bool = False) -> list[str]:
    """Spawn ``world`` gloo ranks running :func:`run_cases` (then, ``with_hf``, tests/test_hf.py's
    ``rank_cases``); return all ranks' failures."""
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(world, os.path.join(d, "store"), d, use_cuda, with_hf), nprocs=world, join=True)
        fails = []
        for r in range(world):
            txt = open(os.path.join(d, f"rank{r}.txt")).read()
            fails += [t for t in txt.split("\n") if t] if txt else []
        return fails
