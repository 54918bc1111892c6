"""The sites the engine's SpecTpSync selects, as the engine's processes will: which value of
its switch SGLANG_SPEC_TP_SYNC the ranks read (the pack's hand-over, else the user's, else
unset: the class's own default, or what the engine sets itself where unset), and what the
engine's own parser and class make of it.

Only the release can say what a value selects: its grammar and presets changed across
releases and will again, so every answer here is the engine's own (observation).
"""

from __future__ import annotations

from typing import Optional

from ..engine.contract import Contract
from .callers_proof import engine_writes
from .engine_class import ENGINE_FLAG
from .observation import checked, observed, unparsed


def engine_parse(contract: Contract, raw: str) -> frozenset[int]:
    """The sites `raw` selects by the engine's own parse_spec_tp_sync; Refused naming the
    engine's error where it cannot parse it."""
    seen = observed(contract, [raw])[raw]
    if seen["parse_error"]:
        raise unparsed(contract, raw, seen["parse_error"])
    return frozenset(seen["parse"])


def selection(contract: Contract, value: Optional[str]) -> frozenset[int]:
    """The sites the engine's class selects over a group of more than one rank when built
    with the switch at `value` (None: unset)."""
    return frozenset(checked(contract, value)["selected"]["2"])


def run_value(context) -> Optional[str]:
    """SGLANG_SPEC_TP_SYNC as the engine's processes will read it (None: unset)."""
    return context.handed.get(ENGINE_FLAG, context.environ.get(ENGINE_FLAG))


def selected(contract: Contract, context, engine=None) -> tuple[str, frozenset[int]]:
    """(what selects, the engine's site numbers) the engine's processes will run with:
    the pack's hand-over, else the user's value, else the class's own default (and, with
    `engine`, where the engine sets the switch itself when it is unset), each as the
    engine's class selects when built under it."""
    handed = context.handed.get(ENGINE_FLAG)
    if handed is not None:
        source = f"DSV41_SPEC_TP_SYNC={context.environ.get('DSV41_SPEC_TP_SYNC')!r}"
        return f"{ENGINE_FLAG}={handed!r} (handed over from {source})", selection(contract, handed)
    raw = context.environ.get(ENGINE_FLAG)
    if raw is not None:
        return f"{ENGINE_FLAG}={raw!r}", selection(contract, raw)
    own = "".join(f"; the engine sets {value} itself where it is unset ({where})"
                  for where, value in (engine_writes(engine) if engine is not None else ()))
    return f"{ENGINE_FLAG} unset (the class's own default{own})", selection(contract, None)
