"""The pack's own settings (not adapter flags): one prefix, DSV41_ADAPTERS_*, outside the
engine's SGLANG_* namespace. The names they had before are read as aliases here, and only
here, for one release: the new name wins where both are set.

It sits in the lowest layer so that every layer (the proof cache included) reads its settings
the same way.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Optional

PROOF_CACHE = "DSV41_ADAPTERS_PROOF_CACHE"        # the proof cache's folder, or an off word
SNAPSHOT_KERNEL = "DSV41_ADAPTERS_SNAPSHOT_KERNEL"  # the fence's kernel file
ALIASES = {PROOF_CACHE: "SGLANG_ADAPTERS_PROOF_CACHE", SNAPSHOT_KERNEL: "SGLANG_ADAPTERS_SNAPSHOT_KERNEL"}
NAMES = tuple(ALIASES)


def get(name: str, environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """The setting's value under its name, else under its old name, else None."""
    value = environ.get(name)
    return value if value is not None else environ.get(ALIASES[name])


def alias_notes(environ: Mapping[str, str] = os.environ) -> list[str]:
    """One note per old name that is set: which name replaces it, and whether it is still read."""
    notes = []
    for name, old in ALIASES.items():
        if old in environ:
            used = "ignored: the new name is set too" if name in environ else "read for now"
            notes.append(f"{old} is the old name of {name} ({used}); rename it, the old name goes in a later release")
    return notes
