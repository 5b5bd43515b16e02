"""The transport interface, and what every transport shares: the rank/world of its group, the padding row.

What ``dispatch`` returns is the layout contract: one result type per (algorithm, layout), in
:mod:`moe_ep.layout_contract`.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..errors import MoEEpInputError
from ..layout_contract import DispatchResult


class Transport(Protocol):
    """Moves tokens between ranks. One instance per layer config; buffers are allocated once."""

    name: str
    graph_capturable: bool  # dispatch + combine run with no host sync (MoEEpLayer(cuda_graph=True) needs it)
    replayable: bool  # dispatch + combine are kernels and torch ops of this process alone (forward_plan.py)

    def dispatch(self, hidden_states: torch.Tensor, topk_idx: torch.Tensor,
                 topk_weights: torch.Tensor) -> DispatchResult:
        """Send each token to the ranks owning its picked experts (global ids, -1 skipped); returns the result
        type of the config's layout (``moe_ep.layout_contract.result_type(config)``)."""
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


def group_rank_world(group, needs_process_group: str | None = None) -> tuple[int, int]:
    """(rank, world size) of ``group``: (0, 1) when torch.distributed is not initialized and ``group`` is None
    (one process), unless ``needs_process_group`` names a transport that cannot run without it; then, as for
    a ``group`` given before ``init_process_group``, :class:`MoEEpInputError`."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    if group is None and needs_process_group is None:
        return 0, 1
    what = f"transport '{needs_process_group}'" if needs_process_group else "a process group"
    raise MoEEpInputError(f"torch.distributed is not initialized; allowed: {what} after "
                          "torch.distributed.init_process_group (world size 1 included)")
