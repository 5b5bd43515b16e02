"""moe_ep.hf.convert on tiny random transformers models (Qwen3-MoE, Mixtral, DeepSeek-V3; no download): the
converted model's logits and greedy tokens against the unconverted model at world size 1 (fused_moe) and on
2 and 4 gloo ranks (MoEEpLayer: :func:`rank_cases`, run in tests/test_layer_multirank.py's spawn); the converted router against what the original block hands its experts;
the named errors."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import traceback

import pytest
import torch

transformers = pytest.importorskip("transformers")

import moe_ep.hf
from moe_ep import MoEEpConfigError
from moe_ep.hf import MoEEpBlock, convert

FAMILIES = ["qwen3_moe", "mixtral", "deepseek_v3"]
VOCAB, H = 128, 64
COMMON = dict(hidden_size=H, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              vocab_size=VOCAB, max_position_embeddings=64, tie_word_embeddings=False)

# Relative Frobenius error of the logits, converted vs unconverted, both bf16. Measured 5e-3 .. 1.1e-2 over the
# families and 4 seeds (experts scaled to matter, see tiny_model): below the unconverted model's own bf16 noise
# (its bf16 logits against its fp32 ones: 7e-3 .. 1.8e-2), as moe-ep rounds to bf16 at other points (fp32
# accumulation, routing weights applied in fp32). A wrong expert, a lost routing weight or a gate/up swap gives
# 0.1 and more; the bound keeps ~3x margin over the measured error.
LOGITS_BOUND = 3e-2


def tiny_config(family: str, **overrides):
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**{**COMMON, "intermediate_size": 64, "moe_intermediate_size": 32,
                                              "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
                                              **overrides})
    if family == "mixtral":
        return transformers.MixtralConfig(**{**COMMON, "intermediate_size": 32, "num_local_experts": 8,
                                             "num_experts_per_tok": 2, **overrides})
    if family == "deepseek_v3":  # MLA: as many key/value heads as heads, head_dim the rope part; layer 0 dense
        return transformers.DeepseekV3Config(**{
            **COMMON, "num_key_value_heads": 4, "head_dim": 8, "intermediate_size": 64, "moe_intermediate_size": 32,
            "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2,
            "first_k_dense_replace": 1, "n_shared_experts": 1, "q_lora_rank": 32, "kv_lora_rank": 16,
            "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16, "routed_scaling_factor": 2.5,
            "norm_topk_prob": True, **overrides})
    raise KeyError(family)


MODELS = {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}


def tiny_model(family: str, seed: int = 0, dev="cpu", **overrides):
    """A bf16 eval model with random weights; routers scaled up (the default init makes every expert nearly
    equally likely) and, for DeepSeek-V3, a random score-correction bias, so routing is decisive and
    every part of the router matters; experts scaled up too (by default they barely move the residual stream,
    and a wrong expert would hide in the logits)."""
    torch.manual_seed(seed)
    model = getattr(transformers, MODELS[family])(tiny_config(family, **overrides))
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__ in moe_ep.hf.SUPPORTED:
                m.gate.weight.normal_(0, 0.3)
                shared = getattr(m, "shared_experts", None)
                for p in [*m.experts.parameters(), *(shared.parameters() if shared is not None else ())]:
                    p.normal_(0, p.shape[-1] ** -0.5)  # fan-in scaled: the experts matter to the logits
                if hasattr(m.gate, "e_score_correction_bias"):
                    m.gate.e_score_correction_bias.uniform_(-0.3, 0.3)
    return model.to(device=dev, dtype=torch.bfloat16).eval()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def greedy(model, ids, n=5):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, pad_token_id=0)


def greedy_agrees(model, ref, ids, n) -> bool:
    """The converted model's greedy tokens are the unconverted model's, but for a bf16 tie: at the first token
    where they part, the converted model's pick must be within 2 bf16 ulps of the best logit the unconverted
    model gives there (the two round to bf16 at other points, so a tie may fall either way)."""
    got, want = greedy(model, ids, n), greedy(ref, ids, n)
    differ = (got != want)[0].nonzero()
    if not len(differ):
        return True
    p = int(differ[0])
    with torch.no_grad():
        logits = ref(want[:, :p]).logits[0, -1].float()
    best = logits.max()
    ulp = 2.0 ** (torch.floor(torch.log2(best.abs())) - 7)
    return bool(logits[got[0, p]] >= best - 2 * ulp)


def compare(family: str, dev, seed: int, batch: int, seq: int, gen: int) -> tuple[float, bool]:
    """(logits relative error, greedy tokens equal) of the converted model against its unconverted copy."""
    model = tiny_model(family, 0, dev)
    ref = copy.deepcopy(model)
    names = convert(model)
    assert names and all(isinstance(model.get_submodule(n), MoEEpBlock) for n in names)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g).to(dev)
    with torch.no_grad():
        out, want = model(ids).logits, ref(ids).logits
    assert out.shape == want.shape and out.dtype == want.dtype == torch.bfloat16
    return rel_err(out, want), greedy_agrees(model, ref, ids[:1], gen)


# (a) world size 1: fused_moe --------------------------------------------------------------------------------

def test_fp8_weights_convert_and_run(dev):
    """``convert(weight_format="fp8")``: the experts quantized to FP8 once, W8A8 in the forward. Against the model
    holding the dequantized FP8 weights only the tokens' and the intermediate's e4m3 rounding (2^-4 relative at
    worst per element, twice per MoE layer) and bf16 arithmetic differ."""
    model = tiny_model("mixtral", 0, dev)
    ref = copy.deepcopy(model)
    names = convert(model, weight_format="fp8")
    assert names and all(model.get_submodule(n).config.weight_format.value == "fp8" for n in names)
    err = logits_err_against_dequantized(model, ref, names, dev)
    assert err <= 0.1, f"logits rel err {err:.4f}"


def logits_err_against_dequantized(model, ref, names, dev) -> float:
    """The converted model's logits against ``ref`` (the unconverted copy) given the very weights moe-ep computes
    with (each block's quantized experts dequantized, written into ref's fused experts)."""
    for name in names:
        experts = ref.get_submodule(name).experts
        if isinstance(experts, torch.nn.ModuleList):
            pytest.skip("transformers 4.x experts: the dequantized weights are written back to fused ones only")
        w13, w2 = model.get_submodule(name).weights.dense()
        assert not torch.equal(w13.to(experts.gate_up_proj.dtype), experts.gate_up_proj)  # quantized: they moved
        with torch.no_grad():
            experts.gate_up_proj.copy_(w13)
            experts.down_proj.copy_(w2)
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1)).to(dev)
    with torch.no_grad():
        return rel_err(model(ids).logits, ref(ids).logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_world_1_logits_and_greedy_tokens(family, dev):
    err, same = compare(family, dev, seed=1, batch=2, seq=6, gen=5)
    print(f"{family}: logits rel err {err:.2e}")
    assert err <= LOGITS_BOUND, f"{family}: logits rel err {err:.4f}"
    assert same, f"{family}: greedy tokens differ"


@pytest.mark.parametrize("family", FAMILIES)
def test_converted_blocks_keep_only_their_shard_and_no_original_experts(family, dev):
    model = tiny_model(family, 0, dev)
    old = dict(moe_ep.hf.find_blocks(model))
    convert(model)
    for name, block in old.items():
        new = model.get_submodule(name)
        assert not hasattr(block, "experts"), "the original block still holds its experts"
        assert new.gate is block.gate  # the model's own router module, as it was
        assert not any("experts." in n or n.endswith("gate_up_proj") for n, _ in new.named_parameters()
                       if not n.startswith("shared_experts"))
        w = new.weights
        E, I = new.config.num_experts, new.config.intermediate_size
        assert w.w13.untyped_storage().nbytes() == E * 2 * I * H * 2  # world size 1: all experts, once
        assert w.w2.untyped_storage().nbytes() == E * H * I * 2


def test_batch_seq_shapes_and_tuple_structure(dev):
    """[batch, seq, H] in, the same shape and dtype out, exactly as the original block returns it (a tensor in
    transformers 5.x; (hidden, router_logits) for the 4.x blocks with a Linear gate)."""
    for family in FAMILIES:
        model = tiny_model(family, 0, dev)
        name = [n for n, m in model.named_modules() if type(m).__name__ in moe_ep.hf.SUPPORTED][-1]
        orig = copy.deepcopy(model.get_submodule(name))
        convert(model)
        new = model.get_submodule(name)
        x = torch.randn(3, 5, H, device=dev).bfloat16()
        with torch.no_grad():
            a, b = new(x), orig(x)
        assert type(a) is type(b)
        a, b = (a, b) if isinstance(a, torch.Tensor) else (a[0], b[0])
        assert a.shape == b.shape == x.shape and a.dtype == b.dtype == torch.bfloat16
        assert rel_err(a, b) <= LOGITS_BOUND, family


@pytest.mark.parametrize("family", FAMILIES)
def test_nvfp4_weights_match_the_model_holding_their_dequantized_values(family, dev):
    """weight_format="nvfp4": the converted model against the unconverted one given the very weights moe-ep
    computes with (the NVFP4 codes dequantized), so only the bf16 arithmetic differs: the bf16 bound holds."""
    model = tiny_model(family, 0, dev)
    ref = copy.deepcopy(model)
    names = convert(model, weight_format="nvfp4")
    err = logits_err_against_dequantized(model, ref, names, dev)
    assert err <= LOGITS_BOUND, f"{family}: logits rel err {err:.4f}"


# (c) the router, in isolation --------------------------------------------------------------------------------

def _original_routing(block, x):
    """(ids, weights) the original block hands its fused experts module (transformers 5.x)."""
    got = {}
    hook = block.experts.register_forward_pre_hook(lambda m, args: got.update(ids=args[1], w=args[2]))
    try:
        with torch.no_grad():
            block(x[None])
    finally:
        hook.remove()
    return got["ids"], got["w"]


@pytest.mark.parametrize("family", FAMILIES)
def test_router_gives_the_original_ids_and_weights_exactly(family, dev, monkeypatch):
    model = tiny_model(family, 0, dev)
    name = [n for n, m in model.named_modules() if type(m).__name__ in moe_ep.hf.SUPPORTED][-1]
    orig = copy.deepcopy(model.get_submodule(name))
    if isinstance(orig.experts, torch.nn.ModuleList):
        pytest.skip("transformers 4.x experts: the routing reaches no module to observe it at")
    convert(model)
    new = model.get_submodule(name)
    seen = {}

    def spy(x, ids, w, weights, **kw):  # what the converted block hands moe-ep
        seen.update(ids=ids, w=w)
        return torch.zeros_like(x)

    monkeypatch.setattr(moe_ep.hf.module, "fused_moe", spy)
    for seed in range(3):
        x = torch.randn(24, H, generator=torch.Generator().manual_seed(seed)).bfloat16().to(dev)
        ids, w = _original_routing(orig, x)
        with torch.no_grad():
            new(x[None])
        assert seen["ids"].dtype == torch.int64 and seen["w"].dtype == torch.float32
        assert torch.equal(seen["ids"], ids.long()), family
        assert torch.equal(seen["w"], w.float()), family
        assert len(ids.unique()) > 2  # the routing is not degenerate
    if family == "deepseek_v3":  # the score-correction bias and the group limit change the picks here
        with torch.no_grad():
            orig.gate.e_score_correction_bias.zero_()
        assert not torch.equal(_original_routing(orig, x)[0], ids)


# (d) named errors ---------------------------------------------------------------------------------------------

def test_unsupported_moe_block_is_named():
    cfg = transformers.Qwen2MoeConfig(**{**COMMON, "intermediate_size": 64, "moe_intermediate_size": 32,
                                          "shared_expert_intermediate_size": 32, "num_experts": 8,
                                          "num_experts_per_tok": 2})
    cfg.head_dim = 16
    model = transformers.Qwen2MoeForCausalLM(cfg)
    before = {n: type(m) for n, m in model.named_modules()}
    with pytest.raises(MoEEpConfigError, match=r"Qwen2MoeSparseMoeBlock is not supported; allowed: .*"
                                               r"Qwen3MoeSparseMoeBlock.*MixtralSparseMoeBlock.*DeepseekV3MoE"):
        convert(model)
    assert {n: type(m) for n, m in model.named_modules()} == before


def test_an_unsupported_block_beside_supported_ones_changes_nothing():
    class MyMoeLayer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = torch.nn.ModuleList([torch.nn.Linear(4, 4)])

    model = tiny_model("qwen3_moe")
    model.model.extra = MyMoeLayer()
    with pytest.raises(MoEEpConfigError, match="model.extra of class MyMoeLayer is not supported"):
        convert(model)
    assert not any(isinstance(m, MoEEpBlock) for m in model.modules())


def test_model_without_moe_block_is_named():
    cfg = transformers.LlamaConfig(**{**COMMON, "intermediate_size": 64})
    with pytest.raises(MoEEpConfigError, match="LlamaForCausalLM holds no MoE block; allowed: a model with "
                                               "blocks of class Qwen3MoeSparseMoeBlock"):
        convert(transformers.LlamaForCausalLM(cfg))


@pytest.mark.parametrize("overrides, match", [
    (dict(hidden_size=40, head_dim=16), r"model.layers.0.mlp \(Qwen3MoeSparseMoeBlock\): EpConfig.hidden_size = 40; "
                                        r"allowed: a multiple of 16"),
    (dict(moe_intermediate_size=24), r"EpConfig.intermediate_size = 24; allowed: a multiple of 16"),
    (dict(hidden_act="gelu"), r"Qwen3Moe(Experts|MLP).act_fn = 'GELUActivation'; allowed: SiLU"),
])
def test_sizes_and_activations_moe_ep_cannot_run_are_named(overrides, match):
    model = tiny_model("qwen3_moe", **overrides)
    with pytest.raises(MoEEpConfigError, match=match):
        convert(model)
    assert not any(isinstance(m, MoEEpBlock) for m in model.modules())


@pytest.mark.parametrize("options, match", [
    (dict(weight_format="int8"), "EpConfig.weight_format = 'int8'"),  # (fp8 is a format: DESIGN.md, FP8)
    (dict(activation_format="int4"), "EpConfig.activation_format = 'int4'"),
    (dict(max_tokens=0), "EpConfig.max_tokens_per_rank = 0"),
    (dict(algorithm="ll", layout="flat"), "EpConfig.layout = 'flat'"),
])
def test_bad_options_are_named(options, match):
    with pytest.raises(MoEEpConfigError, match=match):
        convert(tiny_model("mixtral"), **options)


def test_import_moe_ep_does_not_import_transformers():
    code = "import sys, moe_ep; assert 'transformers' not in sys.modules and 'moe_ep.hf' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": os.getcwd()})


# (b) 2 and 4 gloo ranks: MoEEpLayer (spawned by tests/test_layer_multirank.py::test_multi_rank_gloo) ----------

def rank_cases(rank: int, world: int) -> list[str]:
    """This rank's part of the multi-rank checks, in a process group of ``world`` ranks: every family converted
    with this rank's shard, its logits and greedy tokens against the unconverted model. Run by the ranks that
    tests/test_layer_multirank.py spawns (one spawn per world size for the layer and these)."""
    fails = []
    for family in FAMILIES:
        try:
            model = tiny_model(family, 0)  # the same model on every rank
            ref = copy.deepcopy(model)
            names = convert(model, transport="torch", max_tokens=16)
            for n in names:
                block = model.get_submodule(n)
                assert block.experts.world_size == world, block.experts.world_size
                w, c = block.experts.weights, block.config
                L = c.num_experts // world
                assert w.num_local_experts == L, w.num_local_experts
                # this rank's shard alone, not a view into all experts' storage
                assert w.w13.untyped_storage().nbytes() == L * 2 * c.intermediate_size * H * 2
                assert w.w2.untyped_storage().nbytes() == L * H * c.intermediate_size * 2
            ids = torch.randint(0, VOCAB, (1, 4 + rank), generator=torch.Generator().manual_seed(rank))  # own tokens
            with torch.no_grad():
                err = rel_err(model(ids).logits, ref(ids).logits)
            if not err <= LOGITS_BOUND:
                fails.append(f"R={world} rank={rank} {family}: logits rel err {err:.4f}")
            if not greedy_agrees(model, ref, ids, 2):
                fails.append(f"R={world} rank={rank} {family}: greedy tokens differ")
        except Exception:  # the ranks' collectives are out of step now: stop here
            return fails + [f"R={world} rank={rank} {family}:\n" + traceback.format_exc()]
    return fails
