"""FP8 activations on the wire (transport level, not through the compute): EpConfig's format rules; for each
transport and layout, the dispatched FP8 payload against the quantization of the tokens the bf16 dispatch delivers
in the same slots (``quantize_fp8`` bit for bit where we quantize: the portable transport, NCCL-EP HT; the DeepEP
cast that NCCL-EP's DS_FP8E3M4 recipe and NIXL-EP's ``use_fp8`` apply, bit for bit with the stand-ins' model of it,
where the library quantizes: LL); combine of those rows; 2 gloo ranks; rank agreement on the format."""

import dataclasses
import os
import tempfile
import types
from datetime import timedelta

import fake_nccl_ep
import fake_nixl_ep
import pytest
import torch
from hypothesis import given

from moe_ep.config import SUPPORTED_LAYOUTS, Algorithm, EpConfig, Format, Layout
from moe_ep.errors import MoEEpConfigError
from moe_ep.kernels.fp8 import Fp8Tensor, quantize_fp8
from moe_ep.reference import dequantize_fp8_ref
from moe_ep.testing.properties import check_dispatch_fp8
from moe_ep.testing.strategies import layer_cases
from moe_ep.testing.toy_transport import toy_compute, toy_reference, valid_rows
from moe_ep.transports import nccl_ep as nccl_mod
from moe_ep.transports import nixl_ep as nixl_mod
from moe_ep.transports.nccl_ep import NcclEpTransport
from moe_ep.transports.nixl_ep import NixlEpTransport
from moe_ep.transports.torch_dist import TorchDistTransport

LAYOUTS = list(SUPPORTED_LAYOUTS)
IDS = [f"{a.value}-{lay.value}" for a, lay in LAYOUTS]
E, K, T = 8, 2, 4
ContractViolation = fake_nccl_ep.ContractViolation


def cfg(alg=Algorithm.LOW_LATENCY, lay=Layout.EXPERT_MAJOR, H=160, fp8=True, **kw):
    fmt = dict(weight_format="fp8", activation_format="fp8") if fp8 else {}
    return EpConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=32, max_tokens_per_rank=T,
                    algorithm=alg, layout=lay, **fmt, **kw)


def inputs(B, H, seed, rank=0):
    """Tokens with a zero block, a tiny one (below DeepEP's 1e-4 amax floor) and large values; ids with -1."""
    g = torch.Generator().manual_seed(seed * 100 + rank)
    x = torch.randn(B, H, generator=g) * torch.logspace(-3, 3, H)[torch.randperm(H, generator=g)]
    if B > 1:
        x[0, :128] = 0
        x[1, :128] *= 1e-9
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(B)])
    idx[torch.rand(B, K, generator=g) < 0.25] = -1
    return x.bfloat16(), idx, torch.rand(B, K, generator=g)


def check_payload(res8, res16, want):
    """``res8`` (FP8 dispatch) holds ``want(bf16 rows)`` where ``res16`` (bf16 dispatch of the same inputs) holds
    those rows; shapes and dtypes as the contract says; the other fields equal."""
    assert type(res8) is type(res16)
    q, lead, H = res8.tokens, res16.tokens.shape[:-1], res16.tokens.shape[-1]
    assert isinstance(q, Fp8Tensor) and q.block_rows == 1
    assert q.data.dtype == torch.float8_e4m3fn and q.data.shape == (*lead, H)
    assert q.scales.dtype == torch.float32 and q.scales.shape == (*lead, -(-H // 128)) and q.scales.is_contiguous()
    ok = valid_rows(res16)
    assert torch.equal(ok, valid_rows(res8)) and ok.any()
    data, scales = want(res16.tokens[ok])
    assert torch.equal(q.data[ok].view(torch.uint8), data.view(torch.uint8)), "e4m3 codes, bit for bit"
    assert torch.equal(q.scales[ok], scales), "fp32 scales, bit for bit"
    for f in dataclasses.fields(res16):
        if f.name == "tokens":
            continue
        a, b = getattr(res8, f.name), getattr(res16, f.name)
        if a.dim() and a.shape[:ok.dim()] == ok.shape:
            a, b = a[ok], b[ok]
        assert torch.equal(a, b), f.name


def ours(rows):
    q = quantize_fp8(rows)
    return q.data, q.scales


def deepseek(rows):
    return fake_nccl_ep.ds_fp8e3m4(rows)


def dequant(q: Fp8Tensor) -> torch.Tensor:
    """The payload's value, data * scale per 128-channel block (bf16)."""
    return dequantize_fp8_ref(q.data, q.scales, 1).bfloat16()


def combine_check(t, res8, c, x, idx, w, rank=0, world=1):
    """Combine of the toy compute over the payload's value (the FP8 round trip of x), routed as bf16 would be."""
    out = t.combine(toy_compute(res8, c, rank, world))
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    torch.testing.assert_close(out.float(), toy_reference(x, idx, w), rtol=8e-2, atol=8e-2 * x.float().abs().max())


# ---- EpConfig: the format pairs ------------------------------------------------------------------------------

FORMAT_PAIRS = [  # (weight format, activation format, None = allowed, else what the error says)
    ("fp8", "fp8", None), ("fp8", "bf16", None), ("bf16", "bf16", None), ("bf16", "nvfp4", None),
    ("nvfp4", "nvfp4", None), ("nvfp4", "bf16", None),
    ("bf16", "fp8", "'fp8'; allowed: 'bf16' or 'nvfp4' with weight_format 'bf16' (FP8 activations need FP8 weights"),
    ("nvfp4", "fp8", "'fp8'; allowed: 'bf16' or 'nvfp4' with weight_format 'nvfp4' (FP8 activations need FP8"),
    ("fp8", "nvfp4", "EpConfig.activation_format = 'nvfp4'; allowed: 'bf16' or 'fp8' with weight_format 'fp8'"),
    ("fp4", "bf16", "EpConfig.weight_format = 'fp4'; allowed: 'bf16', 'nvfp4', 'fp8'"),
]


@pytest.mark.parametrize("wf,af,error", FORMAT_PAIRS)
def test_epconfig_format_pairs(wf, af, error):
    make = lambda: EpConfig(E, K, 128, 32, T, weight_format=wf, activation_format=af)  # noqa: E731
    if error is None:
        c = make()
        assert (c.weight_format, c.activation_format) == (Format(wf), Format(af))
    else:
        with pytest.raises(MoEEpConfigError, match=error.replace("(", r"\(").replace(")", r"\)")):
            make()


def test_fp8_activations_take_no_global_scale_and_any_multiple_of_16():
    with pytest.raises(MoEEpConfigError, match="activation_global_scale"):
        cfg(activation_global_scale=2.0)
    assert cfg(H=16 * 7).hidden_size == 112   # blocks may be short: the last of a row covers 112 - 0 channels


# ---- the portable transport, world size 1 -----------------------------------------------------------------------

@pytest.mark.parametrize("alg,lay", LAYOUTS, ids=IDS)
def test_torch_transport_carries_quantize_fp8_of_the_bf16_rows(alg, lay, dev):
    if dev.type != "cpu":
        pytest.skip("compares with the CPU bf16 dispatch")
    t8, t16 = TorchDistTransport(cfg(alg, lay), device=dev), TorchDistTransport(cfg(alg, lay, fp8=False), device=dev)
    for step, B in enumerate((T, 2, 3)):   # steps reuse the buffers: stale rows must not leak into valid ones
        x, idx, w = inputs(B, 160, step)
        res8, res16 = t8.dispatch(x, idx, w), t16.dispatch(x, idx, w)
        check_payload(res8, res16, ours)
        combine_check(t8, res8, t8.config, x, idx, w)
        t16.combine(toy_compute(res16, t16.config, 0, 1))


@given(layer_cases())
def test_torch_transport_fp8_payload_property(dev, case):
    """Random layouts, H (multiples of 16, short last blocks), token counts (0 included) and routings: the payload
    is quantize_fp8_ref of the bf16 dispatch's rows (the shared check ``moe-ep fuzz --targets dispatch_fp8`` runs)."""
    check_dispatch_fp8(case, dev)


def test_torch_transport_quantizes_once_before_dispatch(monkeypatch, dev):
    """One quantize_fp8 per dispatch, of the caller's bf16 rows, per row (block_rows 1); no bf16 round trip."""
    import moe_ep.transports.torch_dist as td
    calls, real = [], td.quantize_fp8
    monkeypatch.setattr(td, "quantize_fp8", lambda x, *a, **k: calls.append((x, a, k)) or real(x, *a, **k))
    t = TorchDistTransport(cfg(Algorithm.HIGH_THROUGHPUT, Layout.FLAT), device=dev)
    x, idx, w = inputs(3, 160, 0)
    t.dispatch(x.to(dev), idx.to(dev), w.to(dev))
    assert len(calls) == 1 and calls[0][0].dtype == torch.bfloat16 and calls[0][1] == (1,)


# ---- NCCL-EP (recording stand-in, world size 1 moves data) ---------------------------------------------------

def nccl(config, world=(1, 0)):
    ep = fake_nccl_ep.make_module()
    return NcclEpTransport(config, group=world, ep=ep, rank=world[1], world_size=world[0], device="cpu"), ep


def _cpu_kernels():
    from moe_ep.triton_runtime import device
    if device().type != "cpu":
        pytest.skip("the stand-in library's tensors live on the CPU, the quantize kernel on the GPU")


@pytest.mark.parametrize("alg,lay,H", [(a, lay, H) for a, lay in LAYOUTS
                                       for H in ((512, 1024) if a is Algorithm.LOW_LATENCY else (160, 512))],
                         ids=[f"{a.value}-{lay.value}-H{H}" for a, lay in LAYOUTS
                              for H in ((512, 1024) if a is Algorithm.LOW_LATENCY else (160, 512))])
def test_nccl_ep_fp8_payload(alg, lay, H):
    """LL: bf16 rows in, the DS_FP8E3M4 recipe's e4m3 + fp32 scales out; HT: our quantize_fp8 rows forwarded (FWD),
    their scale rows padded to 16 bytes; both against the bf16 dispatch of the same inputs, two steps."""
    _cpu_kernels()
    ll = alg is Algorithm.LOW_LATENCY
    (t8, ep), (t16, _) = nccl(cfg(alg, lay, H=H)), nccl(cfg(alg, lay, H=H, fp8=False))
    for step, B in enumerate((T, 3)):
        x, idx, w = inputs(B, H, step)
        res8, res16 = t8.dispatch(x, idx, w), t16.dispatch(x, idx, w)
        check_payload(res8, res16, deepseek if ll else ours)
        combine_check(t8, res8, t8.config, x, idx, w)
        t16.combine(toy_compute(res16, t16.config, 0, 1))
    d = [c for c in ep.calls if c[0] == "Handle.dispatch" and c[4] is t8.dispatch_cfg][-1]   # one log: both
    inputs_, outputs_, cfg_ = d[1]._lowpp, d[2]._lowpp, d[4]._lowpp
    recipe = ep.DispatchQuantizationRecipe
    if ll:
        assert cfg_.quantization_recipe == recipe.DS_FP8E3M4 and inputs_.tokens.dt == fake_nccl_ep.BF16
        assert inputs_.scales is None and outputs_.scales.dt == fake_nccl_ep.F32
    else:
        assert cfg_.quantization_recipe == recipe.FWD and inputs_.tokens.dt == fake_nccl_ep.E4M3
        assert inputs_.scales.dt == fake_nccl_ep.U8 and inputs_.scales.sizes[1] == 16 * -(-4 * -(-H // 128) // 16)
    if ll:  # the recipe's rule is not ours, but its value is x to FP8 precision
        ok = valid_rows(res16)
        rel = (dequant(res8.tokens)[ok].float() - res16.tokens[ok].float()).norm() / res16.tokens[ok].float().norm()
        assert rel < 2 ** -4


def test_deepseek_cast_differs_from_ours_where_designed():
    """The stand-in's model of the recipe is DeepEP's rule, not quantize_fp8's: a block below the 1e-4 amax floor
    keeps a scale of 1e-4/448 (ours: amax/448), so its codes stay small; both values are data * scale."""
    _cpu_kernels()
    x = torch.full((1, 512), 3e-6).bfloat16()
    q, s = fake_nccl_ep.ds_fp8e3m4(x)
    ref = quantize_fp8(x)
    assert float(s[0, 0]) == pytest.approx(1e-4 / 448, rel=1e-6) and float(ref.scales[0, 0]) == pytest.approx(
        float(x[0, 0]) / 448, rel=1e-6)
    assert not torch.equal(q.view(torch.uint8), ref.data.view(torch.uint8))
    for v in (q.float() * s.repeat_interleave(128, -1), dequant(ref).float()):
        torch.testing.assert_close(v, x.float(), rtol=2 ** -3, atol=0)


@pytest.mark.parametrize("alg,lay", LAYOUTS, ids=IDS)
def test_nccl_ep_fp8_shapes_world2(alg, lay):
    """At R=2 the stand-in checks the recipes' shapes, dtypes and byte budgets (no data moves)."""
    _cpu_kernels()
    H = 512
    t, ep = nccl(cfg(alg, lay, H=H), world=(2, 1))
    x, idx, w = inputs(T, H, 0)
    res = t.dispatch(x, idx, w)
    assert isinstance(res.tokens, Fp8Tensor)
    t.combine(torch.zeros(res.tokens.shape, dtype=torch.bfloat16))
    t.close()


def test_nccl_ep_ll_fp8_hidden_rule():
    for lay in (Layout.EXPERT_MAJOR, Layout.RANK_MAJOR):
        with pytest.raises(MoEEpConfigError, match="hidden_size = 384; allowed with FP8 activations and LOW_LATENCY "
                                                   "on transport 'nccl_ep': a multiple of 512"):
            nccl(cfg(Algorithm.LOW_LATENCY, lay, H=384))
    nccl(cfg(Algorithm.HIGH_THROUGHPUT, Layout.FLAT, H=16))   # HT's FWD rows: any H (scale rows padded)


def test_stand_in_catches_the_recipe_below_512(monkeypatch):
    """Mutate the wrapper's rule: the stand-in refuses DS_FP8E3M4 with H = 384, as the library does."""
    monkeypatch.setattr(nccl_mod, "DS_FP8_HIDDEN_MULTIPLE", 128)
    t, _ = nccl(cfg(Algorithm.LOW_LATENCY, Layout.EXPERT_MAJOR, H=384))
    with pytest.raises(ContractViolation, match="divisible by 512"):
        t.dispatch(*inputs(2, 384, 0))


def test_stand_in_catches_unpadded_scale_rows(monkeypatch):
    """Mutate: HT FWD scale rows of the bare 4 * ceil(H/128) bytes (8 at H = 160) are not 16-byte aligned."""
    _cpu_kernels()
    monkeypatch.setattr(nccl_mod, "fp8_scale_row_bytes", lambda H: 4 * -(-H // 128))
    t, _ = nccl(cfg(Algorithm.HIGH_THROUGHPUT, Layout.FLAT, H=160))
    with pytest.raises(ContractViolation, match="16-byte aligned"):
        t.dispatch(*inputs(2, 160, 0))


def test_stand_in_refuses_the_recipe_on_ht():
    """The wrapper never asks for DS_FP8E3M4 on HT; the stand-in refuses it, as nccl_ep.cc does."""
    t, ep = nccl(cfg(Algorithm.HIGH_THROUGHPUT, Layout.FLAT, fp8=False))
    t.dispatch_cfg = ep.DispatchConfig(quantization_recipe=ep.DispatchQuantizationRecipe.DS_FP8E3M4)
    with pytest.raises(ContractViolation, match="only in LL mode"):
        t.dispatch(*inputs(2, 160, 0))


# ---- NIXL-EP ---------------------------------------------------------------------------------------------------

def nixl(config):
    m = fake_nixl_ep.make_module()
    return NixlEpTransport(config, nixl=m, store=object(), rank=0, world_size=1, device="cpu"), m


def test_nixl_ep_fp8_payload():
    """use_fp8=True: the LL cast's e4m3 rows and fp32 scales (column-major from the library), contiguous here."""
    H = 2048
    (t8, m), (t16, _) = nixl(cfg(H=H)), nixl(cfg(H=H, fp8=False))
    for step, B in enumerate((T, 3)):
        x, idx, w = inputs(B, H, step)
        res8, res16 = t8.dispatch(x, idx.int(), w), t16.dispatch(x, idx.int(), w)
        check_payload(res8, res16, deepseek)
        combine_check(t8, res8, t8.config, x, idx, w)
        t16.combine(toy_compute(res16, t16.config, 0, 1))
    assert [c[-1] for c in m.calls if c[0] == "low_latency_dispatch"] == [True, False] * 2   # one log: both
    t8.close()


def test_nixl_ep_fp8_config_errors(monkeypatch):
    with pytest.raises(MoEEpConfigError, match="activation_format = 'nvfp4'; allowed with transport 'nixl_ep': "
                                               "'bf16' or 'fp8'"):
        nixl(EpConfig(E, K, 2048, 32, T, activation_format="nvfp4"))
    monkeypatch.setattr(nixl_mod, "LL_HIDDEN_SIZES", (1280,))   # no shipped size breaks the FP8 rule
    with pytest.raises(MoEEpConfigError, match="hidden_size = 1280; allowed with FP8 activations on transport "
                                               "'nixl_ep': a multiple of 512"):
        nixl(cfg(H=1280))


def test_nixl_stand_in_returns_column_major_scales(monkeypatch):
    """Mutate: hand the library's scales on as they are; they are column-major (the stand-in models TMA's layout),
    so the contiguity check_payload asserts holds only because the wrapper copies them."""
    t, _ = nixl(cfg(H=2048))
    monkeypatch.setattr(t, "_scales", types.SimpleNamespace(copy_=lambda s: s))
    x, idx, w = inputs(T, 2048, 0)
    res = t.dispatch(x, idx.int(), w)
    assert not res.tokens.scales.is_contiguous()


# ---- rank agreement ------------------------------------------------------------------------------------------

def test_fingerprint_encodes_fp8_after_the_existing_formats():
    """Enums travel by position: FP8 appended keeps BF16 = 0 and NVFP4 = 1 (a rank of the previous version reads
    the same numbers), and FP8 shows as 'fp8'."""
    from moe_ep import rank_agreement as ra
    w = types.SimpleNamespace(format=Format.FP8, num_local_experts=E, hidden_size=160, intermediate_size=32,
                              device=torch.device("cpu"))
    fp = ra.fingerprint(cfg(), w, "torch", False, 1)
    at = {f: fp[i] for i, f in enumerate(ra.FIELDS)}
    assert [list(Format).index(f) for f in (Format.BF16, Format.NVFP4, Format.FP8)] == [0, 1, 2]
    assert at["EpConfig.weight_format"] == at["EpConfig.activation_format"] == at["weights.format"] == 2
    assert ra._shown("EpConfig.activation_format", 2) == "fp8"


# ---- 2 gloo ranks: the portable transport's exchange and the format agreement (one spawn) ---------------------

def _worker(rank, world, store, out_dir):
    import traceback

    import torch.distributed as dist

    import moe_ep  # noqa: F401
    from moe_ep import rank_agreement
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    lines = []
    try:
        for alg, lay in LAYOUTS:
            t8, t16 = TorchDistTransport(cfg(alg, lay), device="cpu"), TorchDistTransport(cfg(alg, lay, fp8=False),
                                                                                         device="cpu")
            for step in range(2):
                x, idx, w = inputs(T - step * rank, 160, step, rank)   # ranks send different counts
                try:
                    res8, res16 = t8.dispatch(x, idx, w), t16.dispatch(x, idx, w)
                    check_payload(res8, res16, ours)
                    combine_check(t8, res8, t8.config, x, idx, w, rank, world)
                    t16.combine(toy_compute(res16, t16.config, rank, world))
                except Exception:
                    lines.append(f"{alg.value}-{lay.value} step {step}: {traceback.format_exc()}")
        fp8 = rank == world - 1   # the last rank asks for W8A8, the others for bf16
        w = types.SimpleNamespace(format=Format.FP8 if fp8 else Format.BF16, num_local_experts=E // world,
                                  hidden_size=512, intermediate_size=32, device=torch.device("cpu"))
        try:
            rank_agreement.agree(rank_agreement.fingerprint(cfg(H=512, fp8=fp8), w, "torch", False, world), None,
                                 None, rank, world, torch.device("cpu"), timedelta(seconds=30))
            lines.append("agreement: no error")
        except MoEEpConfigError as e:
            lines.append(f"agreement: {e}")
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.write("\n".join(lines))


@pytest.fixture(scope="module")
def two_ranks():
    if torch.cuda.is_available():
        pytest.skip("CPU ranks (gloo)")
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(2, os.path.join(d, "store"), d), nprocs=2, join=True)
        return [open(os.path.join(d, f"rank{r}.txt")).read().split("\n") for r in range(2)]


@pytest.mark.one_triton  # spawned ranks: gloo and process plumbing, which Triton does not touch
def test_two_ranks_carry_quantize_fp8_of_the_bf16_rows(two_ranks):
    for r, lines in enumerate(two_ranks):
        fails = [ln for ln in lines if not ln.startswith("agreement: ")]
        assert not fails, f"rank {r}:\n" + "\n".join(fails)


@pytest.mark.one_triton  # spawned ranks: gloo and process plumbing, which Triton does not touch
def test_two_ranks_disagreeing_on_the_format_both_fail_naming_it(two_ranks):
    for lines in two_ranks:
        [agreement] = [ln for ln in lines if ln.startswith("agreement: ")]
        for want in ("EpConfig.weight_format: rank 0 = 'bf16', rank 1 = 'fp8'",
                     "EpConfig.activation_format: rank 0 = 'bf16', rank 1 = 'fp8'",
                     "weights.format: rank 0 = 'bf16', rank 1 = 'fp8'"):
            assert want in agreement, agreement
