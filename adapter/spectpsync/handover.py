"""What the pack hands to the engine's switch SGLANG_SPEC_TP_SYNC (sglang 0.5.19+).

The user's DSV41_SPEC_TP_SYNC, in the engine's own grammar, so that every site the engine
would keep under that selection stays on, the sites of a release the pack has never seen
included: `all` stays `all`, `rng` stays `rng`, an exclusion stays the engine's exclusion.
Each token is handed over as written where the engine's own parser takes it, and replaced
by the engine slugs of what the pack means by it where it does not (`dspark-draft` on
0.5.19 - 0.5.21, which split it into per-path sites); the pack's own sites are left out
(no release has them). Where the engine reads a kept token differently for the sites the
pack knows (a preset that changed), the difference is put right at the end of the value,
one slug each, so that those sites are exactly the pack's selection and every other site
is the engine's. The value is then parsed by the engine's own parser once more: one the
engine cannot read is refused before any rank sees it.
"""

from __future__ import annotations

from ..engine.contract import Contract, Refused
from . import sites as grammar
from .engine_class import engine_sites, to_engine
from .observation import observed
from .selected_sites import engine_parse
from .sites import PACK, UPSTREAM, slug_of


def known_numbers(contract: Contract) -> frozenset[int]:
    """The engine's numbers of the sites the pack knows (by name, or as the per-path draft
    sites of 0.5.19 - 0.5.21)."""
    known = set()
    for site in UPSTREAM:
        try:
            known |= to_engine(contract, {site})
        except Refused:  # a site this release lacks is simply not among the known
            continue
    return frozenset(known)


def value(contract: Contract, raw: str, flag: str) -> str:
    """SGLANG_SPEC_TP_SYNC for DSV41_SPEC_TP_SYNC=`raw` on this engine (module docstring)."""
    names = {number: name for name, number in engine_sites(contract).items()}
    slug = lambda n: slug_of(names[n])  # noqa: E731
    planned = []
    for token in grammar.tokens(raw):
        sign, name = ("-", token[1:]) if token.startswith("-") else ("", token)
        meant = grammar.parse_value(name, flag)
        if meant and meant <= PACK:
            continue  # the pack's own site: no release has it
        planned.append((sign, name, to_engine(contract, meant - PACK)))
    read = observed(contract, [name for _, name, _ in planned])
    handed = []
    for sign, name, meant in planned:
        if read[name]["parse_error"]:
            handed += [sign + slug(n) for n in sorted(meant)]
        else:
            handed.append(sign + name)
    wanted = to_engine(contract, grammar.parse_value(raw, flag) - PACK)
    known = known_numbers(contract)
    first = ",".join(handed) or "none"
    got = engine_parse(contract, first)
    fixes = [slug(n) for n in sorted(wanted - got)] + ["-" + slug(n) for n in sorted((got & known) - wanted)]
    return ",".join(handed + fixes) if fixes else first


def unknown_sites(contract: Contract, numbers) -> list[str]:
    """The engine's sites among `numbers` that the pack does not know, each with what the
    engine's source says of it (the comment on or above its line), where it says anything."""
    known = known_numbers(contract)
    names = {number: name for name, number in engine_sites(contract).items()}
    notes = site_comments(contract)
    return [f"{n}:{slug_of(names[n])}" + (f" ({notes[names[n]]})" if notes.get(names[n]) else "")
            for n in sorted(set(numbers) - known) if n in names]


def site_comments(contract: Contract) -> dict[str, str]:
    """SpecTpSyncSite member name -> the comment the engine wrote on its line or just above."""
    lines = contract.source().split("\n")
    found, inside, above = {}, False, []
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("class SpecTpSyncSite"):
            inside = True
            continue
        if inside and line and not line[0].isspace():
            break
        if not inside:
            continue
        if stripped.startswith("#"):
            text = stripped.lstrip("#").strip()
            if not text.startswith("--"):  # a section heading ("-- DFlash --") says nothing of one site
                above.append(text)
            continue
        head, _, comment = stripped.partition("#")
        name = head.split("=")[0].strip()
        if "=" in head and name.isupper():
            found[name] = comment.strip() or " ".join(a for a in above if a)
        above = [] if stripped else above
    return found
