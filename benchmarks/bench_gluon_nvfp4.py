"""Time the Gluon NVFP4-weight grouped GEMM (Hopper) against the tl path and the byte floor, one GEMM, decode shapes.

Each row: one GEMM (no SwiGLU) of a model's local experts, ragged bf16 x with the same tokens per expert, NVFP4
weights (one global scale per expert). Columns, all CUDA-graph timed in this run: the Gluon kernel
(``gluon_nvfp4_grouped_gemm``, bf16 out; with its PTX decode and with the plain one), the tl path
(``moe_ep.kernels.grouped_gemm`` on the same NvFp4Tensor, autotuned first, bounded search), the time a plain
streaming-read kernel takes to read the same weight bytes once (codes + scales: the floor), the byte floor at
4.8 TB/s, and the relative error of each against the fp32 reference on the dequantized weights; the PTX-decode
kernel also at other ring depths, register budgets and with the MMA overlapping the next decode
(``LAUNCH_SWEEP``), to pick ``launch_params`` from. A kernel that fails is reported in its row (the error), not
fatal.

From the repository root, on an H100 / H200:

    PYTHONPATH=$PWD python3 benchmarks/bench_gluon_nvfp4.py --out gluon.json
"""

from __future__ import annotations

import argparse
import traceback

import torch

import moe_ep  # noqa: F401  (before triton)
from moe_ep import options  # noqa: E402
from moe_ep.commands.bench_rows import error_line, rel_err, run_rows, timed_column  # noqa: E402
from moe_ep.commands.common import uniform_offsets  # noqa: E402
from moe_ep.commands.timing import time_graph, time_read  # noqa: E402
from moe_ep.kernels import grouped_gemm, nvfp4_global_scale, quantize_nvfp4  # noqa: E402
from moe_ep.kernels.grouped_gemm.gluon_nvfp4 import (  # noqa: E402
    LAUNCH_SWEEP, gluon_nvfp4_grouped_gemm, launch_params, token_tile)
from moe_ep.reference import dequantize_nvfp4_ref  # noqa: E402

BW = 4.8e12
SHAPES = [  # (name, local experts G, N, K, tokens per expert)
    ("DeepSeek-V3 EP8 gemm1 (gate+up)", 32, 4096, 7168, 16),
    ("DeepSeek-V3 EP8 gemm2 (down)", 32, 7168, 2048, 16),
    ("Qwen3-30B-A3B gemm1 (gate+up)", 128, 1536, 2048, 8),
    ("Qwen3-30B-A3B gemm2 (down)", 128, 2048, 768, 8),
]


def reference(x, w, offs):
    """fp32 ``x_g @ dequant(w_g)^T`` per expert, one matmul per expert on the GPU."""
    dense = dequantize_nvfp4_ref(w.data, w.scales, w.global_scale)
    out = torch.zeros(x.shape[0], w.shape[1], device=x.device)
    o = offs.tolist()
    for g in range(w.shape[0]):
        out[o[g]:o[g + 1]] = x[o[g]:o[g + 1]].float() @ dense[g].T
    return out


def run_row(name, G, N, K, tpe):
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    x = (torch.randn(G * tpe, K, device=dev, generator=gen) * 0.5).bfloat16()
    w = torch.randn(G, N, K, device=dev, generator=gen) * K ** -0.5
    w = quantize_nvfp4(w, nvfp4_global_scale(w, per_slice=True))
    offs = uniform_offsets(G, tpe, dev)
    row = {"shape": name, "experts": G, "N": N, "K": K, "tokens_per_expert": tpe, "token_tile": token_tile(tpe)}
    nbytes = w.data.numel() + w.scales.numel()
    row["byte_floor_us"] = nbytes / BW * 1e6
    row["read_weights_us"] = time_read(w.data, w.scales.view(torch.uint8)) * 1e6
    ref = reference(x, w, offs)
    for col, fast in (("gluon", True), ("gluon_plain", False)):  # PTX decode (the default), plain fp32 decode
        timed_column(row, col, lambda f=fast: gluon_nvfp4_grouped_gemm(x, w, offs, tokens_per_expert=tpe,
                                                                       fast_decode=f), ref, label=f"{name} {tpe}")
    sweep = {}
    for stages, maxnreg, overlap in LAUNCH_SWEEP[1:]:
        key = f"stages{stages}_regs{maxnreg}{'_overlap' if overlap else ''}"
        launch = dict(tokens_per_expert=tpe, stages=stages, maxnreg=maxnreg, overlap=overlap)
        try:
            out = gluon_nvfp4_grouped_gemm(x, w, offs, **launch)
            torch.cuda.synchronize()
            sweep[key] = {"rel_err": rel_err(out, ref),
                          "us": time_graph(lambda a=launch: gluon_nvfp4_grouped_gemm(x, w, offs, **a)) * 1e6}
        except Exception:  # noqa: BLE001  (a launch that does not fit, e.g. shared memory, is reported)
            sweep[key] = {"error": error_line(traceback.format_exc())}
    row["gluon_sweep"] = sweep
    row["gluon_defaults"] = dict(zip(("stages", "maxnreg"), launch_params(token_tile(tpe))))
    try:
        with options.override(autotune_quick=True):
            got, plan = grouped_gemm(x, w, offsets=offs, m_hint=tpe, return_plan=True)
        row["rel_err_tl"] = rel_err(got, ref)
        row["tl_config"] = plan.config
        row["tl_us"] = time_graph(lambda: grouped_gemm(x, w, offsets=offs, m_hint=tpe)) * 1e6
    except Exception:  # noqa: BLE001
        row["tl_error"] = traceback.format_exc()[-2000:]
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_gluon_nvfp4.json", help="full results as JSON")
    args = ap.parse_args()
    rows = run_rows(SHAPES, run_row, args.out,
                    lambda shape: dict(zip(("shape", "experts", "N", "K", "tokens_per_expert"), shape)))

    def f(v):
        return "-" if v is None or v != v else f"{v:8.1f}"

    def e(v):
        return "-" if v is None else f"{v:8.1e}"
    print(f"\n{'shape':34} {'tok/e':>5} {'gluon':>8} {'gl plain':>8} {'tl':>8} {'read':>8} {'byteflr':>8} {'gl/tl':>6} "
          f"{'gl/read':>7} {'err gl':>8} {'err tl':>8}")
    for r in rows:
        if "row_error" in r:
            print(f"{r['shape'][:34]:34} {r['tokens_per_expert']:5d} failed: {error_line(r['row_error'])}")
            continue
        gl_us, tl_us, rd = r.get("gluon_us"), r.get("tl_us"), r["read_weights_us"]
        print(f"{r['shape'][:34]:34} {r['tokens_per_expert']:5d} {f(gl_us):>8} {f(r.get('gluon_plain_us')):>8} "
              f"{f(tl_us):>8} {f(rd):>8} "
              f"{f(r['byte_floor_us']):>8} {gl_us / tl_us if gl_us and tl_us else float('nan'):6.2f} "
              f"{gl_us / rd if gl_us else float('nan'):7.2f} {e(r.get('rel_err_gluon')):>8} "
              f"{e(r.get('rel_err_tl')):>8}")
        for k in ("gluon_error", "gluon_plain_error", "tl_error"):
            if k in r:
                print(f"  {k}: {error_line(r[k])}")
        print(f"  defaults {r['gluon_defaults']}; sweep: " + ", ".join(
            f"{k}: {v['us']:.1f} us (err {v['rel_err']:.1e})" if "us" in v else f"{k}: {v['error']}"
            for k, v in r["gluon_sweep"].items()))
    print("times in us (median of CUDA-graph replays); gluon / gl plain: the Gluon kernel with the PTX / plain fp32 "
          "decode (gl/tl, gl/read: the PTX one); read: the NVFP4 weight codes + scales streamed once by a plain "
          "Triton read kernel (best of a few tilings); byteflr: those bytes / 4.8 TB/s; err: relative Frobenius error "
          "against fp32 x @ dequant(w)^T (bf16 outputs)")


if __name__ == "__main__":
    main()
