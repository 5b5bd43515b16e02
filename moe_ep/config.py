"""EpConfig and its enums. Every rule a configuration must obey is checked here, once."""

from __future__ import annotations

import enum
import math
import numbers
import operator
from dataclasses import dataclass

from .errors import MoEEpConfigError


class Algorithm(enum.Enum):
    """LOW_LATENCY (decode: fixed-size buffers, graph-capturable) or HIGH_THROUGHPUT (prefill)."""
    LOW_LATENCY = "ll"
    HIGH_THROUGHPUT = "ht"


class Layout(enum.Enum):
    """What dispatch hands the compute (DESIGN.md's contract table)."""
    EXPERT_MAJOR = "expert_major"
    RANK_MAJOR = "rank_major"   # LL only
    FLAT = "flat"               # HT only


SUPPORTED_LAYOUTS = ((Algorithm.LOW_LATENCY, Layout.EXPERT_MAJOR), (Algorithm.LOW_LATENCY, Layout.RANK_MAJOR),
                     (Algorithm.HIGH_THROUGHPUT, Layout.FLAT), (Algorithm.HIGH_THROUGHPUT, Layout.EXPERT_MAJOR))
"""The (algorithm, layout) pairs EpConfig accepts, in DESIGN.md's table order; the one list of them. Each has
its dispatch result type (``moe_ep.layout_contract.RESULT_TYPES``)."""


class Format(enum.Enum):
    """Number format of weights or activations."""
    BF16 = "bf16"
    NVFP4 = "nvfp4"
    FP8 = "fp8"


ACTIVATION_FORMATS = {Format.BF16: (Format.BF16, Format.NVFP4), Format.NVFP4: (Format.BF16, Format.NVFP4),
                      Format.FP8: (Format.BF16, Format.FP8)}
"""The activation formats each weight format runs with. FP8 weights: bf16 activations (the compute quantizes them
after dispatch) or FP8 ones (W8A8: dispatch carries the FP8 payload); FP8 activations need FP8 weights."""

MAX_INT32 = 2**31 - 1


def _err(field: str, value, allowed: str) -> MoEEpConfigError:
    return MoEEpConfigError(f"EpConfig.{field} = {value!r}; allowed: {allowed}")


@dataclass(frozen=True)
class EpConfig:
    """One MoE layer's expert-parallel configuration. Validated on construction.

    ``num_experts`` global experts (E, a multiple of the world size), ``top_k`` picks per token,
    ``hidden_size`` H, ``intermediate_size`` I (per expert), ``max_tokens_per_rank`` T (the most tokens a
    rank passes to one forward), the algorithm and layout, and the formats of the expert weights and of
    the activations the experts consume.

    ``activation_global_scale`` (NVFP4 activations only): None (default) quantizes each token with its own
    global scale ``2688 / amax(token)``; a positive finite float is one static scale for every token (what an
    NVFP4 checkpoint ships as ``1 / input_scale``). Either way a token's result never depends on the other
    tokens of its batch (DESIGN.md, NVFP4).

    Formats (weights, activations): bf16 or NVFP4 weights with bf16 or NVFP4 activations; FP8 weights with bf16
    activations (quantized to FP8 after dispatch) or FP8 activations (W8A8: dispatch carries e4m3 tokens and one
    fp32 scale per token per 128 channels, DESIGN.md, FP8).
    """

    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    max_tokens_per_rank: int
    algorithm: Algorithm = Algorithm.LOW_LATENCY
    layout: Layout = Layout.EXPERT_MAJOR
    weight_format: Format = Format.BF16
    activation_format: Format = Format.BF16
    activation_global_scale: float | None = None

    def __post_init__(self):
        for name in ("algorithm", "layout", "weight_format", "activation_format"):
            enum_type = {"algorithm": Algorithm, "layout": Layout}.get(name, Format)
            v = getattr(self, name)
            if not isinstance(v, enum_type):
                try:
                    object.__setattr__(self, name, enum_type(v))
                except (ValueError, TypeError):
                    raise _err(name, v, ", ".join(repr(m.value) for m in enum_type)) from None
        for name in ("num_experts", "top_k", "hidden_size", "intermediate_size", "max_tokens_per_rank"):
            v = getattr(self, name)
            try:  # ints and int-likes (numpy ints) are taken as ints; bools, floats and strings are not
                n = None if isinstance(v, bool) else operator.index(v)
            except TypeError:
                n = None
            if n is None or not 0 < n <= MAX_INT32:  # the kernels index rows, ids and slots with int32
                raise _err(name, v, f"an int in [1, {MAX_INT32}]")
            object.__setattr__(self, name, n)
        if self.max_tokens_per_rank * self.top_k > MAX_INT32:
            raise _err("max_tokens_per_rank", self.max_tokens_per_rank,
                       f"max_tokens_per_rank * top_k <= {MAX_INT32} (int32 slot indices)")
        if self.top_k > self.num_experts:
            raise _err("top_k", self.top_k, f"<= num_experts ({self.num_experts})")
        h_mult = 32 if self.activation_format is Format.NVFP4 else 16
        if self.hidden_size % h_mult:
            raise _err("hidden_size", self.hidden_size,
                       f"a multiple of {h_mult}" + (" (NVFP4 activations)" if h_mult == 32 else ""))
        if self.intermediate_size % 16:
            raise _err("intermediate_size", self.intermediate_size, "a multiple of 16")
        allowed = ACTIVATION_FORMATS[self.weight_format]
        if self.activation_format not in allowed:
            raise _err("activation_format", self.activation_format.value,
                       " or ".join(repr(f.value) for f in allowed) + f" with weight_format {self.weight_format.value!r}"
                       + (" (FP8 activations need FP8 weights: W8A8)" if self.activation_format is Format.FP8 else ""))
        gs = self.activation_global_scale
        if gs is not None:
            if self.activation_format is not Format.NVFP4:
                raise _err("activation_global_scale", gs, "None unless activation_format is 'nvfp4'")
            if isinstance(gs, bool) or not isinstance(gs, numbers.Real) or not 0 < gs < math.inf:
                raise _err("activation_global_scale", gs, "None (one scale per token) or a positive finite float")
            object.__setattr__(self, "activation_global_scale", float(gs))
        if (self.algorithm, self.layout) not in SUPPORTED_LAYOUTS:
            raise _err("layout", self.layout.value, " or ".join(repr(lay.value) for alg, lay in SUPPORTED_LAYOUTS
                                                                if alg is self.algorithm) + f" with {self.algorithm.name}")

    def local_experts(self, world_size: int) -> int:
        """Experts per rank; raises MoEEpConfigError unless num_experts divides evenly."""
        if world_size <= 0 or self.num_experts % world_size:
            raise _err("num_experts", self.num_experts, f"a multiple of the world size ({world_size})")
        return self.num_experts // world_size

    def tokens_per_expert(self, world_size: int, batch: int) -> int:
        """The rows an expert receives on average when every rank sends ``batch`` tokens (``world * batch * top_k /
        num_experts``, at least 1): which tuned grouped-GEMM tiles to use. The layout's own row capacity is no
        guide: a rank-major buffer holds every pick of every token, an expert-major one all tokens per expert."""
        return max(1, -(-world_size * batch * self.top_k // self.num_experts))
