"""A reason in one line of a given width: the fix whole, then the reason, cut where it must be.

The pack's reasons end with what to do where there is something to do ("...: drop dspark-draft
from the flag, e.g. all,-dspark-draft)", "...; unset DSV41_X and use ..."). A line cut at its end
loses exactly that, so a reason too long for its line is rewritten `fix: <the fix>; <the reason,
cut at a word>...` (`safe: <setting>; ...` where the reason names its safe setting). The fix is found by its shape: a `safe: <setting>` clause where the reason
names the safe setting, else its last clause starting with an imperative verb; a reason without
either is cut at a word.
"""

from __future__ import annotations

import re

CUT = "..."
VERBS = ("drop", "unset", "use", "set", "switch", "leave", "rename", "point", "run", "install", "build",
         "upgrade", "remove", "pass", "add", "fix", "select", "report")
# the last clause (after "; ", ": ", " - " or "(") that starts with an imperative verb and runs to the end
_FIX = re.compile(r"(?:;\s+|:\s+|\s-\s|\()(?=(?:" + "|".join(VERBS) + r")\b)([^;()]*(?:\([^()]*\)[^;()]*)*)\)?\s*$")


_SAFE = re.compile(r";\s+(safe: [^;]*)")


def fix_of(text: str) -> tuple[str, str]:
    """(the reason without its fix, the fix); the fix is "" where the reason names none."""
    safe = _SAFE.search(text)
    if safe is not None:
        return (text[:safe.start()] + text[safe.end():]).strip(), safe[1].strip()
    found = _FIX.search(text)
    if found is None:
        return text, ""
    return text[:found.start()].rstrip(" ;:-("), found[1].strip()


def cut(text: str, room: int) -> str:
    """`text` in at most `room` characters, cut after a word or a dotted name's part
    (`TargetVerifyExecutor...`), mid-word only for a word longer than the room."""
    if len(text) <= room:
        return text
    head = text[:max(room - len(CUT), 0)]
    end = max(head.rstrip().rfind(" "), head.rfind(".") + 1 if head.rfind(".") > 0 else -1)
    if end > 0:
        head = head[:end]
    return head.rstrip(" ,;:-(.") + CUT


def fit(text: str, room: int) -> str:
    """`text` in at most `room` characters: itself where it fits, else its fix whole first and its
    reason cut after it; a fix that alone fills the room is cut too (the details are doctor's)."""
    if len(text) <= room:
        return text
    reason, fix = fix_of(text)
    if not fix:
        return cut(text, room)
    head = f"{fix}; " if fix.startswith("safe: ") else f"fix: {fix}; "
    if len(head) + 12 > room:
        return cut(head.rstrip("; "), room)
    return head + cut(reason, room - len(head))
