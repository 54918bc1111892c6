"""Strict parsing of the pack's environment flags.

A value that is not understood is a start-up error, never "enabled by accident".
"""

from __future__ import annotations

from collections.abc import Mapping

ON_WORDS = ("1", "on", "true")
# Off for every flag of the pack; the site selector also takes an empty value as off.
OFF_WORDS = ("0", "off", "false", "none")


class FlagError(ValueError):
    """An adapter flag holds a value the pack does not understand."""


def parse_switch(name: str, environ: Mapping[str, str]) -> bool:
    """On/off flag: 1/on/true, 0/off/false/none in any case; unset means off.

    Anything else, including an empty value or surrounding spaces, is refused,
    because a typo must never silently pick a side.
    """
    raw = environ.get(name)
    if raw is None:
        return False
    if raw.lower() in ON_WORDS:
        return True
    if raw.lower() in OFF_WORDS:
        return False
    raise FlagError(
        f"{name}={raw!r} is not understood; accepted values are "
        f"{'/'.join(ON_WORDS)} to switch it on and {'/'.join(OFF_WORDS)} to switch it off "
        f"(any case, no spaces), or leave {name} unset for off"
    )


def edit_distance(a: str, b: str, limit: int) -> int:
    """Levenshtein distance (insertions, deletions, substitutions), row by row, or limit + 1
    as soon as it must exceed `limit`: every variable of every process is measured against
    every flag at start-up, and only near misses matter."""
    previous = list(range(len(b) + 1))
    for i, char_a in enumerate(a, 1):
        current = [i]
        for j, char_b in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (char_a != char_b)))
        if min(current) > limit:  # a row's minimum never decreases further down
            return limit + 1
        previous = current
    return min(previous[-1], limit + 1)


def resembles(name: str, flags) -> str | None:
    """The flag `name` is a near miss of (same letters in another case, or at most two
    edits away ignoring case), None when it resembles none. Exact names are no miss."""
    if name in flags:
        return None
    upper = name.upper()
    close = sorted((edit_distance(upper, flag, 2), flag) for flag in flags if abs(len(flag) - len(upper)) <= 2)
    return close[0][1] if close and close[0][0] <= 2 else None
