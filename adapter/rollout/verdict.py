"""What the canary found, as readable lines and as the JSON verdict for pipelines
(docs/canary-verdict.schema.json, schema version SCHEMA_VERSION).

Every finding is one line, `<server>: ok|FAIL|note <message>`, and one object in the JSON's
`findings`; a FAIL fails the canary, a note is said and judges nothing (a baseline without
traffic, a check that could not be made). The last line is `canary PASS` or `canary FAIL`."""

from __future__ import annotations

import dataclasses
import datetime
from typing import Optional

SCHEMA_VERSION = 1  # bump on any incompatible change of the JSON verdict

EXIT_PASS = 0
EXIT_FAIL = 1
EXIT_USAGE = 64  # the pack's command line (sysexits EX_USAGE), as every other subcommand
EXIT_UNREACHABLE = 75  # sysexits EX_TEMPFAIL: a server did not answer before anything was judged; try again
EXIT_STATUSES = (
    (EXIT_PASS, "PASS: every check held"),
    (EXIT_FAIL, "FAIL: a check failed (each FAIL line says which, naming the server, rank and time)"),
    (EXIT_USAGE, "the command line: an unknown option or a value out of range"),
    (EXIT_UNREACHABLE, "a server did not answer at the start: nothing was judged"),
)

OK, FAIL, NOTE = "ok", "fail", "note"


@dataclasses.dataclass(frozen=True)
class Finding:
    server: str  # "canary", "baseline", or "outputs" for the comparison of answers
    check: str
    status: str  # OK, FAIL or NOTE
    message: str
    rank: Optional[str] = None  # the TP rank it is about; "-" for a server-wide series
    time: Optional[float] = None  # seconds since the epoch, when it was seen

    def line(self) -> str:
        word = {OK: "ok", FAIL: "FAIL", NOTE: "note"}[self.status]
        return f"{self.server}: {word} {self.message}"

    def as_json(self) -> dict:
        return {"server": self.server, "check": self.check, "status": self.status, "message": self.message,
                "rank": self.rank, "time": None if self.time is None else stamp(self.time)}


def stamp(when: float) -> str:
    """UTC, to the millisecond, as the pack's JSON log lines."""
    moment = datetime.datetime.fromtimestamp(when, datetime.timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def failed(findings) -> bool:
    return any(f.status == FAIL for f in findings)


def plural(count, word: str) -> str:
    return f"{count:g} {word}" + ("" if count == 1 else "s")


def last_line(status: int) -> str:
    return {EXIT_PASS: "canary PASS", EXIT_FAIL: "canary FAIL"}.get(status, "canary UNREACHABLE (nothing judged)")


def name(status: int) -> str:
    """The verdict's word in the JSON."""
    return {EXIT_PASS: "pass", EXIT_FAIL: "fail"}.get(status, "unreachable")
