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
