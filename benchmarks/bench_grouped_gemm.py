"""Time moe-ep's expert MLP (two grouped GEMMs, SwiGLU fused) against torch._grouped_mm on one GPU.

Each row: a model's local experts at a number of tokens per expert, ragged layout (expert-sorted rows +
offsets). Every expert gets exactly that many rows; rows of up to 128 tokens per expert are also timed with the
same rows spread as routing spreads them ("routed": counts vary around the mean, which is what a model's router
gives, ours and torch's alike), and in the masked layout. Columns: our time with bf16 weights and with NVFP4
weights (for decode rows also with the GEMM1 -> GEMM2 chain off), with NVFP4 x and weights, torch._grouped_mm
(bf16, two GEMMs + silu*mul) in the same process, the time a plain streaming-read kernel takes to read the bf16
weights once (the practical byte ceiling), the byte floor (weight bytes / 4.8 TB/s), the FLOP floor (/ 795
TFLOP/s), and the relative error against the torch peer. ``--weights`` picks the quantized weight formats timed beside
bf16 (default ``nvfp4``; ``fp8``: DeepSeek-V3's block-scaled e4m3, W8A8, timed with bf16 x quantized per token inside
the MLP and with x already FP8 as an FP8 dispatch delivers it, held against its own floors: FP8 weight and scale
bytes / 4.8 TB/s and FLOPs / 1979 TFLOP/s, the H200's dense FP8 peak).
Autotunes first (printing the winning configs); ``--write-configs DIR`` saves the winners as a tuned-config
file (``DIR/<device>.json``) that later runs load via ``MOE_EP_CONFIG_DIR``.

From the repository root (or with moe-ep installed, without ``PYTHONPATH``):

    PYTHONPATH=$PWD python3 benchmarks/bench_grouped_gemm.py --out results.json [--quick] [--rows-from N] \
        [--gluon-fp8-min-m N|off] [--gluon-fp8-variants GEMM1,GEMM2] [--gluon-nvfp4-min-m N|off] \
        [--gluon-nvfp4-unverified] [--write-configs DIR] [--weights nvfp4,fp8]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch  # noqa: E402

import moe_ep  # noqa: E402,F401  (before triton)
import triton  # noqa: E402
from moe_ep.kernels import expert_mlp, grouped_gemm, nvfp4_global_scale, quantize_nvfp4  # noqa: E402
from moe_ep import device_facts, options  # noqa: E402
from moe_ep.kernels import dequantize_nvfp4  # noqa: E402
from moe_ep.kernels.fp8 import FP8_BLOCK, Fp8Tensor, dequantize_fp8, quantize_fp8  # noqa: E402
from moe_ep.commands.bench_rows import rel_err  # noqa: E402
from moe_ep.kernels.grouped_gemm import config_space, gluon_fp8, gluon_nvfp4_prefill  # noqa: E402
from moe_ep.triton_runtime import triton_minor  # noqa: E402
from moe_ep.commands.common import routed_offsets, uniform_offsets  # noqa: E402
from moe_ep.commands.timing import time_graph, time_read  # noqa: E402


BW = 4.8e12
FLOPS = 795e12
FP8_FLOPS = 1979e12  # H200 dense FP8 tensor-core peak
WEIGHT_FORMATS = ("nvfp4", "fp8")
MODELS = {  # name: (local experts, hidden H, intermediate I, tokens-per-expert rows)
    "DeepSeek-V3 EP8": (32, 7168, 2048, (16, 128, 1024)),
    "Qwen3-30B-A3B": (128, 2048, 768, (8, 64, 512)),
    "Mixtral-8x7B": (8, 4096, 14336, (64, 512)),
}
ROUTED_MAX = 128  # rows with this many tokens per expert or fewer are also timed routed, and masked
QUICK = {"DeepSeek-V3 EP8": (16, 1024), "Qwen3-30B-A3B": (8,), "Mixtral-8x7B": (512,)}


def torch_mlp(x, w13t, w2t, offs_end, inter):
    h = torch._grouped_mm(x, w13t, offs=offs_end)
    a = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
    return torch._grouped_mm(a, w2t, offs=offs_end)


def warm(x, w13, w2, idx, m, table):
    """Autotune both GEMMs (first call) and return their plans (with the configs that won). FP8 weights: x quantized
    per token, GEMM1 with its FP8 output, as the expert MLP runs them."""
    fp8 = isinstance(w13, Fp8Tensor)
    if fp8 and not isinstance(x, Fp8Tensor):
        x = quantize_fp8(x, 1)
    h, plan1 = grouped_gemm(x, w13, swiglu=True, m_hint=m, **idx, return_plan=True, quantize_out=fp8)
    won = [plan1, grouped_gemm(h, w2, m_hint=m, **idx, return_plan=True)[1]]
    n1, k1 = w13.shape[1] // 2, w13.shape[2]
    n2, k2 = w2.shape[1], w2.shape[2]
    fp4 = not isinstance(w13, torch.Tensor) and not fp8
    for (n, k, sw), c in zip(((n1, k1, True), (n2, k2, False)), won):
        if c.config and c.path == "tl" and not any(c.decoded):  # (decoded NVFP4 operands run bf16 tiles)
            cfg = {k_: c.config[k_] for k_ in config_space.CONFIG_KEYS}
            key = config_space.shape_class(n, k, fp4, sw, fp8, fp8 and sw)
            table.setdefault(key, {})[str(config_space.m_bucket(m))] = cfg
    return won


def short(c):
    if not c or not c.config:
        return "-"
    k = c.config
    if c.path != "tl":  # a fast path's named variant, or its token tile
        return f"{c.path}:{k['VARIANT'] if 'VARIANT' in k else 't' + str(k.get('BLOCK_T', '?'))}"
    return (f"{'dec:' if any(c.decoded) else ''}"  # NVFP4 operands decoded to bf16 first
            f"{k['BLOCK_M']}x{k['BLOCK_N']}x{k['BLOCK_K']}{'s' if k['SWAP_AB'] else ''}{'t' if k.get('TMA') else ''}"
            f"/w{k['num_warps']}s{k['num_stages']}")


def run_row(name, E, H, I, tpe, table, formats=("nvfp4",)):
    dev = torch.device("cuda")
    S = E * tpe
    gen = torch.Generator(device=dev).manual_seed(0)
    x = (torch.randn(S, H, device=dev, generator=gen) * 0.5).bfloat16()
    w13 = (torch.randn(E, 2 * I, H, device=dev, generator=gen) * H ** -0.5).bfloat16()
    w2 = (torch.randn(E, H, I, device=dev, generator=gen) * I ** -0.5).bfloat16()
    offs = uniform_offsets(E, tpe, dev)
    counts = torch.full((E,), tpe, device=dev, dtype=torch.int32)
    row = {"model": name, "experts": E, "H": H, "I": I, "tokens_per_expert": tpe}
    elems = E * 3 * H * I
    row["byte_floor_us"] = elems * 2 / BW * 1e6
    row["flop_floor_us"] = 2 * S * 3 * H * I / FLOPS * 1e6

    row["read_weights_us"] = time_read(w13, w2) * 1e6
    w13t, w2t = w13.transpose(1, 2), w2.transpose(1, 2)
    try:
        peer = torch_mlp(x, w13t, w2t, offs[1:], I)
        row["torch_grouped_mm_us"] = time_graph(lambda: torch_mlp(x, w13t, w2t, offs[1:], I)) * 1e6
    except Exception as e:  # noqa: BLE001  (a peer that cannot run is reported, not fatal)
        peer, row["torch_grouped_mm_us"], row["torch_error"] = None, float("nan"), repr(e)[:200]

    t0 = time.time()
    row["configs_bf16"] = [short(c) for c in warm(x, w13, w2, dict(offsets=offs), tpe, table)]
    row["autotune_s"] = time.time() - t0
    ours = expert_mlp(x, w13, w2, offsets=offs)
    row["ours_bf16_us"] = time_graph(lambda: expert_mlp(x, w13, w2, offsets=offs)) * 1e6
    row["rel_err_bf16"] = rel_err(ours, peer) if peer is not None else float("nan")
    if tpe <= config_space.DECODE_MAX_M:  # the same with the GEMM1 -> GEMM2 chain off (one GEMM after the other)
        with options.override(gemm_chain=False):  # the caller's own setting comes back after
            row["ours_bf16_unchained_us"] = time_graph(lambda: expert_mlp(x, w13, w2, offsets=offs)) * 1e6
    routed = routed_offsets(E, tpe, dev) if tpe <= ROUTED_MAX else None
    if routed is not None:
        row["ours_bf16_routed_us"] = time_graph(lambda: expert_mlp(x, w13, w2, offsets=routed)) * 1e6
        row["torch_routed_us"] = time_graph(lambda: torch_mlp(x, w13t, w2t, routed[1:], I)) * 1e6
    if tpe <= ROUTED_MAX:
        xm = x.view(E, tpe, H)
        warm(xm, w13, w2, dict(counts=counts), tpe, table)
        row["ours_bf16_masked_us"] = time_graph(lambda: expert_mlp(xm, w13, w2, counts=counts)) * 1e6
    if "fp8" in formats:
        _fp8_columns(row, x, w13, w2, offs, counts, routed, tpe, table)
    if "nvfp4" not in formats:
        return row
    q13 = quantize_nvfp4(w13, nvfp4_global_scale(w13, per_slice=True))
    q2 = quantize_nvfp4(w2, nvfp4_global_scale(w2, per_slice=True))
    row["byte_floor_nvfp4_us"] = elems * (0.5 + 1 / 16) / BW * 1e6
    plans = warm(x, q13, q2, dict(offsets=offs), tpe, table)
    row["configs_nvfp4"] = [short(c) for c in plans]
    ours4 = expert_mlp(x, q13, q2, offsets=offs)
    row["ours_nvfp4_us"] = time_graph(lambda: expert_mlp(x, q13, q2, offsets=offs)) * 1e6
    if any(p.path != "tl" for p in plans):  # the tl paths beside the fast path, same operands (its peer)
        with options.override(gluon_nvfp4_min_m="off"):
            row["configs_nvfp4_tl"] = [short(c) for c in warm(x, q13, q2, dict(offsets=offs), tpe, table)]
            tl = expert_mlp(x, q13, q2, offsets=offs)
            row["ours_nvfp4_tl_us"] = time_graph(lambda: expert_mlp(x, q13, q2, offsets=offs)) * 1e6
        row["rel_diff_nvfp4_tl"] = rel_err(ours4, tl)
    if routed is not None:
        row["ours_nvfp4_routed_us"] = time_graph(lambda: expert_mlp(x, q13, q2, offsets=routed)) * 1e6
    # NVFP4 x too (one global scale per row, as received tokens carry): decoded to a bf16 copy before GEMM1
    qx = quantize_nvfp4(x, nvfp4_global_scale(x.view(S, 1, H), per_slice=True))
    ours44 = expert_mlp(qx, q13, q2, offsets=offs)
    row["ours_nvfp4_x_us"] = time_graph(lambda: expert_mlp(qx, q13, q2, offsets=offs)) * 1e6
    if tpe <= ROUTED_MAX:
        qxm = quantize_nvfp4(x.view(E, tpe, H))
        row["ours_nvfp4_x_masked_us"] = time_graph(lambda: expert_mlp(qxm, q13, q2, counts=counts)) * 1e6
    d13, d2 = dequantize_nvfp4(q13), dequantize_nvfp4(q2)
    try:
        row["rel_err_nvfp4"] = rel_err(ours4, torch_mlp(x, d13.transpose(1, 2), d2.transpose(1, 2), offs[1:], I))
        row["rel_err_nvfp4_x"] = rel_err(ours44, torch_mlp(dequantize_nvfp4(qx), d13.transpose(1, 2),
                                                           d2.transpose(1, 2), offs[1:], I))
    except Exception:  # noqa: BLE001
        row["rel_err_nvfp4"] = row["rel_err_nvfp4_x"] = float("nan")
    return row


def _fp8_columns(row, x, w13, w2, offs, counts, routed, tpe, table):
    """FP8 weights (per 128x128 block; w13's gate and up blocked apart): the MLP from bf16 x (quantized per token
    inside), from x already FP8, routed and masked; its floors; the error against torch on the dequantized operands
    (torch keeps the intermediate in bf16, ours rounds it to FP8: a few percent apart)."""
    E, H, I = row["experts"], row["H"], row["I"]
    S = x.shape[0]
    q13, q2 = quantize_fp8(w13, FP8_BLOCK, gate_up=True), quantize_fp8(w2, FP8_BLOCK)
    xq = quantize_fp8(x, 1)
    row["byte_floor_fp8_us"] = sum(t.data.numel() + 4 * t.scales.numel() for t in (q13, q2)) / BW * 1e6
    row["flop_floor_fp8_us"] = 2 * S * 3 * H * I / FP8_FLOPS * 1e6
    plans = warm(xq, q13, q2, dict(offsets=offs), tpe, table)
    row["configs_fp8"] = [short(c) for c in plans]
    ours = expert_mlp(x, q13, q2, offsets=offs)
    row["ours_fp8_us"] = time_graph(lambda: expert_mlp(x, q13, q2, offsets=offs)) * 1e6
    row["ours_fp8_x_us"] = time_graph(lambda: expert_mlp(xq, q13, q2, offsets=offs)) * 1e6
    if any(p.path != "tl" for p in plans):  # the tl kernel beside the fast path, same operands (its peer)
        with options.override(gluon_fp8_min_m="off"):
            row["configs_fp8_tl"] = [short(c) for c in warm(xq, q13, q2, dict(offsets=offs), tpe, table)]
            tl = expert_mlp(xq, q13, q2, offsets=offs)
            row["ours_fp8_x_tl_us"] = time_graph(lambda: expert_mlp(xq, q13, q2, offsets=offs)) * 1e6
        row["rel_diff_fp8_x_tl"] = rel_err(expert_mlp(xq, q13, q2, offsets=offs), tl)
    if routed is not None:
        row["ours_fp8_x_routed_us"] = time_graph(lambda: expert_mlp(xq, q13, q2, offsets=routed)) * 1e6
    if tpe <= ROUTED_MAX:
        xqm = quantize_fp8(x.view(E, tpe, H), 1)
        warm(xqm, q13, q2, dict(counts=counts), tpe, table)
        row["ours_fp8_x_masked_us"] = time_graph(lambda: expert_mlp(xqm, q13, q2, counts=counts)) * 1e6
    try:
        d13, d2 = dequantize_fp8(q13), dequantize_fp8(q2)
        row["rel_err_fp8"] = rel_err(ours, torch_mlp(dequantize_fp8(xq), d13.transpose(1, 2), d2.transpose(1, 2),
                                                     offs[1:], I))
        del d13, d2
    except Exception:  # noqa: BLE001
        row["rel_err_fp8"] = float("nan")


def _print_fp8(rows):
    def f(v):
        return "-" if v is None or v != v else f"{v:8.1f}"
    print(f"\n{'model':16} {'tok/e':>5} {'ours bf16':>9} {'fp8':>8} {'fp8 x':>8} {'x tl':>8} {'x rout':>8} "
          f"{'x mask':>8} {'byteflr':>8} {'flopflr':>8} {'err fp8':>8}  configs (gemm1, gemm2)")
    for r in rows:
        print(f"{r['model'][:16]:16} {r['tokens_per_expert']:5d} {f(r['ours_bf16_us']):>9} {f(r['ours_fp8_us']):>8} "
              f"{f(r['ours_fp8_x_us']):>8} {f(r.get('ours_fp8_x_tl_us')):>8} {f(r.get('ours_fp8_x_routed_us')):>8} "
              f"{f(r.get('ours_fp8_x_masked_us')):>8} {f(r['byte_floor_fp8_us']):>8} {f(r['flop_floor_fp8_us']):>8} "
              f"{r['rel_err_fp8']:8.1e}  {','.join(r['configs_fp8'])}")
    print("FP8 weights (W8A8, 128x128 weight blocks, per-token 128-channel activation scales): fp8: from bf16 x "
          "(quantized per token inside the MLP); fp8 x: x already FP8 (as an FP8 dispatch delivers it), uniform / "
          "routed / masked; x tl: fp8 x on the tl kernel where the plan took a fast path (the Gluon FP8 GEMMs); "
          "floors: FP8 weight + scale bytes / 4.8 TB/s, FLOPs / 1979 TFLOP/s (dense FP8 peak); "
          "err: against torch on the dequantized operands with a bf16 intermediate")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_grouped_gemm.json", help="full results as JSON")
    ap.add_argument("--quick", action="store_true", help="a few rows, bounded autotune")
    ap.add_argument("--rows-from", type=int, default=None, metavar="N",
                    help="every row with at least N tokens per expert (with --quick: those rows, bounded autotune)")
    ap.add_argument("--gluon-fp8-min-m", default=None, metavar="N|off",
                    help="the MOE_EP_GLUON_FP8_MIN_M option for this run (options.override): from this bucket on the "
                    "FP8 rows take the Gluon GEMMs, timed beside the tl kernel ('x tl')")
    ap.add_argument("--gluon-fp8-variants", default=None, metavar="GEMM1,GEMM2",
                    help="the Gluon FP8 variants the dispatcher takes in this run, GEMM1's (of "
                    "gluon_fp8.SWIGLU_VARIANTS) and GEMM2's (of gluon_fp8.VARIANTS), instead of its defaults: to time "
                    "a variant through the whole MLP before it is made the default")
    ap.add_argument("--gluon-nvfp4-min-m", default=None, metavar="N|off",
                    help="the MOE_EP_GLUON_NVFP4_MIN_M option for this run: from this bucket on the NVFP4-weight rows "
                    "take the Gluon prefill GEMM where it is verified, timed beside the tl paths ('tl' columns)")
    ap.add_argument("--gluon-nvfp4-unverified", action="store_true",
                    help="let the dispatcher take the Gluon NVFP4 prefill GEMM under this Triton before its GPU tests "
                    "have passed here (gluon_nvfp4_prefill.CHECKED_TRITONS and MASKED_CHECKED_TRITONS, for this "
                    "run): to time it through the MLP")
    ap.add_argument("--write-configs", default=None, help="folder to write <device>.json tuned configs into")
    ap.add_argument("--weights", default="nvfp4", help="quantized weight formats timed beside bf16, comma-separated: "
                    f"{', '.join(WEIGHT_FORMATS)} (default nvfp4)")
    args = ap.parse_args()
    formats = tuple(f.strip() for f in args.weights.split(",") if f.strip())
    if any(f not in WEIGHT_FORMATS for f in formats):
        sys.exit(f"--weights {args.weights!r}; allowed: a comma-separated subset of {', '.join(WEIGHT_FORMATS)}")
    if args.gluon_fp8_variants is not None:
        pinned = tuple(v.strip() for v in args.gluon_fp8_variants.split(","))
        if len(pinned) != 2 or pinned[0] not in gluon_fp8.SWIGLU_VARIANTS or pinned[1] not in gluon_fp8.VARIANTS:
            sys.exit(f"--gluon-fp8-variants {args.gluon_fp8_variants!r}; allowed: GEMM1,GEMM2 with GEMM1 one of "
                     f"{', '.join(gluon_fp8.SWIGLU_VARIANTS)} and GEMM2 one of {', '.join(gluon_fp8.VARIANTS)}")
        # (read by the dispatcher's plan of each call; no plan is made before this)
        gluon_fp8.DEFAULT_SWIGLU_VARIANT, gluon_fp8.DEFAULT_VARIANT = pinned
        print(f"Gluon FP8 variants: GEMM1 {pinned[0]}, GEMM2 {pinned[1]}", flush=True)
    if args.gluon_nvfp4_unverified:
        # (read by the dispatcher's plan of each call; no plan is made before this)
        gluon_nvfp4_prefill.CHECKED_TRITONS = gluon_nvfp4_prefill.MASKED_CHECKED_TRITONS = (triton_minor(), )
        print(f"Gluon NVFP4 prefill GEMM taken under Triton {triton.__version__} before its GPU tests (ragged and "
              "masked)", flush=True)
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    dev_name = torch.cuda.get_device_name()
    print(f"device {dev_name}, {device_facts.sm_count()} SMs, triton {triton.__version__}, torch {torch.__version__}",
          flush=True)
    rows, table = [], {}
    run_options = {"autotune_quick": True} if args.quick else {}  # (quick: a bounded search)
    if args.gluon_fp8_min_m is not None:
        run_options["gluon_fp8_min_m"] = args.gluon_fp8_min_m
    if args.gluon_nvfp4_min_m is not None:
        run_options["gluon_nvfp4_min_m"] = args.gluon_nvfp4_min_m
    with options.override(**run_options):
        for name, (E, H, I, tpes) in MODELS.items():
            for tpe in tpes:
                if (tpe < args.rows_from) if args.rows_from is not None else (args.quick and tpe not in QUICK[name]):
                    continue
                r = run_row(name, E, H, I, tpe, table, formats)
                torch.cuda.empty_cache()  # the row's tensors went with its call: their memory back before the next
                rows.append(r)
                print(json.dumps(r), flush=True)
    with open(args.out, "w") as f:
        json.dump({"device": dev_name, "rows": rows}, f, indent=1)
    if args.write_configs:
        os.makedirs(args.write_configs, exist_ok=True)
        path = os.path.join(args.write_configs, device_facts.device_name() + ".json")
        with open(path, "w") as f:
            json.dump(table, f, indent=1, sort_keys=True)
        print("tuned configs ->", path)

    if "fp8" in formats:
        _print_fp8(rows)
    if "nvfp4" not in formats:
        return

    def f(v):
        return "-" if v is None or v != v else f"{v:8.1f}"

    print(f"\n{'model':16} {'tok/e':>5} {'ours bf16':>9} {'unchain':>8} {'masked':>8} {'torch':>8} {'routed':>8} "
          f"{'torch rt':>8} {'fp4 rt':>8} {'read':>8} "
          f"{'byteflr':>8} {'flopflr':>8} {'ours fp4':>8} {'fp4 tl':>8} {'fp4flr':>8} {'x+w fp4':>8} {'x+w msk':>8} "
          f"{'err bf16':>8} {'err fp4':>8} {'err x+w':>8}  "
          "configs (gemm1, gemm2; bf16 | fp4)")
    for r in rows:
        print(f"{r['model'][:16]:16} {r['tokens_per_expert']:5d} {f(r['ours_bf16_us']):>9} "
              f"{f(r.get('ours_bf16_unchained_us')):>8} "
              f"{f(r.get('ours_bf16_masked_us')):>8} {f(r['torch_grouped_mm_us']):>8} "
              f"{f(r.get('ours_bf16_routed_us')):>8} {f(r.get('torch_routed_us')):>8} "
              f"{f(r.get('ours_nvfp4_routed_us')):>8} {f(r['read_weights_us']):>8} "
              f"{f(r['byte_floor_us']):>8} "
              f"{f(r['flop_floor_us']):>8} {f(r.get('ours_nvfp4_us')):>8} {f(r.get('ours_nvfp4_tl_us')):>8} "
              f"{f(r.get('byte_floor_nvfp4_us')):>8} "
              f"{f(r.get('ours_nvfp4_x_us')):>8} {f(r.get('ours_nvfp4_x_masked_us')):>8} "
              f"{r['rel_err_bf16']:8.1e} {r.get('rel_err_nvfp4', float('nan')):8.1e} "
              f"{r.get('rel_err_nvfp4_x', float('nan')):8.1e}  "
              f"{','.join(r['configs_bf16'])} | {','.join(r.get('configs_nvfp4', []))}")
    print("times in us (median of CUDA-graph replays, triton.testing.do_bench_cudagraph); unchain: ours bf16 with "
          "MOE_EP_GEMM_CHAIN=off (decode rows); routed / torch rt / fp4 rt: rows up to 128 tokens per expert "
          "spread over the experts as routing spreads them (ours bf16, torch, ours NVFP4 weights); read: the bf16 "
          "weights streamed once (a plain Triton read kernel, best of 3 tilings); x+w fp4 / x+w msk: NVFP4 x (per-row "
          "global scales; masked: one) and NVFP4 weights, ragged / masked; fp4 tl: ours fp4 on the tl paths where "
          "the plan took a fast path (the Gluon NVFP4 prefill GEMM); "
          "floors: weight bytes / 4.8 TB/s, FLOPs / 795 TFLOP/s")


if __name__ == "__main__":
    main()
