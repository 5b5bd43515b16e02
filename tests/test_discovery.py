"""Transport discovery: available_transports(), require_transport(), the `moe-ep info` table (probes faked)."""

import pytest

import moe_ep
from moe_ep.errors import MoEEpBackendUnavailable, MoEEpConfigError
from moe_ep.transports import discovery as d


@pytest.fixture
def env(monkeypatch, tmp_path):
    """A machine with everything right; tests break one thing each."""
    inc = tmp_path / "include"
    inc.mkdir()
    (inc / "nccl.h").write_text("#define NCCL_MAJOR 2\n#define NCCL_MINOR 30\n#define NCCL_PATCH 7\n")
    pkg = tmp_path / "nixl_ep_cu13"
    pkg.mkdir()
    for b in ("212", "213", "214"):
        (pkg / f"nixl_ep_cpp_torch{b}.cpython-312-x86_64-linux-gnu.so").write_text("")
    (pkg / "__init__.py").write_text("")
    monkeypatch.setattr(d, "_installed", lambda m: True)
    monkeypatch.setattr(d, "_cuda_available", lambda: True)
    monkeypatch.setattr(d, "_torch_mm", lambda: "213")
    monkeypatch.setattr(d, "_loaded_nccl", lambda: ("2.30.7", "/x/libnccl.so.2"))
    monkeypatch.setattr(d, "_nvcc", lambda: "/usr/local/cuda/bin/nvcc")
    monkeypatch.setattr(d, "required_nccl_version", lambda: "2.30.7")
    monkeypatch.setenv("NCCL_HOME", str(tmp_path))
    import importlib.util
    real = importlib.util.find_spec
    spec = importlib.util.spec_from_file_location("nixl_ep_cu13", pkg / "__init__.py")
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: spec if n == "nixl_ep_cu13" else real(n, *a))
    return tmp_path


def by_name():
    return {t.name: t for t in moe_ep.available_transports()}


def test_all_available(env):
    t = by_name()
    assert t["nccl_ep"].available and t["nixl_ep"].available and t["torch"].available
    assert d.require_transport("auto") == "nccl_ep"


def test_not_installed(env, monkeypatch):
    monkeypatch.setattr(d, "_installed", lambda m: False)
    t = by_name()
    assert not t["nccl_ep"].available and "not installed" in t["nccl_ep"].reason
    assert not t["nixl_ep"].available and "not installed" in t["nixl_ep"].reason
    assert d.require_transport("auto") == "torch"
    with pytest.raises(MoEEpBackendUnavailable, match=r"pip install 'moe-ep\[nccl\]'"):
        d.require_transport("nccl_ep")
    with pytest.raises(MoEEpBackendUnavailable, match=r"pip install 'moe-ep\[nixl\]'"):
        d.require_transport("nixl_ep")


def test_no_gpu(env, monkeypatch):
    monkeypatch.setattr(d, "_cuda_available", lambda: False)
    t = by_name()
    assert "no CUDA GPU" in t["nccl_ep"].reason and "no CUDA GPU" in t["nixl_ep"].reason


def test_wrong_loaded_nccl(env, monkeypatch):
    monkeypatch.setattr(d, "_loaded_nccl", lambda: ("2.28.9", "/torch/lib/libnccl.so.2"))
    r = by_name()["nccl_ep"]
    assert not r.available and "2.28.9" in r.reason and "2.30.7" in r.reason and "LD_PRELOAD" in r.reason


def test_wrong_headers(env):
    (env / "include" / "nccl.h").write_text("#define NCCL_MAJOR 2\n#define NCCL_MINOR 32\n#define NCCL_PATCH 0\n")
    r = by_name()["nccl_ep"]
    assert not r.available and "2.32.0" in r.reason and "ncclDevComm" in r.reason


def test_no_nvcc(env, monkeypatch):
    monkeypatch.setattr(d, "_nvcc", lambda: None)
    assert "nvcc" in by_name()["nccl_ep"].reason


def test_nixl_torch_version(env, monkeypatch):
    monkeypatch.setattr(d, "_torch_mm", lambda: "211")
    r = by_name()["nixl_ep"]
    assert not r.available and "torch 2.11" in r.reason and "2.12, 2.13, 2.14" in r.reason


def test_unknown_name(env):
    with pytest.raises(MoEEpConfigError, match="'auto'"):
        d.require_transport("mpi")


def test_table(env, monkeypatch):
    monkeypatch.setattr(d, "_cuda_available", lambda: False)
    s = d.format_transports_table()
    lines = s.splitlines()
    assert lines[0].split()[:2] == ["transport", "available"] and len(lines) == 4
    assert "no CUDA GPU" in s and "moe-ep[nccl]" not in s   # install hint only when not installed


def test_header_parse(tmp_path):
    assert d.header_nccl_version(tmp_path) is None
    (tmp_path / "nccl.h").write_text("#define NCCL_MAJOR 2\n#define NCCL_MINOR 30\n#define NCCL_PATCH 7\n")
    assert d.header_nccl_version(tmp_path) == "2.30.7"


def test_real_machine_smoke():
    """On this machine (whatever it has) discovery runs and torch is always available."""
    t = by_name()
    assert t["torch"].available and set(t) == {"nccl_ep", "nixl_ep", "torch"}
