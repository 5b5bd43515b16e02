"""What the compile checks build: ``(raw jit function, signature, constexprs)`` per kernel variant, one function
per kernel module (:data:`TABLES`), for ``tests/test_compile.py``, which builds each with ``triton.compile`` for
sm_90 and sm_100 in a process without the interpreter (no GPU needed). Test support, so it lives here, not in the
kernels."""

from __future__ import annotations

from ..kernels import bridge as _bridge
from ..kernels import fp8 as _fp8
from ..kernels import nvfp4 as _nvfp4
from ..kernels.grouped_gemm import fp4_decode as _fp4_decode
from ..kernels.grouped_gemm import gluon_fp8 as _gluon_fp8
from ..kernels.grouped_gemm import gluon_nvfp4 as _gluon_nvfp4
from ..kernels.grouped_gemm import gluon_nvfp4_prefill as _gluon_nvfp4_prefill
from ..kernels.grouped_gemm import kernels as _gg_kernels
from ..kernels.grouped_gemm import sm100_fp4 as _sm100_fp4


def nvfp4():
    """(kernel, signature, constexprs) per variant, for tests/test_compile.py (sm_90 / sm_100 builds)."""
    checks = []
    for xt in ("bf16", "fp16", "fp32"):
        for has_idx in (False, True):
            for swz in (False, True):
                sig = {"x_ptr": f"*{xt}", "idx_ptr": "*i64" if has_idx else f"*{xt}", "gs_ptr": "*fp32",
                       "q_ptr": "*u8", "s_ptr": "*u8", **{a: "i32" for a in (
                           "R", "M_SRC", "K", "stride_x", "rows_per_gs", "slice_rows", "slice_cp", "K_BUCKET")}}
                for fast in (False, True):
                    checks.append((_nvfp4._quantize_kernel.fn.fn, sig, {"HAS_IDX": has_idx, "SWIZZLE": swz,
                                                                        "BLOCK_M": 16,
                                                                 "BLOCK_K": 512, "EVEN_K": fast, "ONE_GS": fast}))
        for swz in (False, True):
            sig = {"q_ptr": "*u8", "s_ptr": "*u8", "gs_ptr": "*fp32", "out_ptr": f"*{xt}",
                   **{a: "i32" for a in ("R", "K", "rows_per_gs", "slice_rows", "slice_cp", "K_BUCKET")}}
            checks.append((_nvfp4._dequantize_kernel.fn, sig, {"SWIZZLE": swz, "BLOCK_M": 16, "BLOCK_K": 512}))
    return checks


def fp8():
    """(kernel, signature, constexprs) per variant of the FP8 quantize / dequantize kernels (sm_90 / sm_100)."""
    checks = []
    for per_row in (True, False):
        bm = 16 if per_row else 128
        for xt in ("bf16", "fp16", "fp32"):
            sig = {"x_ptr": f"*{xt}", "q_ptr": "*u8", "s_ptr": "*fp32",
                   **{a: "i32" for a in ("R", "K", "stride_x", "ROW_BLOCKS", "COL_BLOCKS")}}
            const = {"PER_ROW": per_row, "BLOCK_M": bm}
            checks.append((_fp8._quantize_fp8_kernel, {**sig, **dict.fromkeys(const, "constexpr")}, const))
            sig = {"q_ptr": "*u8", "s_ptr": "*fp32", "out_ptr": f"*{xt}",
                   **{a: "i32" for a in ("R", "K", "ROW_BLOCKS", "COL_BLOCKS")}}
            checks.append((_fp8._dequantize_fp8_kernel, {**sig, **dict.fromkeys(const, "constexpr")}, const))
    return checks


def bridge():
    """(raw jit function, signature, constexprs) per kernel variant, for ``triton.compile`` on sm_90/sm_100
    without a GPU (tests/test_compile.py)."""
    ids = {"idx_ptr": "*i64", "valid_ptr": "*i32"}
    shape = {"N": "i32", "K": "i32", "ROWS_PER_GROUP": "i32", "L": "i32", "HAS_VALID": "constexpr"}
    hist = {**ids, "hist_ptr": "*i32", **shape, "CHUNK": "constexpr", "LP": "constexpr"}
    place = {**ids, "hist_ptr": "*i32", "counts_ptr": "*i32", "offsets_ptr": "*i32", "slot_ptr": "*i32",
             "row_of_slot_ptr": "*i32", "C": "i32", "N": "i32", "K": "i32", "ROWS_PER_GROUP": "i32", "L": "i32",
             "PAD_ROWS": "i32", "w_ptr": "*fp32", "slot_w_ptr": "*fp32", "ready_ptr": "*i32", "HAS_VALID": "constexpr",
             "ONE_CHUNK": "constexpr", "PADDED": "constexpr", "SLOT_W": "constexpr", "ZERO_READY": "constexpr",
             "CHUNK": "constexpr", "LP": "constexpr"}
    gather = {"x_ptr": "*bf16", "row_ptr": "*i32", "offsets_ptr": "*i32", "TOTAL_AT": "i32", "out_ptr": "*bf16",
              "N": "i32", "M_X": "i32", "H": "i32", "stride_x": "i32", "BLOCK_M": "constexpr", "BLOCK_H": "constexpr"}
    red = {"y_ptr": "*bf16", "slot_ptr": "*i32", "w_ptr": "*fp32", "out_ptr": "*bf16", "M": "i32", "H": "i32",
           "K": "constexpr", "N_Y": "i32", "stride_y": "i32", "HAS_W": "constexpr", "BLOCK_M": "constexpr",
           "BLOCK_H": "constexpr"}
    big = {"CHUNK": _bridge._ROUTE_CHUNK, "LP": 64}
    checks = [(_bridge._route_hist_kernel, hist, {"HAS_VALID": True, **big}),
              (_bridge._route_hist_kernel, dict(hist, idx_ptr="*i32", valid_ptr="*i64"), {"HAS_VALID": True, **big})]

    def chunk(one):
        return _bridge._ROUTE_ONE_LAUNCH if one else _bridge._ROUTE_CHUNK
    # (the bridged compute's routes: LL RANK_MAJOR, HT FLAT, fused_moe; ZERO_READY: its chain counters zeroed)
    checks += [(_bridge._route_place_kernel, place, {"HAS_VALID": v, "ONE_CHUNK": one, "PADDED": False,
                                                     "SLOT_W": False, "ZERO_READY": v, **big, "CHUNK": chunk(one)})
               for v in (False, True) for one in (False, True)]
    # LL EXPERT_MAJOR at world size 1 (padded slots), HT EXPERT_MAJOR (slot weights, int64 counts and offsets)
    wide = dict(place, counts_ptr="*i64", offsets_ptr="*i64", w_ptr="*bf16")
    checks += [(_bridge._route_place_kernel, sig, {"HAS_VALID": False, "ONE_CHUNK": one, "PADDED": pad,
                                                   "SLOT_W": sw, "ZERO_READY": False, **big, "CHUNK": chunk(one)})
               for one in (False, True) for pad, sw, sig in ((True, False, place), (False, True, wide))]
    scatter = {"x_ptr": "*bf16", "slot_ptr": "*i32", "out_ptr": "*bf16", "N": "i32", "K": "i32", "H": "i32",
               "stride_x": "i32", "N_OUT": "i32", "BLOCK_M": "constexpr", "BLOCK_H": "constexpr"}
    for t in ("bf16", "u8", "fp32"):  # bf16 rows; NVFP4 rows: packed codes and scales (u8), global scales (fp32)
        checks.append((_bridge._gather_rows_kernel.fn, dict(gather, x_ptr=f"*{t}", out_ptr=f"*{t}"),
                       {"BLOCK_M": 4, "BLOCK_H": 1024}))
        checks.append((_bridge._scatter_rows_kernel.fn, dict(scatter, x_ptr=f"*{t}", out_ptr=f"*{t}"),
                       {"BLOCK_M": 4, "BLOCK_H": 1024}))
    checks += [(_bridge._unpermute_reduce_kernel.fn, red, {"K": 8, "HAS_W": w, "BLOCK_M": 4, "BLOCK_H": 1024})
               for w in (False, True)]
    return checks


def fp4_decode():
    """(kernel, signature, constexprs) for tests/test_compile.py (sm_90 / sm_100 builds); the decode functions
    inside the GEMM are built by grouped_gemm's checks."""
    def sig(cnt):  # in argument order
        return {"q_ptr": "*u8", "s_ptr": "*u8", "out_ptr": "*bf16", "cnt_ptr": cnt,
                **{a: "i32" for a in ("R", "K", "KQ", "K16", "G", "M_MAX", "K_BUCKET")}, "MASKED": "constexpr"}
    # counts: int32 or int64
    return [(_fp4_decode._decode_kernel.fn, sig(cnt), {"MASKED": masked, "BLOCK_M": bm, "BLOCK_K": bk})
            for masked, cnt, bm, bk in ((False, "*u8", 16, 512), (True, "*i32", 64, 128), (True, "*i64", 16, 512))]


def grouped_gemm():
    """(raw jit function, signature, constexprs) per kernel variant, one representative config each,
    for ``tests/test_compile.py`` (``triton.compile`` for sm_90 / sm_100 without the interpreter)."""
    checks = []
    for ragged in (False, True):
        for x_dec in (False, True):
            for w_fp4 in (False, True):
                for swiglu, has_rs in ((True, False), (False, True)):
                    for swap, tma in ((True, False), (False, False), (False, True)):
                        if tma and (w_fp4 or not ragged):
                            continue
                        sig = dict(_gemm_signature(), w_ptr="*u8" if w_fp4 else "*bf16")
                        const = {"RAGGED": ragged, "W_FP4": w_fp4, "SWIGLU": swiglu, "HAS_RS": has_rs, "BLOCK_G": 32,
                                 "FP8": False, "FP8_OUT": False,
                                 "X_DECODED": x_dec, "W_DECODED": not (w_fp4 or swiglu),  # decoded NVFP4 copies
                                 "BLOCK_M": 16 if swap else 128, "BLOCK_N": 128 if swap else 128,
                                 "BLOCK_K": 128 if swap else 64, "SWAP_AB": swap, "GROUP_M": 8, "TMA": tma,
                                 "EVEN_K": ragged,  # both load paths, over the variants
                                 "PERSISTENT": not ragged and swiglu and not tma,  # both masked grids
                                 "SIGNAL": swiglu and not tma, "WAIT": not swiglu and not tma,  # as in expert_mlp
                                 "PDL": not tma}
                        if not tma:
                            const.update(x_desc=None, w_desc=None)
                        for name in const:
                            sig[name] = "constexpr"
                        checks.append((_gg_kernels._grouped_gemm_kernel, sig, const))
    return checks + _fp8_gemms()


def _gemm_signature() -> dict:
    """The grouped-GEMM kernel's runtime arguments (bf16 operands; variants change the pointer types)."""
    return {"x_ptr": "*bf16", "xgs_ptr": "*fp32", "xs_ptr": "*fp32", "XGS_STRIDE": "i32", "w_ptr": "*bf16",
            "ws_ptr": "*u8", "wgs_ptr": "*fp32", "out_ptr": "*bf16", "os_ptr": "*fp32", "rs_ptr": "*fp32",
            "cnt_ptr": "*i32", "x_desc": "tensordesc<bf16[128, 64]>", "w_desc": "tensordesc<bf16[128, 64]>",
            "ready_ptr": "*i32", "WAIT_BM": "i32", "WAIT_NT": "i32", "G": "i32", "M_MAX": "i32", "N": "i32",
            "K": "i32", "S": "i32", "KQ": "i32", "K16": "i32", "M_BUCKET": "i32"}


def _fp8_gemms():
    """FP8 x FP8 variants (e4m3 operands, fp32 scales): both layouts; GEMM1 (SwiGLU, FP8 output or bf16) and GEMM2
    (row scale); swapped decode tiles and unswapped ones, K steps of 128, 64 and 32, tiles of one weight scale block
    and of two; both K load paths and grids; ragged TMA tiles."""
    checks = []
    for ragged in (False, True):
        for swiglu, fp8_out in ((True, True), (True, False), (False, False)):
            for swap, bm, bn, bk, tma in ((True, 16, 128, 128, False), (False, 64, 128, 64, False),
                                          (False, 128, 128, 32, False), (False, 16, 256, 64, False),
                                          (False, 64, 128, 128, True), (False, 32, 256, 64, True),
                                          (False, 128, 128, 64, True)):  # (SwiGLU: in two halves)
                if tma and not ragged:
                    continue
                sig = dict(_gemm_signature(), x_ptr="*fp8e4nv", w_ptr="*fp8e4nv", ws_ptr="*fp32",
                           out_ptr="*u8" if fp8_out else "*bf16")
                const = {"RAGGED": ragged, "W_FP4": False, "SWIGLU": swiglu, "HAS_RS": not swiglu, "BLOCK_G": 32,
                         "FP8": True, "FP8_OUT": fp8_out, "X_DECODED": False, "W_DECODED": False, "BLOCK_M": bm,
                         "BLOCK_N": bn, "BLOCK_K": bk, "SWAP_AB": swap, "GROUP_M": 8, "TMA": tma,
                         "EVEN_K": ragged != swap, "PERSISTENT": not ragged and swap, "SIGNAL": False, "WAIT": False,
                         "PDL": False}
                if tma:
                    sig.update(fp8_tma_descriptors(bm, bn, bk, swiglu))
                else:
                    const.update(x_desc=None, w_desc=None)
                for name in const:
                    sig[name] = "constexpr"
                checks.append((_gg_kernels._grouped_gemm_kernel, sig, const))
    return checks


def fp8_tma_descriptors(bm: int, bn: int, bk: int, swiglu: bool) -> dict:
    """The signature's e4m3 TMA descriptors of an FP8 TMA tile (w's box half the tile's rows where the tile is
    computed in two halves: ``config_space.fp8_split_halves``)."""
    from ..kernels.grouped_gemm import config_space
    half = config_space.fp8_split_halves({"TMA": True, "BLOCK_M": bm}, swiglu)
    return {"x_desc": f"tensordesc<fp8e4nv[{bm}, {bk}]>",
            "w_desc": f"tensordesc<fp8e4nv[{bn // 2 if half else bn}, {bk}]>"}


FP8_ALIGNED = ("x_ptr", "xs_ptr", "w_ptr", "ws_ptr", "out_ptr", "os_ptr", "rs_ptr", "cnt_ptr", "N", "K")


def fp8_gemm_registers(cfg, swiglu: bool) -> tuple[int, int, int]:
    """(registers per thread, spill store bytes, spill load bytes) ptxas reports for an unswapped FP8 grouped-GEMM
    config (a ``triton.Config``, pointer loads or TMA) built for sm_90a as a launch builds it (aligned pointers, the
    config's warps and stages), as GEMM1 (swiglu: SwiGLU with an FP8 output) or GEMM2 (row scale). Needs the
    interpreter off."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    tma = bool(cfg.kwargs["TMA"])
    kernel, sig, const = next((k, s, c) for k, s, c in _fp8_gemms() if c["RAGGED"] and c["SWIGLU"] == swiglu
                              and c["FP8_OUT"] == swiglu and not c["SWAP_AB"] and c["TMA"] == tma)
    bm, bn, bk = (cfg.kwargs[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
    const = dict(const, **{k: cfg.kwargs[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SWAP_AB", "GROUP_M")},
                 EVEN_K=True, PERSISTENT=False)
    if tma:
        sig = dict(sig, **fp8_tma_descriptors(bm, bn, bk, swiglu))
    attrs = {(kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a in FP8_ALIGNED}
    k = triton.compile(ASTSource(kernel, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    return sm90_ptxas_usage(sm90_ptxas_log(k.asm["ptx"]))


def sm90_ptxas_log(ptx: str) -> str:
    """What ``ptxas -v --gpu-name sm_90a`` says of a PTX text (stdout and stderr; raises if it fails), with the ptxas
    Triton builds sm_90 with (3.9: not bin/ptxas)."""
    import os
    import subprocess
    import tempfile

    import triton.backends.nvidia.compiler as nvidia_compiler
    ptxas = nvidia_compiler.get_ptxas(90).path
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "k.ptx"), "w") as f:
            f.write(ptx)
        r = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", os.path.join(d, "k.ptx"), "-o",
                            os.path.join(d, "k.cubin")], capture_output=True, text=True, check=True)
    return r.stdout + r.stderr


def sm90_ptxas_usage(log: str) -> tuple[int, int, int]:
    """(registers per thread, spill store bytes, spill load bytes) of the one kernel a :func:`sm90_ptxas_log` is
    of (a log without those lines raises ``ValueError``)."""
    import re
    regs = re.findall(r"Used (\d+) registers", log)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if len(regs) != 1 or len(spills) != 1:
        raise ValueError(f"not the ptxas -v log of one kernel: {log!r}")
    return int(regs[0]), int(spills[0][0]), int(spills[0][1])


def fp8_prefill_configs(swiglu: bool) -> list:
    """The GPU space's unswapped configs (pointer loads and TMA) an FP8 GEMM1 (swiglu, FP8 output) or GEMM2 may take
    by the FP8 rules and the SwiGLU tile bound, before the register rule (``config_space.fp8_registers_ok``)."""
    from ..kernels.grouped_gemm import config_space
    return [c for c in config_space.grouped_gemm_configs()
            if not (c.kwargs["SWAP_AB"] or config_space.fp8_rule_broken(c.kwargs, swiglu))
            and not (swiglu and c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] > 128 * 128)]


def gluon_nvfp4():
    """(Gluon kernel, signature, constexprs, compile options) per token tile, output dtype, decode and pipeline
    (overlap) of the Hopper NVFP4 GEMM, at the launch's stages and registers: built with ``GluonASTSource`` (a Gluon
    function is not a ``triton.language`` one), for sm_90 only (:data:`SM90_ONLY`: it is wgmma code)."""
    checks = []
    for block_t in _gluon_nvfp4.TOKEN_TILES:
        for out, fast, overlap in (("bf16", True, False), ("fp32", True, False), ("bf16", False, False),
                                   ("bf16", True, True)):
            sig, const, opts = _gluon_nvfp4.compile_signature(block_t, out, fast, overlap)
            checks.append((_gluon_nvfp4._gluon_nvfp4_kernel, sig, const, opts))
    return checks


def gluon_nvfp4_prefill():
    """(Gluon kernel, signature, constexprs, compile options) per token tile and form (GEMM2's with and without the
    row scale, GEMM1's SwiGLU) of the Hopper NVFP4-weight prefill GEMM, with and without the TMA store, ragged, and
    each form masked at one tile and with its scale words 3 steps ahead at another, as a launch builds it: sm_90 only
    (:data:`SM90_ONLY`)."""
    kernel = _gluon_nvfp4_prefill._gluon_nvfp4_prefill_kernel
    return [(kernel, *_gluon_nvfp4_prefill.compile_signature(block_t, has_rs, tma_store, swiglu))
            for block_t in _gluon_nvfp4_prefill.TOKEN_TILES for swiglu in (False, True)
            for has_rs in ((False, ) if swiglu else (True, False)) for tma_store in (True, False)
            if tma_store or block_t == 128] + \
        [(kernel, *_gluon_nvfp4_prefill.compile_signature(128, not swiglu, True, swiglu, masked=True))
         for swiglu in (False, True)] + \
        [(kernel, *_gluon_nvfp4_prefill.compile_signature(256, not swiglu, True, swiglu, scale_ahead=3))
         for swiglu in (False, True)]  # (an out TMA cannot store into takes 128-token tiles: launch)


def gluon_fp8():
    """(Gluon kernel, signature, constexprs, compile options) per variant of the Hopper FP8 block-scaled GEMM: GEMM2's
    form (``gluon_fp8.VARIANTS``) with and without the row scale, and GEMM1's (``gluon_fp8.SWIGLU_VARIANTS``: SwiGLU,
    FP8 out), as a launch builds it: sm_90 only (:data:`SM90_ONLY`)."""
    return [(_gluon_fp8._gluon_fp8_kernel, *_gluon_fp8.compile_signature(variant, has_rs))
            for variant in _gluon_fp8.VARIANTS for has_rs in (True, False)] + \
        [(_gluon_fp8._gluon_fp8_kernel, *_gluon_fp8.compile_signature(variant, swiglu=True))
         for variant in _gluon_fp8.SWIGLU_VARIANTS]


TABLES = {"nvfp4": nvfp4, "fp8": fp8, "bridge": bridge, "fp4_decode": fp4_decode, "grouped_gemm": grouped_gemm,
          "gluon_nvfp4": gluon_nvfp4, "gluon_nvfp4_prefill": gluon_nvfp4_prefill, "gluon_fp8": gluon_fp8}
"""Kernel module -> its variants."""

SM90_ONLY = {"gluon_nvfp4", "gluon_nvfp4_prefill", "gluon_fp8"}
"""Kernel modules built for sm_90 alone (Hopper-only instructions): the sm_100 build says so instead of building."""


SM100_FP4_ALIGNED = ("xq_ptr", "xs_ptr", "xgs_ptr", "wq_ptr", "ws_ptr", "wgs_ptr", "out_ptr", "rs_ptr", "cnt_ptr",
                     "N", "K", "K16")


def sm100_fp4():
    """(kernel, signature, constexprs, compile options) per config of ``sm100_fp4.SM100_CONFIGS``, as a launch builds
    it (16-byte aligned pointers and sizes, the config's warps and stages), with formats and epilogues rotating over
    the configs: both layouts, SwiGLU (GEMM1) and row scale (GEMM2), linear and swizzled scales, bf16 and fp32 out,
    both K load paths. Built for sm_100 alone (tcgen05 code), by tests/test_sm100_fp4.py, which reads the PTX;
    not in :data:`TABLES`."""
    kernel = _sm100_fp4._sm100_fp4_kernel
    checks = []
    for i, c in enumerate(_sm100_fp4.SM100_CONFIGS):
        swiglu = _sm100_fp4.config_fits(c.kwargs, True) and (i % 2 == 0 or not _sm100_fp4.config_fits(c.kwargs, False))
        ragged, swz, fp32_out, even_k = i % 3 != 0, i % 4 in (1, 2), i % 5 == 4, i % 7 != 3
        sig = {"xq_ptr": "*u8", "xs_ptr": "*u8", "xgs_ptr": "*fp32", "XGS_STRIDE": "i32", "wq_ptr": "*u8",
               "ws_ptr": "*u8", "wgs_ptr": "*fp32", "out_ptr": "*fp32" if fp32_out else "*bf16", "rs_ptr": "*fp32",
               "cnt_ptr": "*i32", **{a: "i32" for a in ("G", "M_MAX", "N", "K", "S", "K16", "X_SLICE_ROWS",
                                                          "W_SLICE_ROWS", "CP")}}
        const = dict(RAGGED=ragged, SWIGLU=swiglu, HAS_RS=not swiglu, X_SWIZZLED=swz, W_SWIZZLED=swz, BLOCK_G=32,
                     EVEN_K=even_k, EMULATE=False, **c.kwargs)
        sig.update(dict.fromkeys(const, "constexpr"))
        checks.append((kernel, sig, const, dict(num_warps=c.num_warps, num_stages=c.num_stages)))
    return checks


def sm100_fp4_build(check, cc: int = 100):
    """Build one :func:`sm100_fp4` check for ``GPUTarget("cuda", cc, 32)`` (interpreter off): the compiled kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel, sig, const, opts = check
    attrs = {(kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a in SM100_FP4_ALIGNED}
    return triton.compile(ASTSource(kernel, sig, const, attrs), target=GPUTarget("cuda", cc, 32), options=opts)


def block_scaled_fp4_mmas(ptx: str) -> list[dict]:
    """The tcgen05 MMAs of a PTX text, each ``{"op": opcode, "idesc": its instruction descriptor (an int, None where
    it is not a constant)}``: what the sm_100 compile checks read to see that the block-scaled NVFP4 MMA was built
    (``kind::mxf4nvf4.block_scale`` with a 16-block: ``scale_vec::4X`` in Triton 3.6, ``block16`` in 3.9) and with
    which scale type (descriptor bit 23: 0 is UE4M3, 1 UE8M0; N >> 3 in bits 17-22, M >> 4 in bits 24-28)."""
    import re
    consts = dict(re.findall(r"mov\.b32\s+(%r\d+),\s*(-?\d+);", ptx))
    found = []
    for op, reg in re.findall(r"(tcgen05\.mma[\w:.]*)\s+\[[^\]]*\],\s*%rd\d+,\s*%rd\d+,\s*(%r\d+)", ptx):
        found.append({"op": op, "idesc": int(consts[reg]) & 0xFFFFFFFF if reg in consts else None})
    return found


def nvfp4_mma_ok(mma: dict) -> bool:
    """Whether one of :func:`block_scaled_fp4_mmas` is the NVFP4 instruction: FP4 x FP4, 16-element blocks, UE4M3
    scales."""
    op, idesc = mma["op"], mma["idesc"]
    sixteen = op.endswith(".block_scale.scale_vec::4X") or op.endswith(".block_scale.block16")
    return "kind::mxf4nvf4" in op and sixteen and idesc is not None and not idesc >> 23 & 1
