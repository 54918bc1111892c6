"""The pack's text lines as a test reads them: the logging timestamp in front taken off."""

from __future__ import annotations

import re

# `[2026-05-01 10:00:00] ` (the pack's own) or `[2026-05-01 10:00:00 TP0] ` (the engine's format)
TIMESTAMP = re.compile(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d{3})?(?: [^\]]*)?\] ")


PROGRESS = re.compile(r"\[sglang-adapters\] pid=\d+ rank=\S+ progress: ")


def untimed(text: str) -> list[str]:
    """Each line of `text`, its leading timestamp removed where it has one; progress lines, which
    come or not with the machine's speed, left out (tests/test_progress.py has them)."""
    lines = [TIMESTAMP.sub("", line, count=1) if TIMESTAMP.match(line) else line for line in text.splitlines()]
    return [line for line in lines if not PROGRESS.match(line)]
