"""The grouped GEMM's entry points: check the call, make its plan (``plan.py``), launch what the plan says.

No host sync anywhere: the schedule comes from the device-side counts / offsets inside the kernel, so a call can be
captured in a CUDA graph once its config is known (tuned file, first config, or autotuned on an earlier call).
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from ...errors import check, fail
from ...triton_runtime import check_on_kernel_device
from .. import host_math, launch_cache
from ..fp8 import FP8_BLOCK, Fp8Tensor, fp8_scales_shape, quantize_fp8
from ..nvfp4 import NvFp4Tensor
from . import config_space, kernels, schedule, sm100_fp4
from . import plan as plans
from .chain import Link, dependent_launch_supported
from .chain import enabled as chain_enabled
from .config_space import DECODE_MAX_M, m_bucket
from .fp4_decode import decode_nvfp4
from .plan import GemmPlan


@dataclass
class _Call:
    """A checked call: contiguous operands and the sizes the plan is made from."""
    xd: torch.Tensor
    xs: torch.Tensor | None
    xgs: torch.Tensor | None
    xshape: tuple
    x_fp4: bool
    wd: torch.Tensor
    ws: torch.Tensor | None
    wgs: torch.Tensor | None
    wshape: tuple
    w_fp4: bool
    fp8: bool  # x and w both FP8 (xs, ws: their fp32 scales)
    quantize_out: bool  # the epilogue writes FP8 (out is an Fp8Tensor)
    idx: torch.Tensor
    ragged: bool
    swiglu: bool
    row_scale: torch.Tensor | None
    out: torch.Tensor | Fp8Tensor  # an Fp8Tensor when the epilogue quantizes (quantize_out)
    out_fp32: bool  # out is float32 (tests of the fp32 epilogue)
    G: int
    N: int
    K: int
    M_max: int
    S: int
    m: int


def grouped_gemm(x, w, *, counts: torch.Tensor | None = None, offsets: torch.Tensor | None = None,
                 swiglu: bool = False, row_scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
                 m_hint: int | None = None, config: dict | None = None, return_plan: bool = False,
                 quantize_out: bool = False):
    """Grouped GEMM ``y_g = x_g @ w_g^T`` per expert g, fp32 accumulation, bf16 output.

    Layouts (exactly one of ``counts`` / ``offsets``, int32/int64 on x's device; no host sync, so the call
    can be captured in a CUDA graph once autotuning has run for its shape):

    - masked: ``x [G, M_max, K]``, ``counts [G]``; returns ``[G, M_max, N]``. Rows ``>= counts[g]`` are
      never read or written (the output is allocated with ``torch.empty``: they hold garbage). Counts are
      clamped to ``[0, M_max]`` on the device: a count past M_max (an int64 of 2^31 or more included) means all
      rows, a negative one none.
    - ragged: ``x [S, K]`` sorted by expert, ``offsets [G+1]``; rows ``offsets[g]:offsets[g+1]`` belong to expert
      g. Returns ``[S, N]``; rows outside every expert are not written. Precondition: offsets nondecreasing, in
      ``[0, S]`` (``expert_offsets`` of the bridge are). Checking that would cost a host sync, so the kernel
      instead clamps offsets to ``[0, S]`` and takes their running maximum on the device: whatever the values,
      every row belongs to at most one expert and no row past S is touched (an expert whose offsets go backwards
      loses the rows an earlier expert owns).

    ``x``: bf16, or an :class:`NvFp4Tensor` (linear scales; one global scale, or one per row as
    received NVFP4 tokens carry their source rank's). ``w``: bf16 ``[G, N, K]``,
    or an NvFp4Tensor of that shape (linear scales, global scale ``[G]``, one per expert). K % 16 == 0.
    FP8 (DeepSeek-V3's block-scaled e4m3, docs/DESIGN.md): ``x`` an :class:`Fp8Tensor` with ``block_rows`` 1
    (scales ``[..., ceil(K / 128)]`` per row) and ``w`` one with ``block_rows`` 128 (scales ``[G, ceil(N / 128),
    ceil(K / 128)]``; with ``swiglu``, gate's row blocks then up's: ``gate_up=True``, ``[G, 2 * ceil(I / 128),
    ceil(K / 128)]``). FP8 x goes with FP8 w only: any other pairing with an FP8 operand raises MoEEpInputError
    (quantize bf16 x with ``quantize_fp8(x, 1)``; :func:`expert_mlp` does so itself). ``quantize_out`` (FP8 with
    ``swiglu`` only): the epilogue writes the fp32 SwiGLU result quantized per row per 128 columns, as
    ``quantize_fp8`` does (``reference.swiglu_fp8_ref``), and returns an Fp8Tensor (``block_rows`` 1) instead of
    bf16; ``out`` must be None then.
    NVFP4 x is decoded into a transient bf16 copy first (as large as bf16 x; masked: only the rows within the
    counts are decoded), and so are NVFP4 weights from 512 tokens per expert on (``MOE_EP_DECODED_MIN_M``: another
    bucket, or off); the GEMM then multiplies bf16 tiles: faster than decoding in every tile that reads them.
    ``swiglu`` (bool): w holds gate rows then up rows (``[G, 2I, K]``) and the result is ``silu(gate) * up``,
    ``[*, I]``, without the ``[*, 2I]`` intermediate ever being written. ``row_scale``: float32, one factor
    per row of x (``[G, M_max]`` / ``[S]``), applied to the output row (the routing weight).
    ``out``: optional bf16 (or, for tests of the fp32 epilogue, float32) contiguous output to write into.
    ``m_hint``: expected tokens per expert (a positive int), to pick the tuned config (default: M_max when masked, ceil(S / G) when ragged).
    ``config``: a tile config to launch instead of choosing one (``moe-ep tune``; the tuned-file schema).
    ``return_plan``: return ``(out, plan)``, the :class:`GemmPlan` of what was launched (an autotuned config
    included). Bad arguments raise MoEEpInputError, a bad config MoEEpConfigError.
    """
    call = _check(x, w, counts, offsets, swiglu, row_scale, out, m_hint, quantize_out)
    p = _plan(call, None, config)
    p = _launch(call, p, None)
    return (call.out, p) if return_plan else call.out


def plan_grouped_gemm(x, w, *, counts: torch.Tensor | None = None, offsets: torch.Tensor | None = None,
                      swiglu: bool = False, row_scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
                      m_hint: int | None = None, config: dict | None = None, quantize_out: bool = False) -> GemmPlan:
    """The :class:`GemmPlan` :func:`grouped_gemm` would launch with these arguments, without launching (the same
    checks and errors; an autotuned config is None here: it is picked at the launch)."""
    if out is None:  # the plan does not depend on the output buffer: no need to allocate one
        out = _NO_OUT
    return _plan(_check(x, w, counts, offsets, swiglu, row_scale, out, m_hint, quantize_out), None, config)


_NO_OUT = object()


def expert_mlp(x, w13, w2, *, counts: torch.Tensor | None = None, offsets: torch.Tensor | None = None,
               row_scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
               m_hint: int | None = None, return_plan: bool = False, chain_ready: torch.Tensor | None = None):
    """Expert SwiGLU MLP ``(silu(x W1^T) * (x W3^T)) W2^T`` per expert: two grouped GEMMs, bf16 in between.

    ``w13 [G, 2I, H]`` (gate rows then up rows) and ``w2 [G, H, I]``: bf16 tensors or NvFp4Tensors (global
    scale per expert), or Fp8Tensors (``block_rows`` 128; w13 with gate's row blocks then up's, ``gate_up``). ``x``,
    ``counts`` / ``offsets`` (and their clamping), ``row_scale`` (applied to the output of the second GEMM), ``out``
    and ``m_hint`` as in :func:`grouped_gemm`. Returns bf16 ``[G, M_max, H]`` (masked; rows past the counts
    untouched) or ``[S, H]`` (ragged); with ``return_plan``, ``(out, (plan1, plan2))``.

    FP8 weights: x is an Fp8Tensor (``block_rows`` 1), or bf16, which is quantized here per token per 128 channels
    (``quantize_fp8(x, 1, check_finite=False)``: a row's codes depend on that row alone, so garbage rows past the
    counts touch nothing). GEMM1 writes its SwiGLU result as FP8 (``quantize_out``), which GEMM2 multiplies by w2.

    Decode-sized calls (up to 32 tokens per expert) with bf16 weights chain the two GEMMs: GEMM2 starts on an expert
    as soon as GEMM1 has finished that expert's tiles (``chain.py``; ``MOE_EP_GEMM_CHAIN=off`` turns it off).
    ``chain_ready``: int32 ``[G]`` zeros on x's device (zeroed by the caller's earlier kernel, e.g. the bridge's route),
    which the chain then counts in; default (None): a zeroed tensor made here per chained call (one torch op). A call
    that does not chain leaves it as it is.
    """
    shape13 = tuple(w13.shape) if isinstance(w13, (torch.Tensor, NvFp4Tensor, Fp8Tensor)) else None
    shape2 = tuple(w2.shape) if isinstance(w2, (torch.Tensor, NvFp4Tensor, Fp8Tensor)) else None
    # (if / fail, not check(): this runs on every forward, and a call costs host time)
    if shape13 is None or len(shape13) != 3:
        fail("w13.shape", shape13, "[G, 2I, H]")
    if shape2 is None or len(shape2) != 3:
        fail("w2.shape", shape2, "[G, H, I]")
    G, I2, H = shape13
    if shape2 != (G, H, I2 // 2):
        fail("w2.shape", shape2, f"{(G, H, I2 // 2)} (from w13 {shape13})")
    _check_m_hint(m_hint)
    fp8 = isinstance(w13, Fp8Tensor)
    if fp8 != isinstance(w2, Fp8Tensor):
        fail("(type(w13), type(w2))", (type(w13).__name__, type(w2).__name__), "both Fp8Tensors, or neither")
    if fp8 and isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16 and x.dim() in (2, 3):
        check_on_kernel_device(x, "x")
        x = quantize_fp8(x, 1, check_finite=False)  # per token: garbage rows past the counts touch no other row
    # bf16 weights at decode shapes: GEMM2 waits for GEMM1's tiles expert by expert, not for all of GEMM1 (chain.py).
    # Not prefill and not NVFP4 weights: neither waits on DRAM (docs/PERF.md). Not as a dependent launch when out
    # shares memory with x: GEMM2 would write it while GEMM1 still reads other experts' rows.
    xshape = tuple(x.shape) if isinstance(x, (torch.Tensor, NvFp4Tensor, Fp8Tensor)) else ()
    decode = len(xshape) in (2, 3) and G >= 1 and \
        m_bucket(_tokens_per_expert(xshape, offsets is not None, G, m_hint)) <= DECODE_MAX_M
    chained = decode and isinstance(w13, torch.Tensor) and chain_enabled()
    env = plans.environment()  # one for both GEMMs
    call1 = _check(x, w13, counts, offsets, True, None, None, m_hint, fp8)
    if chain_ready is not None and not (type(chain_ready) is torch.Tensor and chain_ready.dtype is torch.int32
                                        and chain_ready.shape == (G,) and chain_ready.device == call1.xd.device
                                        and chain_ready.is_contiguous()):
        fail("chain_ready", f"{getattr(chain_ready, 'dtype', type(chain_ready).__name__)} "
             f"{tuple(getattr(chain_ready, 'shape', ()))} on {getattr(chain_ready, 'device', None)}",
             f"None or a contiguous int32 tensor [{G}] of zeros on {call1.xd.device} (x's device)")
    first = Link(chain_ready, pdl=dependent_launch_supported()) if chained else None
    p1 = _launch(call1, _plan(call1, first, None, env), first)
    h = call1.out
    second = None
    if first is not None and p1.config is not None:  # chained, and GEMM1 had rows
        second = Link(first.ready, (p1.config["BLOCK_M"], host_math.cdiv(I2 // 2, p1.config["BLOCK_N"])),
                      first.pdl and not _shares_memory(out, x))
    call2 = _check(h, w2, counts, offsets, False, row_scale, out, m_hint, False, first_gemm=call1)
    p2 = _launch(call2, _plan(call2, second, None, env), second)
    return (call2.out, (p1, p2)) if return_plan else call2.out


def _plan(call: _Call, link: Link | None, config: dict | None, env: tuple | None = None) -> GemmPlan:
    chain = "none" if link is None else ("counts" if link.wait is None else "waits")
    return plans.decide(ragged=call.ragged, x_fp4=call.x_fp4, w_fp4=call.w_fp4, fp8=call.fp8,
                        fp8_out=call.quantize_out, out_fp32=call.out_fp32, swiglu=call.swiglu,
                        row_scale=call.row_scale is not None, G=call.G, N=call.N, K=call.K, M_max=call.M_max,
                        S=call.S, m=call.m, chain=chain, pdl=link is not None and link.pdl, config=config, env=env)


def _launch(c: _Call, p: GemmPlan, link: Link | None) -> GemmPlan:
    """Launch plan ``p`` for call ``c``; the plan as launched (an autotuned one with the autotuner's pick)."""
    if p.config_source == "no-launch":
        return p
    if p.path == "gluon-fp8":
        _launch_gluon_fp8(c, p)
        return p
    if p.path == "gluon-nvfp4":
        _launch_gluon_nvfp4(c, p)
        return p
    if p.path == "sm100-fp4":
        sm100_fp4.launch(c.xd, c.xs, c.xgs, c.wd, c.ws, c.wgs, c.idx, c.out, c.row_scale, ragged=c.ragged,
                         swiglu=c.swiglu, G=c.G, N=c.N, K=c.K, M_max=c.M_max, S=c.S, config=p.config)
        return p
    xd, wd, K = c.xd, c.wd, c.K
    if p.x_decoded:
        xd = decode_nvfp4(xd, c.xs, c.xshape, None if c.ragged else c.idx)
    if p.w_decoded:
        wd = decode_nvfp4(wd, c.ws, c.wshape)
    w_tiles_fp4 = c.w_fp4 and not p.w_decoded
    if p.tma_possible:  # descriptor bases must be 16-byte aligned (rows are: K % 16 == 0); a view at an odd offset
        xd = xd if xd.data_ptr() % 16 == 0 else xd.clone()  # is copied
        wd = wd if wd.data_ptr() % 16 == 0 else wd.clone()
    dummy = xd
    xgs_stride = int(c.x_fp4 and c.xgs.numel() > 1)  # per-row global scales (received NVFP4 tokens)
    fp8_out = c.quantize_out
    out, out_scales = (c.out.data.view(torch.uint8), c.out.scales) if fp8_out else (c.out, dummy)
    args = (xd, c.xgs if p.x_decoded else dummy, c.xs if c.fp8 else dummy, xgs_stride, wd,
            c.ws if w_tiles_fp4 or c.fp8 else dummy, c.wgs if c.w_fp4 else dummy, out, out_scales,
            c.row_scale if c.row_scale is not None else dummy, c.idx)
    chain_args = (c.idx, 1, 1)  # ready counts (a placeholder when not chained), GEMM1's BLOCK_M and column tiles
    if link is not None:
        if link.ready is None:  # a zeroed counter per chained call, not one kept and reset by its last reader:
            # no GEMM2 program knows that every other has read its expert's count (a reset could hide tiles from
            # one still waiting), and the next forward's GEMM1, a dependent launch, may count before a reset lands
            link.ready = torch.zeros(c.G, dtype=torch.int32, device=xd.device)
        chain_args = (link.ready, *(link.wait or (1, 1)))
        link.pdl = p.pdl  # timed configs run one after another: a searched GEMM1 is followed by a plain launch
        link.launched = args
    tail = (*chain_args, c.G, c.M_max, c.N, K, c.S, K // 4, K // 16, p.m_bucket)
    cfg = p.config
    if cfg is not None:  # the plan has the grid and the constexprs launch_kernel's heuristics would derive: the bare
        # kernel, with a tuple grid and the keyword arguments kept per plan (no heuristics, no grid function)
        descs = (_descriptors(xd, wd, K, config_space.tma_blocks(cfg, c.fp8, c.swiglu)) if cfg["TMA"]
                 else (None, None))
        kw, items = _launch_kwargs(p)
        launch_cache.launch_kept(kernels.grouped_gemm_kernel, (p.grid,), (*args, *descs, *tail), kw, items)
        return p
    ragged, G, M_max, S, N, swiglu = c.ragged, c.G, c.M_max, c.S, c.N, c.swiglu

    def programs(meta):
        return (schedule.grid_size(meta, ragged, G, M_max, S, N, swiglu),)

    descs = (TensorDescriptor.from_tensor(xd.view(-1, K), [16, 32]),  # tile shapes set per config
             TensorDescriptor.from_tensor(wd.view(-1, K), [16, 32])) if p.tma_possible else (None, None)
    best = launch_cache.launch(kernels.autotuned_kernel, programs, *args, *descs, *tail, **_flags(p))
    return plans.autotuned(p, config_space.config_dict(best) if best is not None else None)


def _launch_gluon_fp8(c: _Call, p: GemmPlan) -> None:
    """Plan ``p``'s launch on the Gluon FP8 kernels (``gluon_fp8.py``), which take int32 offsets
    (:func:`_int32_index`)."""
    from . import gluon_fp8
    offsets = _int32_index(c)
    if c.quantize_out:  # GEMM1: SwiGLU, codes and scales out
        out, out_scales = c.out.data, c.out.scales
    else:
        out, out_scales = c.out, c.xs  # (unread without SwiGLU)
    gluon_fp8.launch(c.xd, c.xs, c.wd, c.ws, offsets, out, out_scales, c.row_scale, p.config["VARIANT"],
                     swiglu=c.swiglu, num_programs=p.grid)


def _launch_gluon_nvfp4(c: _Call, p: GemmPlan) -> None:
    """Plan ``p``'s launch on the Gluon NVFP4-weight prefill GEMM (``gluon_nvfp4_prefill.py``): int32 offsets, or
    masked int32 counts and the experts' row blocks flattened (:func:`_int32_index`), and the weights' global scales
    (``c.wgs``: one per expert already). NVFP4 x is decoded to its bf16 copy first, as for the tl kernel, and its
    global scales (one, or one per row) enter as the kernel's row factor, ``256 / xgs`` (times the routing weight,
    where there is one), applied before SwiGLU as the tl kernel applies it."""
    from . import gluon_nvfp4_prefill
    xd, row_factor = c.xd, None if c.row_scale is None else c.row_scale.reshape(c.S)
    if p.x_decoded:
        xd = decode_nvfp4(c.xd, c.xs, c.xshape, None if c.ragged else c.idx)
        x_factor = (256.0 / c.xgs).expand(c.S)  # (c.xgs: fp32, flat: one, or one per row)
        row_factor = (x_factor if row_factor is None else x_factor * row_factor).contiguous()
    gluon_nvfp4_prefill.launch(xd.reshape(c.S, c.K), c.wd, c.ws, c.wgs, _int32_index(c), c.out.view(c.S, c.N),
                               row_factor, p.config["BLOCK_T"], p.grid, swiglu=c.swiglu,
                               m_max=None if c.ragged else c.M_max)


def _int32_index(c: _Call) -> torch.Tensor:
    """The call's offsets (or masked counts) as the Gluon kernels take them, int32: int64 ones (HT expert-major's)
    clamped to [0, S] (counts: [0, M_max]) first, as the kernels would clamp them, so that no value wraps in the
    cast."""
    return c.idx if c.idx.dtype is torch.int32 else c.idx.clamp(0, c.S if c.ragged else c.M_max).to(torch.int32)


def _flags(p: GemmPlan) -> dict:
    """The kernel's constexprs for plan ``p`` besides its tile config: layout, operand formats, epilogues, chain."""
    return dict(RAGGED=p.ragged, W_FP4=p.w_format == "nvfp4" and not p.w_decoded, X_DECODED=p.x_decoded,
                W_DECODED=p.w_decoded, FP8=p.x_format == "fp8", FP8_OUT=p.out_format == "fp8", SWIGLU=p.swiglu,
                HAS_RS=p.row_scale, BLOCK_G=max(host_math.next_power_of_2(p.sizes[0]), 2),
                SIGNAL=p.chain == "counts", WAIT=p.chain == "waits", PDL=p.pdl)


def _config_constexprs(p: GemmPlan) -> dict:
    """The config of plan ``p`` with EVEN_K and PERSISTENT, as ``kernels.launch_kernel``'s heuristics derive them."""
    cfg = p.config
    return dict(cfg, EVEN_K=p.sizes[2] % cfg["BLOCK_K"] == 0, PERSISTENT=p.persistent and not cfg["TMA"])


_KEPT_KWARGS: dict[int, tuple] = {}  # id(plan) -> (plan, keyword arguments, their items); plans are cached values
_MAX_KEPT = 1024


def _launch_kwargs(p: GemmPlan) -> tuple[dict, tuple]:
    """(keyword arguments, ``tuple`` of their items) of plan ``p``'s launch with its config: a function of the plan
    alone, made once per plan (``launch_cache.launch_kept``)."""
    kept = _KEPT_KWARGS.get(id(p))
    if kept is not None and kept[0] is p:
        return kept[1], kept[2]
    kw = dict(_flags(p), **_config_constexprs(p))
    if p.pdl and p.chain == "waits":  # GEMM2 as GEMM1's dependent
        kw["launch_pdl"] = True
    if len(_KEPT_KWARGS) >= _MAX_KEPT:
        _KEPT_KWARGS.clear()
    _KEPT_KWARGS[id(p)] = (p, kw, tuple(kw.items()))
    return kw, _KEPT_KWARGS[id(p)][2]


def _descriptors(xd: torch.Tensor, wd: torch.Tensor, K: int, blocks: tuple) -> tuple:
    """TMA descriptors of x as ``[rows, K]`` and w as ``[G * NW, K]``, with the boxes ``config_space.tma_blocks``
    gives a config (the ones ``config_space.set_tma_blocks`` sets on an autotuned launch)."""
    return _descriptor(xd, K, blocks[0]), _descriptor(wd, K, blocks[1])


_DESCRIPTOR_FIELDS = [f.name for f in dataclasses.fields(TensorDescriptor)]
_CHECKED_BLOCKS: set = set()


def _descriptor(t: torch.Tensor, K: int, block: tuple) -> TensorDescriptor:
    """``TensorDescriptor.from_tensor(t.view(-1, K), block)`` without its per-call checks, which hold here by
    construction: ``t`` is contiguous bf16 or e4m3 (rows of K, K % 16 == 0: every row stride is 16-byte aligned; at
    least one row: empty calls launch nothing) and the launcher aligned its base to 16 bytes; the block shape (a
    config's tiles) is checked once per element type. The base is ``t`` itself (the descriptor takes its address and
    dtype; the shape and strides given are the 2-D view's). A Triton whose descriptor has other fields gets ``from_tensor``."""
    if (block, t.dtype) not in _CHECKED_BLOCKS or \
            _DESCRIPTOR_FIELDS != ["base", "shape", "strides", "block_shape", "padding"]:
        d = TensorDescriptor.from_tensor(t.view(-1, K), list(block))  # Triton's own checks (once per box and dtype)
        _CHECKED_BLOCKS.add((block, t.dtype))
        return d
    d = object.__new__(TensorDescriptor)
    d.base, d.shape, d.strides, d.block_shape, d.padding = t, (t.numel() // K, K), (K, 1), list(block), "zero"
    return d


def _check(x, w, counts, offsets, swiglu, row_scale, out, m_hint, quantize_out=False,
           first_gemm: _Call | None = None) -> _Call:
    """The call's arguments checked (MoEEpInputError naming the argument, its value and what is allowed) and made
    contiguous; ``out`` allocated when None (an Fp8Tensor with ``quantize_out``). ``first_gemm``: for the expert
    MLP's GEMM2, GEMM1's checked call, whose output ``x`` is: x, the counts / offsets and ``m_hint`` were checked
    with it (w, row_scale and out are checked here)."""
    ragged = offsets is not None
    if first_gemm is None:
        if (counts is None) == (offsets is None):  # (if / fail, not check(): every call runs these)
            fail("(counts, offsets)", ("tensor" if counts is not None else None,
                                       "tensor" if offsets is not None else None),
                 "exactly one of counts (masked layout) or offsets (ragged layout)")
        if type(swiglu) is not bool:
            fail("swiglu", swiglu, "True or False")
        if type(quantize_out) is not bool:
            fail("quantize_out", quantize_out, "True or False")
        _check_m_hint(m_hint)
        xd, xs, xgs, xshape, x_fmt = _operand(x, "x", 2 if ragged else 3,
                                              "[S, K] (ragged)" if ragged else "[G, M_max, K] (masked)")
    elif first_gemm.quantize_out:  # GEMM1's FP8 output: e4m3 codes and their fp32 scales, contiguous
        xd, xs, xgs, xshape, x_fmt = x.data, x.scales, None, tuple(x.shape), "fp8"
    else:
        xd, xs, xgs, xshape, x_fmt = x, None, None, tuple(x.shape), "bf16"
    wd, ws, wgs, wshape, w_fmt = _operand(w, "w", 3, "[G, N, K]")
    x_fp4, w_fp4, fp8 = x_fmt == "nvfp4", w_fmt == "nvfp4", x_fmt == "fp8"
    if "fp8" in (x_fmt, w_fmt) and x_fmt != w_fmt:
        fail("(x, w) formats", (x_fmt, w_fmt), "both FP8 (Fp8Tensors), or neither: quantize a bf16 x with "
             "quantize_fp8(x, 1); FP8 does not pair with NVFP4 or bf16 weights")
    if wd.device != xd.device:
        fail("w.device", str(wd.device), f"{xd.device} (x's device)")
    G, NW, K = wshape
    if G < 1:
        fail("w.shape[0] (G)", G, ">= 1")
    if K < 16 or K % 16:
        fail("w.shape[2] (K)", K, "a positive multiple of 16")
    if xshape[-1] != K:
        fail("x.shape[-1]", xshape[-1], f"{K} (w's K)")
    if NW < 1 or (swiglu and NW % 2):
        fail("w.shape[1] (N)", NW, "an even number >= 2 (gate rows then up rows)" if swiglu else ">= 1")
    if quantize_out and not (fp8 and swiglu):
        fail("quantize_out", quantize_out, "False unless x and w are FP8 and swiglu is True")
    if fp8:
        _check_fp8(x, w, swiglu)
    dev = xd.device
    if x_fp4:
        n_rows = xd.numel() // (K // 2)
        if xgs.numel() not in (1, n_rows):
            fail("x.global_scale.shape", tuple(x.global_scale.shape),
                 f"a scalar, or one per row ({n_rows} = {tuple(xshape[:-1])})")
    if w_fp4:
        if wgs.numel() not in (1, G):
            fail("w.global_scale.shape", tuple(w.global_scale.shape), f"[{G}] (one per expert)")
        wgs = wgs.expand(G).contiguous()
    if ragged:
        S, M_max = xshape[0], 0
        idx = _index(offsets, "offsets", G + 1, dev) if first_gemm is None else first_gemm.idx
        rows_shape = (S,)
    else:
        if xshape[0] != G:
            fail("x.shape[0]", xshape[0], f"{G} (w's number of experts G)")
        S, M_max = G * xshape[1], xshape[1]
        idx = _index(counts, "counts", G, dev) if first_gemm is None else first_gemm.idx
        rows_shape = (G, M_max)
    N = NW // 2 if swiglu else NW
    if row_scale is not None:
        check(isinstance(row_scale, torch.Tensor) and row_scale.dtype == torch.float32, "row_scale.dtype",
              getattr(row_scale, "dtype", type(row_scale).__name__), "torch.float32")
        if tuple(row_scale.shape) != rows_shape:
            fail("row_scale.shape", tuple(row_scale.shape), str(rows_shape))
        if row_scale.device != dev:
            fail("row_scale.device", str(row_scale.device), str(dev))
        row_scale = row_scale.contiguous()
    out_fp32 = False
    if quantize_out and out is not _NO_OUT:
        if out is not None:
            fail("out", type(out).__name__, "None with quantize_out (a new Fp8Tensor is returned)")
        shape = (*rows_shape, N)
        out = Fp8Tensor(torch.empty(shape, dtype=torch.float8_e4m3fn, device=dev),
                        torch.empty(fp8_scales_shape(shape, 1), dtype=torch.float32, device=dev), 1)
    elif out is None:
        out = torch.empty(*rows_shape, N, dtype=torch.bfloat16, device=dev)
    elif out is not _NO_OUT:
        check(isinstance(out, torch.Tensor) and out.dtype in (torch.bfloat16, torch.float32), "out.dtype",
              getattr(out, "dtype", type(out).__name__), "torch.bfloat16 (or torch.float32)")
        if tuple(out.shape) != (*rows_shape, N):
            fail("out.shape", tuple(out.shape), str((*rows_shape, N)))
        if out.device != dev or not out.is_contiguous():
            fail("out", f"{out.device}, contiguous={out.is_contiguous()}", f"a contiguous tensor on {dev}")
        out_fp32 = out.dtype is torch.float32
    return _Call(xd, xs, xgs, xshape, x_fp4, wd, ws, wgs, wshape, w_fp4, fp8, quantize_out, idx, ragged, swiglu,
                 row_scale, out, out_fp32, G, N, K, M_max, S, _tokens_per_expert(xshape, ragged, G, m_hint))


def _check_m_hint(m_hint) -> None:
    if m_hint is None or (type(m_hint) is int and m_hint >= 1):  # the common case without the ABC check
        return
    if not isinstance(m_hint, numbers.Integral) or isinstance(m_hint, bool) or m_hint < 1:
        fail("m_hint", m_hint, "None or a positive int (expected tokens per expert)")


def _check_fp8(x: Fp8Tensor, w: Fp8Tensor, swiglu: bool) -> None:
    """FP8 operands against each other: x per token (block_rows 1), w per 128x128 block with the scale layout its
    rows need (each Fp8Tensor's parts were checked against its own shape already)."""
    if x.block_rows != 1:
        fail("x.block_rows", x.block_rows, "1 (FP8 activations: one scale per row per 128 columns)")
    if w.block_rows != FP8_BLOCK:
        fail("w.block_rows", w.block_rows, f"{FP8_BLOCK} (FP8 weights: one scale per 128x128 block)")
    NW = w.shape[1]
    if swiglu:  # gate's row blocks then up's (Fp8Tensor.gate_up; the plain layout where I % 128 == 0)
        want = fp8_scales_shape(w.shape, FP8_BLOCK, gate_up=True)
        if tuple(w.scales.shape) != want:
            fail("w.scales.shape", tuple(w.scales.shape), f"{want}: gate's row blocks then up's, with swiglu "
                 "(an Fp8Tensor with gate_up=True)")
    elif w.gate_up and (NW // 2) % FP8_BLOCK:
        fail("w.gate_up", True, f"False without swiglu (or N / 2 a multiple of {FP8_BLOCK})")


def _operand(t, name: str, dims: int, what: str):
    """(data, scales, global scale, logical shape, format) of a bf16 tensor, an NvFp4Tensor (scales as bytes) or an
    Fp8Tensor (e4m3 data, fp32 scales); format "bf16", "nvfp4" or "fp8"."""
    if isinstance(t, NvFp4Tensor):  # (messages are built only on failure: this runs on every call)
        t.check(name)  # the parts agree with the shape and with each other
        if t.swizzled:
            fail(f"{name}.swizzled", t.swizzled, "False (linear scales)")
        shape = tuple(t.shape)
        if len(shape) != dims:
            fail(f"{name}.shape", shape, what)
        check_on_kernel_device(t.data, f"{name}.data")  # (check() put every part on one device)
        return (t.data.contiguous(), t.scales.contiguous().view(torch.uint8), t.global_scale.reshape(-1).contiguous(),
                shape, "nvfp4")
    if isinstance(t, Fp8Tensor):
        t.check(name)
        shape = tuple(t.shape)
        if len(shape) != dims:
            fail(f"{name}.shape", shape, what)
        check_on_kernel_device(t.data, f"{name}.data")
        # e4m3, not bytes: a tile loaded through an e4m3 pointer feeds the MMA from shared memory as it is (a bitcast
        # byte tile goes through registers, which the two fp32 tiles of an FP8 step need)
        return t.data.contiguous(), t.scales.contiguous(), None, shape, "fp8"
    if not isinstance(t, torch.Tensor):
        fail(f"type({name})", type(t).__name__, "a bf16 torch.Tensor, an NvFp4Tensor or an Fp8Tensor")
    if t.dtype != torch.bfloat16:
        fail(f"{name}.dtype", t.dtype, "torch.bfloat16 (or an NvFp4Tensor, an Fp8Tensor)")
    if t.dim() != dims:
        fail(f"{name}.shape", tuple(t.shape), what)
    check_on_kernel_device(t, name)
    return t.contiguous(), None, None, tuple(t.shape), "bf16"


def _index(t, name: str, length: int, dev) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        fail(f"type({name})", type(t).__name__, "a torch.Tensor")
    if t.dtype not in (torch.int32, torch.int64):
        fail(f"{name}.dtype", t.dtype, "torch.int32 or torch.int64")
    if tuple(t.shape) != (length,):
        fail(f"{name}.shape", tuple(t.shape), f"({length},)")
    if t.device != dev:
        fail(f"{name}.device", str(t.device), str(dev))
    return t.contiguous()


def _tokens_per_expert(xshape, ragged: bool, G: int, m_hint: int | None) -> int:
    """The tokens per expert a call's tuned config is picked for: ``m_hint``, else M_max (masked) or S / G (ragged)."""
    return int(m_hint) if m_hint is not None else (host_math.cdiv(xshape[0], G) if ragged else xshape[1])


def _shares_memory(out, x) -> bool:
    """Whether the caller's ``out`` lives in the same storage as x (or x's packed NVFP4 data)."""
    xd = x.data if isinstance(x, (NvFp4Tensor, Fp8Tensor)) else x
    return (isinstance(out, torch.Tensor) and isinstance(xd, torch.Tensor)
            and out.untyped_storage().data_ptr() == xd.untyped_storage().data_ptr())
