"""Whether moe-ep's Triton kernels run compiled (on a GPU) or through Triton's interpreter (without one), decided
before triton is first imported: ``@triton.jit`` reads ``TRITON_INTERPRET`` when a kernel is decorated.

``import moe_ep`` imports neither torch nor triton (``moe-ep --help`` must not wait seconds for them), so the
decision cannot be made there; instead it registers :class:`DecideBeforeTriton`, which makes it at the first import
of triton, whoever imports it: ``import moe_ep`` first still means every kernel, the caller's own included, is
built in the right mode. :mod:`moe_ep.triton_runtime`, which every module running a kernel imports, decides too,
for a process that imported triton before moe_ep (it warns then).
"""

from __future__ import annotations

import os
import sys
import warnings


def interpreter_on() -> bool:
    """True when ``TRITON_INTERPRET`` asks for Triton's interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def decide() -> bool:
    """Set ``TRITON_INTERPRET=1`` when there is no CUDA device and the variable is unset (the caller's setting
    wins); return whether kernels run through the interpreter. Imports torch (to ask for CUDA), never triton."""
    import torch

    if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
        if "triton" in sys.modules:
            warnings.warn(
                "moe_ep: no CUDA device and triton was imported before moe_ep; kernels need "
                "TRITON_INTERPRET=1 set before triton is imported to run on the CPU",
                stacklevel=3,
            )
        os.environ["TRITON_INTERPRET"] = "1"
    return interpreter_on()


class DecideBeforeTriton:
    """A ``sys.meta_path`` finder that finds nothing: at the first import of triton it takes itself off the path and
    runs :func:`decide`; the import then goes on through the usual finders."""

    def find_spec(self, name, path=None, target=None):
        if name == "triton":
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            decide()


def decide_before_triton() -> None:
    """Have :func:`decide` run before triton's first import (nothing to do when it is imported already, which
    :mod:`moe_ep.triton_runtime` warns about, or when ``TRITON_INTERPRET`` is set: then nothing is decided)."""
    if "triton" in sys.modules or "TRITON_INTERPRET" in os.environ:
        return
    if not any(isinstance(f, DecideBeforeTriton) for f in sys.meta_path):
        sys.meta_path.insert(0, DecideBeforeTriton())
