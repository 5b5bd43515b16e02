"""Time each GEMM of the NVFP4-weight expert MLP under fixed configs (no autotune) and check it against the
dequantized torch peer; prints the best config per GEMM and shape. ``python benchmarks/sweep_nvfp4.py``"""

import json
import sys
import time

import torch

import moe_ep  # noqa: F401
import triton
from moe_ep.kernels import grouped_gemm, nvfp4_global_scale, quantize_nvfp4, dequantize_nvfp4, tuning

gg = sys.modules["moe_ep.kernels.grouped_gemm"]
SHAPES = [("DeepSeek", 32, 7168, 2048, 16), ("Qwen3", 128, 2048, 768, 8), ("Qwen3", 128, 2048, 768, 64),
          ("Mixtral", 8, 4096, 14336, 64), ("DeepSeek", 32, 7168, 2048, 128)]


def cfg(bm, bn, bk, swap, w, s):
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SWAP_AB=swap, GROUP_M=8, num_warps=w, num_stages=s)


DECODE = [cfg(16, 64, 128, True, 4, 4), cfg(16, 64, 256, True, 4, 3), cfg(16, 128, 128, True, 4, 4),
          cfg(16, 128, 128, True, 8, 4), cfg(16, 64, 128, True, 4, 6), cfg(16, 128, 256, True, 8, 3)]
MID = [cfg(64, 64, 128, True, 4, 4), cfg(64, 64, 256, True, 4, 3), cfg(64, 128, 128, True, 4, 3),
       cfg(64, 128, 128, True, 8, 3), cfg(128, 128, 64, False, 8, 3), cfg(64, 128, 64, False, 4, 4)]
FORCED = {}
tuning.tuned_gemm_config = lambda *a, **k: FORCED.get("cfg")


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main():
    dev = torch.device("cuda")
    rows = []
    for name, E, H, I, tpe in SHAPES:
        S = E * tpe
        g = torch.Generator(device=dev).manual_seed(0)
        x = (torch.randn(S, H, device=dev, generator=g) * 0.5).bfloat16()
        w13 = (torch.randn(E, 2 * I, H, device=dev, generator=g) * H ** -0.5).bfloat16()
        w2 = (torch.randn(E, H, I, device=dev, generator=g) * I ** -0.5).bfloat16()
        offs = torch.arange(0, S + 1, tpe, device=dev, dtype=torch.int32)
        q13 = quantize_nvfp4(w13, nvfp4_global_scale(w13, per_slice=True))
        q2 = quantize_nvfp4(w2, nvfp4_global_scale(w2, per_slice=True))
        d13, d2 = dequantize_nvfp4(q13), dequantize_nvfp4(q2)
        h_ref = torch._grouped_mm(x, d13.transpose(1, 2), offs=offs[1:])
        h_ref = torch.nn.functional.silu(h_ref[:, :I].float()) * h_ref[:, I:].float()
        hb = h_ref.bfloat16()
        y_ref = torch._grouped_mm(hb, d2.transpose(1, 2), offs=offs[1:])
        t_bf16 = {}
        for tag, xx, ww, sw, ref in (("g1", x, q13, True, h_ref), ("g2", hb, q2, False, y_ref)):
            best = None
            for c in (DECODE if tpe <= 32 else MID):
                FORCED["cfg"] = c
                try:
                    out = grouped_gemm(xx, ww, offsets=offs, swiglu=sw)
                    err = rel(out, ref)
                    t = triton.testing.do_bench(lambda: grouped_gemm(xx, ww, offsets=offs, swiglu=sw), warmup=10,
                                                rep=40, return_mode="median") * 1e3
                except Exception as e:  # noqa: BLE001
                    print(name, tpe, tag, c, "FAILED", repr(e)[:300], flush=True)
                    continue
                print(f"{name} {tpe} {tag} {c} {t:.1f}us err {err:.2e}", flush=True)
                if err < 2e-2 and (best is None or t < best[0]):
                    best = (t, c, err)
            rows.append((name, tpe, tag, best))
        del q13, q2, d13, d2, w13, w2
        torch.cuda.empty_cache()
    print("\nBEST")
    for r in rows:
        print(r[0], r[1], r[2], f"{r[3][0]:.1f}us" if r[3] else "-", json.dumps(r[3][1]) if r[3] else "", flush=True)


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"{time.time() - t0:.0f}s")
