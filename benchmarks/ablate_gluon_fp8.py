"""Where the Gluon FP8 GEMMs' time goes: time a variant with parts of its work switched off (ablations).

The switches are not in the kernel. This script copies ``moe_ep/kernels/grouped_gemm/gluon_fp8.py`` into a temporary
module, patched (:data:`PATCHES`; a patch whose text the kernel no longer has stops the run and names itself), with the
switch set written into it as the constexpr ``ABLATE``; each switch set is timed in a process of its own:

- 1 promotion: the tensor core sums every K block into the accumulator (``use_acc=True``, waited for each step); with
  nothing to scale, no scale loads either;
- 2 (with 1) one MMA left in flight across the K steps;
- 4 store: the output's stores masked off by a condition false at run time (the values are still computed);
- 8 scale loads: the block factors are the constant 1 (their global loads dropped);
- 16 (GEMM1) epilogue: no SwiGLU or quantization, the sums reduced per row and stored under a false condition;
- 32 (GEMM2's form) two w boxes: each K step's 128-row w tile loaded as two TMA boxes of 64 rows, as GEMM1's slots
  are filled (its gate rows and its up rows), not one (a switch that adds work: set it alone against 0).

A switched-off kernel computes wrong numbers; only its time is read. Each row: 32 experts, uniform rows, CUDA-graph
median, us and TFLOP/s. From the repository root, on an H100 / H200:

    PYTHONPATH=$PWD python3 benchmarks/ablate_gluon_fp8.py --form gemm1 --switches 0,8,1,16,31
    PYTHONPATH=$PWD python3 benchmarks/ablate_gluon_fp8.py --form gemm2 --variant coop_tma_store_paired
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile

KERNEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "moe_ep", "kernels", "grouped_gemm",
                      "gluon_fp8.py")
SHAPES = {"gemm1": (2048, 7168, 1024), "gemm2": (7168, 2048, 1024), "plain": (4096, 7168, 1024)}
"""Form -> (N (GEMM1: I), K, rows per expert): DeepSeek-V3 EP8's GEMM1 and GEMM2, and a GEMM2-form GEMM of GEMM1's
FLOPs."""

PATCHES = [  # (what, the kernel's text, the ablation's)
    ("relative imports", "from ... import device_facts", "from moe_ep import device_facts"),
    ("relative imports", "from ...errors import", "from moe_ep.errors import"),
    ("relative imports", "from ...triton_runtime import", "from moe_ep.triton_runtime import"),
    ("relative imports", "from ..fp8 import", "from moe_ep.kernels.fp8 import"),
    ("relative imports", "from .gluon_fp8_swiglu import", "from moe_ep.kernels.grouped_gemm.gluon_fp8_swiglu import"),
    ("8: scale loads", "    return xs, ws, ws_up\n", """    if ABLATE & 8:  # (the loads above go unused: dropped)
        xs = gl.full(rows.shape, 1.0, gl.float32, layout=rows.type.layout)
        ws = xs
        ws_up = xs
    return xs, ws, ws_up
"""),
    ("1, 2: promotion", "    elif PAIRED:\n", """    elif ABLATE & 1:
        acc = gl.zeros_like(da)
        if ABLATE & 2:
            acc = _ablate_mma(x_ring, w_ring, ready, i, acc, WG, STAGES)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            i += 1
            for ks in range(1, KB_STEPS):
                acc = _ablate_mma(x_ring, w_ring, ready, i, acc, WG, STAGES)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
                mbarrier.arrive(empty.index((i - 1) % STAGES), count=1)
                i += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            mbarrier.arrive(empty.index((i - 1) % STAGES), count=1)
        else:
            for ks in range(0, KB_STEPS):
                pa = _ablate_mma(x_ring, w_ring, ready, i, acc, WG, STAGES)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(pa, ))
                mbarrier.arrive(empty.index(i % STAGES), count=1)
                i += 1
    elif PAIRED:
"""),
    ("1, 2: promotion", "@gluon.jit\ndef _promoted_sums(", """@gluon.jit
def _ablate_mma(x_ring, w_ring, ready, i, acc, WG: gl.constexpr, STAGES: gl.constexpr):
    slot = i % STAGES
    mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
    a = x_ring.index(slot).slice(WG * acc.shape[0], acc.shape[0], dim=0)
    return warpgroup_mma(a, w_ring.index(slot).permute((1, 0)), acc, use_acc=True, is_async=True)


@gluon.jit
def _promoted_sums("""),
    ("16: GEMM1's epilogue", "                h0 = swiglu_pass(acc, n0, N, half_layout)\n",
     """                if ABLATE & 16:
                    k0 = gl.sum(acc, axis=1)
                else:
                    h0 = swiglu_pass(acc, n0, N, half_layout)
"""),
    ("4, 16: GEMM1's store", """                h1 = swiglu_pass(acc, n0 + BN // 2, N, half_layout)
                store_fp8_block(h0, h1, out_ptr, os_ptr, row0, end, n0, N)""", """                if ABLATE & 16:
                    gl.store(os_ptr + rows, k0 + gl.sum(acc, axis=1), mask=rmask & (N < 0))
                else:
                    h1 = swiglu_pass(acc, n0 + BN // 2, N, half_layout)
                    end_s = end
                    if ABLATE & 4:
                        end_s = row0 + (end - row0) * (N < 0).to(gl.int32)
                    store_fp8_block(h0, h1, out_ptr, os_ptr, row0, end_s, n0, N)"""),
    ("32: two w boxes", "                        _tma_load(w_desc, [g * N + n0, ks * BK], bar, w_ring.index(slot))\n",
     """                        if ABLATE & 32:
                            _tma_load(w_desc, [g * N + n0, ks * BK], bar, w_ring.index(slot).slice(0, HALF, dim=0))
                            _tma_load(w_desc, [g * N + n0 + HALF, ks * BK], bar,
                                      w_ring.index(slot).slice(HALF, HALF, dim=0))
                        else:
                            _tma_load(w_desc, [g * N + n0, ks * BK], bar, w_ring.index(slot))
"""),
    ("32: two w boxes", "w_desc.block_type.shape[0] * (2 if SWIGLU else 1)",
     "w_desc.block_type.shape[0] * (2 if SWIGLU or ABLATE & 32 else 1)"),
    ("32: two w boxes", "wq.contiguous().view(G * R, K), [block_n // 2 if swiglu else block_n,",
     "wq.contiguous().view(G * R, K), [block_n // 2 if swiglu or ABLATE.value & 32 else block_n,"),
    ("32: two w boxes", "tensordesc<fp8e4nv[{block_n // 2 if swiglu else block_n}, {BLOCK_K}]",
     "tensordesc<fp8e4nv[{block_n // 2 if swiglu or ABLATE.value & 32 else block_n}, {BLOCK_K}]"),
]

GEMM2_STORE = ("                cols = n0 + c_off\n", "        first = last\n")
"""Where GEMM2's store block begins, and the line after its end: switch 4 puts the block under a condition false at
run time, and keeps the kernel's own block, unchanged, without the switch."""


def ablated_module(path: str, switches: int):
    """The kernel module with :data:`PATCHES` applied and ``switches`` (the module doc's bits) as ``ABLATE``, written
    to ``path`` and imported."""
    with open(KERNEL) as f:
        src = f.read()
    anchor = "BLOCK_K = FP8_BLOCK  #"
    if src.count(anchor) != 1:
        raise SystemExit(f"ablate_gluon_fp8: the kernel has {anchor!r} {src.count(anchor)} times, not once")
    src = src.replace(anchor, f"ABLATE = gl.constexpr({int(switches)})\n{anchor}")
    for what, old, new in PATCHES:
        if src.count(old) != 1:
            raise SystemExit(f"ablate_gluon_fp8: the kernel has the text of the patch '{what}' {src.count(old)} times, "
                             f"not once: {old[:60]!r}")
        src = src.replace(old, new)
    begin = src.find(GEMM2_STORE[0])
    end = src.find(GEMM2_STORE[1], begin)
    if begin < 0 or end < 0:
        raise SystemExit("ablate_gluon_fp8: the kernel no longer has GEMM2's store block where the switch 4 expects it")
    block = src[begin:end].splitlines()
    src = (src[:begin] + "                if ABLATE & 4:\n                    if N < 0:\n"
           + "".join("        " + line + "\n" for line in block) + "                else:\n"
           + "".join("    " + line + "\n" for line in block) + src[end:])
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("gluon_fp8_ablated", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def time_one(form: str, variant: str, switches: int, path: str) -> dict:
    """Time ``variant`` of ``form`` with ``switches`` off, on ``bench_gluon_fp8.py``'s operands of the shape."""
    import torch
    import moe_ep  # noqa: F401  (before triton)
    from bench_gluon_fp8 import EXPERTS, operands  # (this folder: the script's own, first on sys.path)
    from moe_ep.commands.timing import time_graph
    from moe_ep.kernels.fp8 import fp8_scales_shape
    g = ablated_module(path, switches)
    N, K, rows = SHAPES[form]
    dev = torch.device("cuda")
    swiglu = form == "gemm1"
    R = 2 * N if swiglu else N
    _, _, x8, w8, offs, rs = operands(N, K, rows, swiglu)
    M = EXPERTS * rows
    if swiglu:
        out = torch.empty(M, N, dtype=torch.float8_e4m3fn, device=dev)
        out_scales = torch.empty(fp8_scales_shape((M, N), 1), dtype=torch.float32, device=dev)
    else:
        out, out_scales = torch.empty(M, N, dtype=torch.bfloat16, device=dev), x8.scales
    progs = torch.cuda.get_device_properties(dev).multi_processor_count

    def call():
        g.launch(x8.data, x8.scales, w8.data, w8.scales, offs, out, out_scales, rs, variant, swiglu=swiglu,
                 num_programs=progs)
    call()
    torch.cuda.synchronize()
    us = time_graph(call) * 1e6
    return dict(form=form, variant=variant, switches=switches, N=N, K=K, rows=rows, us=round(us, 1),
                tflops=round(2 * M * R * K / us / 1e6, 1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--form", choices=sorted(SHAPES), default="gemm2")
    ap.add_argument("--variant", default=None, help="default: the form's default (gemm1: GEMM1's, else GEMM2's)")
    ap.add_argument("--switches", default="0,8,3,4,15", help="comma-separated switch sets (module doc)")
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # a child process's switch set
    ap.add_argument("--out", default=None, help="append each row as a JSON line")
    a = ap.parse_args()
    import moe_ep  # noqa: F401  (before triton)
    from moe_ep.kernels.grouped_gemm import gluon_fp8
    variant = a.variant or (gluon_fp8.DEFAULT_SWIGLU_VARIANT if a.form == "gemm1" else gluon_fp8.DEFAULT_VARIANT)
    if gluon_fp8.unavailable_reason() is not None:
        raise SystemExit(f"ablate_gluon_fp8: cannot run here: {gluon_fp8.unavailable_reason()}")
    if a.one is not None:  # the child: one switch set
        with tempfile.TemporaryDirectory() as d:
            print(json.dumps(time_one(a.form, variant, a.one, os.path.join(d, "gluon_fp8_ablated.py"))), flush=True)
        return
    for s in (int(v) for v in a.switches.split(",")):
        cmd = [sys.executable, __file__, "--form", a.form, "--variant", variant, "--one", str(s)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        line = r.stdout.strip().splitlines()[-1] if r.returncode == 0 and r.stdout.strip() else None
        if line is None:
            print(f"switches {s}: failed (rc {r.returncode}): {r.stderr.strip().splitlines()[-1:]}", flush=True)
            continue
        print(line, flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
