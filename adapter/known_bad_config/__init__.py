"""Known-bad configurations refused (DSV41_KNOWN_BAD_CONFIG).

Some configurations corrupt output on some engine trees without an error: the tokens are
simply wrong. With the flag on, such a configuration does not start: the launcher refuses
it where the command's server arguments say enough, and every TP rank judges the values its
engine resolved (at the start of Scheduler.__init__, as every adapter), so a value the
command leaves to the engine is judged where it is known. The refusal names the hazard, the
upstream thread and the setting that is safe. Nothing is patched; each hazard is judged by
the engine's code and the deployment's server arguments, never by the release label.

Outcomes: superseded where the engine carries upstream's fix; applied where the deployment
was checked and is safe (nothing patched); refused where it is not; decided at launch where
the value the hazard depends on is known only to the ranks (doctor, the launcher).

The hazard it knows: dspark_write_pad.py (DSpark's verify window beyond what the DeepSeek-V4
compress write plan keeps resident, sgl-project/sglang#34959).

Off unless set, as every flag of the pack: the framework takes an unset flag for an adapter
that is off (a flag-less launch never needs the ranks to load the pack, and a rank whose
Scheduler moved stops only where a flag is set), so an adapter on by default would need
those to change first.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ..framework.flags import parse_switch
from ..framework.ledger import Ledger, UpstreamFix
from ..framework.surface import Surface

NAME = "known_bad_config"
FLAG = "DSV41_KNOWN_BAD_CONFIG"
SUMMARY = "refuse configurations that silently corrupt output"  # one line of --help, whose length is bounded
CHECK_VALUE = "1"  # the setting doctor's engine check and the compatibility matrix use


def parse(environ: Mapping[str, str] = os.environ) -> bool:
    return parse_switch(FLAG, environ)


from . import dspark_write_pad  # noqa: E402  (it reads the names above)


def check(engine, enabled: bool, context):
    """The deployment against every known hazard of `engine`; patches nothing."""
    return dspark_write_pad.plan(engine, context)


LEDGER = Ledger(
    why="DSpark with a verify window above 4 (block size above 3) on a tree whose DeepSeek-V4 compress write plan "
        "caps its pad at 4 under-writes the compress-state ring: later compressions read stale KV and the output "
        "is corrupted without an error",
    upstream_issue="sgl-project/sglang#34959",
    fixes=(UpstreamFix("sgl-project/sglang#34189 (get_compress_state_write_pad: the pad derived from the ring, "
                       "the verify window bounded by it)", "0.5.18"),),
    retire_when="no supported release caps the compress write pad (every one carries #34189)",
)
SURFACE = Surface(
    name=NAME, flag=FLAG, summary=SUMMARY, parse=parse, check=check, check_value=CHECK_VALUE, ledger=LEDGER,
    server_args=dspark_write_pad.SERVER_ARGS,
)
