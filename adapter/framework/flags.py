"""Strict parsing of the pack's environment flags.

A value that is not understood is a start-up error, never "enabled by accident".
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping

ON_WORDS = ("1", "on", "true")
# Off for every flag of the pack; the site selector also takes an empty value as off.
OFF_WORDS = ("0", "off", "false", "none")
# The engine's own boolean words (sglang.srt.environ.EnvBool: true/1/yes/y, false/0/no/n, any
# case), taken by every switch too, so that a deployer's words mean the same to both.
ENGINE_ON, ENGINE_OFF = ("yes", "y"), ("no", "n")
SWITCH_ON, SWITCH_OFF = ON_WORDS + ENGINE_ON, OFF_WORDS + ENGINE_OFF


class FlagError(ValueError):
    """An adapter flag holds a value the pack does not understand."""


def parse_switch(name: str, environ: Mapping[str, str]) -> bool:
    """On/off flag: 1/on/true/yes/y, 0/off/false/none/no/n in any case; unset means off.

    Anything else, including an empty value or surrounding spaces, is refused,
    because a typo must never silently pick a side.
    """
    raw = environ.get(name)
    if raw is None:
        return False
    if raw.lower() in SWITCH_ON:
        return True
    if raw.lower() in SWITCH_OFF:
        return False
    raise FlagError(
        f"{name}={raw!r} is not understood; accepted values are "
        f"{'/'.join(SWITCH_ON)} to switch it on and {'/'.join(SWITCH_OFF)} to switch it off "
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


# Kubernetes gives every container variables for every Service in its namespace (unless the
# pod sets enableServiceLinks: false), named after the Service: a Service `dsv41` gives
# DSV41_SERVICE_HOST=10.0.0.1, DSV41_SERVICE_PORT=30000 (and _SERVICE_PORT_<PORT NAME>),
# DSV41_PORT=tcp://10.0.0.1:30000, DSV41_PORT_30000_TCP=tcp://10.0.0.1:30000 and its _PROTO=tcp,
# _PORT=30000, _ADDR=10.0.0.1. A variable is taken for one only when both its name and its
# value have that shape: a near miss of a flag (DSV41_FOLDED_FENSE=1) has neither.
_PROTOCOLS = ("tcp", "udp", "sctp")


def _address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _port(text: str) -> bool:
    return text.isascii() and text.isdigit() and 0 < int(text) < 65536


def _url(text: str, protocol: str | None = None, port: str | None = None) -> bool:
    found = re.fullmatch(r"([a-z]+)://(?:\[([0-9a-fA-F:.]+)\]|([0-9.]+)):(\d+)", text)
    return bool(found) and found[1] in ((protocol,) if protocol else _PROTOCOLS) and _address(found[2] or found[3]) \
        and _port(found[4]) and port in (None, found[4])


def service_link(name: str, value: str) -> bool:
    """Whether NAME=VALUE is a variable Kubernetes injects for a Service."""
    if not re.fullmatch(r"[A-Z][A-Z0-9_]*", name):
        return False
    numbered = re.fullmatch(r"\w+?_PORT_(\d+)_(TCP|UDP|SCTP)(?:_(ADDR|PORT|PROTO))?", name)
    if numbered:
        port, protocol, part = numbered[1], numbered[2].lower(), numbered[3]
        if {None: _url(value, protocol, port), "ADDR": _address(value), "PORT": value == port,
                "PROTO": value == protocol}[part]:
            return True
    if name.endswith("_SERVICE_HOST"):
        return _address(value)
    if re.fullmatch(r"\w+?_SERVICE_PORT(?:_\w+)?", name) and _port(value):
        return True
    return name.endswith("_PORT") and _url(value)
