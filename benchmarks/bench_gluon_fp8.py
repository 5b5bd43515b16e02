"""Time the Gluon FP8 block-scaled grouped GEMM (Hopper) against the tl FP8 grouped GEMM and the bf16 one, prefill.

Each row: one GEMM of DeepSeek-V3's EP8 rank (32 local experts), ragged x with the same rows per expert, FP8
operands in DeepSeek-V3's format (x per row per 128 channels, w per 128x128 block): GEMM2's form (no SwiGLU, bf16
out, the row's routing weight) or GEMM1's (w13 of 2I rows, SwiGLU, FP8 out per row per 128 channels; the tl paths
with ``swiglu=True``, tl FP8 with ``quantize_out=True``, tl bf16 writing bf16). Columns, all CUDA-graph timed medians
in this run: each Gluon variant of the form (``gluon_fp8.VARIANTS`` / ``SWIGLU_VARIANTS``), the tl FP8 path
(``moe_ep.kernels.grouped_gemm`` on the same Fp8Tensors, autotuned first, bounded search), the tl bf16 path on the
bf16 operands the FP8 ones were quantized from, the FLOP floor at 1979 TFLOP/s (H200 dense FP8), and the relative
error of each result (FP8 outputs dequantized) against the fp32 reference on the dequantized operands. A variant or
path that fails is reported in its row (the error), and the others still run.

From the repository root, on an H100 / H200:

    PYTHONPATH=$PWD python3 benchmarks/bench_gluon_fp8.py --out gluon_fp8.json
"""

from __future__ import annotations

import argparse
import traceback

import torch

import moe_ep  # noqa: F401  (before triton)
from moe_ep import options  # noqa: E402
from moe_ep.commands.bench_rows import error_line, run_rows, timed_column  # noqa: E402
from moe_ep.commands.bench_rows import rel_err as bf16_rel_err  # noqa: E402
from moe_ep.commands.common import uniform_offsets  # noqa: E402
from moe_ep.commands.timing import time_graph  # noqa: E402
from moe_ep.kernels import grouped_gemm  # noqa: E402
from moe_ep.kernels.fp8 import Fp8Tensor, quantize_fp8  # noqa: E402
from moe_ep.kernels.grouped_gemm.gluon_fp8 import (SWIGLU_VARIANTS, VARIANTS, gluon_fp8_grouped_gemm,  # noqa: E402
                                                   gluon_fp8_swiglu_grouped_gemm)
from moe_ep.reference import dequantize_fp8_ref  # noqa: E402

FP8_PEAK = 1979e12
EXPERTS = 32
SHAPES = [  # (name, N (GEMM1: I), K, rows per expert, GEMM1's form)
    ("DeepSeek-V3 EP8 gemm2 (down)", 7168, 2048, 1024, False),
    ("gemm1-sized plain GEMM", 4096, 7168, 1024, False),
    ("DeepSeek-V3 EP8 gemm1 (swiglu)", 2048, 7168, 1024, True),
    ("DeepSeek-V3 EP8 gemm2 (down)", 7168, 2048, 128, False),
    ("gemm1-sized plain GEMM", 4096, 7168, 128, False),
    ("DeepSeek-V3 EP8 gemm1 (swiglu)", 2048, 7168, 128, True),
]


def rel_err(a, b):
    return bf16_rel_err(dequantize_fp8_ref(a.data, a.scales, 1) if isinstance(a, Fp8Tensor) else a, b)


def reference(x8, w8, offs, swiglu):
    """fp32 product of the dequantized operands per expert, SwiGLU of it for GEMM1, one matmul per expert (w
    dequantized one expert at a time: the whole fp32 copy of a GEMM1-sized weight would be 3.8 GB)."""
    n = w8.shape[1] // 2 if swiglu else w8.shape[1]
    out = torch.zeros(x8.shape[0], n, device=x8.device)
    xf = dequantize_fp8_ref(x8.data, x8.scales, 1)
    o = offs.tolist()
    for g in range(w8.shape[0]):
        h = xf[o[g]:o[g + 1]] @ dequantize_fp8_ref(w8.data[g], w8.scales[g], 128, swiglu).T
        out[o[g]:o[g + 1]] = torch.nn.functional.silu(h[:, :n]) * h[:, n:] if swiglu else h
    return out


def operands(N, K, rows, swiglu):
    """A row's operands on the GPU (seed 0: every call makes the same ones): bf16 x ``[32 * rows, K]`` and w
    ``[32, R, K]`` (R = 2N with ``swiglu``, GEMM1's w13, else N), their FP8 forms (x per row, w per 128x128 block,
    gate and up blocked apart for GEMM1), int32 offsets of ``rows`` per expert, and GEMM2's routing weights (None for
    GEMM1): ``(x, w, x8, w8, offs, rs)``. ``ablate_gluon_fp8.py`` times the same."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    R = 2 * N if swiglu else N
    x = torch.randn(EXPERTS * rows, K, device=dev, generator=gen).bfloat16()
    w = (torch.randn(EXPERTS, R, K, device=dev, generator=gen) * K ** -0.5).bfloat16()
    x8, w8 = quantize_fp8(x, 1), quantize_fp8(w, 128, gate_up=swiglu)
    offs = uniform_offsets(EXPERTS, rows, dev)
    rs = None if swiglu else torch.rand(EXPERTS * rows, device=dev, generator=gen) + 0.5
    return x, w, x8, w8, offs, rs


def run_row(name, N, K, rows, swiglu):
    R = 2 * N if swiglu else N
    x, w, x8, w8, offs, rs = operands(N, K, rows, swiglu)
    M = EXPERTS * rows
    row = {"shape": name, "experts": EXPERTS, "N": N, "K": K, "rows_per_expert": rows, "swiglu": swiglu,
           "flop_floor_us": 2 * M * R * K / FP8_PEAK * 1e6}
    ref = reference(x8, w8, offs, swiglu)
    if rs is not None:
        ref = ref * rs[:, None]
    for variant in SWIGLU_VARIANTS if swiglu else VARIANTS:
        def call(v=variant):
            if swiglu:
                return gluon_fp8_swiglu_grouped_gemm(x8, w8, offs, variant=v)
            return gluon_fp8_grouped_gemm(x8, w8, offs, row_scale=rs, variant=v)
        timed_column(row, variant, call, ref, err=rel_err, label=f"{name} {rows}")
    for col, a, b in (("tl_fp8", x8, w8), ("tl_bf16", x, w)):
        def tl_call(a=a, b=b, **kw):
            return grouped_gemm(a, b, offsets=offs, row_scale=rs, m_hint=rows, swiglu=swiglu,
                                quantize_out=swiglu and b is w8, **kw)
        try:  # the tl kernel: the dispatcher's Gluon path off
            with options.override(gluon_fp8_min_m="off"):
                with options.override(autotune_quick=True):
                    got, plan = tl_call(return_plan=True)
                assert plan.path == "tl", plan
                row[f"rel_err_{col}"] = rel_err(got, ref)
                row[f"{col}_config"] = plan.config
                row[f"{col}_us"] = time_graph(tl_call) * 1e6
        except Exception:  # noqa: BLE001
            row[f"{col}_error"] = traceback.format_exc()[-2000:]
            print(f"  {name} {rows}: {col} failed: {error_line(row[f'{col}_error'])}", flush=True)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_gluon_fp8.json", help="full results as JSON")
    args = ap.parse_args()
    rows = run_rows(SHAPES, run_row, args.out,
                    lambda shape: dict(zip(("shape", "N", "K", "rows_per_expert", "swiglu"), shape)))

    def f(v):
        return "-" if v is None or v != v else f"{v:8.1f}"

    for swiglu, variants in ((False, VARIANTS), (True, SWIGLU_VARIANTS)):
        cols = [*variants, "tl_fp8", "tl_bf16"]
        print(f"\n{'GEMM1 (SwiGLU, FP8 out)' if swiglu else 'GEMM2 (bf16 out, routing weight)'}\n"
              f"{'shape':30} {'rows/e':>6} " + " ".join(f"{c[:14]:>14}" for c in cols) + f" {'floor':>8} "
              f"{'best/bf16':>9} {'best/tl8':>8} {'best/floor':>10}")
        for r in rows:
            if bool(r.get("swiglu")) != swiglu:
                continue
            times = {c: r.get(f"{c}_us") for c in cols}
            gl_times = [times[v] for v in variants if times[v]]
            best = min(gl_times) if gl_times else None
            floor = r.get("flop_floor_us")
            ratios = [best / d if best and d else float("nan") for d in (times["tl_bf16"], times["tl_fp8"], floor)]
            print(f"{r['shape'][:30]:30} {r['rows_per_expert']:6d} " + " ".join(f"{f(times[c]):>14}" for c in cols)
                  + f" {f(floor):>8} {ratios[0]:9.2f} {ratios[1]:8.2f} {ratios[2]:10.2f}")
            print("  rel err: " + ", ".join(f"{c} {r[f'rel_err_{c}']:.1e}" for c in cols if f"rel_err_{c}" in r))
            for k in [k for k in r if k.endswith("_error")]:
                print(f"  {k}: {error_line(r[k])}")
    print("times in us (median of CUDA-graph replays); GEMM2 rows with the row's routing weights; floor: 2 M N K / "
          "1979 TFLOP/s (dense FP8; GEMM1: N = 2I, gate and up); best: the fastest Gluon variant; rel err: relative "
          "Frobenius error against fp32 on the dequantized FP8 operands (GEMM1: its SwiGLU values; FP8 outputs "
          "dequantized, so GEMM1's FP8 columns include the output's e4m3 rounding; tl_bf16: on the bf16 operands they "
          "were quantized from, so its error is FP8's rounding)")


if __name__ == "__main__":
    main()
