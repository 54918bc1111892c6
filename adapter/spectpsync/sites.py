"""The decision sites and the site-selector grammar (DSV41_SPEC_TP_SYNC).

Pure: no engine, no environment. Numbering and grammar are upstream's (0.5.22+
`SpecTpSyncSite` / `parse_spec_tp_sync`): a comma list of presets (all/off/none/
init/rng), site slugs and numbers, each negatable with a leading "-"; "_" reads as
"-", spaces and case are ignored; the retired draft handles 2-6 and their slugs
select DSPARK_DRAFT (17). An unknown token is a FlagError.

The pack adds two things. A whole value that says "off" in the words every pack flag
uses (empty, 0, off, false, none) selects nothing, so switching the flag off never
changes what the engine does. And sites of its own (PACK), for decisions no release
broadcasts: they are selected only by their own token (slug or number, negatable like
the others) and never by a preset, so `all`, `rng` and `init` select exactly what
upstream's do. Their tokens cannot be taken for upstream's: upstream numbers its sites
from 1 upwards (17 in 0.5.23; retired numbers are remapped, never reused) and names them
DSPARK_*/DFLASH_*, while the pack numbers its own from 31 downwards (the divergence
report's top row: tp_divergence.divergence.ROWS is 32) and prefixes their slugs with
"pack-". A release that defines either is refused where the pack hands its selection to
the engine (rank0_broadcast), so a collision is a refusal naming SpecTpSyncSite.

One pack site is compared, never broadcast (REPORT_ONLY): 30:pack-decode-graph-key, the
decode graph key a target forward replays (tp_divergence.graph_key). The divergence report
compares it whenever the report is on; selecting it here is a FlagError that says so.
"""

from __future__ import annotations

import difflib
from enum import IntEnum

from ..framework.flags import OFF_WORDS, FlagError


class Site(IntEnum):
    """Upstream 0.5.22+ numbering (SpecTpSyncSite), then the pack's own sites."""

    DSPARK_MEM = 1
    DSPARK_PLAN = 7
    DSPARK_ACCEPT_GREEDY = 8
    DSPARK_ACCEPT_SAMPLE = 9
    DSPARK_ACCEPT_GRAPH = 10
    DSPARK_TARGET = 11
    DSPARK_DRAFT = 17
    DFLASH_MEM = 12
    DFLASH_SELECTOR = 13
    DFLASH_ACCEPT_SAMPLE = 14
    DFLASH_ACCEPT_GREEDY = 15
    DFLASH_TARGET = 16
    # The pack's own (PACK): DFlash's greedy draft proposal where it is rank-local
    # (upstream PR sgl-project/sglang#40246, in no release; adapter.rank0_broadcast.dflash_draft).
    PACK_DFLASH_DRAFT_GREEDY = 31
    # The pack's own report site (REPORT_ONLY): the decode graph key a target forward replays
    # (upstream PR sgl-project/sglang#31195 compares it in logs; adapter.tp_divergence.graph_key).
    PACK_DECODE_GRAPH_KEY = 30

    @property
    def slug(self) -> str:
        return slug_of(self.name)

    @property
    def label(self) -> str:
        return f"{int(self)}:{self.slug}"


def slug_of(name: str) -> str:
    """A site's name as its slug, upstream's way: DSPARK_ACCEPT_GRAPH -> dspark-accept-graph."""
    return name.lower().replace("_", "-")


PACK = frozenset({Site.PACK_DFLASH_DRAFT_GREEDY})
REPORT_ONLY = frozenset({Site.PACK_DECODE_GRAPH_KEY})  # numbered like PACK, compared by the report, never selected
PACK_PREFIX = "pack-"
UPSTREAM = frozenset(Site) - PACK - REPORT_ONLY
ALL = UPSTREAM  # upstream's preset: the pack's own sites are selected by their own token
MEMORY = frozenset({Site.DSPARK_MEM, Site.DFLASH_MEM})
_RNG = frozenset({Site.DSPARK_ACCEPT_SAMPLE, Site.DSPARK_TARGET, Site.DFLASH_SELECTOR,
                  Site.DFLASH_ACCEPT_SAMPLE, Site.DFLASH_TARGET})
PRESETS = {"all": ALL, "off": frozenset(), "none": frozenset(), "init": MEMORY, "rng": MEMORY | _RNG}
_BY_SLUG = {s.slug: s for s in Site}
_BY_NUMBER = {str(int(s)): s for s in Site}
RETIRED = {t: Site.DSPARK_DRAFT for t in (
    "dspark-draft-greedy", "dspark-draft-sample", "dspark-draft-multinomial",
    "dspark-graph-sample", "dspark-graph-greedy", "2", "3", "4", "5", "6")}


def labels(sites) -> str:
    return ", ".join(s.label for s in sorted(sites))


def spans(numbers) -> str:
    """Site numbers in short: `1,7-17` (doctor's one line); "none" for none."""
    ordered, runs = sorted(int(n) for n in numbers), []
    for number in ordered:
        if runs and number == runs[-1][1] + 1:
            runs[-1][1] = number
        else:
            runs.append([number, number])
    return ",".join(f"{lo}" if lo == hi else f"{lo},{hi}" if hi == lo + 1 else f"{lo}-{hi}" for lo, hi in runs) or "none"


def accepted_forms() -> str:
    return (f"presets {', '.join(sorted(PRESETS))}; site slugs or numbers {labels(ALL)}; "
            f"the pack's own sites {labels(PACK)} (no preset selects them); "
            f"retired draft handles 2-6; each optionally negated with a leading '-', comma-separated")


def tokens(raw: str) -> list[str]:
    """A selection's tokens as the grammar reads them: spaces dropped, "_" read as "-", any case."""
    return [token for token in raw.replace(" ", "").replace("_", "-").lower().split(",") if token]


def parse_value(raw: str, flag: str = "DSV41_SPEC_TP_SYNC") -> frozenset:
    """Upstream's parse_spec_tp_sync, token for token (FlagError instead of ValueError)."""
    sites: frozenset = frozenset()
    for token in tokens(raw):
        if token.startswith("-"):
            sites = sites - _resolve(token[1:], raw, flag)
        else:
            sites = sites | _resolve(token, raw, flag)
    return sites


def _resolve(name: str, raw: str, flag: str) -> frozenset:
    if name in PRESETS:
        return PRESETS[name]
    if name in RETIRED:
        return frozenset({RETIRED[name]})
    site = _BY_SLUG.get(name) or _BY_NUMBER.get(name)
    if site in REPORT_ONLY:
        raise FlagError(f"{flag}={raw!r}: {site.label} is a report site, not a broadcast: the divergence report "
                        "(DSV41_TP_DIVERGENCE) compares it whenever it is on; remove it from "
                        f"{flag}; accepted: {accepted_forms()}")
    if site is None:
        close = difflib.get_close_matches(name, [*PRESETS, *_BY_SLUG, *RETIRED], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise FlagError(f"{flag}={raw!r}: unknown token {name!r}{hint}; accepted: {accepted_forms()}; "
                        f"or leave {flag} unset for off")
    return frozenset({site})


def parse_selector(raw, flag: str = "DSV41_SPEC_TP_SYNC") -> frozenset:
    """The pack's selector flag: unset or an off word selects nothing, else the grammar."""
    if raw is None or raw.strip().lower() in OFF_WORDS + ("",):
        return frozenset()
    return parse_value(raw, flag)


def parse_numbers(raw: str) -> frozenset[int]:
    """A selection written as bare site numbers, or "none" (what the pack hands to the engine)."""
    return frozenset() if raw == "none" else frozenset(int(token) for token in raw.split(","))
