"""Benchmark the EP layer on one GPU (world size 1): a DeepSeek-V3-like rank, 32 local experts, H 7168,
I 2048, top-8; LL at 128 tokens, HT at 4096 tokens, every layout.

Per stage (dispatch, bridge, GEMM1, GEMM2, combine) in microseconds (CUDA events), the whole forward,
its host overhead (CPU time to enqueue one forward; ``MOE_EP_FORWARD_PLAN`` off: the whole host path), the same
with the forward replayed from its recording (the default, ``moe_ep/forward_plan.py``; its output checked equal to
the eager one) and that replay's host time step by step (each aten op and kernel launch of the recording, on an idle
GPU: where the replayed forward's host time goes), the same for the layer's CUDA-graph mode
(``cuda_graph=True``: inputs copied into the graph's buffers, or filled in place), and the bridge's steps
(gather bandwidth, route, unpermute-reduce; device time, graph-timed) against a device copy of the same
bytes and against the torch version of the same step, all measured in this run. The short table is printed
last; ``--out FILE`` writes everything as JSON.

From the repository root (or with moe-ep installed, without ``PYTHONPATH``):

    PYTHONPATH=$PWD python3 benchmarks/bench_layer.py [--weight-format nvfp4] [--out bench_layer.json]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import time
import warnings

import moe_ep  # noqa: F401  (before triton)
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from moe_ep import EpConfig, ExpertWeights, MoEEpLayer, options
from moe_ep.commands.bench_rows import rel_err
from moe_ep.commands.timing import time_graph, time_host_idle, time_loop
from moe_ep.forward_plan import ForwardPlan, _DescriptorSlot, _Launch
from moe_ep.kernels import grouped_gemm, launch_cache
from moe_ep.kernels.bridge import permute_rows, route_experts, unpermute_reduce


def graph_mode_times(graphed: MoEEpLayer, x, idx, w, eager_fwd) -> dict:
    """A ``cuda_graph=True`` layer's forward timed on the caller's tensors (input copies + replay), in place (its
    ``graph_inputs`` filled, so the replay alone) and as the bare replay; device us (CUDA events) and host us to
    enqueue one, ``validate=False``. Also whether its output equals ``eager_fwd()``'s. Every rank of a collective
    run calls this in the same order (the capture's warm-ups and each timed call are collective)."""
    B = x.shape[0]
    static = graphed.graph_inputs(B, idx.dtype, w.dtype)  # captured here
    for dst, src in zip(static, (x, idx, w)):
        dst.copy_(src)
    gfwd = lambda: graphed(x, idx, w, validate=False)  # noqa: E731
    inplace = lambda: graphed(*static, validate=False)  # noqa: E731
    ref, got = eager_fwd().float(), inplace().float()
    t_fwd, t_inplace = time_loop(gfwd), time_loop(inplace)
    t_replay = time_loop(graphed._graphs.get(B, idx.dtype, w.dtype).graph.replay)  # the floor
    return {"graph_forward_us": t_fwd.device * 1e6, "graph_host_us": t_fwd.host * 1e6,
            "graph_inplace_us": t_inplace.device * 1e6, "graph_inplace_host_us": t_inplace.host * 1e6,
            "graph_replay_host_us": t_replay.host * 1e6,
            "graph_matches_eager": bool(torch.equal(got, ref)),
            "graph_rel_err": rel_err(got, ref)}


@triton.jit
def _empty_kernel(p, n):
    pass


@triton.jit
def _tile_by_pointers(src, dst):
    offs = tl.arange(0, 16)[:, None] * 16 + tl.arange(0, 16)[None, :]
    tl.store(dst + offs, tl.load(src + offs))


@triton.jit
def _tile_by_descriptor(src_desc, dst):
    offs = tl.arange(0, 16)[:, None] * 16 + tl.arange(0, 16)[None, :]
    tl.store(dst + offs, src_desc.load([0, 0]))


def launch_floor() -> dict:
    """Host us to enqueue one empty Triton kernel and one tiny torch op: what an eager forward's launches cost
    before any of our Python runs (an eager forward makes many launches: docs/PERF.md, "The layer"). Also one
    tile copy launched with a host TMA descriptor against the same copy by pointers: the difference is what
    Triton's launcher spends per descriptor (encoding its CUtensorMap), which a replay pays per descriptor too."""
    t = torch.zeros(16, device="cuda")
    src, dst = torch.zeros(16, 16, device="cuda", dtype=torch.bfloat16), torch.empty(256, device="cuda").bfloat16()
    desc = TensorDescriptor.from_tensor(src, [16, 16])
    return {"case": "launch floor", "tokens": 0,
            "triton_launch_host_us": time_loop(lambda: _empty_kernel[(1,)](t, 16), iters=200).host * 1e6,
            "torch_op_host_us": time_loop(lambda: t.add_(1), iters=200).host * 1e6,
            "pointer_tile_launch_host_us": time_loop(lambda: _tile_by_pointers[(1,)](src, dst), iters=200).host * 1e6,
            "descriptor_tile_launch_host_us": time_loop(lambda: _tile_by_descriptor[(1,)](desc, dst),
                                                        iters=200).host * 1e6}


def _kernel_names() -> dict:
    """Compiled function handle -> kernel name, for every launch the launch cache keeps."""
    names = {}
    for info in launch_cache._KERNELS.values():
        for entry in info.entries.values():
            for _, function, _, _ in entry.compiled.values():
                names[function] = info.jit.fn.__name__
    return names


def replay_steps(layer: MoEEpLayer, inputs: tuple, reps: int = 25) -> list[dict]:
    """The layer's recorded forward (its one plan) replayed step by step, each step's host us (the median over
    ``reps`` replays, each onto an idle GPU): an aten op by name, a kernel launch by kernel name and its number of
    TMA descriptors made per launch (built on each replay, and Triton's launcher encodes each into a CUtensorMap).
    The loop is :meth:`ForwardPlan.replay`'s, with a clock around each step."""
    plan = next(p for p in layer._plans.plans.values() if type(p) is ForwardPlan)
    device = torch.cuda.current_device()
    stream = launch_cache._driver().get_current_stream(device)
    names, times = _kernel_names(), [[] for _ in plan.steps]
    for _ in range(reps):
        torch.cuda.synchronize()
        tensors = list(inputs)
        for i, step in enumerate(plan.steps):
            launch = type(step) is _Launch
            t0 = time.perf_counter()
            step.run(tensors, stream) if launch else step.run(tensors)
            times[i].append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    out = []
    for step, t in zip(plan.steps, times):
        if type(step) is _Launch:
            descs = sum(type(slot) is _DescriptorSlot for _, slot in step.slots)
            label = f"{names.get(step.function, 'kernel')}" + (f" ({descs} TMA desc.)" if descs else "")
        else:
            label = str(step.func).replace("aten.", "")
        out.append({"step": label, "host_us": sorted(t)[len(t) // 2] * 1e6})
    return out


def torch_route(ids: torch.Tensor, L: int):
    """The torch version of the bridge's route + gather index: stable sort of the flat ids (index_add_, not
    bincount, so it has no host sync and can be graph-timed like ours)."""
    flat = ids.reshape(-1)
    key = torch.where((flat >= 0) & (flat < L), flat, L)
    order = torch.sort(key, stable=True).indices
    ones = torch.ones_like(key, dtype=torch.int64)
    counts = torch.zeros(L + 1, dtype=torch.int64, device=ids.device).index_add_(0, key, ones)
    return order // ids.shape[1], counts[:L].cumsum(0)


def _profile(fwd, path: str) -> None:
    """cProfile of 20 forwards into ``path``: functions by own time, then by cumulative time."""
    prof = cProfile.Profile()
    prof.runcall(lambda: [fwd() for _ in range(20)])
    torch.cuda.synchronize()
    with open(path, "w") as f:
        pstats.Stats(prof, stream=f).sort_stats("tottime").print_stats(30)
        pstats.Stats(prof, stream=f).sort_stats("cumulative").print_stats(40)


def bench_case(alg: str, layout: str, B: int, args, w13, w2) -> dict:
    E, K, H, I = args.experts, args.top_k, args.hidden, args.inter
    cfg = EpConfig(E, K, H, I, B, alg, layout, args.weight_format, args.activation_format)
    weights = ExpertWeights(w13, w2, args.weight_format)
    layer = MoEEpLayer(cfg, weights)
    dev = torch.device("cuda")
    x = torch.randn(B, H, device=dev).bfloat16()
    idx = torch.rand(B, E, device=dev).topk(K, dim=1).indices
    w = torch.rand(B, K, device=dev)
    fwd = lambda: layer(x, idx, w, validate=False)  # noqa: E731
    with options.override(forward_plan=False):  # the whole host path on every forward
        t_fwd = time_loop(fwd)
        r = {"case": f"{alg}/{layout}", "tokens": B, "forward_us": t_fwd.device * 1e6, "host_us": t_fwd.host * 1e6,
             "host_idle_us": time_host_idle(fwd) * 1e6}
        eager = fwd().clone()
    with options.override(forward_plan=True):  # the same forward replayed from its recording (forward_plan.py)
        fwd()  # the signature's first forward: as it is
        fwd()  # recorded
        t_plan = time_loop(fwd)
        r.update(plan_forward_us=t_plan.device * 1e6, plan_host_us=t_plan.host * 1e6,
                 plan_host_idle_us=time_host_idle(fwd) * 1e6, plan_failure=layer._plans.last_failure,
                 plan_matches_eager=bool(torch.equal(fwd(), eager)),
                 # back to back over more forwards: a longer queue of earlier work for the driver to push back with
                 plan_host_us_80=time_loop(fwd, iters=80).host * 1e6)
        if r["plan_failure"] is None:
            r["replay_steps"] = replay_steps(layer, (x, idx, w))
    if args.profile:  # where the host time of an eager forward goes: host syncs, then functions by own time
        with options.override(forward_plan=False):
            torch.cuda.set_sync_debug_mode("warn")
            with warnings.catch_warnings(record=True) as syncs:
                warnings.simplefilter("always")
                fwd()
            torch.cuda.set_sync_debug_mode("default")
            r["host_syncs"] = [f"{w.filename}:{w.lineno}: {str(w.message).splitlines()[0][:120]}" for w in syncs]
            _profile(fwd, os.path.join(args.profile, f"host_{alg}_{layout}.txt"))
        with options.override(forward_plan=True):  # and of the replayed one
            _profile(fwd, os.path.join(args.profile, f"host_plan_{alg}_{layout}.txt"))
    tr = layer.transport
    r["dispatch_us"] = time_loop(lambda: tr.dispatch(x, idx, w)).device * 1e6
    d = tr.dispatch(x, idx, w)
    L = E
    m_hint = cfg.tokens_per_expert(1, B)  # the GEMMs' tiles, as the layer picks them
    if layout in ("rank_major", "flat"):  # bridge in the compute
        ids = d.topk_idx.reshape(-1, K)
        valid = d.src_rank_counts if layout == "rank_major" else d.num_recv.reshape(1)
        group = B if layout == "rank_major" else ids.shape[0]
        rows = d.tokens.reshape(-1, H)
        route = route_experts(ids, L, valid_rows=valid, rows_per_group=group)
        r["bridge_us"] = time_loop(lambda: permute_rows(rows, route_experts(ids, L, valid_rows=valid,
                                                                            rows_per_group=group))).device * 1e6
        xs = permute_rows(rows, route)
        off = dict(offsets=route.offsets, m_hint=m_hint)
        h = grouped_gemm(xs, weights.w13, swiglu=True, **off)
        r["gemm1_us"] = time_loop(lambda: grouped_gemm(xs, weights.w13, swiglu=True, **off)).device * 1e6
        y = grouped_gemm(h, weights.w2, **off)
        r["gemm2_us"] = time_loop(lambda: grouped_gemm(h, weights.w2, **off)).device * 1e6
        red = unpermute_reduce(y, route, d.topk_weights.reshape(-1, K))
        r["combine_us"] = time_loop(lambda: tr.combine(unpermute_reduce(y, route, d.topk_weights.reshape(-1, K)))
                                    ).device * 1e6
        # bridge bandwidth: gathered rows read + written, vs a device copy of the same bytes, vs torch
        total = int(route.offsets[-1])
        nbytes = 2 * total * H * 2
        src = torch.empty(total, H, device=dev, dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        # bridge steps: device time of the kernels (graph-timed), ours and torch's; eager = with launches
        src_of_slot = route.row_of_slot[:total].long()
        t_gather = time_graph(lambda: permute_rows(rows, route), rep_ms=50) * 1e6
        t_copy = time_graph(lambda: dst.copy_(src), rep_ms=50) * 1e6
        t_torch_gather = time_graph(lambda: rows.index_select(0, src_of_slot), rep_ms=50) * 1e6
        t_route = time_graph(lambda: route_experts(ids, L, valid_rows=valid, rows_per_group=group), rep_ms=50) * 1e6
        t_torch_route = time_graph(lambda: torch_route(ids, L), rep_ms=50) * 1e6
        t_red = time_graph(lambda: unpermute_reduce(y, route, d.topk_weights.reshape(-1, K)), rep_ms=50) * 1e6
        slot = route.slot.long()
        wts = d.topk_weights.reshape(-1, K)
        t_torch_red = time_graph(lambda: (y[slot.clamp(min=0)].float() * (wts * (slot >= 0))[..., None]).sum(1),
                                 rep_ms=50) * 1e6
        r.update(gather_eager_us=time_loop(lambda: permute_rows(rows, route)).device * 1e6,
                 route_eager_us=time_loop(lambda: route_experts(ids, L, valid_rows=valid, rows_per_group=group)
                                          ).device * 1e6)
        r.update(gather_GBps=nbytes / t_gather / 1e3, copy_GBps=nbytes / t_copy / 1e3,
                 torch_gather_GBps=nbytes / t_torch_gather / 1e3, route_us=t_route, torch_route_us=t_torch_route,
                 unpermute_us=t_red, torch_unpermute_us=t_torch_red)
        del red
    else:  # expert-major: the transport's dispatch did the packing; GEMMs straight on its layout
        r["bridge_us"] = 0.0
        if layout == "expert_major" and alg == "ll":
            off = dict(counts=d.expert_counts, m_hint=m_hint)
        else:
            off = dict(offsets=torch.cat([d.expert_offsets, d.expert_offsets[-1:] + d.expert_counts[-1:]]),
                       m_hint=m_hint)
        xs = d.tokens
        h = grouped_gemm(xs, weights.w13, swiglu=True, **off)
        r["gemm1_us"] = time_loop(lambda: grouped_gemm(xs, weights.w13, swiglu=True, **off)).device * 1e6
        rs = dict(row_scale=d.topk_weights.float()) if alg == "ht" else {}
        y = grouped_gemm(h, weights.w2, **off, **rs)
        r["gemm2_us"] = time_loop(lambda: grouped_gemm(h, weights.w2, **off, **rs)).device * 1e6
        r["combine_us"] = time_loop(lambda: tr.combine(y)).device * 1e6
    r.update(graph_mode_times(MoEEpLayer(cfg, weights, cuda_graph=True), x, idx, w, fwd))
    wbytes = sum(t.numel() * t.element_size() for t in (
        [weights.w13, weights.w2] if args.weight_format == "bf16"
        else [weights.w13.data, weights.w13.scales, weights.w2.data, weights.w2.scales]))
    r["weight_floor_us"] = wbytes / args.bandwidth_tbps / 1e6
    r["flop_floor_us"] = 2 * B * K * 3 * H * I / args.tflops / 1e6
    return r


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--inter", type=int, default=2048)
    p.add_argument("--ll-tokens", type=int, default=128)
    p.add_argument("--ht-tokens", type=int, default=4096)
    p.add_argument("--weight-format", default="bf16", choices=["bf16", "nvfp4"])
    p.add_argument("--activation-format", default="bf16", choices=["bf16", "nvfp4"])
    p.add_argument("--bandwidth-tbps", type=float, default=4.26, help="device copy ceiling (DESIGN.md)")
    p.add_argument("--tflops", type=float, default=795.0, help="bf16 dense matmul ceiling (DESIGN.md)")
    p.add_argument("--out", default=None)
    p.add_argument("--profile", default=None,
                   help="folder for cProfile reports of the eager and the replayed forward's host time")
    args = p.parse_args()
    assert torch.cuda.is_available(), "bench_layer.py needs a CUDA GPU"
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    torch.manual_seed(0)
    dev = torch.device("cuda")
    E, H, I = args.experts, args.hidden, args.inter
    w13 = (torch.randn(E, 2 * I, H, device=dev) / H ** 0.5).bfloat16()
    w2 = (torch.randn(E, H, I, device=dev) / I ** 0.5).bfloat16()
    cases = [("ll", "expert_major", args.ll_tokens), ("ll", "rank_major", args.ll_tokens),
             ("ht", "flat", args.ht_tokens), ("ht", "expert_major", args.ht_tokens)]
    results = [launch_floor()]
    print(json.dumps(results[0]))
    for alg, lay, B in cases:
        r = bench_case(alg, lay, B, args, w13, w2)
        results.append(r)
        print(json.dumps(r))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "device": torch.cuda.get_device_name(), "results": results}, f, indent=1)
    cols = ["dispatch_us", "bridge_us", "gemm1_us", "gemm2_us", "combine_us", "forward_us", "host_us", "host_idle_us",
            "plan_host_us", "plan_host_idle_us", "graph_forward_us", "graph_host_us", "graph_inplace_host_us",
            "graph_replay_host_us", "weight_floor_us", "flop_floor_us"]
    heads = [c.replace("_us", "").replace("graph_", "g.").replace("inplace_", "inpl.").replace("replay_", "rpl.")
             for c in cols]
    print(f"\n{'case':<16}{'tok':>6}" + "".join(f"{h:>12}" for h in heads) + "   (us)")
    for r in results[1:]:
        print(f"{r['case']:<16}{r['tokens']:>6}" + "".join(f"{r.get(c, float('nan')):>12.1f}" for c in cols)
              + ("" if r["graph_matches_eager"] else "   graph != eager (!)")
              + ("" if r["plan_matches_eager"] else "   replay != eager (!)")
              + (f"   not recorded: {r['plan_failure']}" if r["plan_failure"] else ""))  # (the why of a failed one)
    print(f"launch floor (host us): empty Triton kernel {results[0]['triton_launch_host_us']:.1f}, "
          f"torch op {results[0]['torch_op_host_us']:.1f}; a tile copy by pointers "
          f"{results[0]['pointer_tile_launch_host_us']:.1f}, by a TMA descriptor "
          f"{results[0]['descriptor_tile_launch_host_us']:.1f}")
    print("\nreplayed forward, host us per step (idle GPU, median); back to back over 20 / 80 forwards:")
    for r in results[1:]:
        if "replay_steps" in r:
            steps = r["replay_steps"]
            print(f"{r['case']:<16} sum {sum(st['host_us'] for st in steps):.1f}; back to back {r['plan_host_us']:.1f}"
                  f" / {r['plan_host_us_80']:.1f}: " + ", ".join(f"{st['step']} {st['host_us']:.1f}" for st in steps))
    print(f"\n{'bridge (GB/s, us)':<16}{'gather':>10}{'copy':>10}{'torch':>10}{'route':>10}{'torch':>10}"
          f"{'unperm':>10}{'torch':>10}")
    for r in results:
        if "gather_GBps" in r:
            print(f"{r['case']:<16}{r['gather_GBps']:>10.0f}{r['copy_GBps']:>10.0f}{r['torch_gather_GBps']:>10.0f}"
                  f"{r['route_us']:>10.1f}{r['torch_route_us']:>10.1f}{r['unpermute_us']:>10.1f}"
                  f"{r['torch_unpermute_us']:>10.1f}")


if __name__ == "__main__":
    main()
