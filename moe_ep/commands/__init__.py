"""The ``moe-ep`` subcommands, one module each (``info``, ``bench``, ``tune``, ``fuzz``).

``moe_ep.cli`` only wires argparse; each module here has ``add_arguments(parser)`` and ``run(args) -> int``.
Shared pieces (model presets, timing, progress bars, torchrun setup) live in :mod:`.common`.
"""
