"""Every line the pack prints, through one function: `emit` (and `render`, which formats a
line without printing it).

A line names the process that printed it: its pid and its rank, the TP rank of a scheduler
(set at the start of `Scheduler.__init__`, `label_scheduler`), the rank of an initialised
torch.distributed group, or `launcher` for every other process (the image's entrypoint,
doctor). Text lines read `[sglang-adapters] pid=N rank=R <message>`; with
DSV41_ADAPTERS_LOG=json each line is one JSON object instead, with a UTC timestamp, the
message, and the line's own fields (an adapter's full reason, a site's counts) for log
pipelines. Lines go to stderr, flushed, as the engine's own log does; a stderr that cannot be
written loses the line and raises nothing, as the engine's logging does (a refusal still stops
the start: it is raised, not only printed).
"""

from __future__ import annotations

import datetime
import inspect
import json
import os
import sys
from collections.abc import Mapping
from typing import Optional

PREFIX = "[sglang-adapters]"
LOG_FORMAT = "DSV41_ADAPTERS_LOG"
LOG_FORMATS = ("text", "json")
LAUNCHER = "launcher"

_label: Optional[str] = None


def reset() -> None:
    """Forget this process's label (tests): it is the launcher's again."""
    global _label
    _label = None


def set_process_label(label) -> None:
    """What this process's lines (and the pack's metrics) call it: a rank."""
    global _label
    _label = str(label)


def process_label() -> str:
    if _label is not None:
        return _label
    dist = sys.modules.get("torch.distributed")  # never imported here: only read if the process has it
    if dist is not None and dist.is_available() and dist.is_initialized():
        return str(dist.get_rank())
    return LAUNCHER


def label_scheduler(init, args, kwargs) -> str:
    """Label this process after the Scheduler `init` (the bound `__init__`) is building:
    0.5.16-0.5.20 pass its tp_rank, pp_rank and dp_rank as arguments; 0.5.21+ build it
    from (server_args, port_args) after publishing the process's ranks in the engine's
    runtime context. `2` for TP rank 2, `pp1-2` past the first pipeline stage, `dp1-2`
    under a data-parallel controller."""
    try:
        ranks = inspect.signature(init).bind_partial(*args, **kwargs).arguments
        if "tp_rank" not in ranks:
            from sglang.srt.runtime_context import get_parallel

            parallel = get_parallel()
            ranks = {name: getattr(parallel, name, None) for name in ("tp_rank", "pp_rank", "dp_rank")}
        label = str(ranks["tp_rank"])
        if ranks.get("pp_rank"):
            label = f"pp{ranks['pp_rank']}-{label}"
        if ranks.get("dp_rank") is not None:
            label = f"dp{ranks['dp_rank']}-{label}"
    except Exception:  # a rank we cannot place is still a scheduler, never the launcher
        label = "scheduler"
    set_process_label(label)
    return label


def log_format(environ: Mapping[str, str] = os.environ) -> str:
    return "json" if environ.get(LOG_FORMAT, "").lower() == "json" else "text"


def head() -> str:
    """What a text line starts with."""
    return f"{PREFIX} pid={os.getpid()} rank={process_label()} "


def render(message: str, form: Optional[str] = None, **fields) -> str:
    """One line: `message` after the head, or a JSON object of the head's fields, a UTC
    timestamp, `message` and `fields` (form: this process's DSV41_ADAPTERS_LOG by default)."""
    if (form or log_format()) == "json":
        now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        return json.dumps({"pack": PREFIX.strip("[]"), "time": now, "pid": os.getpid(), "rank": process_label(),
                           "message": message, **fields}, separators=(",", ":"))
    return head() + message


def emit(message: str, form: Optional[str] = None, **fields) -> str:
    line = render(message, form, **fields)
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):  # stderr full, gone or closed: the line is lost, never the process
        pass
    return line
