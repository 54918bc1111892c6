"""The ledger: why each adapter exists, which upstream fix retires it, and the flags of
adapters already retired.

Each adapter folder declares its `Ledger` (vllm-ascend keeps one per patched symbol: why,
how, the related upstream PR, the future plan). tests/test_ledger.py checks every ledger
against the compatibility matrix: an adapter is superseded on exactly the releases and
layouts its released fixes reach, and the code it keeps for older releases serves releases
before its first fix.

A retired adapter's flag stays known here (RETIRED_FLAGS): an env file that still sets it
is told so in one line, never refused, so that removing an adapter breaks no deployment.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Optional

# The layouts a fix can reach, as framework.topology.REPRESENTATIVE names them.
EVERY_LAYOUT = ("tp", "dp-attention-tp1", "dp-attention-tp2")


@dataclass(frozen=True)
class UpstreamFix:
    """what: the upstream change (PR, or the engine symbol that carries it); first_release:
    the first sglang release that has it, None while no release does; layouts: the
    representative layouts where it does the adapter's job."""

    what: str
    first_release: Optional[str]
    layouts: tuple[str, ...] = EVERY_LAYOUT


@dataclass(frozen=True)
class Ledger:
    """why: the hazard; upstream_issue: where upstream tracks it; fixes: the upstream changes
    that do the adapter's job; retire_when: the condition for deleting the adapter; legacy:
    a file of the adapter's folder kept only for older releases -> those releases
    ("0.5.16-0.5.18"), to be deleted with them."""

    why: str
    upstream_issue: str
    fixes: tuple[UpstreamFix, ...]
    retire_when: str
    legacy: Mapping[str, str] = field(default_factory=dict)
    legacy_until: Optional[str] = None

    @property
    def legacy_ends(self) -> Optional[str]:
        """The first release the legacy files do not serve."""
        if self.legacy_until is not None:
            return self.legacy_until
        released = [fix.first_release for fix in self.fixes if fix.first_release is not None]
        return min(released, key=lambda v: tuple(int(p) for p in v.split(".")), default=None)


# A retired adapter's flag (and extra flags) -> what to tell an env file that still sets it.
RETIRED_FLAGS: dict[str, str] = {}
