"""NVFP4 quantize/dequantize speed on the GPU vs the device-copy ceiling and the torch reference.

From the repository root (or with moe-ep installed, without ``PYTHONPATH``):

    PYTHONPATH=$PWD python3 benchmarks/bench_nvfp4.py [--out results.json]

Bytes counted per call: bf16 input read + packed codes and e4m3 scales written (quantize), and the
reverse (dequantize). The ceiling is a device-to-device copy of the same input size, measured here.
"""

from __future__ import annotations

import argparse
import json

import moe_ep  # noqa: F401  (before triton)
import torch
import triton

from moe_ep.commands.timing import time_call, time_graph
from moe_ep.kernels import dequantize_nvfp4, quantize_nvfp4
from moe_ep.reference import quantize_nvfp4_ref

SHAPES = [(128, 7168), (4096, 7168), (16384, 7168)]
REPS = dict(rep_ms=300, warmup_ms=50)  # the eager timings' (time_call) budget


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    rows = []
    big = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    copy_bw = 2 * big.numel() / time_call(lambda: big.clone(), **REPS)
    del big
    for m, k in SHAPES:
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        gs = torch.tensor(2688.0, device="cuda") / x.abs().amax().float()
        q = quantize_nvfp4(x, gs, check_finite=False)
        d, s, _ = quantize_nvfp4_ref(x, gs)
        exact = torch.equal(q.data, d) and torch.equal(q.scales.view(torch.uint8), s.view(torch.uint8))
        nbytes = x.numel() * 2 + q.data.numel() + q.scales.numel()
        t_q = time_call(lambda: quantize_nvfp4(x, gs, check_finite=False), **REPS)
        t_qg = time_graph(lambda: quantize_nvfp4(x, gs, check_finite=False), rep_ms=200)
        t_qs = time_call(lambda: quantize_nvfp4(x, gs, swizzle=True, check_finite=False), **REPS)
        t_qa = time_call(lambda: quantize_nvfp4(x, check_finite=False), **REPS)  # + amax pass for the global scale
        t_ref = time_call(lambda: quantize_nvfp4_ref(x, gs), **REPS)
        t_dq = time_call(lambda: dequantize_nvfp4(q), **REPS)
        small_copy = time_call(lambda: x.clone(), **REPS)
        rows.append(dict(shape=f"{m}x{k}", exact=exact, bytes=nbytes, quant_us=t_q * 1e6,
                         quant_gbps=nbytes / t_q / 1e9, pct_copy=100 * nbytes / t_q / copy_bw,
                         quant_graph_us=t_qg * 1e6, graph_pct_copy=100 * nbytes / t_qg / copy_bw,
                         quant_swizzled_us=t_qs * 1e6, quant_with_amax_us=t_qa * 1e6, torch_ref_us=t_ref * 1e6,
                         speedup_vs_ref=t_ref / t_q, dequant_us=t_dq * 1e6, dequant_gbps=nbytes / t_dq / 1e9,
                         same_size_copy_us=small_copy * 1e6))
    res = dict(device=torch.cuda.get_device_name(), copy_gbps=copy_bw / 1e9, rows=rows,
               torch=torch.__version__, triton=triton.__version__)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    print(f"\n{res['device']}: device copy {copy_bw / 1e9:.0f} GB/s (read + write, 1 GiB)")
    print(f"{'shape':>11} {'exact':>5} {'quant us':>9} {'GB/s':>6} {'%copy':>6} {'swz us':>7} {'+amax us':>8} "
          f"{'graph us':>8} {'%copy':>6} "
          f"{'torch us':>9} {'x ref':>6} {'deq us':>7} {'deq GB/s':>8}")
    for r in rows:
        print(f"{r['shape']:>11} {str(r['exact']):>5} {r['quant_us']:9.1f} {r['quant_gbps']:6.0f} {r['pct_copy']:6.1f} "
              f"{r['quant_swizzled_us']:7.1f} {r['quant_with_amax_us']:8.1f} {r['quant_graph_us']:8.1f} "
              f"{r['graph_pct_copy']:6.1f} {r['torch_ref_us']:9.1f} "
              f"{r['speedup_vs_ref']:6.1f} {r['dequant_us']:7.1f} {r['dequant_gbps']:8.0f}")


if __name__ == "__main__":
    main()
