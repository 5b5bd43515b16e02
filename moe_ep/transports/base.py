"""The transport interface and the layout contract (DESIGN.md) every transport's dispatch obeys.

Notation: B tokens on this rank, H hidden, K top-k, R ranks, L local experts, T max tokens per rank,
S received slots (HT). Ids the compute sees are *local* expert ids; -1 means "not here".

| algorithm, layout | dispatch gives | compute returns | weights applied by |
|---|---|---|---|
| LL EXPERT_MAJOR | tokens [L, R*T, H], expert_counts [L] | [L, R*T, H] | transport's combine |
| LL RANK_MAJOR | tokens [R, T, H], topk_idx [R, T, K] (int32), topk_weights [R, T, K], src_rank_counts [R] | [R, T, H] weighted sum over local picks | compute |
| HT FLAT | tokens [S, H], topk_idx [S, K] (int64), topk_weights [S, K] | [S, H] weighted sum | compute |
| HT EXPERT_MAJOR | tokens [S, H] grouped by expert, expert_offsets [L], expert_counts [L], topk_weights [S] | [S, H] each slot scaled | compute |

With NVFP4 activations ``tokens`` is an ``NvFp4Tensor`` (packed uint8 [..., H/2], e4m3 scales
[..., H/16] linear) instead of bf16 rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..errors import MoEEpInputError


@dataclass
class DispatchResult:
    """What ``Transport.dispatch`` hands the expert compute; fields not used by a layout are None."""

    tokens: object                                # torch.Tensor (bf16) or NvFp4Tensor
    expert_counts: torch.Tensor | None = None     # [L] rows per local expert (EXPERT_MAJOR)
    expert_offsets: torch.Tensor | None = None    # [L] first row of each expert (HT EXPERT_MAJOR)
    topk_idx: torch.Tensor | None = None          # local ids or -1 (RANK_MAJOR [R,T,K] int32, FLAT [S,K] int64)
    topk_weights: torch.Tensor | None = None      # [R,T,K] / [S,K] / [S] (HT EXPERT_MAJOR, one per slot)
    src_rank_counts: torch.Tensor | None = None   # [R] tokens received from each rank (RANK_MAJOR)
    num_recv: torch.Tensor | None = None          # scalar: valid rows of tokens (HT layouts; rows past are garbage)


class Transport(Protocol):
    """Moves tokens between ranks. One instance per layer config; buffers are allocated once."""

    name: str
    graph_capturable: bool  # dispatch + combine run with no host sync (MoEEpLayer(cuda_graph=True) needs it)

    def dispatch(self, hidden_states: torch.Tensor, topk_idx: torch.Tensor,
                 topk_weights: torch.Tensor) -> DispatchResult:
        """Send each token to the ranks owning its picked experts (global ids, -1 skipped)."""
        ...

    def combine(self, expert_out: torch.Tensor) -> torch.Tensor:
        """Return ``[B, H]`` in the original token order from the compute's output of the last dispatch."""
        ...

    def close(self) -> None:
        """Release communication resources."""
        ...




def padding_row(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, top_k: int):
    """One token that picks no expert (zeros, ids -1): what a rank with no tokens sends, since it must
    still take part in the collective dispatch and combine."""
    return (torch.zeros(1, x.shape[1], dtype=x.dtype, device=x.device),
            torch.full((1, top_k), -1, dtype=topk_idx.dtype, device=x.device),
            torch.zeros(1, top_k, dtype=topk_weights.dtype, device=x.device))


def initialized_rank_world(group, transport: str) -> tuple[int, int]:
    """(rank, world size) of ``group`` for a transport that needs torch.distributed initialized."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        raise MoEEpInputError(f"torch.distributed is not initialized; allowed: transport '{transport}' after "
                              "torch.distributed.init_process_group (world size 1 included)")
    return dist.get_rank(group), dist.get_world_size(group)
