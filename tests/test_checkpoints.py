"""NVFP4 checkpoints in the ModelOpt layout load into ExpertWeights as they are: the codes and block scales bit for bit,
the global scale 1 / weight_scale_2, gate rows then up rows; the layer on them matches the reference; bad input raises
its named error. Checkpoints are made here from the reference quantizer, stored the way ModelOpt stores them."""

import re

import pytest
import torch

from moe_ep import (EpConfig, ExpertWeights, Format, MoEEpInputError, MoEEpLayer, NvFp4Projection,
                    nvfp4_activation_global_scale, nvfp4_experts_from_state_dict)
from moe_ep.reference import dequantize_nvfp4_ref, e2m1_values_ref, moe_reference, quantize_nvfp4_ref

L, H, I = 2, 64, 32
PREFIX = "model.layers.3.mlp.experts"


def rand(*shape, seed, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def modelopt_scale_2(w: torch.Tensor) -> torch.Tensor:
    """A per-expert weight_scale_2 as ModelOpt computes it, amax / (6 * 448), in fp32."""
    return w.abs().flatten(1).amax(dim=1).float() / 2688.0


def projection(w: torch.Tensor, scale_2: torch.Tensor, input_scale=None) -> NvFp4Projection:
    """w [L, out, in] quantized by the reference with global scale 1 / scale_2 (what the loader will use), stored as a
    ModelOpt checkpoint stores it."""
    data, scales, _ = quantize_nvfp4_ref(w, torch.ones_like(scale_2) / scale_2)
    return NvFp4Projection(data, scales, scale_2, input_scale)


def checkpoint(seed=0, input_scales=True):
    """gate, up, down of L experts, one weight_scale_2 per expert shared by gate and up (ModelOpt's fused export)."""
    w13, w2 = rand(L, 2 * I, H, seed=seed, scale=0.3), rand(L, H, I, seed=seed + 1, scale=0.2)
    s13, s2 = modelopt_scale_2(w13), modelopt_scale_2(w2)
    ins = (lambda *v: torch.tensor(v)) if input_scales else (lambda *v: None)
    return (dict(gate=projection(w13[:, :I], s13, ins(0.01, 0.03)), up=projection(w13[:, I:], s13, ins(0.02, 0.01)),
                 down=projection(w2, s2, ins(0.5, 0.25))), w13, w2)


def modelopt_value(p: NvFp4Projection) -> torch.Tensor:
    """A checkpoint's value in its own (multiplying) convention: e2m1 * weight_scale * weight_scale_2."""
    codes = torch.stack([p.weight & 0xF, p.weight >> 4], dim=-1).flatten(-2)
    blocks = e2m1_values_ref(codes).unflatten(-1, (-1, 16)) * p.weight_scale.float().unsqueeze(-1)
    return blocks.flatten(-2) * p.weight_scale_2.view(-1, 1, 1)


def to_state_dict(projs: dict, experts=range(L), names=("gate_proj", "up_proj", "down_proj")) -> dict:
    """Per-expert tensors under ModelOpt's names, scalars 0-d, as a checkpoint's safetensors hold them."""
    sd = {}
    for (role, p), name in zip(projs.items(), names):
        for i, e in enumerate(experts):
            for part in ("weight", "weight_scale", "weight_scale_2", "input_scale"):
                t = getattr(p, part)
                if t is not None:
                    sd[f"{PREFIX}.{e}.{name}.{part}"] = t[i].clone()
    sd[f"{PREFIX}.gate.weight"] = torch.zeros(4, H)  # the router's: not an expert tensor, ignored
    return sd


def assert_same(a: torch.Tensor, b: torch.Tensor):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                       b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)


def dense_cpu(projs: dict, dev) -> tuple[torch.Tensor, torch.Tensor]:
    """dense() of the loaded weights, dequantized by the kernel where the kernels run, back on the CPU."""
    return tuple(t.cpu() for t in ExpertWeights.from_nvfp4(**projs, device=dev).dense())


def test_loads_bit_exact_what_expert_weights_quantizes(dev):
    """Weights whose amax makes every global scale a power of two (so 1 / (1 / gs) == gs): the loaded parts are
    exactly what ExpertWeights(w13, w2, 'nvfp4') computes from the full-precision weights."""
    w13, w2 = rand(L, 2 * I, H, seed=3).clamp(-2, 2), rand(L, H, I, seed=4).clamp(-2, 2)
    w13[:, 5, 7], w2[:, 2, 1] = 2.625, -2.625  # amax 2.625: gs = 2688 / 2.625 = 1024 for every expert
    s2 = torch.full((L,), 2.0 ** -10)
    gate, up, down = projection(w13[:, :I], s2), projection(w13[:, I:], s2), projection(w2, s2)
    got = ExpertWeights.from_nvfp4(gate, up, down, device=dev)
    want = ExpertWeights(w13.to(dev), w2.to(dev), "nvfp4")  # quantized where the kernels run
    for g, w in ((got.w13, want.w13), (got.w2, want.w2)):
        assert g.shape == w.shape and not g.swizzled
        for part in ("data", "scales", "global_scale"):
            assert_same(getattr(g, part).cpu(), getattr(w, part).cpu())
    assert (got.format, got.num_local_experts, got.hidden_size, got.intermediate_size) == (Format.NVFP4, L, H, I)
    assert got.activation_global_scale is None and want.activation_global_scale is None


def test_parts_are_the_checkpoints_and_dense_is_the_reference(dev):
    """Any weight_scale_2: codes and block scales are the checkpoint's (gate rows, then up rows), the global scale is
    1 / weight_scale_2 in fp32, dense() is the reference's dequantization exactly and the checkpoint's own
    e2m1 * s * weight_scale_2 to within the rounding of 1 / weight_scale_2."""
    projs, _, _ = checkpoint()
    g, u, d = projs["gate"], projs["up"], projs["down"]
    w = ExpertWeights.from_nvfp4(**projs)
    assert_same(w.w13.data, torch.cat([g.weight, u.weight], dim=1))
    assert_same(w.w13.scales, torch.cat([g.weight_scale, u.weight_scale], dim=1))
    assert_same(w.w13.global_scale, 1 / g.weight_scale_2)
    assert_same(w.w2.data, d.weight)
    assert_same(w.w2.scales, d.weight_scale)
    assert_same(w.w2.global_scale, 1 / d.weight_scale_2)
    dense13, dense2 = dense_cpu(projs, dev)
    assert_same(dense13, dequantize_nvfp4_ref(w.w13.data, w.w13.scales, 1 / g.weight_scale_2))
    assert_same(dense2, dequantize_nvfp4_ref(d.weight, d.weight_scale, 1 / d.weight_scale_2))
    mo13 = torch.cat([modelopt_value(g), modelopt_value(u)], dim=1)
    torch.testing.assert_close(dense13, mo13, rtol=2.5e-7, atol=0)
    torch.testing.assert_close(dense2, modelopt_value(d), rtol=2.5e-7, atol=0)


def test_activation_global_scale_is_the_conservative_one():
    projs, _, _ = checkpoint()
    w = ExpertWeights.from_nvfp4(**projs)
    assert w.activation_global_scale == float(torch.tensor(1.0) / torch.tensor(0.03))  # gate and up; never down's
    assert nvfp4_activation_global_scale(to_state_dict(projs), PREFIX, range(L)) == w.activation_global_scale
    assert ExpertWeights.from_nvfp4(**checkpoint(input_scales=False)[0]).activation_global_scale is None


@pytest.mark.parametrize("k", [1, -2])
def test_gate_and_up_a_power_of_two_apart_are_joined_exactly(dev, k):
    """up's weight_scale_2 = gate's * 2**k: one side's block scales are shifted, and every value stays the one the
    checkpoint gives (compared with each projection dequantized on its own, bit for bit)."""
    projs, w13, _ = checkpoint(seed=5)
    s2 = projs["gate"].weight_scale_2
    up_s2 = s2 * 2.0 ** k
    projs["up"] = projection(w13[:, I:] * 2.0 ** k, up_s2)
    w = ExpertWeights.from_nvfp4(**projs)
    dense13 = dense_cpu(projs, dev)[0]
    g, u = projs["gate"], projs["up"]
    assert_same(dense13[:, :I], dequantize_nvfp4_ref(g.weight, g.weight_scale, 1 / s2))
    assert_same(dense13[:, I:], dequantize_nvfp4_ref(u.weight, u.weight_scale, 1 / up_s2))
    assert_same(w.w13.data, torch.cat([g.weight, u.weight], dim=1))


def test_shifting_the_other_side_when_one_would_overflow(dev):
    """up's weight_scale_2 is twice gate's and its block scales reach 448, so raising them to gate's scale_2 would
    overflow: gate's are halved instead, and w13 takes up's scale_2."""
    projs, w13, _ = checkpoint(seed=6)
    s2 = projs["gate"].weight_scale_2
    amax = lambda t: t.abs().flatten(1).amax(dim=1).view(-1, 1, 1)  # noqa: E731
    projs["up"] = projection(w13[:, I:] / amax(w13[:, I:]) * 2 * amax(w13), s2 * 2)
    assert (projs["up"].weight_scale.float() == 448).flatten(1).any(dim=1).all()
    w = ExpertWeights.from_nvfp4(**projs)
    assert_same(w.w13.global_scale, 1 / (s2 * 2))
    dense13 = dense_cpu(projs, dev)[0]
    g, u = projs["gate"], projs["up"]
    assert_same(dense13[:, :I], dequantize_nvfp4_ref(g.weight, g.weight_scale, 1 / s2))
    assert_same(dense13[:, I:], dequantize_nvfp4_ref(u.weight, u.weight_scale, 1 / (s2 * 2)))


@pytest.mark.parametrize("af", ["bf16", "nvfp4"])
def test_layer_on_loaded_weights_matches_the_reference(dev, af):
    """World 1: the layer on the loaded weights vs moe_reference on their dequantized values (and, for NVFP4
    activations, on x quantized by the checkpoint's static scale)."""
    projs, _, _ = checkpoint(seed=7)
    w = ExpertWeights.from_nvfp4(**projs, device=dev)
    assert w.device.type == torch.device(dev).type
    static = w.activation_global_scale if af == "nvfp4" else None
    cfg = EpConfig(num_experts=L, top_k=2, hidden_size=H, intermediate_size=I, max_tokens_per_rank=8,
                   weight_format="nvfp4", activation_format=af, activation_global_scale=static)
    x = rand(8, H, seed=8, scale=30.0).bfloat16()  # past the static scale's range (2688 / 33.3): some saturate
    idx = torch.tensor([[0, 1], [1, 0], [0, -1], [1, -1]] * 2)
    wts = torch.rand(8, 2, generator=torch.Generator().manual_seed(9))
    out = MoEEpLayer(cfg, w)(x.to(dev), idx.to(dev), wts.to(dev)).float().cpu()
    xr = x.float()
    if static is not None:
        xr = dequantize_nvfp4_ref(*quantize_nvfp4_ref(xr, torch.full((8,), static))[:2], torch.full((8,), static))
    want = moe_reference(xr, idx, wts, *(t.cpu() for t in w.dense()))
    assert (out - want).norm() <= 2e-2 * want.norm(), float((out - want).norm() / want.norm())


def test_state_dict_shard_and_names():
    """A rank's shard of a 4-expert layer comes from its own keys; Mixtral's names work too; the result loads
    like the stacked projections do."""
    projs4 = {r: NvFp4Projection(*(None if t is None else torch.cat([t, t.flip(0)])
                                   for t in (p.weight, p.weight_scale, p.weight_scale_2, p.input_scale)))
              for r, p in checkpoint(seed=10)[0].items()}
    sd = to_state_dict(projs4, experts=range(4), names=("w1", "w3", "w2"))
    shard = nvfp4_experts_from_state_dict(sd, PREFIX + ".", range(2, 4), projections=("w1", "w3", "w2"))
    for role, p in shard.items():
        for part in ("weight", "weight_scale", "weight_scale_2", "input_scale"):
            assert_same(getattr(p, part), getattr(projs4[role], part)[2:4])
    a, b = ExpertWeights.from_nvfp4(**shard), ExpertWeights.from_nvfp4(**{r: p for r, p in projs4.items()})
    assert_same(a.w13.data, b.w13.data[2:4])
    assert_same(a.w2.global_scale, b.w2.global_scale[2:4])


def test_mappings_and_scalar_sequences_are_taken():
    projs, _, _ = checkpoint()
    as_maps = {r: {"weight": p.weight, "weight_scale": p.weight_scale,
                   "weight_scale_2": [s for s in p.weight_scale_2]} for r, p in projs.items()}
    a, b = ExpertWeights.from_nvfp4(**as_maps), ExpertWeights.from_nvfp4(**projs)
    for part in ("data", "scales", "global_scale"):
        assert_same(getattr(a.w13, part), getattr(b.w13, part))
        assert_same(getattr(a.w2, part), getattr(b.w2, part))


# --- bad input: one table -------------------------------------------------------------------------------------------

def replace(*roles, **parts):
    """from_nvfp4 on a good checkpoint with some parts of the projections ``roles`` replaced."""
    def call():
        projs = checkpoint()[0]
        for role in roles:
            p = projs[role]
            projs[role] = NvFp4Projection(**{f: parts[f](getattr(p, f)) if f in parts else getattr(p, f)
                                             for f in ("weight", "weight_scale", "weight_scale_2", "input_scale")})
        ExpertWeights.from_nvfp4(**projs)
    return call


def setbyte(value):
    def f(s):
        s = s.clone()
        s.view(torch.uint8)[1, 2, s.shape[2] - 1] = value
        return s
    return f


def other_up_scale_2(factor):
    """Expert 1's up weights and weight_scale_2 times ``factor`` (its codes and block scales as before)."""
    def call():
        projs, w13, _ = checkpoint()
        s2, f = projs["gate"].weight_scale_2, torch.tensor([1.0, factor])
        projs["up"] = projection(w13[:, I:] * f.view(-1, 1, 1), s2 * f)
        ExpertWeights.from_nvfp4(**projs)
    return call


def scale_2_pair(gate_s2, up_s2):
    """gate's and up's weight_scale_2 set to these (codes and block scales as they were)."""
    def call():
        projs = checkpoint()[0]
        for role, v in (("gate", gate_s2), ("up", up_s2)):
            p = projs[role]
            projs[role] = NvFp4Projection(p.weight, p.weight_scale, torch.full((L,), v), p.input_scale)
        ExpertWeights.from_nvfp4(**projs)
    return call


def from_map(edit):
    def call():
        projs = checkpoint()[0]
        p = projs["gate"]
        m = {"weight": p.weight, "weight_scale": p.weight_scale, "weight_scale_2": p.weight_scale_2}
        edit(m)
        projs["gate"] = m
        ExpertWeights.from_nvfp4(**projs)
    return call


def from_sd(edit, fn=nvfp4_experts_from_state_dict, experts=range(L), **kw):
    def call():
        sd = to_state_dict(checkpoint()[0])
        edit(sd)
        fn(sd, PREFIX, experts, **kw)
    return call


K0 = f"{PREFIX}.0"
K1 = f"{PREFIX}.1"
BAD = [
    ("weight dtype", replace("gate", weight=lambda t: t.to(torch.int8)), "gate.weight.dtype = torch.int8"),
    ("weight 2-D", replace("gate", weight=lambda t: t[0]), "gate.weight.shape = (32, 32)"),
    ("in_features not a multiple of 16", replace("up", weight=lambda t: t[..., :4], weight_scale=lambda t: t[..., :1]),
     "up.weight.shape[2] * 2 (in_features) = 8; allowed: a multiple of 16"),
    ("weight_scale dtype", replace("gate", weight_scale=lambda t: t.float()),
     "gate.weight_scale.dtype = torch.float32"),
    ("weight_scale shape", replace("down", weight_scale=lambda t: t[..., :1]), "down.weight_scale.shape = (2, 64, 1)"),
    ("weight_scale NaN", replace("gate", weight_scale=setbyte(0x7F)), "gate.weight_scale(1, 2, 3) = nan"),
    ("weight_scale negative", replace("down", weight_scale=setbyte(0xB8)), "down.weight_scale(1, 2, 1) = -1.0"),
    ("weight_scale_2 zero", replace("gate", weight_scale_2=lambda t: t * torch.tensor([1.0, 0.0])),
     "gate.weight_scale_2[1] = 0.0; allowed: a positive finite"),
    ("weight_scale_2 NaN", replace("down", weight_scale_2=lambda t: t + float("nan")), "down.weight_scale_2[0] = nan"),
    ("weight_scale_2 negative", replace("up", weight_scale_2=lambda t: -t), "up.weight_scale_2[0] = -"),
    ("weight_scale_2 Inf", replace("up", weight_scale_2=lambda t: t / 0), "up.weight_scale_2[0] = inf"),
    ("weight_scale_2 bf16", replace("gate", weight_scale_2=lambda t: t.bfloat16()), "gate.weight_scale_2.dtype"),
    ("weight_scale_2 one too many", replace("gate", weight_scale_2=lambda t: torch.cat([t, t[:1]])),
     "gate.weight_scale_2.shape = (3,); allowed: (2,) (one per expert)"),
    ("weight_scale_2 needs grad", replace("gate", weight_scale_2=lambda t: t.clone().requires_grad_()),
     "gate.weight_scale_2.requires_grad = True"),
    ("weight_scale_2 too small to invert", replace("down", weight_scale_2=lambda t: t * 0 + 1e-45),
     "down.weight_scale_2[0] = 1.401298464324817e-45; allowed: a float32 whose reciprocal is finite"),
    ("gate/up weight_scale_2 too small to invert", replace("gate", "up", weight_scale_2=lambda t: t * 0 + 2.0 ** -140),
     "gate/up.weight_scale_2[0] = 7.174648137343064e-43"),
    ("input_scale too small to invert", replace("gate", "up", input_scale=lambda t: t * 0 + 1e-45),
     "max(input_scale) = 1.401298464324817e-45"),
    ("input_scale Inf", replace("up", input_scale=lambda t: t / 0), "up.input_scale[0] = inf"),
    ("input_scale zero", replace("down", input_scale=lambda t: t * 0), "down.input_scale[0] = 0.0"),
    ("fewer down experts", replace("down", weight=lambda t: t[:1], weight_scale=lambda t: t[:1],
                                   weight_scale_2=lambda t: t[:1], input_scale=lambda t: t[:1]),
     "down.weight.shape[0] (experts) = 1; allowed: 2 (gate.weight's)"),
    ("up's I differs", replace("up", weight=lambda t: t[:, :16], weight_scale=lambda t: t[:, :16]),
     "up.weight.shape = (2, 16, 32)"),
    ("down's H differs", replace("down", weight=lambda t: t[:, :32], weight_scale=lambda t: t[:, :32]),
     "down.weight.shape = (2, 32, 16); allowed: (2, 64, 16)"),
    ("gate and up scale_2 not a power of two apart", other_up_scale_2(1.5),
     "up.weight_scale_2[1] (gate.weight_scale_2[1] = "),
    ("... hint says what to do", other_up_scale_2(3.0), "dequantize them and pass full-precision w13/w2"),
    # 2**-15: up's block scales would become e4m3 subnormals (bits lost), gate's would overflow
    ("a power of two apart, both shifts inexact", other_up_scale_2(2.0 ** -15), "2**-15 apart with every block scale"),
    ("2**-200 apart: up's shifted block scales would underflow fp32 itself", scale_2_pair(2.0 ** 100, 2.0 ** -100),
     "2**-200 apart"),
    ("projection of another type", lambda: ExpertWeights.from_nvfp4("gate", *list(checkpoint()[0].values())[1:]),
     "type(gate) = 'str'"),
    ("mapping missing weight_scale", from_map(lambda m: m.pop("weight_scale")), "gate['weight_scale'] is missing"),
    ("mapping with a typo", from_map(lambda m: m.update(weight_scale2=m["weight_scale_2"])),
     "gate keys = ['weight_scale2']"),
    ("device not a device", lambda: ExpertWeights.from_nvfp4(**checkpoint()[0], device="gpu7"), "device = 'gpu7'"),
    ("state dict key missing", from_sd(lambda sd: sd.pop(f"{K1}.up_proj.weight_scale")),
     f"state_dict['{K1}.up_proj.weight_scale'] is missing"),
    ("input_scale for some experts only", from_sd(lambda sd: sd.pop(f"{K1}.down_proj.input_scale")),
     f"state_dict['{K1}.down_proj.input_scale'] is missing"),
    ("state dict dtype", from_sd(lambda sd: sd.update({f"{K1}.gate_proj.weight_scale_2": torch.tensor(1.0).double()})),
     f"state_dict['{K1}.gate_proj.weight_scale_2'].dtype = torch.float64"),
    ("state dict expert shapes differ", from_sd(lambda sd: sd.update({f"{K1}.up_proj.weight":
                                                                      sd[f"{K1}.up_proj.weight"][:8]})),
     f"state_dict['{K1}.up_proj.weight'].shape = (8, 32); allowed: (32, 32)"),
    ("state dict scale not a scalar", from_sd(lambda sd: sd.update({f"{K0}.down_proj.weight_scale_2": torch.ones(2)})),
     f"state_dict['{K0}.down_proj.weight_scale_2'].shape = (2,); allowed: a scalar"),
    ("state dict value not a tensor", from_sd(lambda sd: sd.update({f"{K0}.gate_proj.weight": [1, 2]})),
     f"type(state_dict['{K0}.gate_proj.weight']) = 'list'"),
    ("no experts", from_sd(lambda sd: None, experts=range(0)), "experts = range(0, 0); allowed: a non-empty"),
    ("duplicate experts", from_sd(lambda sd: None, experts=[0, 0]), "distinct expert ids"),
    ("two projection names", from_sd(lambda sd: None, projections=("w1", "w3")), "projections = ('w1', 'w3')"),
    ("activation scale: input_scale 0", from_sd(lambda sd: sd[f"{K1}.up_proj.input_scale"].zero_(),
                                                fn=nvfp4_activation_global_scale),
     f"state_dict['{K1}.up_proj.input_scale'] = 0.0; allowed: a positive finite"),
    ("activation scale: input_scale missing", from_sd(lambda sd: sd.pop(f"{K0}.gate_proj.input_scale"),
                                                      fn=nvfp4_activation_global_scale),
     f"state_dict['{K0}.gate_proj.input_scale'] is missing"),
]


@pytest.mark.parametrize("case, fn, fragment", BAD, ids=[c[0] for c in BAD])
def test_bad_input(case, fn, fragment):
    with pytest.raises(MoEEpInputError, match=re.escape(fragment)):
        fn()


def test_the_table_is_large_enough():
    assert len(BAD) >= 10
