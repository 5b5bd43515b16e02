"""The Gluon NVFP4-weight prefill GEMM (moe_ep/kernels/grouped_gemm/gluon_nvfp4_prefill.py) against the fp32 reference.

The GPU cases need sm_90 (wgmma with the weights' A operand in registers, TMA). On the CPU: the register decode's
bit operations (``_DECODE_ASM`` and the layout it fills), emulated in Python on every code byte and scale byte, give
the reference's values at the k each register holds; the bad-input table (the checks come before any launch); the
dispatcher's decisions and its launch of the path (with a reference stand-in). On the GPU, the shared property
(``moe_ep.testing.properties.check_gluon_nvfp4_prefill_gemm``): the fp32 reference on the dequantized weights, which
the kernel computes up to fp32 summation order and the global scale applied to the sum, plus the bf16 output
rounding (``GEMM_TOL``, as for the tl kernel's GEMM).
"""

import re

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from moe_ep import MoEEpInputError, device_facts, options
from moe_ep.kernels import expert_mlp, plan_grouped_gemm, quantize_nvfp4
from moe_ep.kernels.grouped_gemm import gluon_nvfp4_prefill as gp
from moe_ep.kernels.grouped_gemm import plan as gemm_plan
from moe_ep.reference import E2M1_VALUES, dequantize_nvfp4_ref, grouped_gemm_ref
from moe_ep.testing.properties import assert_rel_close, check_gluon_nvfp4_prefill_gemm, gluon_nvfp4_prefill_problem
from moe_ep.testing.strategies import cpu_nvfp4_weights, gluon_nvfp4_prefill_cases
from moe_ep.triton_runtime import device as kernel_device

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
hopper_only = pytest.mark.skipif(not HOPPER, reason="the Gluon kernel is built for sm_90 (Hopper)")


def _bf16_bits_to_float(h) -> float:
    return float(np.array([int(h) << 16], dtype=np.uint32).view(np.float32)[0])


def _bf16_mul(a: int, b: int) -> int:
    """bf16 bits a * b, exact here (the products fit bf16: asserted), as the asm's bf16x2 fma with -0 computes it."""
    p = np.array([_bf16_bits_to_float(a) * _bf16_bits_to_float(b)], dtype=np.float32).view(np.uint32)[0]
    assert not p & 0xFFFF, "a product that does not fit bf16"
    return int(p) >> 16


def _prmt(a: int, b: int, sel: int) -> int:
    """PTX ``prmt.b32`` (default mode): result byte i is byte ``(sel >> 4i) & 7`` of {b, a} (a's bytes 0-3)."""
    src = (b << 32) | a
    return sum(((src >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))


def run_asm(text: str, regs: dict) -> dict:
    """Interpret the PTX of an inline asm block (the instructions ``_DECODE_ASM`` uses) on 32-bit values: ``regs``
    maps ``$i`` operands (and, as the block runs, its own registers) to ints."""
    def val(a):
        return int(a, 0) if a[0].isdigit() else regs[a]
    for stmt in text.strip().strip("{}").split(";"):
        stmt = stmt.strip()
        if not stmt or stmt.startswith(".reg"):
            continue
        op, rest = stmt.split(None, 1)
        d, *args = [a.strip() for a in rest.split(",")]
        v = [val(a) for a in args]
        if op == "mov.b32":
            regs[d] = v[0]
        elif op == "prmt.b32":
            regs[d] = _prmt(*v)
        elif op == "shr.b32":
            regs[d] = v[0] >> v[1]
        elif op == "and.b32":
            regs[d] = v[0] & v[1]
        elif op == "mul.lo.u32":
            regs[d] = (v[0] * v[1]) & 0xFFFFFFFF
        elif op == "fma.rn.bf16x2":
            assert v[2] == 0x80008000, "the decode's fma adds -0: a multiply"
            regs[d] = _bf16_mul(v[0] & 0xFFFF, v[1] & 0xFFFF) | _bf16_mul(v[0] >> 16, v[1] >> 16) << 16
        else:
            raise AssertionError(f"an instruction the interpreter does not know: {stmt}")
    return regs


def _scale_bf16(byte) -> int:
    """A scale byte as the kernel takes it (sign dropped, e4m3) times 2^118, as bf16 bits (exact)."""
    s = torch.tensor([int(byte) & 0x7F], dtype=torch.uint8).view(torch.float8_e4m3fn).float() * 2.0 ** 118
    return int(s.bfloat16().view(torch.int16).item()) & 0xFFFF


def test_register_decode_gives_each_a_register_the_reference_values_of_its_k():
    """Every lane of a warp decodes one K step (64) of its rows as the kernel does, the kernel's ``_DECODE_ASM`` text
    interpreted instruction by instruction: words ``2j + h`` of rows r and r + 8 and the chunk's scales; the outputs,
    placed at k = 16j + 8h + 2c + e of their rows (wgmma's A fragment), equal ``e2m1 * s / 256`` of every code (all
    16 codes, zero, subnormal and largest scales occur)."""
    rng = np.random.default_rng(0)
    rows = 16
    codes = rng.integers(0, 256, size=(rows, 32), dtype=np.uint8)  # a K step's 64 codes per row
    codes[0, :8] = np.arange(8) * 0x11  # codes 0..7 in both nibbles
    codes[1, :8] = 0x88 + np.arange(8) * 0x11  # 8..15
    scales = rng.integers(0, 256, size=(rows, 4), dtype=np.uint8)
    scales[2] = [0, 1, 0x7E, 0xFE]  # zero, the smallest subnormal, the largest finite (sign set on one)
    want = np.zeros((rows, 64), dtype=np.float32)
    e2m1 = np.asarray(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=np.float32)  # codes 8-15: negative
    for r in range(rows):
        for k in range(64):
            code = (codes[r, k // 2] >> (4 * (k % 2))) & 0xF
            s = torch.tensor([scales[r, k // 16] & 0x7F], dtype=torch.uint8).view(torch.float8_e4m3fn).float().item()
            want[r, k] = e2m1[code] * s / 256.0
    words = codes.view("<u4")  # [rows, 8]: word 2j + h
    got = np.full((rows, 64), np.nan, dtype=np.float32)
    for lane in range(32):
        c, r = lane % 4, lane // 4
        for j in range(4):
            s_r, s_r8 = _scale_bf16(scales[r, j]), _scale_bf16(scales[r + 8, j])
            for h in range(2):
                # the asm's operands: its 4 elements (e, row + 8) repeat each row's word, selector and scale
                w_r, w_r8 = int(words[r, 2 * j + h]), int(words[r + 8, 2 * j + h])
                sel = c | ((4 + c) << 8)
                regs = run_asm(gp._DECODE_ASM.value, {"$2": w_r, "$3": w_r, "$4": w_r8, "$5": w_r8,
                                                      **{f"${i}": sel for i in range(6, 10)},
                                                      "$10": s_r * 0x10001, "$11": s_r8 * 0x10001})
                k = 16 * j + 8 * h + 2 * c
                for row, reg in ((r, regs["$0"]), (r + 8, regs["$1"])):
                    got[row, k], got[row, k + 1] = _bf16_bits_to_float(reg & 0xFFFF), _bf16_bits_to_float(reg >> 16)
    np.testing.assert_array_equal(got, want)


def test_decode_layout_is_the_wgmma_a_operand_layout():
    """The decode layout, its (r, j, h, c, e) order made k = 16j + 8h + 2c + e, is wgmma's bf16 A operand for a
    64-row warpgroup tile (the kernel converts it with no data movement): lane l holds rows l // 4 (+ 8) of its
    warp's 16, and k = 2 (l % 4) + e + 8h of each 16-chunk, the registers in the operand's order."""
    L = gp.DECODE_LAYOUT
    # the bases of [r, c, j, h, e] mapped to the [row, k] tile after the kernel's permute and reshape
    def rk(b):
        r, c, j, h, e = b
        return [r, 16 * j + 8 * h + 2 * c + e]
    assert [rk(b) for b in L.reg_bases] == [[0, 1], [8, 0], [0, 8], [0, 16], [0, 32]]
    assert [rk(b) for b in L.lane_bases] == [[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]]
    assert [rk(b) for b in L.warp_bases] == [[16, 0], [32, 0]]
    # the words a thread loads (WORD_LAYOUT) are the decode layout's rows, c broadcast, word 2j + h in registers
    W = gp.WORD_LAYOUT
    assert W.lane_bases[:2] == [[0, 0], [0, 0]] and W.lane_bases[2:] == [[b[0], 0] for b in L.lane_bases[2:]]
    assert W.reg_bases == [[8, 0], [0, 1], [0, 2], [0, 4]] and W.warp_bases == [[16, 0], [32, 0]]
    # GEMM1: a warpgroup's 32 gate rows and 32 up rows, each loaded in HALF_WORD_LAYOUT and joined (u, the join's
    # register bit, first), are WORD_LAYOUT's words when decode row 16w + 8u + r is half-row 8w + r's gate / up row
    H = gp.HALF_WORD_LAYOUT

    def rho(b):
        row, word = b
        return [row // 8 * 16 + row % 8, word]
    assert [[8, 0]] + [rho(b) for b in H.reg_bases] == W.reg_bases
    assert [rho(b) for b in H.lane_bases] == W.lane_bases and [rho(b) for b in H.warp_bases] == W.warp_bases


@pytest.mark.gpu
@hopper_only
@settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(c=gluon_nvfp4_prefill_cases())
def test_gluon_nvfp4_prefill_matches_reference(c):
    """The shared property (``moe-ep fuzz``'s ``gluon_nvfp4_prefill_grouped_gemm`` target): the reference, the tl
    kernel, the rows of no expert untouched."""
    check_gluon_nvfp4_prefill_gemm(c, torch.device("cuda"))


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("G,N,K,rows,swiglu", [(32, 7168, 2048, 1024, False), (32, 2048, 7168, 128, True),
                                               (128, 2048, 768, 512, False), (8, 14336, 4096, 512, True)],
                         ids=["dsv3-gemm2-1024", "dsv3-gemm1-128", "qwen3-gemm2-512", "mixtral-gemm1-512"])
def test_gluon_nvfp4_prefill_benchmark_shapes(G, N, K, rows, swiglu):
    """Shapes of the benchmark (GEMM2 with routing weights, GEMM1 with SwiGLU; balanced counts): both token tiles."""
    c = dict(G=G, N=N, K=K, counts=[rows] * G, pad=0, one_gs=False, scale=1.0, zero_frac=0.0, rs=not swiglu,
             swiglu=swiglu, seed=1)
    problem = gluon_nvfp4_prefill_problem(c, torch.device("cuda"))
    for block_t in gp.TOKEN_TILES:
        check_gluon_nvfp4_prefill_gemm(dict(c, block_t=block_t), torch.device("cuda"), problem)


def _bad_inputs():
    """(name, arguments for check_gluon_nvfp4_prefill as a function of a valid set, what the message must name)."""
    return [
        ("K not a multiple of 64",
         lambda a: dict(a, w=cpu_nvfp4_weights(2, 64, 96), x=torch.zeros(3, 96, dtype=torch.bfloat16)),
         "w.shape[2] (K)"),
        ("w bf16", lambda a: dict(a, w=torch.zeros(2, 64, 128)), "type(w)"),
        ("w 2-D", lambda a: dict(a, w=cpu_nvfp4_weights(None, 64, 128)), "w.shape"),
        ("w swizzled", lambda a: dict(a, w=cpu_nvfp4_weights(2, 64, 128, swizzled=True)), "w.swizzled"),
        ("x fp32", lambda a: dict(a, x=torch.zeros(3, 128)), "x.dtype"),
        ("x K mismatch", lambda a: dict(a, x=torch.zeros(3, 256, dtype=torch.bfloat16)), "x.shape"),
        ("offsets int64", lambda a: dict(a, offsets=torch.zeros(3, dtype=torch.int64)), "offsets.dtype"),
        ("offsets length", lambda a: dict(a, offsets=torch.zeros(2, dtype=torch.int32)), "offsets.shape"),
        ("token tile 48", lambda a: dict(a, block_t=48), "block_t"),
        ("no programs", lambda a: dict(a, num_programs=0), "num_programs"),
        ("row scale bf16", lambda a: dict(a, row_scale=torch.ones(3, dtype=torch.bfloat16)), "row_scale.dtype"),
        ("row scale length", lambda a: dict(a, row_scale=torch.ones(4)), "row_scale.shape"),
        ("SwiGLU, I not a multiple of 8", lambda a: dict(a, w=cpu_nvfp4_weights(2, 36, 128), swiglu=True),
         "w.shape[1] (2I)"),
        ("offsets and counts", lambda a: dict(a, counts=torch.zeros(2, dtype=torch.int32)), "(offsets, counts)"),
        ("neither offsets nor counts", lambda a: dict(a, offsets=None), "(offsets, counts)"),
        ("masked x 2-D", lambda a: dict(a, offsets=None, counts=torch.zeros(2, dtype=torch.int32)), "x.shape"),
        ("masked x of other experts", lambda a: dict(a, offsets=None, counts=torch.zeros(2, dtype=torch.int32),
                                                     x=torch.zeros(3, 4, 128, dtype=torch.bfloat16)), "x.shape"),
        ("counts int64", lambda a: dict(a, offsets=None, counts=torch.zeros(2, dtype=torch.int64),
                                        x=torch.zeros(2, 4, 128, dtype=torch.bfloat16)), "counts.dtype"),
        ("counts length", lambda a: dict(a, offsets=None, counts=torch.zeros(3, dtype=torch.int32),
                                         x=torch.zeros(2, 4, 128, dtype=torch.bfloat16)), "counts.shape"),
        ("masked row scale flat", lambda a: dict(a, offsets=None, counts=torch.zeros(2, dtype=torch.int32),
                                                 x=torch.zeros(2, 4, 128, dtype=torch.bfloat16),
                                                 row_scale=torch.ones(8)), "row_scale.shape"),
        ("x on the CPU", lambda a: dict(a), "x.device"),  # valid otherwise: only a CUDA device is refused for
        ("masked x on the CPU", lambda a: dict(a, offsets=None, counts=torch.zeros(2, dtype=torch.int32),
                                               x=torch.zeros(2, 4, 128, dtype=torch.bfloat16)), "x.device"),
    ]


@pytest.mark.parametrize("name,make,what", _bad_inputs(), ids=[b[0] for b in _bad_inputs()])
def test_gluon_nvfp4_prefill_bad_inputs_raise_named_errors(name, make, what):
    """Each bad argument raises MoEEpInputError naming it (the checks come before the device is touched, so this
    runs on a CPU: the CPU tensors fail only the device check, which comes last)."""
    args = make(dict(x=torch.zeros(3, 128, dtype=torch.bfloat16), w=cpu_nvfp4_weights(2, 64, 128),
                     offsets=torch.zeros(3, dtype=torch.int32)))
    with pytest.raises(MoEEpInputError, match="^" + re.escape(what) + " = "):
        gp.check_gluon_nvfp4_prefill(**args)


# --- the grouped-GEMM dispatcher's "gluon-nvfp4" path ---------------------------------------------------------


@pytest.fixture
def nvfp4_dispatchable(monkeypatch):
    """The dispatcher sees the Gluon prefill GEMM as verified here (a CPU test of its decisions); plans made before
    and after are dropped."""
    monkeypatch.setattr(gp, "dispatchable", lambda masked=False: True)
    gemm_plan.clear_cache()
    yield
    gemm_plan.clear_cache()


def _mlp_weights(dev, G=3, H=256, I=128):
    gen = torch.Generator().manual_seed(7)
    w13 = quantize_nvfp4((torch.randn(G, 2 * I, H, generator=gen) * 0.1).to(dev))
    w2 = quantize_nvfp4((torch.randn(G, H, I, generator=gen) * 0.1).to(dev))
    return w13, w2


def test_dispatcher_takes_the_gluon_path_for_ragged_nvfp4_weight_prefill(nvfp4_dispatchable):
    """Where ``gluon_nvfp4_prefill.dispatchable``: ragged calls of NVFP4 weights from
    ``MOE_EP_GLUON_NVFP4_MIN_M`` tokens per expert on plan the "gluon-nvfp4" path in both forms (GEMM1 SwiGLU, GEMM2
    with routing weights), with the bucket's token tile, the weights as they are and one program per SM, NVFP4 x
    decoded first; masked calls likewise where it is verified for them; everything else keeps the tl kernel: below the
    bucket, the option off, masked where it is not verified for them, an fp32 output, a forced config, K not a
    multiple of 64, GEMM1's I not a multiple of 8."""
    dev = kernel_device()
    w13, w2 = _mlp_weights(dev)
    offsets = torch.tensor([0, 140, 140, 271], dtype=torch.int32, device=dev)
    x, h = torch.zeros(272, 256, dtype=torch.bfloat16, device=dev), torch.zeros(272, 128, dtype=torch.bfloat16,
                                                                                 device=dev)
    rs = torch.ones(272, device=dev)
    with options.override(gluon_nvfp4_min_m=64):
        p1 = plan_grouped_gemm(x, w13, offsets=offsets, swiglu=True, m_hint=128)
        p2 = plan_grouped_gemm(h, w2, offsets=offsets, row_scale=rs, m_hint=512)
        assert (p1.path, p2.path) == ("gluon-nvfp4", "gluon-nvfp4")
        assert p1.config == {"BLOCK_T": 128, "BLOCK_N": 64} and p2.config == {"BLOCK_T": 256, "BLOCK_N": 128}
        assert (p2.w_decoded, p2.grid, p2.persistent, p2.config_source) == (False, device_facts.sm_count(), True,
                                                                            "variant")
        assert plan_grouped_gemm(x, w13, offsets=offsets, swiglu=True, m_hint=16).path == "tl"  # below the bucket
        xm, counts = x[:270].reshape(3, 90, 256), torch.tensor([5, 0, 7], device=dev)
        pm = plan_grouped_gemm(xm, w13, counts=counts, swiglu=True, m_hint=512)
        assert (pm.path, pm.ragged, pm.config["BLOCK_T"]) == ("gluon-nvfp4", False, 256)
        gp.dispatchable = lambda masked=False: not masked  # (the fixture's monkeypatch undoes it)
        gemm_plan.clear_cache()
        assert plan_grouped_gemm(xm, w13, counts=counts, swiglu=True, m_hint=512).path == "tl"  # masked unverified
        assert plan_grouped_gemm(x, w13, offsets=offsets, swiglu=True, m_hint=512).path == "gluon-nvfp4"
        gp.dispatchable = lambda masked=False: True
        gemm_plan.clear_cache()
        xq = plan_grouped_gemm(quantize_nvfp4(x.float()), w13, offsets=offsets, swiglu=True, m_hint=512)
        assert (xq.path, xq.x_decoded, xq.w_decoded) == ("gluon-nvfp4", True, False)
        fp32 = plan_grouped_gemm(h, w2, offsets=offsets, out=torch.empty(272, 256, device=dev), m_hint=512)
        assert (fp32.path, fp32.out_format) == ("tl", "fp32")
        forced = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, SWAP_AB=False, GROUP_M=8, TMA=False, num_warps=4,
                      num_stages=2)
        assert plan_grouped_gemm(h, w2, offsets=offsets, m_hint=512, config=forced).path == "tl"
        w_k80 = quantize_nvfp4(torch.ones(3, 64, 80, device=dev))
        assert plan_grouped_gemm(x[:, :80], w_k80, offsets=offsets, m_hint=512).path == "tl"  # K % 64
        w_i12 = quantize_nvfp4(torch.ones(3, 24, 256, device=dev))
        assert plan_grouped_gemm(x, w_i12, offsets=offsets, swiglu=True, m_hint=512).path == "tl"  # I % 8
    with options.override(gluon_nvfp4_min_m="off"):
        assert plan_grouped_gemm(h, w2, offsets=offsets, m_hint=4096).path == "tl"


def test_dispatchable_needs_a_checked_triton(monkeypatch):
    """``dispatchable`` is ``available`` under a Triton of ``CHECKED_TRITONS`` only (masked calls:
    ``MASKED_CHECKED_TRITONS``), and ``not_dispatchable_reason`` says why not."""
    monkeypatch.setattr(gp, "unavailable_reason", lambda: None)
    monkeypatch.setattr(gp, "CHECKED_TRITONS", ("3.6", ))
    monkeypatch.setattr(gp, "MASKED_CHECKED_TRITONS", ())
    for version, want in (("3.6.0", True), ("3.8.0", False), ("3.10.1", False)):
        monkeypatch.setattr(gp.triton, "__version__", version)
        assert gp.dispatchable() is want, version
        assert (gp.not_dispatchable_reason() is None) is want
        assert want or "verified under 3.6 only" in gp.not_dispatchable_reason()
        assert not gp.dispatchable(masked=True)
        assert gp.not_dispatchable_reason(True) == "the masked layout: not yet run on a GPU"
    monkeypatch.setattr(gp, "MASKED_CHECKED_TRITONS", ("3.8", ))
    monkeypatch.setattr(gp.triton, "__version__", "3.8.0")
    assert gp.dispatchable(masked=True) and not gp.dispatchable()
    monkeypatch.setattr(gp, "unavailable_reason", lambda: "needs an sm_90 GPU")
    monkeypatch.setattr(gp.triton, "__version__", "3.6.0")
    assert not gp.dispatchable() and gp.not_dispatchable_reason() == "needs an sm_90 GPU"


@pytest.mark.parametrize("index_dtype,x_fmt,masked", [(torch.int32, "bf16", False), (torch.int64, "bf16", False),
                                                      (torch.int32, "nvfp4", False), (torch.int32, "bf16", True),
                                                      (torch.int64, "nvfp4", True)])
def test_expert_mlp_launches_the_gluon_path_with_its_parts(nvfp4_dispatchable, monkeypatch, index_dtype, x_fmt,
                                                           masked):
    """The launcher's "gluon-nvfp4" branch, with a reference stand-in for the kernel (its row factor applied before
    SwiGLU, as the kernel applies it): GEMM1 gets x, w13's codes and scales, its global scales one per expert and
    SwiGLU; GEMM2 gets GEMM1's bf16 output, w2 and the routing weights; int64 offsets (or counts) reach the kernel as
    int32; NVFP4 x (a global scale per row, as received tokens carry) arrives decoded, its global scales as GEMM1's row
    factor; masked calls arrive flattened, their counts and M_max with them (a count past M_max clamped); the result
    is the reference MLP's on the dequantized operands."""
    from moe_ep.reference import expert_mlp_ref
    dev = kernel_device()
    calls = []

    def launch(x, codes, scales, gs, offsets, out, row_scale, block_t, num_programs, swiglu=False, m_max=None):
        calls.append(dict(offsets=offsets, swiglu=swiglu, block_t=block_t, gs=gs, row_scale=row_scale, x=x,
                          m_max=m_max))
        w = dequantize_nvfp4_ref(codes, scales.view(torch.float8_e4m3fn), gs)
        xf = x.float() if row_scale is None else x.float() * row_scale[:, None]
        if m_max is None:
            y = grouped_gemm_ref(xf, w, offsets=offsets, swiglu=swiglu)
            lo, hi = int(offsets[0]), int(offsets[-1])
            out[lo:hi] = y[lo:hi].to(out.dtype)
        else:  # the experts' blocks flattened: rows g * m_max + [0, count)
            y = grouped_gemm_ref(xf.view(len(offsets), m_max, -1), w, counts=offsets.clamp(0, m_max), swiglu=swiglu)
            for g, n in enumerate(offsets.clamp(0, m_max).tolist()):
                out[g * m_max:g * m_max + n] = y[g, :n].to(out.dtype)

    monkeypatch.setattr(gp, "launch", launch)
    w13, w2 = _mlp_weights(dev)
    gen = torch.Generator().manual_seed(3)
    rows = (3, 140) if masked else (272, )
    x = torch.randn(*rows, 256, generator=gen).bfloat16().to(dev)
    rs = (torch.rand(*rows, generator=gen) + 0.5).to(dev)
    if masked:
        layout = dict(counts=torch.tensor([140, 0, 2**31 if index_dtype is torch.int64 else 131], dtype=index_dtype,
                                          device=dev))
        valid = torch.arange(140)[None, :] < torch.tensor([140, 0, 140 if index_dtype is torch.int64 else 131])[:, None]
    else:
        layout = dict(offsets=torch.tensor([0, 140, 140, 271], dtype=index_dtype, device=dev))
        valid = torch.arange(272) < 271
    x_in, x_ref = x, x.float()
    if x_fmt == "nvfp4":
        x_in = quantize_nvfp4(x.float(), torch.rand(*rows, generator=gen).to(dev) * 100 + 50)  # a scale per row
        x_ref = dequantize_nvfp4_ref(x_in.data, x_in.scales, x_in.global_scale[..., None])
    with options.override(gluon_nvfp4_min_m=64):
        got = expert_mlp(x_in, w13, w2, **layout, row_scale=rs, m_hint=140)
    assert [c["swiglu"] for c in calls] == [True, False]
    assert all(c["offsets"].dtype == torch.int32 and c["gs"].shape == (3, ) for c in calls)
    assert all(c["m_max"] == (140 if masked else None) and c["x"].dim() == 2 for c in calls)
    assert calls[0]["x"].dtype == torch.bfloat16 and torch.equal(calls[1]["row_scale"], rs.reshape(-1))
    if x_fmt == "nvfp4":
        assert torch.allclose(calls[0]["row_scale"], 256.0 / x_in.global_scale.float().reshape(-1))
    else:
        assert calls[0]["row_scale"] is None and calls[0]["x"].data_ptr() == x.data_ptr()
    want = expert_mlp_ref(x_ref, dequantize_nvfp4_ref(w13.data, w13.scales, w13.global_scale),
                          dequantize_nvfp4_ref(w2.data, w2.scales, w2.global_scale), **layout, row_scale=rs)
    assert_rel_close(got, want, valid, 2e-2, "the gluon-nvfp4 branch")


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("x_fmt,masked", [("bf16", False), ("nvfp4", False), ("bf16", True), ("nvfp4", True)])
def test_expert_mlp_through_the_gluon_path_matches_the_tl_path(nvfp4_dispatchable, x_fmt, masked):
    """The whole expert MLP through the dispatcher's "gluon-nvfp4" path (both GEMMs on the kernel, routing weights,
    an empty expert, a row of no expert (masked: rows past the counts); NVFP4 x with a global scale per row), ragged
    and masked, against the same MLP on the tl path and the reference on the dequantized operands."""
    from moe_ep.reference import expert_mlp_ref
    from moe_ep.testing.properties import MLP_TOL
    dev = torch.device("cuda")
    w13, w2 = _mlp_weights(dev, G=3, H=512, I=256)
    gen = torch.Generator().manual_seed(11)
    rows = (3, 270) if masked else (400, )
    x = torch.randn(*rows, 512, generator=gen).bfloat16().to(dev)
    rs = (torch.rand(*rows, generator=gen) + 0.5).to(dev)
    if masked:
        layout = dict(counts=torch.tensor([260, 0, 139], dtype=torch.int32, device=dev))
        valid = torch.arange(270)[None, :] < torch.tensor([260, 0, 139])[:, None]
    else:
        layout = dict(offsets=torch.tensor([0, 260, 260, 399], dtype=torch.int32, device=dev))
        valid = torch.arange(400) < 399
    x_in, x_ref = x, x.float()
    if x_fmt == "nvfp4":
        x_in = quantize_nvfp4(x.float(), torch.rand(*rows, generator=gen).to(dev) * 100 + 50)
        x_ref = dequantize_nvfp4_ref(x_in.data, x_in.scales, x_in.global_scale[..., None])
    with options.override(gluon_nvfp4_min_m=64):
        got, plans = expert_mlp(x_in, w13, w2, **layout, row_scale=rs, m_hint=200, return_plan=True)
    assert [p.path for p in plans] == ["gluon-nvfp4", "gluon-nvfp4"]
    with options.override(gluon_nvfp4_min_m="off"):
        tl_out = expert_mlp(x_in, w13, w2, **layout, row_scale=rs, m_hint=200)
    want = expert_mlp_ref(x_ref, dequantize_nvfp4_ref(w13.data, w13.scales, w13.global_scale),
                          dequantize_nvfp4_ref(w2.data, w2.scales, w2.global_scale), **layout, row_scale=rs)
    assert_rel_close(got, want, valid, MLP_TOL, "expert_mlp through gluon-nvfp4")
    assert_rel_close(got, tl_out, valid, MLP_TOL, "expert_mlp through gluon-nvfp4 against the tl path")
