"""The divergence report on sglang 0.5.16 - 0.5.18, which have no SpecTpSync: it compares
around the pack's own broadcast (spectpsync.broadcast), at the sites DSV41_SPEC_TP_SYNC
selects. Kept only for those releases (the adapter's ledger): delete this file with them.
"""

from __future__ import annotations

from ..engine.contract import POSITIONAL, Contract, Refused
from ..framework.plan import Patch, Plan
from ..spectpsync import broadcast as pack
from ..spectpsync.broadcast import SERVED_ELSEWHERE
from ..spectpsync.sites import REPORT_ONLY, Site, labels, spans
from . import divergence
# The package defines these before it imports this file.
from . import FLAG, NAME, NOT_COMPARED_BEFORE_19, abort_detail, one_rank, watchdog_dump, when


def compare_broadcast(every: int, abort: bool = False):
    """The wrapper around the pack's broadcast(family, site, *tensors) (0.5.16 - 0.5.18, and
    the pack's own sites on 0.5.19+)."""

    def around_broadcast(wrapped, instance, args, kwargs):
        family, site, *tensors = args
        group = pack.group_of(family)
        if group.world_size == 1:  # nothing is broadcast
            return wrapped(*args, **kwargs)
        divergence.raise_if_stopped()
        number, slug = divergence.label(site)
        if len(tensors) == 1 and group.rank_in_group:
            # One tensor, broadcast in place: rank 0's value is received into a tensor of its
            # own, and one launch compares it with this rank's and writes it there.
            received = wrapped(family, site, divergence.receiver(tensors[0]))
            divergence.observe(number, slug, tensors, received, every, abort, settle=True)
            return tuple(tensors)
        # A packed broadcast sends copies in one block and leaves the tensors as they were:
        # they are this rank's own values (and rank 0's own are rank 0's). Otherwise they are
        # overwritten in place: copy first.
        mine = tensors if pack.keeps_inputs(tensors) or not group.rank_in_group else divergence.copies(tensors)
        result = wrapped(*args, **kwargs)  # rank 0's values: the tensors in place, or the block's
        divergence.observe(number, slug, mine, result, every, abort)
        return result

    return around_broadcast


def plan(engine, setting, context) -> Plan:
    """0.5.16 - 0.5.18: the pack's own broadcast, at the sites rank0_broadcast serves."""
    selector = context.flags["rank0_broadcast"]
    selected = context.settings["rank0_broadcast"]
    one_rank(context, engine)
    if not selected:
        raise Refused(NAME, FLAG, f"no site is broadcast on this release while {selector} is off: there is nothing "
                                  f"to compare; switch {selector} on (e.g. all) or unset {FLAG}", engine.version)
    compared = frozenset(selected) - SERVED_ELSEWHERE.keys()
    if not compared:
        raise Refused(NAME, FLAG, f"{selector} selects no site the pack broadcasts on this release "
                                  f"({labels(selected)}): there is nothing to compare; unset {FLAG}", engine.version)
    contract = Contract(NAME, pack)
    contract.params("broadcast", {"family": POSITIONAL, "site": POSITIONAL})
    skipped = "; ".join(f"{s.label}: {why}" for s, why in sorted(NOT_COMPARED_BEFORE_19.items()))
    off = frozenset(Site) - REPORT_ONLY - compared - NOT_COMPARED_BEFORE_19.keys()
    detail = (f"compares {labels(compared)} at the pack's broadcast ({pack.__name__}.broadcast); not compared: "
              f"{skipped}" + (f"; off in {selector}: {labels(off)}" if off else "")
              + f"; report every {setting.every} calls and at exit, {when(context)}")
    dump, dump_detail = watchdog_dump.patch(engine)
    detail += abort_detail(setting, "this release has no rank-consensus checker (0.5.19+)") + f"; {dump_detail}"
    return Plan("applied", detail,
                [Patch(pack, "broadcast", compare_broadcast(setting.every, setting.abort)),
                 dump], short_reason=f"compares sites {spans(compared)} (the pack's broadcast)")
