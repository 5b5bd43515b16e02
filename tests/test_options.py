"""moe_ep.options: every MOE_EP_* variable by one rule, read once, changed for a block by override()."""

import pytest

from moe_ep import MoEEpConfigError, options
from moe_ep.triton_runtime import INTERPRETER

# (variable, value, field, parsed)
GOOD = [
    ("MOE_EP_AUTOTUNE", "off", "autotune", False), ("MOE_EP_AUTOTUNE", " off", "autotune", False),
    ("MOE_EP_AUTOTUNE", "OFF\n", "autotune", False), ("MOE_EP_AUTOTUNE", "on", "autotune", True),
    ("MOE_EP_AUTOTUNE", "0", "autotune", False), ("MOE_EP_AUTOTUNE", "", "autotune", not INTERPRETER),
    ("MOE_EP_AUTOTUNE_QUICK", "0", "autotune_quick", False), ("MOE_EP_AUTOTUNE_QUICK", "1", "autotune_quick", True),
    ("MOE_EP_AUTOTUNE_QUICK", "Yes", "autotune_quick", True),
    ("MOE_EP_AUTOTUNE_QUICK", "false", "autotune_quick", False),
    ("MOE_EP_AUTOTUNE_QUICK", "  ", "autotune_quick", False),
    ("MOE_EP_DECODED_MIN_M", "64", "decoded_min_m", 64), ("MOE_EP_DECODED_MIN_M", " 1 ", "decoded_min_m", 1),
    ("MOE_EP_DECODED_MIN_M", "Off", "decoded_min_m", None), ("MOE_EP_DECODED_MIN_M", "", "decoded_min_m", 512),
    ("MOE_EP_GEMM_CHAIN", "off", "gemm_chain", False), ("MOE_EP_GEMM_CHAIN", "no", "gemm_chain", False),
    ("MOE_EP_GEMM_CHAIN", "TRUE", "gemm_chain", True),
    ("MOE_EP_GLUON_FP8_MIN_M", "256", "gluon_fp8_min_m", 256),
    ("MOE_EP_GLUON_FP8_MIN_M", "OFF", "gluon_fp8_min_m", None),
    ("MOE_EP_GLUON_FP8_MIN_M", "", "gluon_fp8_min_m", options.DEFAULT_GLUON_FP8_MIN_M),
    ("MOE_EP_CONFIG_DIR", " /tmp/x ", "config_dir", "/tmp/x"), ("MOE_EP_CONFIG_DIR", "", "config_dir", None),
    ("MOE_EP_FORWARD_PLAN", "on", "forward_plan", True), ("MOE_EP_FORWARD_PLAN", "", "forward_plan", True),
    ("MOE_EP_FORWARD_PLAN", "off", "forward_plan", False),
]
BAD = [("MOE_EP_AUTOTUNE", "of"), ("MOE_EP_AUTOTUNE", "2"), ("MOE_EP_AUTOTUNE_QUICK", "quick"),
       ("MOE_EP_GEMM_CHAIN", "disable"), ("MOE_EP_DECODED_MIN_M", "0"), ("MOE_EP_DECODED_MIN_M", "-8"),
       ("MOE_EP_DECODED_MIN_M", "\u00b2"), ("MOE_EP_DECODED_MIN_M", "1e3"), ("MOE_EP_DECODED_MIN_M", "on"),
       ("MOE_EP_GLUON_FP8_MIN_M", "0"), ("MOE_EP_GLUON_FP8_MIN_M", "yes"), ("MOE_EP_GLUON_FP8_MIN_M", "128.0"),
       ("MOE_EP_FORWARD_PLAN", "replay")]


@pytest.mark.parametrize("var, value, field, want", GOOD)
def test_one_rule_for_every_variable(var, value, field, want):
    assert getattr(options.parse({var: value}), field) == want


@pytest.mark.parametrize("var, value", BAD)
def test_values_that_mean_nothing_are_named_errors(var, value):
    with pytest.raises(MoEEpConfigError) as e:
        options.parse({var: value})
    assert var in str(e.value) and repr(value) in str(e.value) and "allowed" in str(e.value)


@pytest.fixture
def _reload_after():
    """The options as the real environment says once the test (and its monkeypatch) is done."""
    yield
    options.reload()


def test_read_once_reload_and_override(_reload_after, monkeypatch):
    monkeypatch.setenv("MOE_EP_AUTOTUNE", "off")
    assert options.reload().autotune is False
    monkeypatch.setenv("MOE_EP_AUTOTUNE", "on")
    assert options.current().autotune is False  # read once: a later change needs reload()
    assert "autotune" in options.explicit()
    with options.override(autotune="on", decoded_min_m=64) as o:
        assert options.current() is o and (o.autotune, o.decoded_min_m) == (True, 64)
        with options.override(decoded_min_m="off"):
            assert options.current().decoded_min_m is None
        assert options.current().decoded_min_m == 64
    assert options.current().autotune is False  # restored
    with pytest.raises(RuntimeError), options.override(autotune_quick=True):
        raise RuntimeError  # restored on an exception too
    assert options.current().autotune_quick is False
    monkeypatch.delenv("MOE_EP_AUTOTUNE")
    assert options.reload().autotune is (not INTERPRETER) and "autotune" not in options.explicit()


@pytest.mark.parametrize("kw", [dict(autotun="off"), dict(autotune="maybe"), dict(decoded_min_m=0),
                                dict(decoded_min_m=True), dict(config_dir=3)])
def test_override_rejects_what_the_environment_would(kw):
    with pytest.raises(MoEEpConfigError, match="allowed"):
        with options.override(**kw):
            pass


def test_no_module_reads_moe_ep_variables_but_options():
    import pathlib
    import re
    root = pathlib.Path(options.__file__).parent
    readers = [p for p in root.rglob("*.py") if p.name != "options.py"
               and re.search(r"environ[^\n]*MOE_EP_|getenv\([^\n]*MOE_EP_", p.read_text())]
    assert readers == [], readers


@pytest.mark.parametrize("env, want", [({}, not INTERPRETER), ({"MOE_EP_AUTOTUNE": " "}, not INTERPRETER),
                                       ({"MOE_EP_AUTOTUNE": "on"}, True), ({"MOE_EP_AUTOTUNE": "off"}, False)])
def test_autotune_is_off_by_default_under_the_interpreter_only(env, want, monkeypatch):
    """The interpreter's timings are Python time: no search there unless MOE_EP_AUTOTUNE=on asks for one."""
    assert options.parse(env).autotune is want
    monkeypatch.setattr("moe_ep.triton_runtime.INTERPRETER", not INTERPRETER)  # the other machine's default
    assert options.parse(env).autotune is (want if env.get("MOE_EP_AUTOTUNE", "").strip() else INTERPRETER)
