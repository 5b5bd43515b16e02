"""Which transports can run here, and why not: ``available_transports()`` and its table for ``moe-ep info``.

Nothing here initializes NCCL or a GPU context beyond ``torch.cuda.is_available()``; the NCCL-EP probe
imports ``nccl.core`` (nccl4py) only once the package is known to be installed and a GPU is present, to
read the version of the libnccl it loads.

Facts behind the checks (from the wheels):
- nccl-extensions 0.1.0 pins ``nvidia-nccl-cu13==2.30.7`` (its METADATA, extra ``cu13``); its HT kernels are
  JIT-compiled at run time against the NCCL headers under ``$NCCL_HOME/include`` (``nccl/ep/__init__.py``
  sets ``NCCL_HOME`` to the ``nvidia.nccl`` package by default) with ``$NCCL_EP_JIT_NVCC``/``$NVCC``/
  ``$CUDA_HOME/bin/nvcc``. With another NCCL's headers (2.32) ``ncclDevComm`` is laid out differently and
  the kernels fault, so both the loaded library and the headers must be the pinned version.
- nixl-cu13 1.5.1 ships ``nixl_ep_cu13/nixl_ep_cpp_torch{212,213,214}*.so`` and imports the one named after
  the running torch's major.minor (``nixl_ep_cu13/__init__.py`` line 50).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..errors import MoEEpBackendUnavailable, MoEEpConfigError

NCCL_EP_PINNED_NCCL = "2.30.7"   # fallback if the installed nccl-extensions metadata cannot be read
NIXL_TORCH_BUILDS = ("212", "213", "214")
PREFERENCE = ("nccl_ep", "nixl_ep", "torch")   # what transport="auto" picks, best first
INSTALL = {"nccl_ep": "pip install 'moe-ep[nccl]'", "nixl_ep": "pip install 'moe-ep[nixl]'",
           "torch": "(always installed)"}


@dataclass(frozen=True)
class TransportInfo:
    """One transport's availability: ``name``, ``available``, ``reason`` (why not, or what runs), ``install``."""

    name: str
    available: bool
    reason: str
    install: str


# ---- probes (small functions so tests can replace them) -------------------------------------------------

def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _cuda_available() -> bool:
    import torch
    return torch.cuda.is_available()


def _torch_mm() -> str:
    import torch
    return "".join(torch.__version__.split("+")[0].split(".")[:2])


def required_nccl_version() -> str:
    """The NCCL version nccl-extensions was built for: its ``nvidia-nccl-cu13==X`` pin, else 2.30.7."""
    try:
        from importlib.metadata import requires
        for req in requires("nccl-extensions") or ():
            m = re.match(r"nvidia-nccl-cu1[23]\s*==\s*([0-9.]+)", req)
            if m:
                return m.group(1)
    except Exception:   # not installed / unreadable metadata: the known pin
        pass
    return NCCL_EP_PINNED_NCCL


def header_nccl_version(include_dir: str | os.PathLike) -> str | None:
    """``MAJOR.MINOR.PATCH`` from ``include_dir/nccl.h`` (``#define NCCL_MAJOR`` ...), or None if absent."""
    path = Path(include_dir) / "nccl.h"
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    parts = [re.search(rf"#define\s+NCCL_{k}\s+(\d+)", text) for k in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(p.group(1) for p in parts) if all(parts) else None


def _nccl_include_dir() -> str | None:
    """Where NCCL-EP's JIT finds the NCCL headers: ``$NCCL_HOME/include`` or the nvidia.nccl package's."""
    home = os.environ.get("NCCL_HOME")
    if not home:
        spec = importlib.util.find_spec("nvidia.nccl") if _installed("nvidia") else None
        if spec is None or not spec.submodule_search_locations:
            return None
        home = list(spec.submodule_search_locations)[0]
    return str(Path(home) / "include")


def _loaded_nccl() -> tuple[str | None, str]:
    """(version, path) of the libnccl that nccl4py (and so nccl.ep) loads."""
    import nccl.core
    lib = nccl.core.get_version().libnccl
    if lib is None:
        return None, "?"
    return str(lib.version), str(lib.path)


def _nvcc() -> str | None:
    for cand in (os.environ.get("NCCL_EP_JIT_NVCC"), os.environ.get("NVCC"),
                 os.environ.get("CUDA_HOME") and str(Path(os.environ["CUDA_HOME"]) / "bin" / "nvcc")):
        if cand and Path(cand).is_file():
            return cand
    return shutil.which("nvcc")


# ---- the checks -----------------------------------------------------------------------------------------

def nccl_ep_problem() -> str | None:
    """Why NCCL-EP cannot run here, or None if it can."""
    if not (_installed("nccl.ep") and _installed("nccl.core")):
        return "not installed (packages nccl-extensions and nccl4py)"
    if not _cuda_available():
        return "no CUDA GPU visible"
    want = required_nccl_version()
    try:
        loaded, path = _loaded_nccl()
    except Exception as e:  # nccl4py cannot load libnccl at all
        return f"nccl4py cannot load libnccl ({type(e).__name__}: {e})"
    if loaded != want:
        return (f"loaded NCCL is {loaded} ({path}); nccl-extensions was built for NCCL {want}: "
                f"pip install nvidia-nccl-cu13=={want} and make it the libnccl.so.2 that loads "
                f"(LD_PRELOAD or LD_LIBRARY_PATH)")
    inc = _nccl_include_dir()
    hdr = header_nccl_version(inc) if inc else None
    if hdr != want:
        return (f"NCCL headers at {inc} are {hdr or 'missing'}; NCCL-EP JIT-compiles its HT kernels against "
                f"them and needs NCCL {want}'s (another version's ncclDevComm layout crashes the kernels); "
                f"set NCCL_HOME to NCCL {want}")
    if _nvcc() is None:
        return "nvcc not found (NCCL-EP JIT-compiles its kernels): set NCCL_EP_JIT_NVCC or CUDA_HOME"
    return None


def nixl_ep_problem() -> str | None:
    """Why NIXL-EP cannot run here, or None if it can."""
    spec = importlib.util.find_spec("nixl_ep_cu13") if _installed("nixl_ep_cu13") else None
    if spec is None:
        return "not installed (package nixl-cu13)"
    mm = _torch_mm()
    pkg = Path(spec.origin).parent if spec.origin else None
    try:  # a package whose __init__ pins the build it loads (e.g. a test rig's copy) loads that one
        pinned = re.search(r'^\s*_torch_mm\s*=\s*"(\d+)"', Path(spec.origin).read_text(), re.M)
        mm = pinned.group(1) if pinned else mm
    except (OSError, TypeError):
        pass
    builds = sorted({p.name.split("torch")[1][:3] for p in pkg.glob("nixl_ep_cpp_torch*")}) if pkg else []
    if mm not in (builds or NIXL_TORCH_BUILDS):
        have = ", ".join(f"{b[0]}.{b[1:]}" for b in (builds or NIXL_TORCH_BUILDS))
        return f"torch {mm[0]}.{mm[1:]} is not one nixl-cu13's EP extension was built for (torch {have})"
    if not _cuda_available():
        return "no CUDA GPU visible"
    return None


def available_transports() -> list[TransportInfo]:
    """Every transport with whether it can run here, why not, and how to install it (best first)."""
    out = []
    for name, probe in (("nccl_ep", nccl_ep_problem), ("nixl_ep", nixl_ep_problem), ("torch", lambda: None)):
        why = probe()
        reason = why or {"torch": "torch.distributed all_to_all (gloo on CPU, nccl on GPU)"}.get(name, "ready")
        out.append(TransportInfo(name, why is None, reason, INSTALL[name]))
    return out


def require_transport(name: str) -> str:
    """Resolve ``name`` (``"auto"`` = best available) to a transport that can run, else raise.

    An unknown name raises MoEEpConfigError (this is the one check of transport names); a known transport that
    cannot run here raises MoEEpBackendUnavailable naming the reason and the install command.
    """
    if name != "auto" and name not in PREFERENCE:
        raise MoEEpConfigError(f"transport = {name!r}; allowed: 'auto', " + ", ".join(repr(n) for n in PREFERENCE))
    infos = {t.name: t for t in available_transports()}
    if name == "auto":
        return next(n for n in PREFERENCE if infos[n].available)
    t = infos[name]
    if not t.available:
        raise MoEEpBackendUnavailable(f"transport {name!r} is unavailable: {t.reason}. Install: {t.install}")
    return name


def format_transports_table(infos: list[TransportInfo] | None = None) -> str:
    """The table ``moe-ep info`` prints: one line per transport."""
    infos = available_transports() if infos is None else infos
    rows = [("transport", "available", "details / install")]
    for t in infos:
        rows.append((t.name, "yes" if t.available else "no",
                     f"{t.reason} -> {t.install}" if t.reason.startswith("not installed") else t.reason))
    w0, w1 = (max(len(r[i]) for r in rows) for i in range(2))
    return "\n".join(f"{a:<{w0}}  {b:<{w1}}  {c}" for a, b, c in rows)
