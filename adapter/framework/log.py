"""Every line the pack prints, through one function: `emit` (and `render`, which formats a
line without printing it).

A line names the process that printed it: its pid and its rank, the TP rank of a scheduler
(set at the start of `Scheduler.__init__`, `label_scheduler`), the rank of an initialised
torch.distributed group, or `launcher` for every other process (the image's entrypoint,
doctor). Text lines read `[sglang-adapters] pid=N rank=R <message>`; with
DSV41_ADAPTERS_LOG=json each line is one JSON object instead, with a UTC timestamp, the
message, and the line's own fields (an adapter's full reason, a site's counts) for log
pipelines.

Lines go through Python's logging (the logger `sglang_dsv41_adapters`) to stderr, flushed. A
text line takes a timestamp: in the engine's own format where the engine has configured
logging (`[2026-05-01 10:00:00 TP0] [sglang-adapters] ...`), and in a scheduler at its
--log-level too (configure_logger runs before Scheduler(...) is built); else in the same shape
without the rank prefix. A JSON line is the object alone (it has its own time). A stderr that cannot
be written loses the line and raises nothing, as the engine's logging does (a refusal still
stops the start: it is raised, not only printed).
"""

from __future__ import annotations

import datetime
import inspect
import json
import logging
import os
import sys
from collections.abc import Mapping
from typing import Optional

PREFIX = "[sglang-adapters]"
LOG_FORMAT = "DSV41_ADAPTERS_LOG"
LOG_FORMATS = ("text", "json")
LAUNCHER = "launcher"

_label: Optional[str] = None
_ranks: Optional[dict] = None  # the engine's own rank labels for this process, where label_scheduler found them
RANK_LABELS = ("tp_rank", "pp_rank", "dp_rank")


def reset() -> None:
    """Forget this process's label (tests): it is the launcher's again."""
    global _label, _ranks
    _label = _ranks = None


def set_process_label(label, ranks: Optional[dict] = None) -> None:
    """What this process's lines (and the pack's metrics) call it: a rank; `ranks`, its
    tp_rank, pp_rank and dp_rank as the engine numbers them (None where it has none)."""
    global _label, _ranks
    _label = str(label)
    _ranks = None if ranks is None else {name: ranks.get(name) for name in RANK_LABELS}


def rank_labels() -> dict[str, str]:
    """This process's tp_rank, pp_rank and dp_rank as the engine's metrics label a scheduler's
    series (sglang.srt.observability.metrics_collector), "" where it has none: the engine leaves
    dp_rank out without a DP controller, which PromQL matches as "". A bare number (a
    torch.distributed rank) is a TP rank of the first stage."""
    if _ranks is not None:
        return {name: "" if _ranks[name] is None else str(_ranks[name]) for name in RANK_LABELS}
    label = process_label()
    return {"tp_rank": label, "pp_rank": "0", "dp_rank": ""} if label.isdigit() else dict.fromkeys(RANK_LABELS, "")


def process_label() -> str:
    if _label is not None:
        return _label
    dist = sys.modules.get("torch.distributed")  # never imported here: only read if the process has it
    try:  # another thread may be importing it (a progress line during the engine's import): half there
        if dist is not None and dist.is_available() and dist.is_initialized():
            return str(dist.get_rank())
    except AttributeError:
        pass
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
        label, ranks = "scheduler", {}
    set_process_label(label, ranks)
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


ENGINE_DATEFMT = "%Y-%m-%d %H:%M:%S"  # sglang.srt.utils.common.configure_logger's
_OWN = logging.Formatter("[%(asctime)s] %(message)s", ENGINE_DATEFMT)
_JSON = logging.Formatter("%(message)s")


def engine_formatter() -> Optional[logging.Formatter]:
    """The formatter of the engine's own logging where its configure_logger set it up in this
    process (`[%(asctime)s<prefix>] %(message)s` with its date format), else None."""
    for handler in logging.getLogger().handlers:
        found = handler.formatter
        if found is not None and found.datefmt == ENGINE_DATEFMT and found._fmt.startswith("[%(asctime)s") \
                and found._fmt.endswith("] %(message)s"):
            return found
    return None


class _Stderr(logging.Handler):
    """The pack's lines on stderr as it is now (a test's capture, a redirected stream), in the
    engine's format and level where it configured logging; a write that fails loses the line."""

    def emit(self, record: logging.LogRecord) -> None:
        engine = engine_formatter()
        # configure_logger with a process prefix (` TP0`) set the root's level from --log-level; a plain
        # `[%(asctime)s] %(message)s` may be the engine's basicConfig at import, with no level of the user's.
        if engine is not None and engine._fmt != _OWN._fmt and record.levelno < logging.getLogger().getEffectiveLevel():
            return
        formatter = _JSON if getattr(record, "form", "text") == "json" else engine or _OWN
        try:
            sys.stderr.write(formatter.format(record) + "\n")
            sys.stderr.flush()
        except (OSError, ValueError):  # stderr full, gone or closed: the line is lost, never the process
            pass


logger = logging.getLogger("sglang_dsv41_adapters")
logger.setLevel(logging.INFO)
logger.propagate = False  # one line per message: the engine's handlers would print it a second time
if not any(isinstance(h, _Stderr) for h in logger.handlers):
    logger.addHandler(_Stderr())


def emit(message: str, form: Optional[str] = None, level: int = logging.INFO, **fields) -> str:
    """Log one line (a fatal one at ERROR); returns it as rendered, without the timestamp."""
    form = form or log_format()
    line = render(message, form, **fields)
    logger.log(logging.ERROR if fields.get("fatal") else level, line, extra={"form": form})
    return line
