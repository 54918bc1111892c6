"""Strict parsing of the pack's environment flags.

A value that is not understood is a start-up error, never "enabled by accident".
"""

from __future__ import annotations

from collections.abc import Mapping

_ON = ("1", "on", "true")
_OFF = ("0", "off", "false")


class FlagError(ValueError):
    """An adapter flag holds a value the pack does not understand."""


def parse_switch(name: str, environ: Mapping[str, str]) -> bool:
    """On/off flag: 1/0, on/off, true/false in any case; unset means off.

    Anything else, including an empty value or surrounding spaces, is refused,
    because a typo must never silently pick a side.
    """
    raw = environ.get(name)
    if raw is None:
        return False
    if raw.lower() in _ON:
        return True
    if raw.lower() in _OFF:
        return False
    raise FlagError(
        f"{name}={raw!r} is not understood; accepted values are "
        f"{'/'.join(_ON)} to switch it on and {'/'.join(_OFF)} to switch it off "
        f"(any case, no spaces), or leave {name} unset for off"
    )
