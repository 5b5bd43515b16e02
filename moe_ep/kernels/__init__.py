"""moe-ep's Triton kernels (each with a plain-torch reference in ``moe_ep.reference``)."""

from .bridge import Route, permute_rows, route_experts, scatter_rows, unpermute_reduce
from .fp8 import Fp8Tensor, dequantize_fp8, quantize_fp8
from .grouped_gemm import GemmPlan, expert_mlp, grouped_gemm, plan_grouped_gemm
from .nvfp4 import (NvFp4Tensor, dequantize_nvfp4, gather_quantize_nvfp4, nvfp4_global_scale, nvfp4_row_global_scale,
                    quantize_nvfp4, quantize_nvfp4_tokens, swizzle_scales, unswizzle_scales)

__all__ = ["Fp8Tensor", "quantize_fp8", "dequantize_fp8", "NvFp4Tensor", "quantize_nvfp4", "dequantize_nvfp4",
           "gather_quantize_nvfp4", "nvfp4_global_scale", "nvfp4_row_global_scale", "quantize_nvfp4_tokens",
           "swizzle_scales", "unswizzle_scales", "grouped_gemm", "expert_mlp", "plan_grouped_gemm", "GemmPlan",
           "Route", "route_experts", "permute_rows", "scatter_rows", "unpermute_reduce"]
