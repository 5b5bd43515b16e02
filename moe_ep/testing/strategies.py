"""Hypothesis strategies for moe-ep's kernels and layer, shared by the property tests and ``moe-ep fuzz``.

A strategy draws a *case*: a small dict of parameters (shapes, value kind, formats, a seed), never tensors,
so a counterexample prints in a line and reproduces anywhere. ``make_*`` helpers build the tensors from a
case. Sizes are bounded by a :class:`Bounds` (``TINY`` for the Triton interpreter, ``GPU`` for fuzzing on
a device). The hypothesis profiles are in :mod:`moe_ep.testing.profiles`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from ..config import SUPPORTED_LAYOUTS


@dataclass(frozen=True)
class Bounds:
    """Largest sizes a strategy draws: rows (tokens), K and N in 16-blocks, experts, top-k."""

    rows: int
    k16: int
    n16: int
    experts: int
    top_k: int


TINY = Bounds(rows=8, k16=4, n16=3, experts=4, top_k=3)
"""For the Triton interpreter (CPU): every case runs in about a second."""

GPU = Bounds(rows=512, k16=96, n16=64, experts=16, top_k=8)
"""For fuzzing on a GPU: real-model K (up to 1536) and hundreds of rows."""

BOUNDS = {"tiny": TINY, "gpu": GPU}

VALUE_KINDS = ("normal", "huge", "tiny", "zeros", "zero_rows", "midpoints", "saturating")
MIDPOINTS = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]  # e2m1 rounding midpoints in units of gs / s


def make_values(shape, kind: str, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Values of a kind: normal, huge, tiny, exact zeros, zero rows, e2m1 midpoints, saturating blocks."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if kind == "huge":
        x = x.clamp(-6, 6) * (1e4 if dtype == torch.float16 else 1e30)
    elif kind == "tiny":
        x = x * (1e-4 if dtype == torch.float16 else 1e-30)
    elif kind == "zeros":
        x = x * (torch.rand(shape, generator=g) < 0.5)
    elif kind == "zero_rows":
        x = x * (torch.rand(tuple(shape[:-1]) + (1,), generator=g) < 0.5)
    elif kind == "midpoints" and x.numel():
        mids = torch.tensor(MIDPOINTS + [6.0])
        x = mids[torch.randint(0, len(mids), tuple(shape), generator=g)] * torch.sign(torch.randn(shape, generator=g))
        x.view(-1, 16)[:, 0] = 6.0
    elif kind == "saturating" and x.numel():
        x = x * 1e3
        x.view(-1, 16)[:, 3] = 7e3
    return x.to(dtype)


_seeds = st.integers(0, 2**31 - 1)
_dtypes = st.sampled_from(["bfloat16", "float16", "float32"])


def quant_cases(b: Bounds = TINY):
    """NVFP4 quantize/dequantize/gather input: ``rows x K`` values of a kind, dtype, given or computed scale."""
    return st.fixed_dictionaries(dict(
        rows=st.integers(0, b.rows), k=st.integers(1, b.k16).map(lambda c: 16 * c),
        kind=st.sampled_from(VALUE_KINDS), dtype=_dtypes, given_scale=st.booleans(), gather=st.integers(0, b.rows),
        seed=_seeds))


@st.composite
def expert_counts(draw, G: int, max_rows: int) -> list[int]:
    """Rows per expert: random, all on one expert, or all experts empty."""
    mode = draw(st.sampled_from(["random", "one-expert", "empty"]))
    if mode == "one-expert":
        c = [0] * G
        c[draw(st.integers(0, G - 1))] = max_rows
        return c
    if mode == "empty":
        return [0] * G
    return [draw(st.integers(0, max_rows)) for _ in range(G)]


@st.composite
def gemm_cases(draw, b: Bounds = TINY, mlp: bool = False):
    """A grouped GEMM (or, with ``mlp``, expert MLP) problem: experts, sizes, per-expert counts, layout
    (masked or ragged), operand formats, SwiGLU / row-scale epilogues, padding rows, value scale, and the
    tokens-per-expert hint that picks the tiles (at ``DECODED_MIN_M``, NVFP4 weights are decoded to bf16 first, as
    NVFP4 x always is)."""
    from ..kernels.grouped_gemm.config_space import DECODED_MIN_M
    G = draw(st.integers(1, b.experts))
    return dict(
        G=G, K=16 * draw(st.integers(1, b.k16)), N=16 * draw(st.integers(1, b.n16)),
        counts=draw(expert_counts(G, b.rows)), ragged=draw(st.booleans()),
        x_fmt=draw(st.sampled_from(X_FORMATS)), w_fmt=draw(st.sampled_from(["bf16", "nvfp4"])),
        swiglu=True if mlp else draw(st.booleans()), row_scale=draw(st.booleans()), pad=draw(st.integers(0, 3)),
        m_hint=draw(st.sampled_from([None, 64, DECODED_MIN_M])), scale=draw(st.sampled_from([1.0, 1e-3, 300.0])),
        zero_frac=draw(st.sampled_from([0.0, 0.3])), seed=draw(_seeds))


def offsets_of(counts, start: int = 0) -> list[int]:
    """The ``G + 1`` row offsets of consecutive experts holding ``counts`` rows each, the first at row ``start``."""
    return list(itertools.accumulate(counts, initial=start))


@st.composite
def gluon_nvfp4_cases(draw, b: Bounds = TINY):
    """A problem of the Gluon NVFP4-weight grouped GEMM (ragged bf16 x, NVFP4 weights): experts, K a multiple of
    256 (its TMA bound), N not always a multiple of the 64-row tile, per-expert counts (empty experts, several token
    chunks), padding rows of no expert, fp32 / bf16 output, a token-tile hint that fits or not, one or per-expert
    global scales, and the launch (decode, ring depth, registers, overlap) from the kernel's sweep."""
    from ..kernels.grouped_gemm.gluon_nvfp4 import LAUNCH_SWEEP
    G = draw(st.integers(1, b.experts))
    return dict(G=G, K=256 * draw(st.integers(1, max(1, b.k16 // 16))), N=draw(st.sampled_from([8, 64, 100, 192])),
                counts=draw(expert_counts(G, b.rows)), pad=draw(st.integers(0, 3)),
                out_dtype=draw(st.sampled_from(["float32", "bfloat16"])), hint=draw(st.sampled_from([None, 1, 16, 64])),
                one_gs=draw(st.booleans()), scale=draw(st.sampled_from([1.0, 1e-3, 300.0])),
                zero_frac=draw(st.sampled_from([0.0, 0.3])), fast_decode=draw(st.booleans()),
                launch=draw(st.integers(0, len(LAUNCH_SWEEP) - 1)), seed=draw(_seeds))


def cpu_nvfp4_weights(G: int | None, N: int, K: int, swizzled: bool = False):
    """NVFP4 weights of ones ``[G, N, K]`` (``[N, K]`` for G None) as CPU tensors on every machine (quantized where the
    kernels run): the bad-input tables' weights, so that each row fails the check it names and only the row meant to
    fails the device check."""
    from ..kernels.nvfp4 import quantize_nvfp4
    from ..kernels.nvfp4_tensor import NvFp4Tensor, swizzle_scales
    from ..triton_runtime import device
    shape = (N, K) if G is None else (G, N, K)
    q = quantize_nvfp4(torch.ones(shape, device=device()))
    q = NvFp4Tensor(q.data.cpu(), q.scales.cpu(), q.global_scale.cpu(), q.shape)
    if swizzled:
        return NvFp4Tensor(q.data, swizzle_scales(q.scales), q.global_scale, q.shape, swizzled=True)
    return q


@st.composite
def gluon_nvfp4_prefill_cases(draw, b: Bounds = TINY):
    """A problem of the Gluon NVFP4-weight prefill GEMM (bf16 x, NVFP4 weights), ragged or masked: 1-6 experts, K a
    multiple of 64 (up to 768), N (GEMM1: I) not always a multiple of the tile's columns, up to 300 tokens per expert
    (past the largest token tile), empty experts, padding rows of no expert (masked: rows past every count), GEMM2's
    form with a routing weight or not and GEMM1's (SwiGLU), one or per-expert global scales, and the token tile
    (None: the kernel's pick). A GPU-only kernel: the shapes are its own, ``b`` is not read."""
    from ..kernels.grouped_gemm.gluon_nvfp4_prefill import TOKEN_TILES
    G = draw(st.integers(1, 6))
    swiglu = draw(st.booleans())
    return dict(G=G, K=64 * draw(st.integers(1, 12)), N=draw(st.sampled_from([8, 64, 128, 200, 384])), swiglu=swiglu,
                counts=draw(expert_counts(G, draw(st.sampled_from([1, 40, 128, 300])))), pad=draw(st.integers(0, 3)),
                one_gs=draw(st.booleans()), scale=draw(st.sampled_from([1.0, 1e-3, 300.0])),
                zero_frac=draw(st.sampled_from([0.0, 0.3])), rs=not swiglu and draw(st.booleans()),
                block_t=draw(st.sampled_from([None, *TOKEN_TILES])), masked=draw(st.booleans()), seed=draw(_seeds))


@st.composite
def gluon_fp8_cases(draw, b: Bounds = TINY, swiglu: bool = False):
    """A problem of the Gluon FP8 block-scaled grouped GEMM, prefill-class: 1-8 experts, K a multiple of 16 (not
    always of 128: a short last scale block; one block, or several, up to twelve), N not always a multiple of the
    tile (nor of the 128-row scale blocks), up to 300 rows per expert (several row tiles), empty experts, rows of no
    expert before the first offset and after the last, values of several magnitudes and exact zeros, and the kernel
    variant. GEMM2's form (``gluon_fp8.VARIANTS``) with or without a routing weight per row; with ``swiglu``
    GEMM1's (``gluon_fp8.SWIGLU_VARIANTS``; N is I, of w13's 2I rows), which takes none. A GPU-only kernel: the shapes
    are its own, ``b`` is not read."""
    from ..kernels.grouped_gemm.gluon_fp8 import SWIGLU_VARIANTS, VARIANTS
    G = draw(st.integers(1, 8))
    K = draw(st.sampled_from([16, 128, 272, 512, 1040, 1536]))
    return dict(G=G, K=K, N=draw(st.sampled_from([8, 64, 200, 384])),
                counts=draw(expert_counts(G, draw(st.sampled_from([1, 64, 130, 300])))), lead=draw(st.integers(0, 2)),
                pad=draw(st.integers(0, 3)), row_scale=not swiglu and draw(st.booleans()),
                scale=draw(st.sampled_from([1.0, 1e-3, 300.0])), zero_frac=draw(st.sampled_from([0.0, 0.3])),
                variant=draw(st.sampled_from(sorted(SWIGLU_VARIANTS if swiglu else VARIANTS))), swiglu=swiglu,
                seed=draw(_seeds))


X_FORMATS = ("bf16", "nvfp4", "nvfp4_rows")
"""GEMM activation formats: bf16, NVFP4 with one global scale, NVFP4 with one global scale per row (how
tokens received from several ranks arrive)."""


def gemm_operand(t: torch.Tensor, fmt: str, *, per_slice: bool = False):
    """(operand for the kernel, dense fp32 operand for the reference) of bf16 ``t`` in format ``fmt`` (one of
    :data:`X_FORMATS`; ``per_slice``: with "nvfp4", one global scale per ``t[i]``, as expert weights carry)."""
    from ..kernels.nvfp4 import NvFp4Tensor, nvfp4_global_scale, quantize_nvfp4
    from ..reference import dequantize_nvfp4_ref
    if fmt == "bf16":
        return t, t.float()
    if fmt == "nvfp4":
        q = quantize_nvfp4(t, nvfp4_global_scale(t, per_slice=True) if per_slice else None)
        return q, dequantize_nvfp4_ref(q.data, q.scales, q.global_scale)
    rows = t.reshape(-1, t.shape[-1])
    q = quantize_nvfp4(rows, nvfp4_global_scale(rows, per_slice=True)) if rows.shape[0] else quantize_nvfp4(rows)
    dense = dequantize_nvfp4_ref(q.data, q.scales, q.global_scale).reshape(t.shape)
    k = t.shape[-1]
    return NvFp4Tensor(q.data.reshape(*t.shape[:-1], k // 2), q.scales.reshape(*t.shape[:-1], k // 16),
                       q.global_scale, t.shape), dense


def fp8_operand(t: torch.Tensor, block_rows: int, *, gate_up: bool = False):
    """(Fp8Tensor for the kernel, dense fp32 operand for the reference) of ``t`` quantized to FP8 (``block_rows`` 1:
    activations, 128: weights; ``gate_up``: a w13's gate and up rows blocked apart)."""
    from ..kernels.fp8 import quantize_fp8
    from ..reference import dequantize_fp8_ref
    q = quantize_fp8(t, block_rows, gate_up=gate_up)
    return q, dequantize_fp8_ref(q.data, q.scales, block_rows, gate_up)


@st.composite
def fp8_gemm_cases(draw, b: Bounds = TINY, mlp: bool = False):
    """A :func:`gemm_cases` problem with FP8 operands (``x_fmt`` and ``w_fmt`` "fp8"), K and N up to ``16 * k16`` /
    ``16 * n16`` (past 128 when the bounds allow: a short last scale block), and, for a single GEMM, the tile config
    to force (None: the plan's own choice), drawn from the configs an FP8 GEMM may take that fit this GPU's shared
    memory (the MLP's configs are its plan's: GEMM1's must suit its FP8 output)."""
    from .. import device_facts
    from ..kernels.grouped_gemm import config_space
    c = draw(gemm_cases(b, mlp))
    c.update(x_fmt="fp8", w_fmt="fp8", config=None)
    if not mlp:
        limit = device_facts.smem_limit()
        space = [config_space.config_dict(k) for k in config_space.grouped_gemm_configs()]
        fits = [k for k in space if not k["TMA"] and config_space.fp8_rule_broken(k, False) is None
                and (limit is None or config_space.smem_bytes(k, c["swiglu"], False, True) <= limit)]
        c["config"] = draw(st.sampled_from([None] + fits))
    return c


def make_gemm_operands(c: dict, dev, *, n_rows: int | None = None):
    """(x bf16, index kwargs, valid-row mask, rows shape) of a gemm case; x is masked ``[G, M_max, K]`` or
    ragged ``[S, K]`` with ``pad`` rows that belong to no expert."""
    G, counts, K = c["G"], c["counts"], c["K"]
    gen = torch.Generator().manual_seed(c["seed"])
    if c["ragged"]:
        offs = offsets_of(counts)
        S = offs[-1] + c["pad"]
        valid = torch.zeros(S, dtype=torch.bool)
        valid[:offs[-1]] = True
        idx = dict(offsets=torch.tensor(offs, dtype=torch.int32, device=dev))
        rows = (S,)
    else:
        M_max = max(counts + [0]) + c["pad"]
        valid = torch.arange(M_max)[None, :] < torch.tensor(counts)[:, None]
        idx = dict(counts=torch.tensor(counts, dtype=torch.int64, device=dev))
        rows = (G, M_max)
    return scaled_values((*rows, K), c["scale"], c["zero_frac"], gen).to(dev), idx, valid.to(dev), rows


def scaled_values(shape, scale: float, zero_frac: float, gen: torch.Generator) -> torch.Tensor:
    """bf16 normal values times ``scale`` on the CPU, a ``zero_frac`` fraction of them exact zeros."""
    v = torch.randn(shape, generator=gen) * scale
    if zero_frac:
        v = v * (torch.rand(shape, generator=gen) >= zero_frac)
    return v.to(torch.bfloat16)


@st.composite
def route_cases(draw, b: Bounds = TINY):
    """Local expert picks ``[M, K]``: random, all on one expert, all invalid, or with other ranks' ids;
    sometimes with per-group valid-row counts (RANK_MAJOR / FLAT)."""
    M = draw(st.integers(0, 3 * b.rows))
    group = draw(st.integers(1, M)) if M and draw(st.booleans()) else None
    return dict(L=draw(st.integers(1, b.experts)), K=draw(st.integers(1, b.top_k)), M=M,
                kind=draw(st.sampled_from(["random", "one_expert", "all_invalid", "out_of_range"])),
                group=group, H=16 * draw(st.integers(1, b.k16)), weighted=draw(st.booleans()),
                dtype=draw(st.sampled_from(["int32", "int64"])), seed=draw(_seeds))


def make_route(c: dict):
    """(topk_idx [M, K] on the CPU, valid_rows or None) of a route case."""
    M, K, L = c["M"], c["K"], c["L"]
    g = torch.Generator().manual_seed(c["seed"])
    if c["kind"] == "random":
        idx = torch.randint(-1, L, (M, K), generator=g)
    elif c["kind"] == "one_expert":
        idx = torch.full((M, K), -1)
        idx[:, 0] = c["seed"] % L
    elif c["kind"] == "all_invalid":
        idx = torch.full((M, K), -1)
    else:
        idx = torch.randint(-1, 2 * L, (M, K), generator=g)
    valid = None
    if c["group"]:
        valid = torch.randint(0, c["group"] + 1, (-(-M // c["group"]),), generator=g)
    return idx.to(getattr(torch, c["dtype"])), valid


LAYER_LAYOUTS = [(a.value, lay.value) for a, lay in SUPPORTED_LAYOUTS]


@st.composite
def layer_cases(draw, b: Bounds = TINY):
    """A world-size-1 layer problem: experts, top-k, sizes, tokens (0 allowed), algorithm/layout, weight
    and activation formats, routing kind."""
    E = draw(st.integers(1, b.experts))
    af = draw(st.sampled_from(["bf16", "nvfp4"]))
    return dict(E=E, K=draw(st.integers(1, min(E, b.top_k))),
                H=(32 if af == "nvfp4" else 16) * draw(st.integers(1, max(1, b.k16 // (2 if af == "nvfp4" else 1)))),
                I=16 * draw(st.integers(1, b.n16)), B=draw(st.integers(0, b.rows)),
                layout=draw(st.sampled_from(LAYER_LAYOUTS)), wf=draw(st.sampled_from(["bf16", "nvfp4"])), af=af,
                routing=draw(st.sampled_from(["random", "some_missing", "one_expert"])), seed=draw(_seeds))


def make_layer_inputs(c: dict):
    """(x [B, H] bf16, topk_idx [B, K] distinct global ids or -1, topk_weights [B, K], w13, w2) on the CPU."""
    E, K, H, I, B = c["E"], c["K"], c["H"], c["I"], c["B"]
    g = torch.Generator().manual_seed(c["seed"])
    x = torch.randn(B, H, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(B)]) if B else torch.zeros(0, K)
    idx = idx.long()
    if c["routing"] == "some_missing" and B:
        idx[torch.rand(B, K, generator=g) < 0.3] = -1
    elif c["routing"] == "one_expert" and B:
        idx[:, :] = -1
        idx[:, 0] = c["seed"] % E
    wts = torch.rand(B, K, generator=g)
    w13 = torch.randn(E, 2 * I, H, generator=g) * H ** -0.5
    w2 = torch.randn(E, H, I, generator=g) * I ** -0.5
    return x, idx, wts, w13, w2
