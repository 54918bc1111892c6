"""The pack's compiled kernel library as the shared decode-path code reaches it: the
broadcast's one-launch block (broadcast.py) and the divergence report's fused comparison
(tp_divergence).

folded_fence.accept_snapshot builds the library (at image build) and loads it by path.
Adapters never import one another, so it offers its loader here when it is imported, which
every rank does when it decides its adapters (the registry loads them all). Where nothing was
offered the callers' torch paths serve and say why.
"""

from __future__ import annotations

_loader = None


def offer(loader) -> None:
    """`loader()` -> (the loaded library, or None where it does not serve this GPU; its file, or why not)."""
    global _loader
    _loader = loader


def library() -> tuple:
    """(the loaded library or None, its file or why not). The first call loads the file (a dlopen)."""
    if _loader is None:
        return None, "its loader (folded_fence.accept_snapshot) is not imported in this process"
    return _loader()


def serving(enabled: bool, served: str, fallback: str) -> tuple[str, str, object]:
    """(mode, its file or why not, the library or None) for a caller that uses the library
    where it serves and is `enabled` (tests and benchmarks switch it off), else its torch path."""
    if not enabled:
        return fallback, "switched off by use_kernel(False)", None
    kernel, detail = library()
    return (served if kernel is not None else fallback), detail, kernel
