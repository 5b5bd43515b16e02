"""moe-ep for HuggingFace transformers models: :func:`convert` replaces a model's sparse MoE blocks, in
place, by blocks whose routed experts run through moe-ep (``pip install 'moe-ep[hf]'``). ``import moe_ep``
does not import this package."""

from .blocks import SUPPORTED
from .convert import convert, find_blocks
from .module import MoEEpBlock

__all__ = ["SUPPORTED", "MoEEpBlock", "convert", "find_blocks"]
