"""``moe-ep bench``: our kernels and the layer vs their peers, measured side by side, against the floors.

For each preset and tokens-per-rank T, one rank's work under uniform routing is ``S = T * top_k`` expert
slots spread over its ``L`` local experts. Every row holds our time, the peer's time measured in the same
run, the byte and FLOP floors (``max(bytes / bandwidth, flops / peak)``, H200 ceilings by default) and the
fraction of the floor each achieves, plus the relative difference between our output and the peer's.
Kernel rows time both sides replayed from a CUDA graph where both capture (``timing`` = graph: GPU time, no
launch overhead), else eagerly; layer rows time the eager forward a user calls (host included).

Rows (``--kernels``):

* ``mlp`` — ``expert_mlp`` bf16, ragged ``[S, H]``; peer ``torch._grouped_mm`` (GEMM1, silu*mul, GEMM2 with
  ``offs``), or the torch reference where ``_grouped_mm`` cannot run (the row says so).
* ``mlp-nvfp4`` — the same with NVFP4 weights (3.5x fewer weight bytes); same bf16 peer.
* ``mlp-fp8`` — the same with FP8 weights (DeepSeek-V3's 128x128 blocks; the bf16 tokens quantized to FP8 per token
  inside, W8A8); same bf16 peer; the FLOP floor at ``--peak-flops-fp8``.
* ``quant`` — ``quantize_nvfp4`` of ``[S, H]``; peer the torch reference.
* ``bridge`` — route + permute + weighted unpermute-reduce of ``[T, K]`` picks; peer torch (argsort, index_add).
* ``layer`` — ``MoEEpLayer`` forward per ``--layouts``, in ``--weight-format`` / ``--activation-format`` (bf16
  by default; the floor counts the weights' bytes in their format); the layer is built with L local experts per rank and
  ``L * world`` experts in all, so each rank's expert load at T tokens matches the full deployment's.
  Peer: a torch MoE (argsort, ``_grouped_mm``, index_add) over this rank's experts (no communication); ``diff``:
  against the dense fp32 MoE over all experts (each rank rebuilds any expert's weights from the seed).

Under torchrun each rank benches its own shard; rank 0 gathers the rows and writes ``bench.json`` and
``bench.png`` (time and % of floor vs tokens) into ``--out``.
"""

from __future__ import annotations

import os
import time

import torch

from ..config import SUPPORTED_LAYOUTS
from ..errors import MoEEpInputError
from ..triton_runtime import INTERPRETER, device
from .bench_rows import rel_err
from .common import (PRESETS, add_format_arguments, add_shape_arguments, check_layer_shape, dist_setup, dist_teardown,
                     int_list, name_list, preset_from_args, print_table, progress, versions, write_json)
from .timing import time_call, time_loop, time_pair

KERNELS = ("mlp", "mlp-nvfp4", "mlp-fp8", "quant", "bridge", "layer")
LAYOUTS = tuple(f"{a.value}-{lay.value}" for a, lay in SUPPORTED_LAYOUTS)


def add_arguments(parser) -> None:
    add_shape_arguments(parser)
    add_format_arguments(parser)   # the layer rows' formats
    parser.add_argument("--presets", default=None, help="comma-separated presets (default: --preset)")
    parser.add_argument("--tokens", default=None,
                        help="tokens per rank to sweep (default 1,8,64,512,4096 on a GPU, 2 on the CPU)")
    parser.add_argument("--kernels", default="all", help=f"'all' or a subset of {','.join(KERNELS)}")
    parser.add_argument("--layouts", default="ll-expert_major,ht-flat", help=f"layer layouts: {','.join(LAYOUTS)}")
    parser.add_argument("--bandwidth", type=float, default=4.8e12, help="byte ceiling, B/s (H200: 4.8e12)")
    parser.add_argument("--peak-flops", type=float, default=795e12, help="FLOP ceiling, FLOP/s (H200 bf16: 795e12)")
    parser.add_argument("--peak-flops-fp8", type=float, default=1979e12,
                        help="FLOP ceiling of the FP8 rows, FLOP/s (H200 dense FP8: 1979e12)")
    parser.add_argument("--rep-ms", type=float, default=100.0, help="measuring time per timed function (GPU)")
    parser.add_argument("--out", default="moe-ep-bench", help="output folder for bench.json and bench.png")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights, activations and routing (default 0)")


# --- peers -------------------------------------------------------------------------------------------------


def grouped_mm_peer(dev) -> tuple[object | None, str]:
    """``torch._grouped_mm`` if it runs here (tried on a tiny problem), else (None, why not)."""
    fn = getattr(torch, "_grouped_mm", None)
    if fn is None:
        return None, "torch._grouped_mm does not exist in this torch"
    try:
        a = torch.zeros(32, 32, dtype=torch.bfloat16, device=dev)
        b = torch.zeros(2, 32, 32, dtype=torch.bfloat16, device=dev).transpose(1, 2)
        fn(a, b, offs=torch.tensor([16, 32], dtype=torch.int32, device=dev))
    except Exception as e:  # noqa: BLE001  (any failure means: no such peer here)
        return None, f"torch._grouped_mm fails here ({type(e).__name__}: {str(e).splitlines()[0][:80]})"
    return fn, "torch._grouped_mm"


def torch_mlp(gmm, x, w13, w2, offsets):
    """Peer expert MLP: bf16 ``_grouped_mm`` GEMM1, silu*mul, GEMM2; or the fp32 reference without gmm."""
    if gmm is None:
        from ..reference import expert_mlp_ref
        return expert_mlp_ref(x, w13, w2, offsets=offsets)
    ends = offsets[1:].to(torch.int32)
    h = gmm(x, w13.transpose(1, 2), offs=ends)
    n = h.shape[-1] // 2
    h = torch.nn.functional.silu(h[:, :n]) * h[:, n:]
    return gmm(h, w2.transpose(1, 2), offs=ends)


def torch_bridge(x, idx, wts, L):
    """Peer bridge: argsort picks by expert, gather rows, (identity expert), weighted index_add back."""
    flat = idx.reshape(-1)
    order = torch.argsort(torch.where(flat >= 0, flat, L), stable=True)
    torch.bincount(flat[flat >= 0], minlength=L)  # the histogram (offsets) the kernels also produce
    rows = order // idx.shape[1]
    xs = x[rows]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    out.index_add_(0, rows, xs.float() * wts.reshape(-1)[order, None].float())
    return out


def torch_moe(gmm, x, idx, wts, w13, w2):
    """Peer MoE over the experts of ``w13``/``w2`` (ids outside them skipped): sort, MLP, index_add."""
    L, K = w13.shape[0], idx.shape[1]
    flat = idx.reshape(-1)
    ok = (flat >= 0) & (flat < L)
    key = torch.where(ok, flat, L)
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=L + 1)[:L]
    offsets = torch.zeros(L + 1, dtype=torch.int32, device=x.device)
    offsets[1:] = counts.cumsum(0)
    rows = order // K
    y = torch_mlp(gmm, x[rows], w13, w2, offsets)
    scale = torch.where(ok[order], wts.reshape(-1)[order].float(), 0.0)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    out.index_add_(0, rows, y.float() * scale[:, None])
    return out


def untuned_shapes(presets, kernels: list[str], layer_format: str = "bf16") -> list[str]:
    """The tuned-file keys (``moe-ep tune``'s shapes) of the expert-MLP GEMMs these presets' rows launch that no
    tuned file holds for this device: each one autotunes on its first call, which makes a first bench take minutes."""
    from ..kernels.grouped_gemm import tuned_files
    from .tune import shape_key, shapes
    formats = [f for k, f in (("mlp", "bf16"), ("layer", layer_format), ("mlp-nvfp4", "nvfp4"), ("mlp-fp8", "fp8"))
               if k in kernels]
    missing = []
    for p in presets:
        for s in shapes(p, ("gemm1", "gemm2"), dict.fromkeys(formats), (1,)):
            if tuned_files.tuned_gemm_config(s["N"], s["K"], 1, s["w_fp4"], s["swiglu"], fp8=s["fp8"],
                                             fp8_out=s["fp8"] and s["swiglu"]) is None:
                missing.append(f"{p.name}: {shape_key(s)}")
    return list(dict.fromkeys(missing))


# --- one row -----------------------------------------------------------------------------------------------


def _routing(T, K, E, gen, dev):
    idx = torch.rand(T, E, generator=gen).topk(K, dim=1).indices
    wts = torch.rand(T, K, generator=gen)
    return idx.to(dev), (wts / wts.sum(1, keepdim=True)).to(dev)


def _weight_bytes(counts, H, I, fp4: bool, fp8: bool = False) -> float:
    per_elem = 0.5 + 1 / 16 if fp4 else 1 + 4 / 128 ** 2 if fp8 else 2.0
    return int((counts > 0).sum()) * 3 * H * I * per_elem


class Bench:
    """Tensors of one preset, reused over the token sweep."""

    def __init__(self, p, world: int, args, dev):
        from ..kernels.nvfp4 import nvfp4_global_scale, quantize_nvfp4
        self.p, self.world, self.args, self.dev = p, world, args, dev
        self.gen = torch.Generator().manual_seed(args.seed)  # routing (small, on the CPU)
        self.dgen = torch.Generator(device=dev).manual_seed(args.seed)  # activations (large, on the device)
        L = p.local_experts
        import torch.distributed as dist
        self.rank = dist.get_rank() if world > 1 and dist.is_initialized() else 0
        local = [self.expert(e) for e in range(self.rank * L, (self.rank + 1) * L)]
        self.w13 = torch.stack([w13 for w13, _ in local])
        self.w2 = torch.stack([w2 for _, w2 in local])
        del local
        self.q13 = self.q2 = None
        if "mlp-nvfp4" in args.kernel_list:
            self.q13 = quantize_nvfp4(self.w13, nvfp4_global_scale(self.w13, per_slice=True))
            self.q2 = quantize_nvfp4(self.w2, nvfp4_global_scale(self.w2, per_slice=True))
        self.f13 = self.f2 = None
        if "mlp-fp8" in args.kernel_list:
            from ..kernels.fp8 import FP8_BLOCK, quantize_fp8
            self.f13 = quantize_fp8(self.w13, FP8_BLOCK, gate_up=True)
            self.f2 = quantize_fp8(self.w2, FP8_BLOCK)
        self.gmm, self.gmm_note = grouped_mm_peer(dev)

    def expert(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Global expert ``e``'s bf16 ``(w13 [2I, H], w2 [H, I])``, the same on every rank (seeded by ``e``): each
        rank holds its own experts and can rebuild any other's for the dense reference."""
        H, I = self.p.hidden, self.p.intermediate
        gen = torch.Generator(device=self.dev).manual_seed(self.args.seed * 1_000_003 + e)
        w13 = torch.randn(2 * I, H, generator=gen, device=self.dev) * H ** -0.5
        w2 = torch.randn(H, I, generator=gen, device=self.dev) * I ** -0.5
        return w13.to(torch.bfloat16), w2.to(torch.bfloat16)

    def dense_reference(self, x, idx, wts) -> torch.Tensor:
        """The full MoE of this rank's tokens over all ``L * world`` experts, fp32 (:func:`moe_ep.reference.
        moe_reference`, one expert's weights at a time: the whole model need not fit beside the layer)."""
        from ..reference import moe_reference
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in torch.unique(idx[idx >= 0]).tolist():
            w13, w2 = self.expert(e)
            out += moe_reference(x, torch.where(idx == e, 0, -1), wts, w13[None], w2[None])
        return out

    def randn(self, *shape):
        return torch.randn(*shape, generator=self.dgen, device=self.dev).to(torch.bfloat16)

    def slots(self, T):
        """Ragged ``[S, H]`` rows (S = T*K) with uniform-routing offsets over the L local experts."""
        p, S = self.p, T * self.p.top_k
        ids = torch.randint(0, p.local_experts, (S,), generator=self.gen)
        counts = torch.bincount(ids, minlength=p.local_experts)
        offsets = torch.zeros(p.local_experts + 1, dtype=torch.int32)
        offsets[1:] = counts.cumsum(0)
        x = self.randn(S, p.hidden)
        return x, counts, offsets.to(self.dev)

    def row(self, kernel: str, T: int, layout: str | None = None) -> dict:
        p, args = self.p, self.args
        H, I, K, L = p.hidden, p.intermediate, p.top_k, p.local_experts
        S = T * K
        from ..kernels import bridge, nvfp4
        note = ""
        peak = args.peak_flops
        if kernel in ("mlp", "mlp-nvfp4", "mlp-fp8"):
            from ..kernels.grouped_gemm import expert_mlp
            x, counts, offsets = self.slots(T)
            fp4, fp8 = kernel == "mlp-nvfp4", kernel == "mlp-fp8"
            w13, w2 = (self.q13, self.q2) if fp4 else (self.f13, self.f2) if fp8 else (self.w13, self.w2)
            ours = lambda: expert_mlp(x, w13, w2, offsets=offsets)  # noqa: E731
            peer = lambda: torch_mlp(self.gmm, x, self.w13, self.w2, offsets)  # noqa: E731
            peer_name = self.gmm_note if self.gmm is not None else f"torch reference ({self.gmm_note})"
            nbytes = _weight_bytes(counts, H, I, fp4, fp8) + 2 * S * H * 2
            flops = 6.0 * S * H * I
            if fp4:
                note = "NVFP4 weights vs the bf16 peer (same function up to quantization)"
            if fp8:
                note = "FP8 weights and tokens (W8A8) vs the bf16 peer (same function up to quantization)"
                peak = args.peak_flops_fp8
        elif kernel == "quant":
            x, _, _ = self.slots(T)
            gs = nvfp4.nvfp4_global_scale(x)
            from ..reference import quantize_nvfp4_ref
            ours = lambda: nvfp4.quantize_nvfp4(x, gs, check_finite=False)  # noqa: E731
            peer = lambda: quantize_nvfp4_ref(x, gs)  # noqa: E731
            peer_name = "torch reference (quantize_nvfp4_ref)"
            nbytes, flops = S * H * (2 + 0.5 + 1 / 16), 0.0
        elif kernel == "bridge":
            x = self.randn(T, H)
            idx, wts = _routing(T, K, L, self.gen, self.dev)

            def ours():
                r = bridge.route_experts(idx, L)
                return bridge.unpermute_reduce(bridge.permute_rows(x, r), r, wts)
            peer = lambda: torch_bridge(x, idx, wts, L)  # noqa: E731
            peer_name = "torch (argsort, gather, index_add)"
            nbytes, flops = 3 * S * H * 2 + T * H * 2 + S * 4 * 8, 2.0 * S * H
        elif kernel == "layer":
            from ..config import EpConfig
            from ..layer import MoEEpLayer
            from ..weights import ExpertWeights
            alg, lay = layout.split("-")
            E = L * self.world
            wf, af = self.args.weight_format, self.args.activation_format
            cfg = EpConfig(E, K, H, I, max(T, 1), algorithm=alg, layout=lay, weight_format=wf, activation_format=af)
            layer = MoEEpLayer(cfg, ExpertWeights(self.w13, self.w2, wf))
            x = self.randn(T, H)
            idx, wts = _routing(T, K, E, self.gen, self.dev)
            ours = lambda: layer(x, idx, wts, validate=False)  # noqa: E731
            # diff: against the dense MoE over all experts (the layer's answer); the timed peer runs this rank's
            # experts on this rank's tokens (ids of other ranks skipped): the compute a rank does, no communication
            reference = self.dense_reference(x, idx, wts)
            local = idx - layer.rank * L
            peer = lambda: torch_moe(self.gmm, x, local, wts, self.w13, self.w2)  # noqa: E731
            peer_name = "torch MoE (argsort, " + ("_grouped_mm" if self.gmm is not None else "reference MLP") + \
                ", index_add)" + (", compute only, no communication" if self.world > 1 else "")
            counts = torch.bincount(idx.reshape(-1).cpu(), minlength=E)[layer.rank * L:(layer.rank + 1) * L]
            nbytes = _weight_bytes(counts, H, I, wf == "nvfp4", wf == "fp8") + 2 * T * H * 2
            flops = 6.0 * int(counts.sum()) * H * I
            kernel = f"layer[{layout}]"
        else:  # guarded by name_list; kept for direct callers
            raise MoEEpInputError(f"kernel = {kernel!r}; allowed: {', '.join(KERNELS)}")
        t0 = time.perf_counter()
        out = ours()
        t_first = time.perf_counter() - t0
        try:
            ref = peer()
        except Exception as e:  # noqa: BLE001  (a peer that cannot run this shape: the reference, said so)
            if not kernel.startswith(("mlp", "layer")):
                raise
            peer_name = f"torch reference (the peer failed here: {type(e).__name__}: {str(e).splitlines()[0][:80]})"
            peer = (lambda fn: lambda: _without_gmm(self, fn))(peer)
            ref = peer()
        if kernel == "quant":  # bit-exact kernel: the fraction of codes that differ (0 expected)
            diff = float((out.data != ref[0]).float().mean().item()) if out.data.numel() else 0.0
            diff_kind = "fraction of codes differing"
        elif kernel.startswith("layer"):
            diff, diff_kind = rel_err(out, reference), "rel err vs the dense fp32 MoE over all experts"
        else:
            diff, diff_kind = rel_err(out, ref), "rel err vs peer"
        # through the interpreter every call costs seconds: the checked call is the timed one
        timing = "eager"
        if INTERPRETER:
            t_ours, t_peer = t_first, time_call(peer, rep_ms=args.rep_ms)
        elif kernel.startswith("layer"):  # what a user's eager forward costs (host included)
            # under torchrun: a collective, so the same call count on every rank
            t_ours = time_loop(ours, warmup=3).device if self.world > 1 else time_call(ours, rep_ms=args.rep_ms)
            t_peer = time_call(peer, rep_ms=args.rep_ms)
        else:  # kernels: their GPU time, replayed from a CUDA graph (small rows would time the host otherwise)
            t_ours, t_peer, timing = time_pair(ours, peer, rep_ms=args.rep_ms)
        floor = max(nbytes / args.bandwidth, flops / peak)
        return dict(preset=p.name, kernel=kernel, tokens=T, slots=S, ours_us=t_ours * 1e6, peer_us=t_peer * 1e6,
                    peer=peer_name, speedup=t_peer / t_ours if t_ours else None, bytes=nbytes, flops=flops,
                    floor_us=floor * 1e6, pct_floor=100 * floor / t_ours if t_ours else None,
                    peer_pct_floor=100 * floor / t_peer if t_peer else None,
                    diff=diff, diff_kind=diff_kind,
                    note=note, timing=timing, rank=int(os.environ.get("RANK", "0")))


def _without_gmm(bench, fn):
    """Run a peer with the reference MLP instead of ``_grouped_mm``."""
    gmm, bench.gmm = bench.gmm, None
    try:
        return fn()
    finally:
        bench.gmm = gmm


# --- output ------------------------------------------------------------------------------------------------


def plot(rows: list[dict], path: str) -> str | None:
    """Time and % of floor vs tokens, one row of panels per preset; None (and a note) without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'moe-ep[bench]')")
        return None
    presets = list(dict.fromkeys(r["preset"] for r in rows))
    fig, axes = plt.subplots(len(presets), 2, figsize=(12, 4 * len(presets)), squeeze=False)
    for (ax_t, ax_p), preset in zip(axes, presets):
        mine = [r for r in rows if r["preset"] == preset and r["rank"] == 0]
        for i, k in enumerate(dict.fromkeys(r["kernel"] for r in mine)):
            rs = sorted((r for r in mine if r["kernel"] == k), key=lambda r: r["tokens"])
            t = [r["tokens"] for r in rs]
            c = f"C{i}"
            ax_t.plot(t, [r["ours_us"] for r in rs], "o-", color=c, label=f"{k}")
            ax_t.plot(t, [r["peer_us"] for r in rs], "x--", color=c, label=f"{k} peer")
            ax_p.plot(t, [r["pct_floor"] for r in rs], "o-", color=c, label=f"{k}")
            ax_p.plot(t, [r["peer_pct_floor"] for r in rs], "x--", color=c, label=f"{k} peer")
        for ax, what in ((ax_t, "time per call (us)"), (ax_p, "% of floor achieved")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("tokens per rank")
            ax.set_ylabel(what)
            ax.set_title(f"{preset}: {what}")
            ax.grid(True, which="both", alpha=0.3)
        ax_t.set_yscale("log")
        ax_t.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run(args) -> int:
    names = name_list(args.presets or args.preset, "--presets", PRESETS)
    args.kernel_list = name_list(args.kernels, "--kernels", KERNELS)
    layouts = name_list(args.layouts, "--layouts", LAYOUTS)
    tokens = int_list(args.tokens or ("2" if INTERPRETER else "1,8,64,512,4096"), "--tokens")
    presets = [preset_from_args(args, n) for n in names]
    rank, world = dist_setup()
    for p in presets:
        if p.experts % p.ep and not args.experts:
            raise MoEEpInputError(f"preset {p.name}: experts {p.experts} not divisible by ep {p.ep}")
        if "layer" in args.kernel_list:  # the layer rows' formats against EpConfig's rules, before any work
            check_layer_shape(p, max(tokens), 1, args.weight_format, args.activation_format)
    dev = device()
    missing = [] if INTERPRETER or rank != 0 else untuned_shapes(presets, args.kernel_list, args.weight_format)
    if missing:
        print(f"{len(missing)} GEMM shapes have no tuned configs for this device ({', '.join(missing)}): each "
              "autotunes on its first call, so this run takes minutes longer; `moe-ep tune --presets "
              f"{','.join(p.name for p in presets)} --formats bf16,nvfp4,fp8` writes them once", flush=True)
    jobs = [(k, lay) for k in args.kernel_list for lay in (layouts if k == "layer" else [None])]
    rows = []
    try:
        with progress("bench", len(presets) * len(tokens) * len(jobs), enabled=rank == 0) as advance:
            for p in presets:
                b = Bench(p, world, args, dev)
                for T in tokens:
                    for k, lay in jobs:
                        rows.append(b.row(k, T, lay))
                        advance(f"{p.name} T={T} {k}{'[' + lay + ']' if lay else ''}")
                del b
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
        if world > 1:
            import torch.distributed as dist
            gathered = [None] * world
            dist.all_gather_object(gathered, rows)
            rows = [r for rs in gathered for r in rs]
    finally:
        dist_teardown()
    if rank != 0:
        return 0
    os.makedirs(args.out, exist_ok=True)
    result = dict(versions=versions(), world_size=world, presets=[p.as_dict() for p in presets],
                  ceilings=dict(bandwidth=args.bandwidth, peak_flops=args.peak_flops,
                                peak_flops_fp8=args.peak_flops_fp8), rows=rows)
    write_json(os.path.join(args.out, "bench.json"), result)
    png = plot(rows, os.path.join(args.out, "bench.png"))
    legend: dict = {}
    fmt = lambda v, f="{:.1f}": "-" if v is None else f.format(v)  # noqa: E731
    print_table(f"moe-ep bench ({result['versions']['device']}, world size {world}; floor = max(bytes / "
                f"{args.bandwidth:.3g} B/s, flops / {args.peak_flops:.3g} FLOP/s; FP8 rows {args.peak_flops_fp8:.3g}))",
                ["preset", "kernel", "T", "timing", "ours us", "peer us", "x peer", "floor us", "% floor",
                 "peer % floor", "diff", "peer (see legend)"],
                [[r["preset"], r["kernel"], r["tokens"], r["timing"], fmt(r["ours_us"]), fmt(r["peer_us"]),
                  fmt(r["speedup"], "{:.2f}"),
                  fmt(r["floor_us"], "{:.2f}"), fmt(r["pct_floor"]), fmt(r["peer_pct_floor"]),
                  fmt(r["diff"], "{:.2e}"), legend.setdefault(r["peer"], f"P{len(legend)}")]
                 for r in rows if r["rank"] == 0])
    for peer_name, tag in legend.items():
        print(f"  {tag}: {peer_name}")
    if INTERPRETER:
        print("(Triton interpreter: times are Python time, not kernel speed)")
    print(f"wrote {os.path.join(args.out, 'bench.json')}" + (f" and {png}" if png else ""))
    return 0
