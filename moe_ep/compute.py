"""Expert compute per (algorithm, layout): a DispatchResult in, the combine's input out (DESIGN.md's table).

* LL EXPERT_MAJOR — masked ``expert_mlp`` on ``[L, R*T, H]``; routing weights are applied by combine.
* LL RANK_MAJOR, HT FLAT — bridge (route, permute) + ragged ``expert_mlp`` + weighted unpermute-reduce.
* HT EXPERT_MAJOR — ragged ``expert_mlp`` on the transport's offsets, each slot scaled by its weight.

Nothing here syncs with the host: counts, offsets and the number of valid rows stay on the device.

NVFP4 activations: received ``NvFp4Tensor`` tokens keep their source rank's global scale per row, and
the GEMM takes them as they are (one global scale per row); the bridge gathers their packed rows, scales
and global scales without requantizing. Tokens that arrive as bf16 when ``activation_format`` is NVFP4
are quantized here with one scale computed on the device (for the bridge layouts in the same pass as the
gather).
"""

from __future__ import annotations

import torch

from .config import Algorithm, EpConfig, Format, Layout
from .kernels import expert_mlp
from .kernels.bridge import permute_rows, route_experts, unpermute_reduce
from .kernels.nvfp4 import NvFp4Tensor, quantize_nvfp4
from .transports.base import DispatchResult
from .weights import ExpertWeights


def _zero_garbage(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Rows outside ``valid`` zeroed, so garbage cannot skew a global scale computed from x."""
    return torch.where(valid[..., None], x, torch.zeros((), dtype=x.dtype, device=x.device))


def _needs_quantizing(x, nvfp4: bool) -> bool:
    """bf16 tokens when NVFP4 activations are asked for (NVFP4 tokens go to the GEMM as they are)."""
    return nvfp4 and not isinstance(x, NvFp4Tensor)


def _quantized(x: torch.Tensor, valid: torch.Tensor) -> NvFp4Tensor:
    """x quantized with one scale, computed on the device from its valid rows."""
    return quantize_nvfp4(_zero_garbage(x, valid), check_finite=False)


def _flat(tokens, M: int, H: int):
    """Tokens ``[..., H]`` as ``M`` rows (an NvFp4Tensor's per-row global scales come along)."""
    if not isinstance(tokens, NvFp4Tensor):
        return tokens.reshape(M, H)
    gs = tokens.global_scale
    return NvFp4Tensor(tokens.data.reshape(M, H // 2), tokens.scales.reshape(M, H // 16),
                       gs.reshape(M) if gs.numel() > 1 else gs, torch.Size((M, H)))


def ll_expert_major(d: DispatchResult, w: ExpertWeights, nvfp4: bool, m_hint: int | None) -> torch.Tensor:
    """``[L, R*T, H]`` -> ``[L, R*T, H]``: masked MLP, rows past ``expert_counts`` untouched."""
    x = d.tokens
    if _needs_quantizing(x, nvfp4):
        x = _quantized(x, torch.arange(x.shape[1], device=w.device)[None, :] < d.expert_counts[:, None])
    return expert_mlp(x, w.w13, w.w2, counts=d.expert_counts, m_hint=m_hint)


def _bridged(tokens, topk_idx: torch.Tensor, topk_weights: torch.Tensor, valid_rows: torch.Tensor,
             rows_per_group: int, w: ExpertWeights, nvfp4: bool, m_hint: int | None) -> torch.Tensor:
    """Route ``[M, K]`` picks, permute rows, ragged MLP, weighted unpermute-reduce -> ``[M, H]``."""
    K = topk_idx.shape[-1]
    M = topk_idx.numel() // K
    route = route_experts(topk_idx.reshape(M, K), w.num_local_experts, valid_rows=valid_rows,
                          rows_per_group=rows_per_group)
    H = tokens.shape[-1]
    x = _flat(tokens, M, H)
    if _needs_quantizing(x, nvfp4):  # quantized in the gather, one scale from the valid rows
        r = torch.arange(M, device=w.device)
        valid = (r % rows_per_group) < valid_rows[r // rows_per_group]
        xs = permute_rows(_zero_garbage(x, valid), route, quantize=True)
    else:
        xs = permute_rows(x, route)
    y = expert_mlp(xs, w.w13, w.w2, offsets=route.offsets, m_hint=m_hint)
    return unpermute_reduce(y, route, topk_weights.reshape(M, K))


def ll_rank_major(d: DispatchResult, w: ExpertWeights, nvfp4: bool, m_hint: int | None) -> torch.Tensor:
    """``[R, T, H]`` + local ``topk_idx [R, T, K]`` -> ``[R, T, H]`` (weighted sum over local picks)."""
    R, T = d.topk_idx.shape[0], d.topk_idx.shape[1]
    out = _bridged(d.tokens, d.topk_idx, d.topk_weights, d.src_rank_counts, T, w, nvfp4, m_hint)
    return out.reshape(R, T, -1)


def ht_flat(d: DispatchResult, w: ExpertWeights, nvfp4: bool, m_hint: int | None) -> torch.Tensor:
    """``[S, H]`` + local ``topk_idx [S, K]`` -> ``[S, H]`` (weighted sum over local picks; rows past num_recv 0)."""
    S = d.topk_idx.shape[0]
    return _bridged(d.tokens, d.topk_idx, d.topk_weights, d.num_recv.reshape(1), max(S, 1), w, nvfp4, m_hint)


def ht_expert_major(d: DispatchResult, w: ExpertWeights, nvfp4: bool, m_hint: int | None) -> torch.Tensor:
    """``[S, H]`` grouped by expert -> ``[S, H]``, slot s scaled by ``topk_weights[s]`` (fused in GEMM2)."""
    offsets = torch.cat([d.expert_offsets, (d.expert_offsets[-1:] + d.expert_counts[-1:])])
    x = d.tokens
    if _needs_quantizing(x, nvfp4):
        x = _quantized(x, torch.arange(x.shape[0], device=w.device) < offsets[-1])
    return expert_mlp(x, w.w13, w.w2, offsets=offsets, row_scale=d.topk_weights.float(), m_hint=m_hint)


_COMPUTE = {
    (Algorithm.LOW_LATENCY, Layout.EXPERT_MAJOR): ll_expert_major,
    (Algorithm.LOW_LATENCY, Layout.RANK_MAJOR): ll_rank_major,
    (Algorithm.HIGH_THROUGHPUT, Layout.FLAT): ht_flat,
    (Algorithm.HIGH_THROUGHPUT, Layout.EXPERT_MAJOR): ht_expert_major,
}


def expert_compute(config: EpConfig, d: DispatchResult, weights: ExpertWeights,
                   tokens_per_expert: int | None = None) -> torch.Tensor:
    """The combine input for ``config``'s algorithm/layout from dispatch's result (see the module doc).
    ``tokens_per_expert``: the expected rows per expert (:meth:`EpConfig.tokens_per_expert`), which picks the
    GEMMs' tuned tiles; default: the layout's row capacity per expert."""
    fn = _COMPUTE[(config.algorithm, config.layout)]
    return fn(d, weights, config.activation_format is Format.NVFP4, tokens_per_expert)
