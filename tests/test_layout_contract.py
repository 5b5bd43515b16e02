"""The layout contract as types: each result type accepts its documented fields and rejects wrong ranks, shapes,
dtypes, devices and types; the supported pairs are one list that EpConfig, the result types, the compute and
every transport agree on."""

import itertools

import fake_nccl_ep
import pytest
import torch

from moe_ep.compute import COMPUTE, expert_compute
from moe_ep.config import SUPPORTED_LAYOUTS, Algorithm, EpConfig, Layout
from moe_ep.errors import MoEEpConfigError, MoEEpInputError
from moe_ep.kernels.fp8 import Fp8Tensor
from moe_ep.kernels.nvfp4 import NvFp4Tensor
from moe_ep.layout_contract import (RESULT_TYPES, HighThroughputExpertMajor, HighThroughputFlat,
                                    LowLatencyExpertMajor, LowLatencyRankMajor, result_type)
from moe_ep.testing.toy_transport import TOY_COMPUTE
from moe_ep.transports.nccl_ep import RECEIVE_BUFFERS, NcclEpTransport
from moe_ep.transports.torch_dist import TorchDistTransport

R, T, L, K, H, S = 2, 3, 4, 2, 32, 12
bf16, i32, i64, f32 = torch.bfloat16, torch.int32, torch.int64, torch.float32


def z(*shape, dt=bf16):
    return torch.zeros(shape, dtype=dt)


def nvfp4(*lead):
    """An NvFp4Tensor of logical shape [*lead, H] (linear scales, one global scale per row)."""
    return NvFp4Tensor(z(*lead, H // 2, dt=torch.uint8), z(*lead, H // 16, dt=torch.float8_e4m3fn), z(*lead, dt=f32),
                       torch.Size((*lead, H)))


def fp8(*lead, block_rows=1):
    """An Fp8Tensor [*lead, H] (e4m3 data; fp32 scales, one per row per 128 channels unless block_rows says)."""
    rows = lead[-1] if block_rows == 1 else -(-lead[-1] // block_rows)
    return Fp8Tensor(z(*lead, H, dt=torch.float8_e4m3fn), z(*lead[:-1], rows, -(-H // 128), dt=f32), block_rows)


VALID = {
    LowLatencyExpertMajor: dict(tokens=z(L, R * T, H), expert_counts=z(L, dt=i32)),
    LowLatencyRankMajor: dict(tokens=z(R, T, H), topk_idx=z(R, T, K, dt=i32), topk_weights=z(R, T, K, dt=f32),
                              src_rank_counts=z(R, dt=i32)),
    HighThroughputFlat: dict(tokens=z(S, H), topk_idx=z(S, K, dt=i64), topk_weights=z(S, K, dt=f32),
                             num_recv=z(dt=i64)),
    HighThroughputExpertMajor: dict(tokens=z(S, H), expert_offsets=z(L, dt=i64), expert_counts=z(L, dt=i64),
                                    topk_weights=z(S, dt=f32), num_recv=z(dt=i64)),
}

# (type, field, bad value): one wrong thing each
BAD = [
    (LowLatencyExpertMajor, "tokens", z(L, R * T, H, dt=torch.float16)),        # dtype
    (LowLatencyExpertMajor, "tokens", z(L * R * T, H)),                          # rank
    (LowLatencyExpertMajor, "tokens", z(L, R * T, H // 2, dt=torch.uint8)),     # packed codes without their scales
    (LowLatencyExpertMajor, "tokens", nvfp4(L * R * T)),                         # NVFP4 of the wrong rank
    (LowLatencyExpertMajor, "tokens", fp8(L * R * T)),                           # FP8 of the wrong rank
    (LowLatencyExpertMajor, "tokens", fp8(L, R * T, block_rows=128)),            # weight-style 128x128 blocks
    (LowLatencyExpertMajor, "tokens", z(L, R * T, H, dt=torch.float8_e4m3fn)),  # e4m3 codes without their scales
    (HighThroughputFlat, "tokens", fp8(1, S)),
    (LowLatencyExpertMajor, "expert_counts", z(L, dt=i64)),
    (LowLatencyExpertMajor, "expert_counts", z(L + 1, dt=i32)),
    (LowLatencyExpertMajor, "expert_counts", None),
    (LowLatencyRankMajor, "tokens", z(R * T, H)),
    (LowLatencyRankMajor, "topk_idx", z(R, T, K, dt=i64)),                       # NCCL-EP's LL ids are int32
    (LowLatencyRankMajor, "topk_idx", z(R, T + 1, K, dt=i32)),
    (LowLatencyRankMajor, "topk_weights", z(R, T, K + 1, dt=f32)),               # K disagrees with topk_idx
    (LowLatencyRankMajor, "topk_weights", z(R, T, K, dt=bf16)),
    (LowLatencyRankMajor, "src_rank_counts", z(R + 1, dt=i32)),
    (LowLatencyRankMajor, "src_rank_counts", z(R, dt=i64)),
    (HighThroughputFlat, "tokens", z(1, S, H)),
    (HighThroughputFlat, "topk_idx", z(S, K, dt=i32)),                           # HT's ids are int64
    (HighThroughputFlat, "topk_idx", z(S - 1, K, dt=i64)),
    (HighThroughputFlat, "topk_weights", z(S, K, 1, dt=f32)),
    (HighThroughputFlat, "num_recv", z(1, dt=i64)),                              # a 0-d tensor, not [1]
    (HighThroughputFlat, "num_recv", 5),
    (HighThroughputExpertMajor, "tokens", "rows"),
    (HighThroughputExpertMajor, "expert_offsets", z(L, dt=i32)),
    (HighThroughputExpertMajor, "expert_offsets", z(L, 1, dt=i64)),
    (HighThroughputExpertMajor, "expert_counts", z(L + 1, dt=i64)),              # disagrees with the offsets
    (HighThroughputExpertMajor, "topk_weights", z(S, K, dt=f32)),                # one weight per slot
    (HighThroughputExpertMajor, "topk_weights", z(S + 1, dt=f32)),
    (HighThroughputExpertMajor, "num_recv", z(dt=i32)),
]


@pytest.mark.parametrize("kind", VALID, ids=lambda t: t.__name__)
def test_valid_results_build_with_bf16_nvfp4_or_fp8_tokens(kind):
    fields = VALID[kind]
    res = kind(**fields)
    assert res.tokens is fields["tokens"]
    lead = tuple(fields["tokens"].shape[:-1])
    assert kind(**{**fields, "tokens": nvfp4(*lead)}).tokens.shape == (*lead, H)
    assert kind(**{**fields, "tokens": fp8(*lead)}).tokens.shape == (*lead, H)


@pytest.mark.parametrize("kind,field,bad", BAD, ids=lambda v: v.__name__ if isinstance(v, type) else
                         (v if isinstance(v, str) else None))
def test_result_types_reject_wrong_fields(kind, field, bad):
    with pytest.raises(MoEEpInputError, match=f"{kind.__name__}.{field}"):
        kind(**{**VALID[kind], field: bad})


@pytest.mark.parametrize("kind", VALID, ids=lambda t: t.__name__)
def test_result_types_reject_a_field_on_another_device(kind):
    """Every field on the tokens' device ('meta' stands in for a second device)."""
    for field in VALID[kind]:
        if field == "tokens":
            continue
        with pytest.raises(MoEEpInputError, match=f"{kind.__name__}.{field}"):
            kind(**{**VALID[kind], field: VALID[kind][field].to("meta")})


def test_results_are_frozen():
    res = LowLatencyExpertMajor(**VALID[LowLatencyExpertMajor])
    with pytest.raises(AttributeError):
        res.tokens = z(L, R * T, H)


def test_supported_layouts_are_what_epconfig_accepts():
    for alg, lay in itertools.product(Algorithm, Layout):
        if (alg, lay) in SUPPORTED_LAYOUTS:
            EpConfig(8, 2, 32, 32, 4, alg, lay)
        else:
            with pytest.raises(MoEEpConfigError, match="layout"):
                EpConfig(8, 2, 32, 32, 4, alg, lay)
    assert len(set(SUPPORTED_LAYOUTS)) == len(SUPPORTED_LAYOUTS)


def test_one_result_type_per_supported_pair():
    assert tuple(RESULT_TYPES) == SUPPORTED_LAYOUTS
    assert set(RESULT_TYPES.values()) == set(VALID)
    for (alg, lay), kind in RESULT_TYPES.items():
        assert result_type(EpConfig(8, 2, 32, 32, 4, alg, lay)) is kind
    # the contract table's last column: only LL EXPERT_MAJOR leaves the routing weights to combine
    assert [k for k in VALID if k.weights_applied_by_combine] == [LowLatencyExpertMajor]


def test_compute_and_every_transport_cover_every_result_type():
    assert set(COMPUTE) == set(RESULT_TYPES.values())
    assert set(TOY_COMPUTE) == set(RESULT_TYPES.values())
    assert set(RECEIVE_BUFFERS) == set(RESULT_TYPES.values())


def test_compute_rejects_something_that_is_not_a_result_type():
    from moe_ep.weights import ExpertWeights
    cfg = EpConfig(8, 2, 32, 32, 4)
    w = ExpertWeights(torch.zeros(8, 64, 32), torch.zeros(8, 32, 32), "bf16")
    with pytest.raises(MoEEpInputError, match="LowLatencyExpertMajor"):
        expert_compute(cfg, dict(VALID[LowLatencyExpertMajor]), w)


@pytest.mark.parametrize("alg,lay", SUPPORTED_LAYOUTS, ids=[f"{a.value}-{lay.value}" for a, lay in SUPPORTED_LAYOUTS])
def test_transports_return_their_layouts_result_type(alg, lay, dev):
    """The portable transport (on the kernels' device) and NCCL-EP (over its recording stand-in, on the CPU) at world
    size 1, two steps each."""
    c = EpConfig(num_experts=8, top_k=2, hidden_size=128, intermediate_size=32, max_tokens_per_rank=4,
                 algorithm=alg, layout=lay)
    ts = [(TorchDistTransport(c, device=dev), dev),
          (NcclEpTransport(c, group=(1, 0), ep=fake_nccl_ep.make_module(), rank=0, world_size=1, device="cpu"),
           torch.device("cpu"))]
    for t, on in ts:
        for B in (4, 2):
            x = torch.randn(B, 128).bfloat16().to(on)
            idx = torch.stack([torch.randperm(8)[:2] for _ in range(B)]).to(on)
            res = t.dispatch(x, idx, torch.rand(B, 2, device=on))
            assert type(res) is result_type(c), (t.name, type(res))
            t.combine(torch.zeros(res.tokens.shape, dtype=torch.bfloat16, device=on))
        t.close()
