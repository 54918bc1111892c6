"""What the canary found, as readable lines and as the JSON verdict for pipelines
(docs/canary-verdict.schema.json, schema version SCHEMA_VERSION).

Every finding is one line, `<server>: ok|FAIL|INCONCLUSIVE|note <message>`, and one object in
the JSON's `findings`. A FAIL fails the canary; an INCONCLUSIVE says too little was compared to
judge (and what to change), and makes the verdict INCONCLUSIVE unless something failed; a note
is said and judges nothing. The problems come first, then the verdict line (`canary PASS`, `canary
FAIL` or `canary INCONCLUSIVE`, with how much was compared), then the notes and the `ok` lines:
a reader sees what is wrong before what held."""

from __future__ import annotations

import dataclasses
import datetime
from typing import Optional

SCHEMA_VERSION = 1  # bump on any incompatible change of the JSON verdict

EXIT_PASS = 0
EXIT_FAIL = 1
EXIT_INCONCLUSIVE = 3  # too little compared to judge: never a pass (2 is argparse's own usage status)
EXIT_USAGE = 64  # the pack's command line (sysexits EX_USAGE), as every other subcommand
EXIT_UNREACHABLE = 75  # sysexits EX_TEMPFAIL: a server did not answer before anything was judged; try again
EXIT_STATUSES = (
    (EXIT_PASS, "PASS: every check held"),
    (EXIT_FAIL, "FAIL: a check failed (each FAIL line says which, naming the server, rank and time)"),
    (EXIT_INCONCLUSIVE, "INCONCLUSIVE: nothing failed, but too little was compared to judge (each INCONCLUSIVE line "
                        "says what, and what to change); never a pass"),
    (EXIT_USAGE, "the command line: an unknown option or a value out of range"),
    (EXIT_UNREACHABLE, "a server did not answer at the start: nothing was judged"),
)

OK, FAIL, INCONCLUSIVE, NOTE = "ok", "fail", "inconclusive", "note"
WORDS = {OK: "ok", FAIL: "FAIL", INCONCLUSIVE: "INCONCLUSIVE", NOTE: "note"}


@dataclasses.dataclass(frozen=True)
class Finding:
    server: str  # "canary", "baseline", or "outputs" for the comparison of answers
    check: str
    status: str  # OK, FAIL, INCONCLUSIVE or NOTE
    message: str
    rank: Optional[str] = None  # the TP rank it is about; "-" for a server-wide series
    time: Optional[float] = None  # seconds since the epoch, when it was seen

    def line(self) -> str:
        return f"{self.server}: {WORDS[self.status]} {self.message}"

    def as_json(self) -> dict:
        return {"server": self.server, "check": self.check, "status": self.status, "message": self.message,
                "rank": self.rank, "time": None if self.time is None else stamp(self.time)}


def stamp(when: float) -> str:
    """UTC, to the millisecond, as the pack's JSON log lines."""
    moment = datetime.datetime.fromtimestamp(when, datetime.timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def failed(findings) -> bool:
    return any(f.status == FAIL for f in findings)


def status_of(findings) -> int:
    """FAIL over INCONCLUSIVE over PASS."""
    if failed(findings):
        return EXIT_FAIL
    return EXIT_INCONCLUSIVE if any(f.status == INCONCLUSIVE for f in findings) else EXIT_PASS


def ordered(findings) -> tuple:
    """(the problems: FAIL and INCONCLUSIVE, the rest: notes and ok), each in the order found."""
    problems = [f for f in findings if f.status in (FAIL, INCONCLUSIVE)]
    return problems, [f for f in findings if f.status not in (FAIL, INCONCLUSIVE)]


def plural(count, word: str) -> str:
    return f"{count:g} {word}" + ("" if count == 1 else "s")


NAMES = {EXIT_PASS: "pass", EXIT_FAIL: "fail", EXIT_INCONCLUSIVE: "inconclusive"}


def verdict_line(status: int, compared: str = "") -> str:
    """`canary PASS|FAIL|INCONCLUSIVE`, with what was compared; UNREACHABLE when nothing was."""
    if status not in NAMES:
        return "canary UNREACHABLE (nothing judged)"
    return f"canary {NAMES[status].upper()}" + (f": {compared}" if compared else "")


def name(status: int) -> str:
    """The verdict's word in the JSON."""
    return NAMES.get(status, "unreachable")
