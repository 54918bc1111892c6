"""Runtime adapters for SGLang speculative decoding under tensor parallelism.

One module per concern, each with the same surface (NAME, FLAG, SUMMARY, TARGETS,
parse, check, install, uninstall). This table imports none of them: choosing what
to patch costs nothing in processes that patch nothing.
"""

import importlib

ADAPTERS = ("folded_fence", "rank0_broadcast", "group_min_memory", "tp_divergence")


def load(name: str):
    return importlib.import_module(f"{__name__}.{name}")
