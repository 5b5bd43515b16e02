"""CONTRACT tests (not integration): the NCCL-EP and NIXL-EP wrappers against recording stand-ins.

The stand-ins (``fake_nccl_ep``, ``fake_nixl_ep``) have the real modules' class and field names and check
each call against ``nccl_ep.h`` / the libraries' compiled asserts; at world size 1 they also move the data, so
the DispatchResult each layout returns is checked end to end with a toy expert compute. What they cannot
show -- that the real kernels behave as documented -- is what ``tests/test_transports_gpu.py`` and
``benchmarks/bench_transports.py`` check on a GPU.
"""

import fake_nccl_ep
import fake_nixl_ep
import pytest
import torch

from moe_ep.config import SUPPORTED_LAYOUTS, Algorithm, EpConfig, Format, Layout
from moe_ep.errors import MoEEpConfigError
from moe_ep.kernels.nvfp4 import NvFp4Tensor
from moe_ep.transports import nccl_ep as nccl_mod
from moe_ep.transports.nccl_ep import NcclEpTransport
from moe_ep.transports.nixl_ep import NixlEpTransport
from moe_ep.testing.toy_transport import toy_compute, toy_reference

ContractViolation = fake_nccl_ep.ContractViolation
LAYOUTS = list(SUPPORTED_LAYOUTS)
IDS = [f"{a.value}-{lay.value}" for a, lay in LAYOUTS]


def cfg(alg, lay, T=8, H=128, E=8, K=3, act=Format.BF16):
    return EpConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=32, max_tokens_per_rank=T,
                    algorithm=alg, layout=lay, activation_format=act)


def routing(B, E, K, seed, idx_dtype=torch.int64, H=128):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(B)]).to(idx_dtype)
    idx[torch.rand(B, K, generator=g) < 0.2] = -1
    if B > 1:
        idx[B - 1] = -1          # a token with no expert at all
    w = torch.rand(B, K, generator=g)
    x = torch.randn(B, H, generator=g).to(torch.bfloat16)
    return x, idx, w


def nccl(config, world=(1, 0)):
    ep = fake_nccl_ep.make_module()
    t = NcclEpTransport(config, group=world, ep=ep, rank=world[1], world_size=world[0], device="cpu")
    return t, ep


@pytest.mark.parametrize("alg,lay", LAYOUTS, ids=IDS)
def test_nccl_ep_layouts_world1(alg, lay):
    c = cfg(alg, lay)
    t, ep = nccl(c)
    ptrs = None
    for step, B in enumerate((8, 5, 1)):
        x, idx, w = routing(B, c.num_experts, c.top_k, step)
        res = t.dispatch(x, idx, w)
        out = t.combine(toy_compute(res, c, 0, 1))
        torch.testing.assert_close(out.float(), toy_reference(x, idx, w), rtol=2e-2, atol=2e-2)
        now = {k: v.data_ptr() for k, v in t.bufs.items()}
        assert ptrs is None or now == ptrs, "output buffers must be allocated once and reused"
        ptrs = now
    names = [c_[0] for c_ in ep.calls]
    assert names.count("Group.create") == 1 and names.count("Group.create_handle") == 1
    assert names.count("Handle.update") == 2, "steps after the first re-bind the handle (no re-allocation)"
    gc = next(c_[1] for c_ in ep.calls if c_[0] == "Group.create")
    assert gc.max_token_bytes == 2 * c.hidden_size
    t.close()
    assert [n for n in (c_[0] for c_ in ep.calls) if "destroy" in n] == ["Handle.destroy", "Group.destroy",
                                                                          "comm.destroy"]
    t.close()  # idempotent


@pytest.mark.parametrize("alg,lay", LAYOUTS, ids=IDS)
def test_nccl_ep_shapes_world2(alg, lay):
    """At R=2 the stand-in checks shapes and budgets only (no data moves)."""
    c = cfg(alg, lay, T=16, K=2)
    t, ep = nccl(c, world=(2, 1))
    gc = next(c_[1] for c_ in ep.calls if c_[0] == "Group.create")
    want = {Layout.FLAT: 16 * 2, Layout.EXPERT_MAJOR: 16 * 2 * 2}.get(lay) if alg is Algorithm.HIGH_THROUGHPUT else 0
    assert gc.max_recv_tokens_per_rank == want
    x, idx, w = routing(16, c.num_experts, c.top_k, 0)
    res = t.dispatch(x, idx, w)
    t.combine(torch.zeros(res.tokens.shape, dtype=torch.bfloat16))
    t.close()


def test_nccl_ep_int32_ids_and_bf16_weights_are_staged():
    c = cfg(Algorithm.LOW_LATENCY, Layout.RANK_MAJOR)
    t, ep = nccl(c)
    for step in range(2):
        x, idx, w = routing(6, c.num_experts, c.top_k, 3 + step, torch.int32)
        w = w.to(torch.bfloat16)
        out = t.combine(toy_compute(t.dispatch(x, idx, w), c, 0, 1))
        torch.testing.assert_close(out.float(), toy_reference(x, idx, w), rtol=2e-2, atol=2e-2)
    ids = {c_[-1].buffer.data_ptr() for c_ in ep.calls if c_[0] in ("Group.create_handle", "Handle.update")}
    assert ids == {t.bufs["idx_in"].data_ptr()}, "int32 ids go through the owned int64 buffer"


# ---- the stand-in is strict: mutate the wrapper, the stand-in must catch it ----

@pytest.mark.parametrize("alg,lay,bad", [(Algorithm.LOW_LATENCY, Layout.RANK_MAJOR, torch.int64),
                                         (Algorithm.HIGH_THROUGHPUT, Layout.FLAT, torch.int32)])
def test_stand_in_catches_wrong_recv_topk_idx_dtype(monkeypatch, alg, lay, bad):
    monkeypatch.setitem(nccl_mod.RECV_TOPK_IDX_DTYPE, (alg, lay), bad)
    c = cfg(alg, lay)
    t, _ = nccl(c)
    x, idx, w = routing(4, c.num_experts, c.top_k, 0)
    with pytest.raises(ContractViolation, match="topk_idx"):
        t.dispatch(x, idx, w)


def test_stand_in_catches_ht_em_counter_dtype(monkeypatch):
    monkeypatch.setattr(nccl_mod, "HT_EM_COUNTER_DTYPE", torch.int32)
    with pytest.raises(ContractViolation, match="int64"):
        t, _ = nccl(cfg(Algorithm.HIGH_THROUGHPUT, Layout.EXPERT_MAJOR))
        t.dispatch(*routing(4, 8, 3, 0))


@pytest.mark.parametrize("alg,lay", [(Algorithm.LOW_LATENCY, Layout.RANK_MAJOR),
                                     (Algorithm.HIGH_THROUGHPUT, Layout.FLAT)])
def test_stand_in_catches_unpinned_id_kind(monkeypatch, alg, lay):
    monkeypatch.setattr(nccl_mod, "RECV_TOPK_IDX_KIND", "AUTO")
    with pytest.raises(ContractViolation, match="LOCAL"):
        t, _ = nccl(cfg(alg, lay))
        t.dispatch(*routing(4, 8, 3, 0))


def test_stand_in_reads_structs_as_built():
    """binding_dataclass fills the C struct at construction: a later assignment does not reach the library."""
    c = cfg(Algorithm.LOW_LATENCY, Layout.RANK_MAJOR)
    t, ep = nccl(c)
    t.dispatch_info.recv_topk_idx_kind = ep.ExpertIdKind.AUTO    # no effect, as with the real bindings
    t.dispatch(*routing(4, 8, 3, 0))


def test_stand_in_catches_missing_combine_weights():
    t, ep = nccl(cfg(Algorithm.LOW_LATENCY, Layout.EXPERT_MAJOR))
    t.dispatch(*routing(4, 8, 3, 0))
    cout, out, stream = t._last
    t._last = (ep.CombineOutputs(tokens=cout.tokens), out, stream)   # mutate: leave out the weights
    with pytest.raises(ContractViolation, match="topk_weights"):
        t.combine(torch.zeros(t.bufs["tokens"].shape, dtype=torch.bfloat16))


def test_stand_in_mirrors_nccl4py_float4_gap():
    with pytest.raises(ValueError):
        fake_nccl_ep.Tensor(1234, dtype=12, shape=(4, 16))


# ---- configuration errors ----

def test_nccl_ep_ht_token_cap():
    with pytest.raises(MoEEpConfigError, match="8192"):
        nccl(cfg(Algorithm.HIGH_THROUGHPUT, Layout.FLAT, T=8193))
    nccl(cfg(Algorithm.HIGH_THROUGHPUT, Layout.FLAT, T=8192))   # the cap itself is fine (buffers are small here)


def test_nccl_ep_nvfp4_hidden_rule():
    with pytest.raises(MoEEpConfigError, match="256"):
        nccl(cfg(Algorithm.HIGH_THROUGHPUT, Layout.FLAT, H=288, act=Format.NVFP4))


def test_nccl_ep_ll_hidden_rule():
    with pytest.raises(MoEEpConfigError, match="128"):
        nccl(cfg(Algorithm.LOW_LATENCY, Layout.RANK_MAJOR, H=64))
    nccl(cfg(Algorithm.HIGH_THROUGHPUT, Layout.FLAT, H=64))


@pytest.mark.parametrize("alg,lay", LAYOUTS, ids=IDS)
def test_nccl_ep_nvfp4_forwards_packed_rows(alg, lay):
    """bf16 in; codes + e4m3 scales + each token's own global scale travel (FWD); NvFp4Tensor out, per-row scale."""
    from moe_ep.triton_runtime import device
    if device().type != "cpu":  # the stand-in library's tensors live on the CPU, the quantize kernel on the GPU
        pytest.skip("needs the kernels on the CPU (the interpreter, as in CI) to meet the CPU stand-in library")
    from moe_ep.reference import nvfp4_row_global_scale_ref, quantize_nvfp4_ref
    H = 256
    c = cfg(alg, lay, H=H, act=Format.NVFP4)
    t, ep = nccl(c)
    B = 6
    x, idx, w = routing(B, c.num_experts, c.top_k, 1, H=H)
    res = t.dispatch(x, idx, w)
    d = next(c_ for c_ in ep.calls if c_[0] == "Handle.dispatch")
    assert d[1]._lowpp.tokens._ep_t.datatype == 12 and d[4]._lowpp.quantization_recipe == ep.DispatchQuantizationRecipe.FWD
    assert isinstance(res.tokens, NvFp4Tensor) and res.tokens.shape[-1] == H and not res.tokens.swizzled
    want_gs = nvfp4_row_global_scale_ref(x)
    want_data, want_sc, _ = quantize_nvfp4_ref(x, want_gs)
    routed = (idx >= 0).any(1)
    data, sc, gs = (res.tokens.data.reshape(-1, H // 2), res.tokens.scales.reshape(-1, H // 16),
                    res.tokens.global_scale.reshape(-1))
    got = {(bytes(data[i].tolist()), bytes(sc[i].view(torch.uint8).tolist()), float(gs[i])) for i in range(len(data))}
    for b in range(B):
        if routed[b]:
            want = (bytes(want_data[b].tolist()), bytes(want_sc[b].view(torch.uint8).tolist()), float(want_gs[b]))
            assert want in got, f"token {b}: codes, scales and global scale arrive unchanged"


# ---- NIXL-EP ----

def nixl(config, world=1):
    m = fake_nixl_ep.make_module()
    return NixlEpTransport(config, nixl=m, store=object(), rank=0, world_size=world, device="cpu"), m


def test_nixl_ep_ll_expert_major_world1():
    c = cfg(Algorithm.LOW_LATENCY, Layout.EXPERT_MAJOR, H=2048)
    t, m = nixl(c)
    for step, B in enumerate((8, 3, 8, 3)):  # (a batch size met again: its staging and output views kept)
        x, idx, w = routing(B, c.num_experts, c.top_k, step, H=2048)
        res = t.dispatch(x, idx, w)
        assert res.tokens.shape == (c.num_experts, 8, 2048) and res.expert_counts.dtype == torch.int32
        out = t.combine(toy_compute(res, c, 0, 1))
        torch.testing.assert_close(out.float(), toy_reference(x, idx, w), rtol=2e-2, atol=2e-2)
    assert ("connect_ranks", [0]) in m.calls and ("get_rdma_size_hint", 8, 2048, 1, 8) in m.calls
    t.close()
    assert m.calls[-1] == ("destroy",)


def test_stand_in_catches_wrong_nixl_topk_dtype():
    import types
    c = cfg(Algorithm.LOW_LATENCY, Layout.EXPERT_MAJOR, H=2048)
    t, m = nixl(c)
    t.nixl = types.SimpleNamespace(topk_idx_t=torch.int64, Buffer=m.Buffer)   # mutate: int64 ids
    with pytest.raises(ContractViolation, match="topk_idx"):
        t.dispatch(*routing(4, 8, 3, 0, H=2048))


@pytest.mark.parametrize("kw,match", [(dict(alg=Algorithm.HIGH_THROUGHPUT, lay=Layout.FLAT), "16 ranks"),
                                      (dict(alg=Algorithm.LOW_LATENCY, lay=Layout.RANK_MAJOR), "expert_major"),
                                      (dict(alg=Algorithm.LOW_LATENCY, lay=Layout.EXPERT_MAJOR, H=1024), "7168"),
                                      (dict(alg=Algorithm.LOW_LATENCY, lay=Layout.EXPERT_MAJOR, E=32, K=17), "16"),
                                      (dict(alg=Algorithm.LOW_LATENCY, lay=Layout.EXPERT_MAJOR, T=6), "multiple of 4")])
def test_nixl_ep_config_errors(kw, match):
    kw.setdefault("H", 2048)
    with pytest.raises(MoEEpConfigError, match=match):
        nixl(cfg(**kw))


def test_nccl_ep_steady_state_builds_nothing(monkeypatch):
    """With the same input buffers, steps after the first construct no descriptor or bundle (host time)."""
    c = cfg(Algorithm.HIGH_THROUGHPUT, Layout.EXPERT_MAJOR)
    t, ep = nccl(c)
    made = []
    for name in ("Tensor", "DispatchInputs", "CombineInputs", "CombineOutputs"):
        real = getattr(ep, name)
        monkeypatch.setattr(ep, name, (lambda r, n: lambda *a, **k: made.append(n) or r(*a, **k))(real, name))
    x, idx, w = routing(8, c.num_experts, c.top_k, 0)
    y = torch.zeros(t.bufs["tokens"].shape, dtype=torch.bfloat16)
    t.dispatch(x, idx, w)
    t.combine(y)
    first = len(made)
    for _ in range(3):
        t.dispatch(x, idx, w)
        t.combine(y)
    assert first > 0 and len(made) == first


def test_needs_initialized_process_group():
    from moe_ep.errors import MoEEpInputError
    with pytest.raises(MoEEpInputError, match="init_process_group"):
        NcclEpTransport(cfg(Algorithm.LOW_LATENCY, Layout.EXPERT_MAJOR), ep=fake_nccl_ep.make_module())
    with pytest.raises(MoEEpInputError, match="init_process_group"):
        NixlEpTransport(cfg(Algorithm.LOW_LATENCY, Layout.EXPERT_MAJOR, H=2048), nixl=fake_nixl_ep.make_module())


@pytest.mark.parametrize("alg,lay", LAYOUTS, ids=IDS)
def test_nccl_ep_rank_with_no_tokens_still_steps(alg, lay):
    """B = 0 must not be refused: a rank with no tokens still joins the collective (one row, no picks)."""
    c = cfg(alg, lay)
    t, ep = nccl(c)
    for step, B in enumerate((0, 4, 0)):
        x, idx, w = routing(B, c.num_experts, c.top_k, step) if B else (
            torch.empty(0, 128, dtype=torch.bfloat16), torch.empty(0, 3, dtype=torch.int64), torch.empty(0, 3))
        out = t.combine(toy_compute(t.dispatch(x, idx, w), c, 0, 1))
        assert out.shape == (B, 128)
        if B:
            torch.testing.assert_close(out.float(), toy_reference(x, idx, w), rtol=2e-2, atol=2e-2)
    assert sum(n == "Handle.dispatch" for n, *_ in ep.calls) == 3
    t.close()


def test_nixl_ep_rank_with_no_tokens_still_steps():
    c = cfg(Algorithm.LOW_LATENCY, Layout.EXPERT_MAJOR, H=2048)
    t, m = nixl(c)
    out = t.combine(toy_compute(t.dispatch(torch.empty(0, 2048, dtype=torch.bfloat16),
                                           torch.empty(0, 3, dtype=torch.int64), torch.empty(0, 3)), c, 0, 1))
    assert out.shape == (0, 2048)
    t.close()
