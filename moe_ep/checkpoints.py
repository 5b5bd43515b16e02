"""NVFP4 expert weights as a ModelOpt checkpoint ships them, taken as they are: never re-quantized.

A ModelOpt NVFP4 checkpoint (``hf_quant_config.json``: ``quant_algo: NVFP4``, ``group_size: 16``) stores each
projection of each expert (an ``nn.Linear`` weight ``[out, in]``) as

* ``weight`` uint8 ``[out, in/2]``: E2M1 codes, element 2i in the low nibble (moe-ep's order);
* ``weight_scale`` float8_e4m3fn ``[out, in/16]``: one scale per 16 consecutive elements of a row (linear);
* ``weight_scale_2`` float32 scalar: the per-tensor scale in the dequantize-*multiply* convention,
  ``value = e2m1(q) * float(weight_scale) * weight_scale_2`` (``amax / (6 * 448)``); moe-ep's global scale
  divides, so it is ``1 / weight_scale_2``;
* ``input_scale`` float32 scalar: the static activation scale ``amax(x) / (6 * 448)``; moe-ep's activation
  global scale is ``1 / input_scale``.

Codes and block scales are kept bit for bit. The global scale is ``1 / weight_scale_2`` rounded to fp32 once, so a
dequantized value matches the checkpoint's ``e2m1 * s * weight_scale_2`` to within that rounding (a few fp32 ulps;
exactly when ``weight_scale_2`` is a power of two).

gate_proj and up_proj become one ``w13`` (gate rows then up rows), which has one global scale per expert. Where an
expert's two ``weight_scale_2`` differ, they are made one *exactly* or not at all: when they are a power of two
apart, one projection's block scales are shifted by that power (``s * 2**k``), which is exact when every shifted
scale is still an e4m3 value (no overflow past 448, no bits lost below 2**-6); the other direction is tried too.
Otherwise :class:`MoEEpInputError` names the expert: re-quantizing would change the checkpoint's numbers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from .errors import MoEEpInputError, check, fail
from .kernels.nvfp4 import NvFp4Tensor

NVFP4_BLOCK = 16
PARTS = {"weight": torch.uint8, "weight_scale": torch.float8_e4m3fn, "weight_scale_2": torch.float32,
         "input_scale": torch.float32}
"""A ModelOpt NVFP4 projection's tensors and their dtypes (``input_scale`` may be absent)."""
MODELOPT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_MUST_DO = ("export gate_proj and up_proj with one shared amax per expert (ModelOpt does for fused experts), or "
            "dequantize them and pass full-precision w13/w2 to ExpertWeights(..., 'nvfp4'), which quantizes again")


@dataclass(frozen=True)
class NvFp4Projection:
    """One projection (gate_proj, up_proj or down_proj) of ``L`` experts, stacked, as a ModelOpt NVFP4 checkpoint
    stores it per expert: ``weight`` uint8 ``[L, out, in/2]``, ``weight_scale`` float8_e4m3fn ``[L, out, in/16]``,
    ``weight_scale_2`` float32 ``[L]`` (or a sequence of ``L`` scalars), ``input_scale`` float32 ``[L]`` or None.
    Checked by :meth:`ExpertWeights.from_nvfp4 <moe_ep.ExpertWeights.from_nvfp4>`, which takes it."""

    weight: torch.Tensor
    weight_scale: torch.Tensor
    weight_scale_2: torch.Tensor | Sequence[torch.Tensor]
    input_scale: torch.Tensor | Sequence[torch.Tensor] | None = None


def nvfp4_experts_from_state_dict(state_dict: Mapping[str, torch.Tensor], prefix: str, experts: Sequence[int], *,
                                  projections: Sequence[str] = MODELOPT_PROJECTIONS) -> dict[str, NvFp4Projection]:
    """The ModelOpt NVFP4 tensors of experts ``experts`` (e.g. ``range(rank * L, (rank + 1) * L)``) of one layer,
    stacked: ``{"gate": ..., "up": ..., "down": ...}`` :class:`NvFp4Projection`, for
    ``ExpertWeights.from_nvfp4(**nvfp4_experts_from_state_dict(sd, prefix, experts))``.

    Keys are ``f"{prefix}.{e}.{projection}.{part}"`` with ``prefix`` e.g. ``"model.layers.3.mlp.experts"``,
    ``projections`` the gate, up and down names (Mixtral's: ``("w1", "w3", "w2")``) and ``part`` each of
    ``weight``, ``weight_scale``, ``weight_scale_2`` and, for all experts of a projection or for none,
    ``input_scale``. A missing key, or an expert's tensor whose dtype, shape or device differs from the first
    expert's, raises :class:`MoEEpInputError` naming the key. Other keys of ``state_dict`` are ignored.
    """
    check(isinstance(state_dict, Mapping), "type(state_dict)", type(state_dict).__name__, "a Mapping[str, Tensor]")
    check(isinstance(prefix, str), "type(prefix)", type(prefix).__name__, "str")
    experts = _expert_ids(experts)
    check(isinstance(projections, Sequence) and not isinstance(projections, str) and len(projections) == 3
          and all(isinstance(p, str) for p in projections), "projections", projections,
          "3 names: gate, up, down (default ('gate_proj', 'up_proj', 'down_proj'))")
    prefix = prefix.rstrip(".")
    out = {}
    for role, proj in zip(("gate", "up", "down"), projections):
        keys = {part: [f"{prefix}.{e}.{proj}.{part}" for e in experts] for part in PARTS}
        if all(k not in state_dict for k in keys["input_scale"]):
            del keys["input_scale"]
        out[role] = NvFp4Projection(**{part: _stacked(state_dict, ks, part) for part, ks in keys.items()})
    return out


def nvfp4_activation_global_scale(state_dict: Mapping[str, torch.Tensor], prefix: str, experts: Sequence[int], *,
                                  projections: Sequence[str] = MODELOPT_PROJECTIONS[:2]) -> float:
    """The static activation global scale of one layer: ``1 / max(input_scale)`` over the gate and up projections
    of ``experts`` (keys as in :func:`nvfp4_experts_from_state_dict`), for ``EpConfig(activation_format='nvfp4',
    activation_global_scale=...)``.

    Tokens are quantized before dispatch, where their experts are not known yet, so one scale serves every
    expert: the largest calibrated amax, which saturates none of them. With several ranks, pass *all* the
    layer's experts (``range(num_experts)``; only these scalars are read) so that every rank's EpConfig agrees.
    down_proj's input_scale is not used: moe-ep keeps the intermediate activation in bf16.
    """
    check(isinstance(state_dict, Mapping), "type(state_dict)", type(state_dict).__name__, "a Mapping[str, Tensor]")
    check(isinstance(prefix, str), "type(prefix)", type(prefix).__name__, "str")
    experts = _expert_ids(experts)
    check(isinstance(projections, Sequence) and not isinstance(projections, str) and len(projections) >= 1
          and all(isinstance(p, str) for p in projections), "projections", projections,
          "names of the projections that read the layer's input (default ('gate_proj', 'up_proj'))")
    prefix = prefix.rstrip(".")
    scales = []
    for proj in projections:
        keys = [f"{prefix}.{e}.{proj}.input_scale" for e in experts]
        t = _stacked(state_dict, keys, "input_scale")
        bad = ~((t > 0) & torch.isfinite(t))
        if bool(bad.any()):
            e = int(bad.nonzero()[0, 0])
            fail(f"state_dict[{keys[e]!r}]", float(t[e]), "a positive finite float32")
        scales.append(t)
    return _activation_scale(scales)


def load_nvfp4_projections(gate, up, down, device=None) -> tuple[NvFp4Tensor, NvFp4Tensor, float | None]:
    """``(w13 [L, 2I, H], w2 [L, H, I], activation_global_scale)`` from the three projections (each an
    :class:`NvFp4Projection` or a mapping with its fields), checked and joined without re-quantizing (module doc).
    What :meth:`ExpertWeights.from_nvfp4 <moe_ep.ExpertWeights.from_nvfp4>` is made of."""
    if device is not None:
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError):
            raise MoEEpInputError(f"device = {device!r}; allowed: a torch.device or its name") from None
    projs = {name: _projection(name, p, device) for name, p in (("gate", gate), ("up", up), ("down", down))}
    g, u, d = projs["gate"], projs["up"], projs["down"]
    L, I, h_half = g.weight.shape
    H = 2 * h_half
    for name in ("up", "down"):
        n = projs[name].weight.shape[0]
        check(n == L, f"{name}.weight.shape[0] (experts)", n, f"{L} (gate.weight's)")
    check(tuple(u.weight.shape) == (L, I, h_half), "up.weight.shape", tuple(u.weight.shape),
          f"{(L, I, h_half)} (gate.weight's: [L, I, H/2])")
    check(tuple(d.weight.shape) == (L, H, I // 2), "down.weight.shape", tuple(d.weight.shape),
          f"{(L, H, I // 2)} ([L, H, I/2] with L, I, H from gate.weight {tuple(g.weight.shape)})")
    for name, p in projs.items():
        check(p.weight.device == g.weight.device, f"{name}.weight.device", str(p.weight.device),
              f"{g.weight.device} (gate.weight's; or pass device=)")
    s2, gate_scales, up_scales = _shared_scale_2(g, u)
    w13 = NvFp4Tensor(torch.cat([g.weight, u.weight], dim=1).contiguous(),
                      torch.cat([gate_scales, up_scales], dim=1).contiguous(),
                      _global_scale(s2, "gate/up.weight_scale_2"), torch.Size((L, 2 * I, H)))
    w2 = NvFp4Tensor(d.weight.contiguous(), d.weight_scale.contiguous(), _global_scale(d.weight_scale_2, "down.weight_scale_2"),
                     torch.Size((L, H, I)))
    act = [p.input_scale for p in (g, u) if p.input_scale is not None]
    return w13, w2, _activation_scale(act) if act else None


def _expert_ids(experts) -> list[int]:
    ok = isinstance(experts, (range, Sequence)) and not isinstance(experts, str) and len(experts) > 0
    ids = list(experts) if ok else []
    check(ok and all(isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in ids)
          and len(set(ids)) == len(ids), "experts", experts,
          "a non-empty range or sequence of distinct expert ids (ints >= 0)")
    return ids


def _stacked(state_dict: Mapping, keys: list[str], part: str) -> torch.Tensor:
    """``state_dict[k]`` for each key, stacked on a new leading dim (scalars to ``[L]``); each checked by its key."""
    ts = []
    for k in keys:
        if k not in state_dict:
            raise MoEEpInputError(f"state_dict[{k!r}] is missing; allowed: every expert's {part} (ModelOpt NVFP4 "
                                  "keys: {prefix}.{expert}.{projection}.weight, .weight_scale, .weight_scale_2 and "
                                  "optionally .input_scale)")
        t = state_dict[k]
        check(isinstance(t, torch.Tensor), f"type(state_dict[{k!r}])", type(t).__name__, "a torch.Tensor")
        check(t.dtype == PARTS[part], f"state_dict[{k!r}].dtype", t.dtype, str(PARTS[part]))
        if part in ("weight_scale_2", "input_scale"):
            check(t.numel() == 1, f"state_dict[{k!r}].shape", tuple(t.shape), "a scalar (one element)")
            t = t.reshape(())
        first = ts[0] if ts else t
        check(t.shape == first.shape, f"state_dict[{k!r}].shape", tuple(t.shape),
              f"{tuple(first.shape)} (state_dict[{keys[0]!r}]'s)")
        check(t.device == first.device, f"state_dict[{k!r}].device", str(t.device),
              f"{first.device} (state_dict[{keys[0]!r}]'s)")
        ts.append(t)
    return torch.stack(ts)


def _projection(name: str, p, device) -> NvFp4Projection:
    """p (an NvFp4Projection or a mapping of its fields) checked, its scalars stacked, on ``device``."""
    if isinstance(p, Mapping):
        unknown = sorted(set(p) - set(PARTS), key=str)
        check(not unknown, f"{name} keys", unknown, ", ".join(PARTS) + " (input_scale optional)")
        for part in ("weight", "weight_scale", "weight_scale_2"):
            if part not in p:
                raise MoEEpInputError(f"{name}[{part!r}] is missing; allowed: a mapping with weight, weight_scale, "
                                      "weight_scale_2 and optionally input_scale")
        p = NvFp4Projection(**p)
    check(isinstance(p, NvFp4Projection), f"type({name})", type(p).__name__,
          "NvFp4Projection or a mapping of its fields")
    parts = {}
    for part, dt in PARTS.items():
        t = getattr(p, part)
        if t is None and part == "input_scale":
            parts[part] = None
            continue
        if part in ("weight_scale_2", "input_scale") and isinstance(t, (list, tuple)) and t:
            check(all(isinstance(v, torch.Tensor) and v.numel() == 1 for v in t), f"{name}.{part}",
                  [type(v).__name__ for v in t], "a tensor [L], or a sequence of L one-element tensors")
            t = torch.stack([v.reshape(()).to(t[0].device) for v in t])
        check(isinstance(t, torch.Tensor), f"type({name}.{part})", type(t).__name__, f"a {dt} torch.Tensor")
        check(t.dtype == dt, f"{name}.{part}.dtype", t.dtype, str(dt))
        check(t.device.type in ("cpu", "cuda"), f"{name}.{part}.device", str(t.device), "a cpu or cuda device")
        if t.requires_grad and torch.is_grad_enabled():
            fail(f"{name}.{part}.requires_grad", True, "False: moe-ep is inference only; pass .detach()")
        parts[part] = t if device is None else t.to(device)
    w, ws = parts["weight"], parts["weight_scale"]
    check(w.dim() == 3 and w.shape[0] >= 1 and w.shape[1] >= 1 and w.shape[2] >= 1, f"{name}.weight.shape",
          tuple(w.shape), "[L, out, in/2] with L, out, in >= 1")
    L, out, k_half = w.shape
    check(k_half % (NVFP4_BLOCK // 2) == 0, f"{name}.weight.shape[2] * 2 (in_features)", 2 * k_half,
          "a multiple of 16 (one e4m3 scale per 16 elements)")
    check(tuple(ws.shape) == (L, out, 2 * k_half // NVFP4_BLOCK), f"{name}.weight_scale.shape", tuple(ws.shape),
          f"{(L, out, 2 * k_half // NVFP4_BLOCK)} ([L, out, in/16], linear, from {name}.weight {tuple(w.shape)})")
    b = ws.view(torch.uint8)
    bad = (b >= 0x80) | (b == 0x7F)  # sign bit set, or e4m3fn's NaN: no block scale of a checkpoint is either
    if bool(bad.any()):
        fail(f"{name}.weight_scale{tuple(bad.nonzero()[0].tolist())}", float(b[bad][:1].view(ws.dtype).float()),
             "finite block scales >= +0 (e4m3 with the sign bit clear)")
    for part in ("weight_scale_2", "input_scale"):
        t = parts[part]
        if t is not None:
            check(tuple(t.shape) == (L,), f"{name}.{part}.shape", tuple(t.shape), f"({L},) (one per expert)")
            _positive_finite(t, f"{name}.{part}")
    return NvFp4Projection(**parts)


def _positive_finite(t: torch.Tensor, name: str) -> torch.Tensor:
    """t unless an element is not positive and finite: then the error names the first (one host sync)."""
    bad = ~((t > 0) & torch.isfinite(t))
    if bool(bad.any()):
        e = int(bad.nonzero()[0, 0])
        fail(f"{name}[{e}]", float(t[e]), "a positive finite float32")
    return t


def _shared_scale_2(g: NvFp4Projection, u: NvFp4Projection):
    """``(weight_scale_2 [L], gate's block scales, up's block scales)`` with one weight_scale_2 per expert for both:
    where an expert's two differ by a power of two, one side's block scales are shifted exactly (module doc)."""
    s2g, s2u = g.weight_scale_2, u.weight_scale_2
    differ = s2g != s2u
    if not bool(differ.any()):
        return s2g, g.weight_scale, u.weight_scale
    mant_g, exp_g = torch.frexp(s2g)
    mant_u, exp_u = torch.frexp(s2u)
    k = (exp_u - exp_g).to(torch.int32)  # s2u == s2g * 2**k exactly where the mantissas agree
    e_bad = differ & (mant_g != mant_u)
    if bool(e_bad.any()):
        e = int(e_bad.nonzero()[0, 0])
        fail(f"up.weight_scale_2[{e}] (gate.weight_scale_2[{e}] = {float(s2g[e])!r})", float(s2u[e]),
             f"equal to gate's, or a power of two apart (ratio {float(s2u[e] / s2g[e]):.6g}): w13 has one global "
             f"scale per expert; {_MUST_DO}")
    # keep gate's scale_2 and shift up's block scales by 2**k, or keep up's and shift gate's by 2**-k
    up_shifted, up_ok = _shift_exactly(u.weight_scale, k)
    gate_shifted, gate_ok = _shift_exactly(g.weight_scale, -k)
    keep_gate = up_ok | ~differ
    e_bad = ~keep_gate & ~gate_ok
    if bool(e_bad.any()):
        e = int(e_bad.nonzero()[0, 0])
        fail(f"up.weight_scale_2[{e}] (gate.weight_scale_2[{e}] = {float(s2g[e])!r})", float(s2u[e]),
             f"equal to gate's, or 2**{int(k[e])} apart with every block scale of one side still exact in e4m3 "
             f"after the shift (here some would overflow 448 or lose bits): {_MUST_DO}")
    s2 = torch.where(keep_gate, s2g, s2u)
    sel = keep_gate.view(-1, 1, 1)
    gate_b = torch.where(sel, g.weight_scale.view(torch.uint8), gate_shifted.view(torch.uint8))
    up_b = torch.where(sel & differ.view(-1, 1, 1), up_shifted.view(torch.uint8), u.weight_scale.view(torch.uint8))
    return s2, gate_b.view(torch.float8_e4m3fn), up_b.view(torch.float8_e4m3fn)


def _shift_exactly(scales: torch.Tensor, k: torch.Tensor):
    """``(scales * 2**k[e] as e4m3, ok [L])``: ok where every shifted scale of expert e is exact in e4m3."""
    k = k.view(-1, 1, 1).float()
    want = torch.ldexp(scales.float(), k)
    shifted = want.to(torch.float8_e4m3fn)  # saturates or rounds where not exact: caught just below
    # and back: a scale that underflowed fp32 itself (to 0) must not pass as exact
    ok = (shifted.float() == want) & (torch.ldexp(shifted.float(), -k) == scales.float())
    return shifted, ok.flatten(1).all(dim=1)


def _global_scale(scale_2: torch.Tensor, name: str) -> torch.Tensor:
    """moe-ep's (dividing) global scale per expert from the checkpoint's multiplying one: ``1 / weight_scale_2``."""
    gs = torch.ones_like(scale_2) / scale_2
    bad = ~torch.isfinite(gs)
    if bool(bad.any()):
        e = int(bad.nonzero()[0, 0])
        fail(f"{name}[{e}]", float(scale_2[e]), "a float32 whose reciprocal is finite (>= 2**-128)")
    return gs.contiguous()


def _activation_scale(input_scales: list[torch.Tensor]) -> float:
    """``1 / max(input_scale)`` in fp32, as a Python float: the conservative static scale for every expert."""
    amax = torch.stack([t.max() for t in input_scales]).max()
    gs = float(torch.ones_like(amax) / amax)
    check(gs < float("inf"), "max(input_scale)", float(amax), "a float32 whose reciprocal is finite (>= 2**-128)")
    return gs
