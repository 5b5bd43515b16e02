"""Benchmark + check the NCCL-EP / NIXL-EP wrappers against the raw library calls, on a GPU.

For every layout a transport offers: (1) correctness -- combine(toy_compute(dispatch(x))) against the toy
reference, and, when the portable transport exists (``make_transport("torch", config, group)``), the valid
rows of both DispatchResults compared bit for bit (as multisets: slot order is the library's business) and
both combine outputs; (2) device time of dispatch+combine per step, wrapper vs the raw library calls on the
same group/handle/buffers (CUDA events), and (3) host time per step (enqueue, no sync): the wrapper's,
the raw calls', and the wrapper's own (library calls replaced by a stand-in that does nothing). Short table last.

From the repository root (or with moe-ep installed, without ``PYTHONPATH``):

World size 1:  PYTHONPATH=$PWD python3 benchmarks/bench_transports.py --out out.json
World size R:  PYTHONPATH=$PWD torchrun --nproc-per-node R benchmarks/bench_transports.py --out out.json
Goal: the wrapper adds next to nothing to the raw calls, in device and in host time (the targets and the
measured numbers: docs/PERF.md).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

from moe_ep.commands.timing import time_loop
from moe_ep.config import SUPPORTED_LAYOUTS, EpConfig, Format
from moe_ep.layout_contract import (HighThroughputExpertMajor, HighThroughputFlat, LowLatencyExpertMajor,
                                    LowLatencyRankMajor)
from moe_ep.testing.toy_transport import toy_compute, toy_reference
from moe_ep.transports.discovery import available_transports

LAYOUTS = {"nccl_ep": [(a.value, lay.value) for a, lay in SUPPORTED_LAYOUTS], "nixl_ep": [("ll", "expert_major")]}


def make(name, config, group):
    if name == "nccl_ep":
        from moe_ep.transports.nccl_ep import NcclEpTransport
        return NcclEpTransport(config, group)
    if name == "nixl_ep":
        from moe_ep.transports.nixl_ep import NixlEpTransport
        return NixlEpTransport(config, group)
    from moe_ep.transports import make_transport   # the portable one, from the layer branch
    return make_transport(name, config, group)


def raw_step(t):
    """The same library calls the wrapper makes, on the wrapper's group/handle/descriptors, built beforehand,
    from the same user inputs (int64 ids: NIXL-EP takes only its int32 ``topk_idx_t``, so the raw caller
    converts them too, as the wrapper does)."""
    if t.name == "nixl_ep":
        B, _idx, w, handle, _out = t._last
        buf, x, ids = t.buffer, t._x, t._idx_in
        T, E = t.config.max_tokens_per_rank, t.config.num_experts
        y, out = t._y, t.out[:B]
        idx_t = t.nixl.topk_idx_t

        def step():
            idx = ids if ids.dtype == idx_t else ids.to(idx_t)
            _, _, h, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=t.fp8, round_scale=False,
                                                     use_ue8m0=False)
            buf.low_latency_combine(y, idx, w, h, out=out)
        return step
    h = t.handle
    (idx_d, inp, cout, _out), = [v for k, v in t._plans.items() if len(k) == 9]   # the wrapper's own
    (cin,) = [v for k, v in t._plans.items() if len(k) == 3]
    _cout, _o, s = t._last

    def step():
        h.update(idx_d, layout_info=t.handle_info, stream=s)
        h.dispatch(inp, t.dispatch_out, layout_info=t.dispatch_info, config=t.dispatch_cfg, stream=s)
        h.combine(cin, cout, stream=s)
    return step


class Replay:
    """Stands in for the library object (NIXL buffer / NCCL-EP handle): every call does nothing and returns
    what the real one returned, so timing the wrapper over it gives the host time of our code alone."""

    def __init__(self, returns: dict):
        self.returns = returns

    def __getattr__(self, name):
        return lambda *a, **k: self.returns.get(name)


def own_host_us(t, wrapper, iters):
    """Host us per step spent in the wrapper itself (library calls replaced by :class:`Replay`)."""
    attr = "buffer" if t.name == "nixl_ep" else "handle"
    real = getattr(t, attr)
    if t.name == "nixl_ep":
        B, _idx, _w, handle, _out = t._last
        res = t.dispatch(t._x, t._idx_in, t._w_in)
        tok = (res.tokens.data, res.tokens.scales) if t.fp8 else res.tokens  # what the library hands back
        returns = {"low_latency_dispatch": (tok, res.expert_counts, handle, None, None),
                   "low_latency_combine": (t.out[:B], None, None)}
    else:
        returns = {}
    setattr(t, attr, Replay(returns))
    try:
        return time_loop(wrapper, iters=iters, warmup=3).host * 1e6
    finally:
        setattr(t, attr, real)


def picked(w, ids):
    """Weights of the picks that are here; a pick that is not (-1) carries none, and transports may zero it."""
    return torch.where(ids >= 0, w.float(), 0.0)


def by_id(ids, w):
    """A row's (id, weight) pairs sorted by id: the picks as a set, whatever order a transport keeps them in."""
    order = ids.argsort(dim=-1, stable=True)
    return ids.gather(-1, order), w.gather(-1, order)


def valid_rows(res, any_pick_order=False):
    """{key: sorted list of row bytes} for the rows the layout says are valid (tokens + ids + weights);
    ``any_pick_order``: a row's picks compared as a set."""
    def picks(ids, w):
        w = picked(w, ids)
        return by_id(ids.int(), w) if any_pick_order else (ids.int(), w)

    def rb(*ts, ids=None):   # rows whose picks are all -1 carry no work: transports may or may not send them
        keep = range(ts[0].shape[0]) if ids is None else (ids >= 0).any(-1).nonzero().flatten().tolist()
        return [b"".join(t[i].contiguous().view(torch.uint8).cpu().numpy().tobytes() for t in ts) for i in keep]
    out = {}
    tok = res.tokens
    if hasattr(tok, "global_scale"):   # NVFP4: a row is its codes | e4m3 scales | fp32 global scale
        tok = torch.cat([tok.data, tok.scales.view(torch.uint8),
                         tok.global_scale.float().unsqueeze(-1).contiguous().view(torch.uint8)], -1)
    elif hasattr(tok, "scales"):   # FP8: a row is its e4m3 codes | fp32 scales per 128 columns
        tok = torch.cat([tok.data.view(torch.uint8), tok.scales.contiguous().view(torch.uint8)], -1)
    if isinstance(res, LowLatencyExpertMajor):
        for e, n in enumerate(res.expert_counts.tolist()):
            out[e] = sorted(rb(tok[e, :n]))
    elif isinstance(res, LowLatencyRankMajor):
        for r, n in enumerate(res.src_rank_counts.tolist()):
            ids = res.topk_idx[r, :n]
            out[r] = sorted(rb(tok[r, :n], *picks(ids, res.topk_weights[r, :n]), ids=ids))
    elif isinstance(res, HighThroughputFlat):
        n = int(res.num_recv)
        ids = res.topk_idx[:n]
        out[0] = sorted(rb(tok[:n], *picks(ids, res.topk_weights[:n]), ids=ids))
    else:
        assert isinstance(res, HighThroughputExpertMajor), type(res)
        for e, (o, n) in enumerate(zip(res.expert_offsets.tolist(), res.expert_counts.tolist())):
            out[e] = sorted(rb(tok[o:o + n], res.topk_weights[o:o + n].view(-1, 1)))
    return out


def run_case(name, alg, lay, args, rank, world, dev):
    act = Format.NVFP4 if args.nvfp4 else Format.FP8 if args.fp8 else Format.BF16
    c = EpConfig(num_experts=args.experts, top_k=args.topk, hidden_size=args.hidden, intermediate_size=256,
                 max_tokens_per_rank=args.tokens, algorithm=alg, layout=lay, activation_format=act,
                 weight_format=Format.FP8 if args.fp8 else Format.BF16)  # FP8 activations go with FP8 weights
    g = torch.Generator(device=dev).manual_seed(1000 + rank)
    B = args.tokens
    x = torch.randn(B, args.hidden, device=dev, generator=g).to(torch.bfloat16)
    idx = torch.rand(B, args.experts, device=dev, generator=g).topk(args.topk, -1).indices
    idx[torch.rand(B, args.topk, device=dev, generator=g) < 0.05] = -1
    w = torch.rand(B, args.topk, device=dev, generator=g)
    row = {"transport": name, "algorithm": alg, "layout": lay, "world": world, "activations": act.value}
    t = make(name, c, None)
    try:
        res = t.dispatch(x, idx, w)
        if act is not Format.BF16:   # no toy compute on quantized rows: the dispatch rows are compared, combine timed
            y = torch.zeros(*res.tokens.shape, dtype=torch.bfloat16, device=dev)
            out = t.combine(y).clone()
            row["ok_vs_toy"] = None
        else:
            y = toy_compute(res, c, rank, world)
            out = t.combine(y).clone()
            torch.cuda.synchronize()
            ref = toy_reference(x, idx, w)
            row["max_abs_err_vs_toy"] = (out.float() - ref).abs().max().item()
            row["ok_vs_toy"] = bool(torch.allclose(out.float(), ref, rtol=2e-2, atol=2e-2))
        mine = valid_rows(res)   # read before the portable transport runs (buffers are reused)
        mine_set = valid_rows(res, any_pick_order=True)
        try:
            pt = make("torch", c, None)
            pres = pt.dispatch(x, idx, w)
            row["dispatch_bitexact_vs_torch"] = mine == valid_rows(pres)
            row["dispatch_equal_up_to_pick_order"] = mine_set == valid_rows(pres, any_pick_order=True)
            if act is Format.BF16:
                pout = pt.combine(toy_compute(pres, c, rank, world))
                row["combine_bitexact_vs_torch"] = bool(torch.equal(out, pout))
            pt.close()
        except ImportError as e:
            row["vs_torch"] = f"skipped ({e})"
        t._x, t._y, t._idx_in, t._w_in = x, y, idx, w

        def wrapper():
            t.dispatch(x, idx, w)
            t.combine(y)
        steps = dict(iters=args.iters, warmup=args.warmup, barrier=True)  # every rank starts the timed steps together
        tw = time_loop(wrapper, **steps)
        # raw_step reuses the state of the last wrapper step (same group, handle and buffers)
        tr = time_loop(raw_step(t), **steps)
        row["wrapper_us"], row["wrapper_host_us"], row["raw_us"], row["raw_host_us"] = (
            tw.device * 1e6, tw.host * 1e6, tr.device * 1e6, tr.host * 1e6)
        row["overhead_pct"] = 100 * (row["wrapper_us"] / row["raw_us"] - 1)
        row["host_overhead_us"] = row["wrapper_host_us"] - row["raw_host_us"]
        row["own_host_us"] = own_host_us(t, wrapper, args.iters)
        torch.cuda.synchronize()
    except Exception as e:  # report and go on with the other layouts
        row["error"] = f"{type(e).__name__}: {e}"
    finally:
        t.close()
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--transports", default="nccl_ep,nixl_ep")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--nvfp4", action="store_true", help="NVFP4 activations (NCCL-EP only)")
    fmt.add_argument("--fp8", action="store_true", help="FP8 activations (and weights), DeepSeek-V3's block scales; "
                     "LL rows are the library's own cast, so they match the portable transport's only in HT")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if "WORLD_SIZE" in os.environ:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl")
    else:
        torch.cuda.set_device(0)
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29533", rank=0, world_size=1)
    rank, world, dev = dist.get_rank(), dist.get_world_size(), torch.device("cuda", torch.cuda.current_device())
    info = {t.name: t for t in available_transports()}
    rows = []
    names = [n for n in args.transports.split(",") if not (args.nvfp4 and n == "nixl_ep")]
    for name in names:
        if not info[name].available:
            rows.append({"transport": name, "error": f"unavailable: {info[name].reason}"})
            continue
        for alg, lay in LAYOUTS[name]:
            rows.append(run_case(name, alg, lay, args, rank, world, dev))
            if rank == 0:
                print(json.dumps(rows[-1]), flush=True)
    if rank == 0:
        print(f"\nworld {world}, T={args.tokens} H={args.hidden} E={args.experts} K={args.topk}")
        print(f"{'transport':9} {'layout':16} {'ok':4} {'wrap us':>8} {'raw us':>8} {'ovh %':>6} {'host us':>8} "
              f"{'host ovh':>8} {'own host':>8}")
        for r in rows:
            if "error" in r:
                print(f"{r['transport']:9} {r.get('algorithm', '')}-{r.get('layout', '')}: {r['error'][:150]}")
                continue
            ok = {True: "yes", False: "NO", None: "-"}[r["ok_vs_toy"]] if r.get("dispatch_bitexact_vs_torch", True) \
                else "DIFF"
            print(f"{r['transport']:9} {r['algorithm'] + '-' + r['layout']:16} {ok:4} "
                  f"{r['wrapper_us']:8.1f} {r['raw_us']:8.1f} {r['overhead_pct']:6.1f} {r['wrapper_host_us']:8.1f} "
                  f"{r['host_overhead_us']:8.1f} {r['own_host_us']:8.1f}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"args": vars(args), "world": world, "rows": rows}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
