"""Where bf16 decode loses against the read ceiling: weight-streaming GEMM variants side by side on one GPU.

At a few tokens per expert the expert MLP is a stream of weights (GEMM1 reads w13, GEMM2 reads w2). This
times, per weight tensor of a model's local experts, in the same run:

- ``read``: a plain streaming read of the weights (the practical ceiling, ``moe_ep.commands.timing.time_read``);
- ``ours``: moe-ep's grouped GEMM on those weights (tuned config; GEMM1 with SwiGLU);
- ``ours +1 expert``: the same with one more expert, per expert (equal per-expert times: no tail-wave loss);
- ``stream``: a minimal swapped-operand streaming GEMM (128 weight rows x 16 tokens per program, cp.async
  pipeline) with the weights row-major (as the library keeps them), tile-contiguous (each program's K step one
  contiguous 32 KB block), or k-major (step s of every tile contiguous, so concurrent programs read one
  window), with and without its activation loads, and with TMA (tensor-descriptor) loads.

``--once`` runs each kernel once, untimed, for a profiler:
``ncu --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum,
dram__throughput.avg.pct_of_peak_sustained_elapsed -k regex:"stream|_read_kernel|_grouped_gemm"
python3 benchmarks/bench_decode_stream.py --once``.

From the repository root (or with moe-ep installed, without ``PYTHONPATH``):

    PYTHONPATH=$PWD python3 benchmarks/bench_decode_stream.py [--out results.json] [--once]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import moe_ep  # noqa: F401  (before triton)
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from moe_ep.commands.common import uniform_offsets
from moe_ep.commands.timing import read_once, time_graph, time_read
from moe_ep.kernels import grouped_gemm

MODELS = {"DeepSeek-V3 EP8": (32, 7168, 2048, 16), "Qwen3-30B-A3B": (128, 2048, 768, 8)}  # E, H, I, tokens/expert
R, BM, BK, STAGES = 128, 16, 128, 4  # the shipped decode tile: 128 weight rows x 16 tokens, K steps of 128
LAYOUTS = ("row-major", "tile-contiguous", "k-major")


@triton.jit
def _stream_kernel(x_ptr, w_ptr, out_ptr, NW, K, LAYOUT: tl.constexpr, X_LOADS: tl.constexpr, R: tl.constexpr,
                   BM: tl.constexpr, BK: tl.constexpr):
    """out[g, rows, :BM] = w[g, rows] @ x[g]^T for one tile of R weight rows of expert g (BM tokens each)."""
    pid = tl.program_id(0)
    tiles = NW // R
    g = pid // tiles
    r = tl.arange(0, R)
    kk = tl.arange(0, BK)
    rows = g.to(tl.int64) * NW + (pid % tiles) * R + r
    if LAYOUT == 0:  # [G, NW, K]
        w = w_ptr + rows[:, None] * K + kk[None, :]
        step = BK
    elif LAYOUT == 1:  # [G, NW / R, K / BK, R, BK]
        w = w_ptr + pid.to(tl.int64) * R * K + r[:, None] * BK + kk[None, :]
        step = R * BK
    else:  # [K / BK, G, NW / R, R, BK]
        w = w_ptr + pid.to(tl.int64) * R * BK + r[:, None] * BK + kk[None, :]
        step = tl.num_programs(0).to(tl.int64) * R * BK
    xt = tl.full([BK, BM], 1.0, tl.float32).to(tl.bfloat16)
    acc = tl.zeros([R, BM], tl.float32)
    for k in range(0, K // BK):
        if X_LOADS:
            xt = tl.load(x_ptr + (g * BM + tl.arange(0, BM))[None, :] * K + (k * BK + kk)[:, None])
        acc = tl.dot(tl.load(w + k * step), xt, acc)
    tl.store(out_ptr + rows[:, None] * BM + tl.arange(0, BM)[None, :], acc.to(tl.bfloat16))


@triton.jit
def _stream_tma_kernel(x_ptr, w_desc, out_ptr, NW, K, R: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """As :func:`_stream_kernel` (row-major weights), the weight tiles loaded by TMA."""
    pid = tl.program_id(0)
    g = pid // (NW // R)
    row0 = g * NW + (pid % (NW // R)) * R
    kk = tl.arange(0, BK)
    acc = tl.zeros([R, BM], tl.float32)
    for k in range(0, K // BK):
        xt = tl.load(x_ptr + (g * BM + tl.arange(0, BM))[None, :] * K + (k * BK + kk)[:, None])
        acc = tl.dot(w_desc.load([row0, k * BK]), xt, acc)
    rows = row0 + tl.arange(0, R)
    tl.store(out_ptr + rows[:, None] * BM + tl.arange(0, BM)[None, :], acc.to(tl.bfloat16))


def relayout(w: torch.Tensor, layout: int) -> torch.Tensor:
    G, NW, K = w.shape
    if layout == 0:
        return w
    t = w.view(G, NW // R, R, K // BK, BK)
    return (t.permute(0, 1, 3, 2, 4) if layout == 1 else t.permute(3, 0, 1, 2, 4)).contiguous()


def stream_variants(w: torch.Tensor, time) -> dict:
    """Time every streaming variant on these weights; all must give the same output (same sums, same order)."""
    G, NW, K = w.shape
    x = torch.randn(G * BM, K, device=w.device).bfloat16()
    grid = (G * NW // R,)
    times, outs = {}, {}
    for layout, name in enumerate(LAYOUTS):
        wl = relayout(w, layout)
        for x_loads in (True, False) if layout == 0 else (True,):
            out = torch.empty(G * NW, BM, device=w.device, dtype=torch.bfloat16)

            def run(wl=wl, out=out, layout=layout, x_loads=x_loads):
                _stream_kernel[grid](x, wl, out, NW, K, LAYOUT=layout, X_LOADS=x_loads, R=R, BM=BM, BK=BK,
                                     num_warps=4, num_stages=STAGES)
            key = name + ("" if x_loads else ", no x loads")
            times[key] = time(run)
            if x_loads:
                outs[key] = out
        del wl
    desc = TensorDescriptor.from_tensor(w.view(G * NW, K), [R, BK])
    out = torch.empty(G * NW, BM, device=w.device, dtype=torch.bfloat16)
    times["row-major, TMA"] = time(lambda: _stream_tma_kernel[grid](x, desc, out, NW, K, R=R, BM=BM, BK=BK,
                                                                    num_warps=4, num_stages=STAGES))
    outs["row-major, TMA"] = out
    first = next(iter(outs.values()))
    times["outputs equal"] = all(torch.equal(first, o) for o in outs.values())
    return times


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_decode_stream.json")
    ap.add_argument("--once", action="store_true", help="run each kernel once, untimed (under a profiler)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")

    def once(fn):  # under a profiler: each kernel once, no time
        fn()
        torch.cuda.synchronize()
        return float("nan")

    def graph_us(fn):
        return time_graph(fn) * 1e6
    time = once if args.once else graph_us
    dev = torch.device("cuda")
    print(f"device {torch.cuda.get_device_name()}, triton {triton.__version__}, torch {torch.__version__}", flush=True)
    rows = []
    for model, (E, H, I, tpe) in MODELS.items():
        for gemm, (n, k) in (("GEMM1 (w13, SwiGLU)", (2 * I, H)), ("GEMM2 (w2)", (H, I))):
            row = {"model": model, "gemm": gemm}
            for experts in (E, E + 1):
                w = (torch.randn(experts, n, k, device=dev) * k ** -0.5).bfloat16()
                x = (torch.randn(experts * tpe, k, device=dev) * 0.5).bfloat16()
                offs = uniform_offsets(experts, tpe, dev)
                swiglu = gemm.startswith("GEMM1")
                grouped_gemm(x, w, offsets=offs, swiglu=swiglu, m_hint=tpe)
                t = time(lambda: grouped_gemm(x, w, offsets=offs, swiglu=swiglu, m_hint=tpe))
                if experts == E:
                    row["read"] = once(lambda: read_once(w)) if args.once else time_read(w) * 1e6
                    row["ours"] = t
                    row.update(stream_variants(w, time))
                else:
                    row["ours +1 expert, per expert x E"] = t / experts * E
            rows.append(row)
            print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()
    if args.once:
        return
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    cols = [c for c in rows[0] if c not in ("model", "gemm", "outputs equal")]
    print(f"\n{'model':16} {'gemm':20} " + " ".join(f"{c[:22]:>22}" for c in cols) + "  equal")
    for r in rows:
        print(f"{r['model'][:16]:16} {r['gemm']:20} " + " ".join(f"{r[c]:22.1f}" for c in cols)
              + f"  {r['outputs equal']}")
    print("us, median of CUDA-graph replays; read: the same weights streamed by a plain read kernel")


if __name__ == "__main__":
    main()
