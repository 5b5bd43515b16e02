"""Time the Gluon NVFP4-weight prefill GEMM (Hopper) against the tl NVFP4 path, the tl bf16 path and torch's bf16
grouped GEMM, prefill shapes (and a few decode ones).

Each row: one grouped GEMM of a model's local experts, ragged x with the same rows per expert: GEMM2 (N = H, K = I,
bf16 out times the row's routing weight) or GEMM1 (w13 of 2I rows, K = H, SwiGLU fused, bf16 ``[M, I]`` out; the tl
paths with ``swiglu=True``, torch's as its GEMM and ``silu(gate) * up``). Weights: ``quantize_nvfp4`` of bf16 ones, a
global scale per expert. Columns, all CUDA-graph timed medians in this run: each variant of the Gluon kernel
(``VARIANTS``: its token tile, and where its scale words load; launched as the dispatcher launches it), the tile the
dispatcher picks with parts of its decode left out (wrong results), the tl NVFP4 path
(``moe_ep.kernels.grouped_gemm`` on the same NvFp4Tensor, autotuned first, bounded search: the dispatcher's path,
which from ``MOE_EP_DECODED_MIN_M`` rows per expert on decodes the weights into a transient bf16 copy first), the tl
bf16 path and ``torch._grouped_mm`` on the bf16 weights the NVFP4 ones were quantized from, the FLOP floor at 989
TFLOP/s (dense bf16: Hopper's MMA is bf16 either way), and each result's relative error against the fp32 reference on
the dequantized weights. A variant or path that fails is reported in its row (the error), and the others still run.

From the repository root, on an H100 / H200:

    PYTHONPATH=$PWD python3 benchmarks/bench_gluon_nvfp4_prefill.py --out gluon_nvfp4_prefill.json
"""

from __future__ import annotations

import argparse

import torch

import moe_ep  # noqa: F401  (before triton)
from moe_ep import options  # noqa: E402
from moe_ep.commands.bench_rows import error_line, run_rows, timed_column  # noqa: E402
from moe_ep.commands.common import uniform_offsets  # noqa: E402
from moe_ep.kernels import nvfp4_global_scale, quantize_nvfp4  # noqa: E402
from moe_ep.kernels.grouped_gemm import grouped_gemm  # noqa: E402
from moe_ep.kernels.grouped_gemm import gluon_nvfp4_prefill  # noqa: E402
from moe_ep.kernels.grouped_gemm.gluon_nvfp4_prefill import TOKEN_TILES, token_tile  # noqa: E402
from moe_ep.reference import dequantize_nvfp4_ref  # noqa: E402

BF16_PEAK = 989e12
SHAPES = [  # (name, experts, N (GEMM1: I), K, rows per expert, GEMM1's form)
    ("DeepSeek-V3 EP8 gemm2", 32, 7168, 2048, 1024, False),
    ("DeepSeek-V3 EP8 gemm1", 32, 2048, 7168, 1024, True),
    ("DeepSeek-V3 EP8 gemm2", 32, 7168, 2048, 128, False),
    ("DeepSeek-V3 EP8 gemm1", 32, 2048, 7168, 128, True),
    ("Qwen3-30B-A3B gemm2", 128, 2048, 768, 512, False),
    ("Qwen3-30B-A3B gemm1", 128, 768, 2048, 512, True),
    ("Mixtral 8x7B gemm2", 8, 4096, 14336, 512, False),
    ("Mixtral 8x7B gemm1", 8, 14336, 4096, 512, True),
    ("DeepSeek-V3 EP8 gemm2", 32, 7168, 2048, 16, False),
    ("DeepSeek-V3 EP8 gemm1", 32, 2048, 7168, 16, True),
    ("Qwen3-30B-A3B gemm2", 128, 2048, 768, 8, False),
    ("Qwen3-30B-A3B gemm1", 128, 768, 2048, 8, True),
    ("DeepSeek-V3 EP8 gemm2", 32, 7168, 2048, 64, False),
    ("DeepSeek-V3 EP8 gemm1", 32, 2048, 7168, 64, True),
]
VARIANTS = {**{f"t{bt}": dict(block_t=bt) for bt in TOKEN_TILES},
            **{f"t{bt}s3": dict(block_t=bt, scale_ahead=3) for bt in (128, 256)}}
"""Each token tile, and the 128 and 256 ones with the scale words loaded 3 K steps ahead of their decode (s3)."""


def variants_for(rows: int) -> list[str]:
    """The variants timed at ``rows`` tokens per expert: the token tiles from the smallest holding them (up to 128)
    on, at most three, and 256 (and the s3 variants) only from 128 rows on."""
    first = next(i for i, t in enumerate(TOKEN_TILES) if t >= min(rows, 128))
    tiles = [f"t{t}" for t in TOKEN_TILES[first:first + 3] if t < 256 or rows >= 128]
    return tiles + (["t128s3", "t256s3"] if rows >= 128 else [])


def swiglu_of(h, n):
    return torch.nn.functional.silu(h[:, :n]) * h[:, n:]


def reference(x, wq, offs, swiglu):
    """fp32 product with the dequantized weights, one matmul per expert (dequantized one expert at a time), and
    SwiGLU of it for GEMM1."""
    n = wq.shape[1] // 2 if swiglu else wq.shape[1]
    out = torch.zeros(x.shape[0], n, device=x.device)
    o = offs.tolist()
    for g in range(wq.shape[0]):
        w = dequantize_nvfp4_ref(wq.data[g], wq.scales[g], wq.global_scale[g])
        h = x[o[g]:o[g + 1]].float() @ w.T
        out[o[g]:o[g + 1]] = swiglu_of(h, n) if swiglu else h
    return out


def gluon(x, wq, offs, rs, swiglu, block_t, scale_ahead=1, ablate=0):
    """The Gluon kernel launched as the dispatcher launches it (``gluon_nvfp4_prefill.launch``), with a variant's
    ``scale_ahead`` or parts of its decode left out (``ablate``: wrong results)."""
    G, R, _ = wq.shape
    out = torch.empty(x.shape[0], R // 2 if swiglu else R, dtype=torch.bfloat16, device=x.device)
    gs = wq.global_scale.reshape(-1).float().expand(G).contiguous()
    gluon_nvfp4_prefill.launch(x, wq.data, wq.scales, gs, offs, out, rs, block_t,
                               torch.cuda.get_device_properties(x.device).multi_processor_count, swiglu=swiglu,
                               scale_ahead=scale_ahead, ablate=ablate)
    return out


def run_row(name, G, N, K, rows, swiglu):
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    R = 2 * N if swiglu else N
    x = torch.randn(G * rows, K, device=dev, generator=gen).bfloat16()
    w = (torch.randn(G, R, K, device=dev, generator=gen) * K ** -0.5).bfloat16()
    wq = quantize_nvfp4(w, nvfp4_global_scale(w, per_slice=True))
    offs = uniform_offsets(G, rows, dev)
    rs = None if swiglu else torch.rand(G * rows, device=dev, generator=gen) + 0.5
    M = G * rows
    row = {"shape": name, "experts": G, "N": N, "K": K, "rows_per_expert": rows, "swiglu": swiglu,
           "flop_floor_us": 2 * M * R * K / BF16_PEAK * 1e6}
    ref = reference(x, wq, offs, swiglu)
    if rs is not None:
        ref = ref * rs[:, None]

    def timed(col, call, checked=True):
        timed_column(row, col, call, ref if checked else None, label=f"{name} {rows}")

    for variant in variants_for(rows):
        timed(variant, lambda kw=VARIANTS[variant]: gluon(x, wq, offs, rs, swiglu, **kw))
    # the tile the dispatcher picks again with the decode's bit operations left out, then also the scale conversion:
    # how much of the time they are (wrong results: no error column)
    bt = token_tile(rows)
    for col, ablate in (("no_decode", 1), ("no_decode_scale", 3)):
        timed(col, lambda ablate=ablate: gluon(x, wq, offs, rs, swiglu, bt, ablate=ablate), checked=False)
    for col, b in (("tl_nvfp4", wq), ("tl_bf16", w)):
        with options.override(autotune_quick=True):
            grouped_gemm(x, b, offsets=offs, row_scale=rs, m_hint=rows, swiglu=swiglu)  # autotune outside the timing
        timed(col, lambda b=b: grouped_gemm(x, b, offsets=offs, row_scale=rs, m_hint=rows, swiglu=swiglu))
    wt = w.transpose(-2, -1)
    if swiglu:
        timed("torch_bf16", lambda: swiglu_of(torch._grouped_mm(x, wt, offs=offs[1:]), N))
    else:
        timed("torch_bf16", lambda: torch._grouped_mm(x, wt, offs=offs[1:]) * rs[:, None].bfloat16())
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_gluon_nvfp4_prefill.json", help="full results as JSON")
    ap.add_argument("--shapes", default=None, help="comma-separated indices into SHAPES (default: all)")
    args = ap.parse_args()
    shapes = SHAPES if args.shapes is None else [SHAPES[int(i)] for i in args.shapes.split(",")]
    rows = run_rows(shapes, run_row, args.out,
                    lambda shape: dict(zip(("shape", "experts", "N", "K", "rows_per_expert", "swiglu"), shape)))

    def f(v):
        return "-" if v is None or v != v else f"{v:8.1f}"

    cols = [*VARIANTS, "no_decode", "no_decode_scale", "tl_nvfp4", "tl_bf16", "torch_bf16"]  # (a wide table)
    print(f"\n{'shape':28} {'rows/e':>6} " + " ".join(f"{c[:12]:>12}" for c in cols) + f" {'floor':>8} "
          f"{'best/bf16':>9} {'best/tlfp4':>10} {'floor/best':>10}")
    for r in rows:
        times = {c: r.get(f"{c}_us") for c in cols}
        gl_times = [times[v] for v in VARIANTS if times[v]]  # (not the ablations)
        best = min(gl_times) if gl_times else None
        floor = r.get("flop_floor_us")
        ratios = [best / d if best and d else float("nan") for d in (times["tl_bf16"], times["tl_nvfp4"])]
        ratios.append(floor / best if best and floor else float("nan"))
        print(f"{r['shape'][:28]:28} {r['rows_per_expert']:6d} " + " ".join(f"{f(times[c]):>12}" for c in cols)
              + f" {f(floor):>8} {ratios[0]:9.2f} {ratios[1]:10.2f} {ratios[2]:10.2f}")
        print("  rel err: " + ", ".join(f"{c} {r[f'rel_err_{c}']:.1e}" for c in cols if f"rel_err_{c}" in r))
        for k in [k for k in r if k.endswith("_error")]:
            print(f"  {k}: {error_line(r[k])}")
    print("times in us (median of CUDA-graph replays), GEMM2 rows with their routing weights; floor: 2 M N K / "
          "989 TFLOP/s (dense bf16; GEMM1: N = 2I); best: the fastest Gluon variant; s3: scale words 3 K steps "
          "ahead; no_decode(_scale): the dispatcher's tile without the code decode's bit operations (and the scale "
          "conversion), wrong results; rel err: relative "
          "Frobenius error against fp32 on the dequantized NVFP4 weights (tl_bf16, torch_bf16: on the bf16 "
          "weights they were quantized from, so their error is NVFP4's rounding)")


if __name__ == "__main__":
    main()
