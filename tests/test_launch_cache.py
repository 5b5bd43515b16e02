"""The launch cache (moe_ep.kernels.launch_cache) launches a kept compiled kernel only when everything Triton
specialized it on is the same: its key separates every pair of arguments Triton's own specialization separates."""

import inspect

import pytest
import torch
import triton
import triton.language as tl
from triton.backends.compiler import BaseBackend
from triton._C.libtriton import native_specialize_impl

from moe_ep.kernels import launch_cache
from moe_ep.testing.stand_in_triton import StandInCompiled, stand_in_triton
from moe_ep.triton_runtime import device as kernel_device

INTS = [0, 1, 2, 15, 16, 17, 32, 2 ** 31 - 16, 2 ** 31 - 1, 2 ** 31, 2 ** 32, 2 ** 32 + 16, 2 ** 63 - 1, 2 ** 63, -1,
        -16, -2 ** 31, -2 ** 31 - 1, -2 ** 31 - 16]


def _triton(v):
    return native_specialize_impl(BaseBackend, v, False, True, True)


@pytest.mark.parametrize("a", INTS)
@pytest.mark.parametrize("b", INTS)
def test_int_key_separates_what_triton_separates(a, b):
    if _triton(a) != _triton(b):
        assert launch_cache._spec(a) != launch_cache._spec(b)


def test_tensor_key_separates_dtype_and_alignment():
    t = torch.zeros(64)
    specs = {launch_cache._spec(x) for x in (t, t[1:], t[4:], t.half(), t.int())}
    assert len(specs) == 5 - 1  # t and t[4:] are both 16-byte aligned fp32: one class, as in Triton
    assert _triton(t) == _triton(t[4:]) and _triton(t) != _triton(t[1:])


def test_other_kinds():
    assert launch_cache._spec(True) != launch_cache._spec(1) != launch_cache._spec(1.0) != launch_cache._spec(None)
    with pytest.raises(TypeError):
        launch_cache._spec(object())


@triton.jit
def _add_kernel(x_ptr, out_ptr, n, c, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=m) + c, mask=m)


@triton.heuristics({"BLOCK": lambda a: 16 if a["n"] < 64 else 64})
@triton.jit
def _add_heuristic_kernel(x_ptr, out_ptr, n, c, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=m) + c, mask=m)


@pytest.mark.parametrize("kernel, kw", [(_add_kernel, {"BLOCK": 32}), (_add_heuristic_kernel, {})])
def test_launches_agree_with_triton_across_keys(dev, kernel, kw):
    """Many calls, alternating between keys (sizes of every int class, misaligned views, dtypes, heuristic values),
    each checked: a kernel kept for one key and launched for another would write the wrong rows or values."""
    base = torch.arange(300, dtype=torch.float32, device=dev)
    for _ in range(2):
        for n in (1, 16, 17, 40, 64, 100):
            for off in (0, 1, 4):
                for dtype in (torch.float32, torch.float16):
                    x = base.to(dtype)[off:off + n]
                    out = torch.full((n + 8,), -7.0, dtype=dtype, device=dev)
                    block = kw.get("BLOCK") or (16 if n < 64 else 64)
                    launch_cache.launch(kernel, (triton.cdiv(n, block),), x, out, n, 2.5, **kw)
                    assert torch.equal(out[:n], x + 2.5), (n, off, dtype)
                    assert bool((out[n:] == -7.0).all()), (n, off, dtype)


# ---- the cache's own path, on any machine: Triton stood in for below the launch cache ----------------------------
# Each call through "Triton" returns a kernel tagged with what Triton specializes that call on (its own
# native_specialize_impl for the runtime arguments, the constexprs' values and types); a kept kernel launched for a call
# whose specialization differs, or with other argument values than the call's, fails the run's asserts.

def _specialized(v):
    try:
        return _triton(v)
    except TypeError:  # a type Triton does not launch with (the stand-in never launches it anyway)
        return type(v)


def _triton_view(values, n_runtime, constexprs):
    """What Triton compiles a call on: the runtime arguments' specialization, and the value of every constexpr
    (those passed positionally, at the positions ``constexprs``, too)."""
    return (tuple((type(v), v) if i in constexprs else _specialized(v) for i, v in enumerate(values[:n_runtime])),
            tuple((type(v), v) for v in values[n_runtime:]))


class _Tagged(StandInCompiled):
    def __init__(self, tag, n_runtime, constexprs, expected):
        super().__init__(None, 1, 2)
        self.tag, self.n_runtime, self.constexprs, self.expected = tag, n_runtime, constexprs, expected

    def run(self, gx, gy, gz, stream, function, metadata, launch_metadata, enter, exit_hook, *values):
        assert (function, metadata) == (1, 2)
        assert _triton_view(values, self.n_runtime, self.constexprs) == self.tag, \
            "a kept kernel launched for another specialization"
        want = self.expected[0]
        assert len(values) == len(want) and all(a is b or (type(a) is type(b) and a == b) for a, b in
                                                zip(values, want)), "launched with other values than the call's"
        assert self.expected[2] in (None, gx), "launched on another grid than the call's"
        self.expected[1] += 1


class _StandInTriton:
    """The launch cache with the interpreter taken as off and Triton's launch stood in for (above), while entered."""

    def __init__(self):
        self.expected = [None, 0, None]  # the call's full values; kept-kernel launches seen; the grid's x (None: any)
        self.through = 0
        self._stand_in = stand_in_triton(self._through_triton)

    def __enter__(self):
        self._stand_in.__enter__()
        return self

    def __exit__(self, *exc):
        return self._stand_in.__exit__(*exc)

    def _through_triton(self, info, kernel, grid, args, kwargs):
        self.through += 1
        config = None
        full = dict(zip(info.names, args), **kwargs)
        if info.autotuner is not None:  # a pick that depends on the tuning key alone, as the autotuner's
            config = info.autotuner.configs[hash(tuple(full[k] for k in info.autotuner.keys)) % 2]
            full.update(config.all_kwargs())
        if info.heuristics is not None:
            for name, fn in info.heuristics.values.items():
                full[name] = fn(full)
        values = tuple(full.get(n) for n in info.names)
        constexprs = {i for i, p in enumerate(inspect.signature(info.jit.fn).parameters.values())
                      if p.annotation is tl.constexpr}
        return config, _Tagged(_triton_view(values, len(args), constexprs), len(args), constexprs, self.expected)

    def call(self, kernel, grid, args, kwargs, full_values, gx=None):
        self.expected[0], self.expected[2] = full_values, gx
        return launch_cache.launch(kernel, grid, *args, **kwargs)


@pytest.fixture
def triton_():
    with _StandInTriton() as stand_in:
        yield stand_in


@triton.jit
def _many_kernel(t, i, f, b, n, BLOCK: tl.constexpr, FLAG: tl.constexpr):
    pass


_heuristic_many = triton.heuristics({"FLAG": lambda a: a["i"] % 3 == 0})(_many_kernel)
_autotuned_many = triton.autotune(configs=[triton.Config({"BLOCK": 16}), triton.Config({"BLOCK": 32})],
                                  key=["i"])(_heuristic_many)
_autotuned_plain = triton.autotune(configs=[triton.Config({"BLOCK": 16, "FLAG": False}),
                                           triton.Config({"BLOCK": 32, "FLAG": True})], key=["i"])(_many_kernel)

_BASE = torch.zeros(256)
_TENSORS = [_BASE, _BASE[1:], _BASE[4:], _BASE.half(), _BASE.int(), _BASE.bfloat16()[8:]]


def _calls():
    """Positional arguments across every class the key separates (and many that fall into one class)."""
    out = []
    for i in INTS[::2] + [3, 48]:
        for t in _TENSORS:
            out.append((t, i, 0.5, i % 2 == 0, None if i % 5 else 7))
    return out


@pytest.mark.parametrize("kernel", ["plain", "heuristics", "autotuned", "autotuned-plain"])
def test_kept_kernels_launch_only_for_their_specialization(triton_, kernel):
    """Many calls in an order that alternates between keys, each with the arguments Triton would bind: a kept
    kernel launched for a call of another specialization, or with another call's values, fails in its run."""
    for _ in range(2):
        for args in _calls():
            if kernel == "plain":
                for block, flag in ((16, False), (32, True)):
                    triton_.call(_many_kernel, (1,), args, dict(BLOCK=block, FLAG=flag), (*args, block, flag))
                    triton_.call(_many_kernel, lambda meta: (meta["BLOCK"],), args, dict(BLOCK=block, FLAG=flag),
                                 (*args, block, flag))
            elif kernel == "heuristics":
                triton_.call(_heuristic_many, (1,), args, dict(BLOCK=16), (*args, 16, args[1] % 3 == 0))
            elif kernel == "autotuned-plain":  # no heuristics: the config's values alone, tuple grids too
                pick = hash((args[1],)) % 2
                for grid, gx in (((1,), 1), (lambda meta: (meta["BLOCK"],), (16, 32)[pick])):
                    config = triton_.call(_autotuned_plain, grid, args, {}, (*args, (16, 32)[pick], bool(pick)), gx)
                    assert config.kwargs["BLOCK"] == (16, 32)[pick]
            else:
                i = args[1]
                block = (16, 32)[hash((i,)) % 2]
                config = triton_.call(_autotuned_many, lambda meta: (meta["BLOCK"],), args, {},
                                      (*args, block, i % 3 == 0))
                assert config.kwargs["BLOCK"] == block
    assert triton_.expected[1] > triton_.through  # most launches were the cache's own


@triton.jit
def _positional_constexpr_kernel(t, K: tl.constexpr, n, BLOCK: tl.constexpr):
    pass


_autotuned_positional = triton.autotune(configs=[triton.Config({"BLOCK": 16}), triton.Config({"BLOCK": 32})],
                                        key=["n"])(_positional_constexpr_kernel)


@pytest.mark.parametrize("autotuned", [False, True])
def test_a_constexpr_passed_positionally_is_keyed_on_its_value(triton_, autotuned):
    """K = 2, 3, 4, 5 are one class of int to Triton's runtime specialization but four compiled variants when K is a
    constexpr (the bridge's reduce kernel passes its top-k that way, and takes its first config untuned when
    autotuning is off): a variant kept for one K and launched for another would read the wrong slots."""
    for _ in range(3):
        for k in (2, 3, 4, 5, 17, 33):
            for n in (3, 48):
                if autotuned:
                    block = (16, 32)[hash((n,)) % 2]
                    triton_.call(_autotuned_positional, (1,), (_BASE, k, n), {}, (_BASE, k, n, block))
                else:
                    triton_.call(_positional_constexpr_kernel, (1,), (_BASE, k, n), dict(BLOCK=16),
                                 (_BASE, k, n, 16))
    assert triton_.expected[1] > triton_.through  # most launches were the cache's own


@triton.jit
def _add_constexpr_kernel(x_ptr, out_ptr, n, C: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=m) + C, mask=m)


def test_launches_with_a_positional_constexpr_add_its_own_value(dev):
    """On the device: each call adds its own constexpr C, whichever variant was launched before it."""
    x = torch.arange(40, dtype=torch.float32, device=dev)
    for _ in range(2):
        for c in (2, 3, 4, 5):
            out = torch.zeros_like(x)
            launch_cache.launch(_add_constexpr_kernel, (1,), x, out, 40, c, BLOCK=64)
            assert torch.equal(out, x + c), c


@triton.jit
def _row_kernel(t, i, n, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    pass


_autotuned_rows = triton.autotune(configs=[triton.Config({"BLOCK_M": 4, "BLOCK_H": 64}),
                                           triton.Config({"BLOCK_M": 16, "BLOCK_H": 32})], key=["i"])(_row_kernel)


def test_block_grid_is_taken_from_the_kept_config(triton_):
    """A BlockGrid (the bridge's and quantize kernels' grids) launches as many programs as its rows and columns take
    in the tiles of the config the autotuner picked for the call's key, on the first call (through Triton) and on
    kept launches alike."""
    assert launch_cache.BlockGrid(33, 65)({"BLOCK_M": 16, "BLOCK_H": 32}) == (3, 3)
    assert launch_cache.BlockGrid(32, 64, "BLOCK_K")({"BLOCK_M": 16, "BLOCK_K": 64}) == (2, 1)
    for _ in range(2):
        for i in (3, 5, 48, 64):
            pick = hash((i,)) % 2
            bm, bh = ((4, 64), (16, 32))[pick]
            for rows in (1, 16, 17, 100):
                config = triton_.call(_autotuned_rows, launch_cache.BlockGrid(rows, 100), (_BASE, i, rows), {},
                                      (_BASE, i, rows, bm, bh), -(-rows // bm))
                assert config.kwargs["BLOCK_M"] == bm
    assert triton_.expected[1] > triton_.through  # most launches were the cache's own


@triton.jit
def _default_kernel(t, n, BLOCK: tl.constexpr = 16):
    pass


def test_unknown_types_and_defaults_go_through_triton(triton_):
    for _ in range(3):
        triton_.call(_many_kernel, (1,), (_BASE, 1, 0.5, True, object()), dict(BLOCK=16, FLAG=True), None)
        triton_.call(_default_kernel, (1,), (_BASE, 1), {}, None)
    assert triton_.through == 6 and triton_.expected[1] == 0


def test_grouped_gemm_launches_with_their_own_keyword_arguments(triton_, monkeypatch):
    """The grouped GEMM launches the bare kernel with keyword arguments it keeps per plan (``launch_kept``): across
    calls that alternate between layouts, epilogues and chain roles, each kept launch runs with the call's own
    arguments and constexprs (as Triton would bind them) and a kernel specialized on them."""
    from moe_ep import options
    from moe_ep.kernels import expert_mlp, grouped_gemm

    real = launch_cache.launch_kept

    def checked(kernel, grid, args, kwargs, items):
        names = launch_cache._kernel(kernel).names
        triton_.expected[0] = (*args, *(kwargs[n] for n in names[len(args):]))
        return real(kernel, grid, args, kwargs, items)

    monkeypatch.setattr(launch_cache, "launch_kept", checked)
    G, M, K, N = 3, 8, 32, 32
    bf16 = dict(dtype=torch.bfloat16, device=kernel_device())  # where the launcher wants them (no kernel runs)
    x3, x2 = torch.zeros(G, M, K, **bf16), torch.zeros(G * M, K, **bf16)
    w, w13, w2 = (torch.zeros(G, n, k, **bf16) for n, k in ((N, K), (2 * N, K), (K, N)))
    cnt, off = (torch.tensor(v, dtype=torch.int32, device=kernel_device()) for v in ([1, 0, 8], [0, 5, 5, 24]))
    calls = [lambda: grouped_gemm(x3, w, counts=cnt), lambda: grouped_gemm(x2, w, offsets=off),
             lambda: grouped_gemm(x3, w13, counts=cnt, swiglu=True),
             lambda: grouped_gemm(x2, w, offsets=off, row_scale=torch.ones(G * M, device=kernel_device())),
             lambda: expert_mlp(x3, w13, w2, counts=cnt), lambda: expert_mlp(x2, w13, w2, offsets=off, m_hint=300)]
    with options.override(autotune="off"):
        for _ in range(3):
            for call in calls:
                call()
    assert triton_.expected[1] >= 2 * 7  # kept launches, each checked
