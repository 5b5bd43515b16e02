"""Expert compute per layout: a dispatch result (``moe_ep.layout_contract``) in, the combine's input out.

* LL EXPERT_MAJOR — masked ``expert_mlp`` on ``[L, R*T, H]``; routing weights are applied by combine.
* LL RANK_MAJOR, HT FLAT — bridge (route, permute) + ragged ``expert_mlp`` + weighted unpermute-reduce.
* HT EXPERT_MAJOR — ragged ``expert_mlp`` on the transport's offsets, each slot scaled by its weight.

Nothing here syncs with the host: counts, offsets and the number of valid rows stay on the device.

NVFP4 activations: received ``NvFp4Tensor`` tokens carry one global scale per row (DESIGN.md, NVFP4), and
the GEMM takes them as they are; the bridge gathers their packed rows, scales and global scales without
requantizing. Tokens that arrive as bf16 when ``activation_format`` is NVFP4 are quantized here by the same
rule (``quantize_nvfp4_tokens``: each row by its own scale, or the config's static one), so garbage rows
past the counts cannot touch a valid row's codes.

FP8 weights (DESIGN.md, FP8): tokens that arrive as an ``Fp8Tensor`` (``block_rows`` 1, one scale per token per
128 channels) are taken as they are; bf16 tokens are quantized here, after dispatch, by the same per-token rule
(``quantize_fp8(x, 1)``), and the bridge gathers FP8 rows and scales as they are (each payload's row parts,
``moe_ep.kernels.row_parts``, one code path for every format). FP8 weights do not take NVFP4
activations, nor FP8 tokens other weights: both raise :class:`~moe_ep.MoEEpInputError`.
"""

from __future__ import annotations

import torch

from .config import EpConfig, Format
from .errors import fail
from .kernels import expert_mlp
from .kernels.bridge import _launch_route, _permute, _route, _unpermute
from .kernels.fp8 import Fp8Tensor, quantize_fp8
from .kernels.kept_routes import KeptRoutes
from .kernels.nvfp4 import NvFp4Tensor, quantize_nvfp4_tokens
from .layout_contract import (DispatchResult, HighThroughputExpertMajor, HighThroughputFlat, LowLatencyExpertMajor,
                              LowLatencyRankMajor, result_type)
from .weights import ExpertWeights


def _tokens(x, config: EpConfig, w: ExpertWeights):
    """The tokens the GEMM takes: x itself, or x quantized to NVFP4 / FP8 by the layer's rule (module doc)."""
    return activations(x, config.activation_format is Format.NVFP4, config.activation_global_scale,
                       w.format is Format.FP8)


def activations(x, nvfp4: bool, static_global_scale: float | None, fp8_weights: bool = False):
    """``x`` as the GEMM takes it: as it is, or with ``nvfp4`` bf16 tokens quantized per token (or by the static
    scale): ``quantize_nvfp4_tokens``; with ``fp8_weights`` bf16 tokens quantized to FP8 per token per 128 channels
    (``quantize_fp8(x, 1)``; codes of a row with NaN/Inf are unspecified, that row's alone: validation checks them)."""
    if fp8_weights:
        if nvfp4 or isinstance(x, NvFp4Tensor):
            fail("activation format with FP8 weights", "nvfp4", "bf16 or fp8 (FP8 weights multiply FP8 tokens)")
        return x if isinstance(x, Fp8Tensor) else quantize_fp8(x, 1, check_finite=False)
    if isinstance(x, Fp8Tensor):
        fail("FP8 tokens with weights of format", "bf16 or nvfp4", "fp8 (ExpertWeights(..., Format.FP8))")
    if nvfp4 and not isinstance(x, NvFp4Tensor):
        return quantize_nvfp4_tokens(x, static_global_scale)
    return x


def ll_expert_major(d: LowLatencyExpertMajor, w: ExpertWeights, config: EpConfig,
                    tokens_per_expert: int | None, routes: KeptRoutes | None = None) -> torch.Tensor:
    """``[L, R*T, H]`` -> ``[L, R*T, H]``: masked MLP, rows past ``expert_counts`` untouched."""
    return expert_mlp(_tokens(d.tokens, config, w), w.w13, w.w2, counts=d.expert_counts, m_hint=tokens_per_expert)


def bridged_mlp(x, topk_idx: torch.Tensor, topk_weights: torch.Tensor, w: ExpertWeights, valid_rows=None,
                rows_per_group: int | None = None, tokens_per_expert: int | None = None,
                routes: KeptRoutes | None = None) -> torch.Tensor:
    """Route the ``[..., K]`` picks (local ids; others skipped), permute ``x``'s rows ``[..., H]`` (bf16, NVFP4 or FP8;
    one per pick row, row dims flattened), ragged MLP, weighted unpermute-reduce (fp32 sums) -> bf16 ``[..., H]`` (the
    picks' row dims; ``valid_rows`` / ``rows_per_group``: see ``route_experts``, a 0-d ``valid_rows`` is one group).
    The picks' row dims stay as they are: the bridge's kernels index rows flat, so no reshape op is spent. ``routes``:
    the caller's kept route buffers (for ``w.num_local_experts`` experts; else each call allocates its route). The
    route's launch also zeroes the expert MLP's chain counters (no zero-fill op of their own)."""
    # the bridge's unchecked entries: the layout contract (or fused_moe's routing checks) checked these tensors
    valid = valid_rows.contiguous() if valid_rows is not None else None
    idx = topk_idx.contiguous()
    route = routes.route(idx) if routes is not None else None
    if route is None:
        route = _route(idx, w.num_local_experts, valid, rows_per_group or 1, chain_ready=True)
    else:
        _launch_route(idx, valid, rows_per_group or 1, w.num_local_experts, route, scratch=routes.scratch)
    y = expert_mlp(_permute(x, route), w.w13, w.w2, offsets=route.offsets, m_hint=tokens_per_expert,
                   chain_ready=route.chain_ready)
    out = torch.empty(*topk_idx.shape[:-1], y.shape[-1], dtype=torch.bfloat16, device=y.device)
    return _unpermute(y, route.slot, topk_weights.contiguous(), out)


def ll_rank_major(d: LowLatencyRankMajor, w: ExpertWeights, config: EpConfig,
                  tokens_per_expert: int | None, routes: KeptRoutes | None = None) -> torch.Tensor:
    """``[R, T, H]`` + local ``topk_idx [R, T, K]`` -> ``[R, T, H]`` (weighted sum over local picks)."""
    return bridged_mlp(_tokens(d.tokens, config, w), d.topk_idx, d.topk_weights, w, d.src_rank_counts,
                       d.topk_idx.shape[1], tokens_per_expert, routes)


def ht_flat(d: HighThroughputFlat, w: ExpertWeights, config: EpConfig, tokens_per_expert: int | None,
            routes: KeptRoutes | None = None) -> torch.Tensor:
    """``[S, H]`` + local ``topk_idx [S, K]`` -> ``[S, H]`` (weighted sum over local picks; rows past num_recv 0)."""
    S = d.topk_idx.shape[0]
    return bridged_mlp(_tokens(d.tokens, config, w), d.topk_idx, d.topk_weights, w, d.num_recv, max(S, 1),
                       tokens_per_expert, routes)


def ht_expert_major(d: HighThroughputExpertMajor, w: ExpertWeights, config: EpConfig,
                    tokens_per_expert: int | None, routes: KeptRoutes | None = None) -> torch.Tensor:
    """``[S, H]`` grouped by expert -> ``[S, H]``, slot s scaled by ``topk_weights[s]`` (fused in GEMM2)."""
    return expert_mlp(_tokens(d.tokens, config, w), w.w13, w.w2, offsets=_gemm_offsets(d),
                      row_scale=d.topk_weights.float(), m_hint=tokens_per_expert)


def _gemm_offsets(d: HighThroughputExpertMajor) -> torch.Tensor:
    """The GEMM's ``offsets [L+1]``: the contract's ``expert_offsets [L]`` and the end of the last expert's slots. A
    transport that holds them in one buffer, ``num_recv`` the element right after ``expert_offsets`` (world_one's
    route does), gives them as that buffer when ``expert_offsets`` is a view of exactly it (read off the view, no torch
    op), else as one view of it (one torch op, not four)."""
    eo, n = d.expert_offsets, d.num_recv
    L = eo.shape[0]
    if (n.dim() == 0 and eo.dim() == 1 and eo.stride(0) == 1 and n.dtype is eo.dtype and n.device == eo.device
            and n.untyped_storage().data_ptr() == eo.untyped_storage().data_ptr()
            and n.storage_offset() == eo.storage_offset() + L):
        base = eo._base  # (the tensor eo was sliced from: a view of it would be the same elements)
        if base is not None and base.dtype is eo.dtype and base.dim() == 1 and base.shape[0] == L + 1 \
                and base.stride(0) == 1 and base.storage_offset() == eo.storage_offset():
            return base
        return eo.as_strided((L + 1,), (1,))
    return torch.cat([eo, eo[-1:] + d.expert_counts[-1:]])


COMPUTE = {LowLatencyExpertMajor: ll_expert_major, LowLatencyRankMajor: ll_rank_major, HighThroughputFlat: ht_flat,
           HighThroughputExpertMajor: ht_expert_major}
"""The compute of each dispatch result type."""

ROUTED = (LowLatencyRankMajor, HighThroughputFlat)
"""The result types whose compute routes the picks itself (:func:`bridged_mlp`): those that take kept routes."""


def kept_routes(config: EpConfig, world_size: int, device) -> KeptRoutes | None:
    """Route buffers for a layer of ``config`` over ``world_size`` ranks to keep between its forwards, where its
    layout's compute routes (:data:`ROUTED`; up to ``world_size * max_tokens_per_rank * top_k`` picks), else None."""
    if result_type(config) not in ROUTED:
        return None
    return KeptRoutes(world_size * config.max_tokens_per_rank * config.top_k, config.local_experts(world_size), device)


def expert_compute(config: EpConfig, d: DispatchResult, weights: ExpertWeights,
                   tokens_per_expert: int | None = None, routes: KeptRoutes | None = None) -> torch.Tensor:
    """The combine input from dispatch's result ``d``, by its type (see the module doc); ``config`` gives the
    activation format. ``tokens_per_expert``: the expected rows per expert (:meth:`EpConfig.tokens_per_expert`),
    which picks the GEMMs' tuned tiles; default: the layout's row capacity per expert. ``routes``: route buffers the
    caller keeps for ``weights.num_local_experts`` experts (the layouts that route here use them; default: each
    call allocates its own)."""
    fn = COMPUTE.get(type(d))
    if fn is None:
        fail("type(dispatch result)", type(d).__name__, ", ".join(t.__name__ for t in COMPUTE))
    return fn(d, weights, config, tokens_per_expert, routes)
