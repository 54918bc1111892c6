"""The pack's state on the engine's own /metrics.

With `--enable-metrics` sglang sets PROMETHEUS_MULTIPROC_DIR before it starts the ranks, and
its /metrics serves prometheus_client's multiprocess collector over that folder: whatever a
rank records there is served with the engine's own metrics. Each rank labels its series with
the engine's own rank labels, tp_rank, pp_rank and dp_rank (adapter.framework.log.rank_labels),
so that a PromQL join with the engine's series needs no label_replace, and, for this release
only, with `rank` as its lines name it (adapter.framework.log.process_label: `0`, `dp1-2`):
`rank` is deprecated and goes in the next release.

    sglang_adapters:adapter_outcome{adapter,flag,outcome}           1 for each adapter's outcome
    sglang_adapters:fence_copy_mode{mode}                           1: the copy the fence uses (one-launch, clones)
    sglang_adapters:fence_boundary_copies_total{route}              results copied at the worker's boundary
    sglang_adapters:tp_divergence_calls_total{site}                 and _diverged_calls_total,
                                                                    _diverged_elements_total (adapter.tp_divergence.divergence)

Gauges use the engine's multiprocess mode (`mostrecent`): one value per label set, the rank
being a label. Without the folder (metrics off), and with the whole pack off (DSV41_ADAPTERS),
nothing is recorded and prometheus_client is not imported.

Metrics never stop a process: prometheus_client opens a file per process and kind
(`gauge_mostrecent_<pid>.db`, `counter_<pid>.db`) in the folder when a value is first made,
which raises OSError where the folder is a file, missing, read-only or removed since, and that
can first happen on the decode path. Any failure to record is said in one line and ends the
pack's metrics in that process.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Optional

from . import log

PREFIX = "sglang_adapters:"
FOLDER = "PROMETHEUS_MULTIPROC_DIR"
_made: dict = {}
_children: dict = {}  # (name, rank, *labels) -> the metric's child for them: a decode step's count is one call
RANK = ("rank",)  # deprecated beside log.RANK_LABELS; goes in the next release
_stopped: Optional[str] = None  # why this process records no more metrics


def reset() -> None:
    """Forget the metrics made in this process and why they stopped (tests)."""
    global _stopped
    _made.clear()
    _children.clear()
    _stopped = None


def made() -> list[str]:
    """The names of the metrics made in this process."""
    return sorted(_made)


# os.environ's own dict (its keys encoded), read directly: `FOLDER in os.environ` runs three Python
# calls of os._Environ, which a count on the decode path made at every step. It is the dict
# os.environ's writes go through (putenv with it), so it answers as os.environ does.
# Another Python whose os.environ lacks these reads it as `in` does.
_ENVIRON = os.environ  # enabled()'s default, the object whose dict is read
_ENVIRON_DATA, _encode_key = getattr(_ENVIRON, "_data", None), getattr(_ENVIRON, "encodekey", None)
_FOLDER_KEY = _encode_key(FOLDER) if isinstance(_ENVIRON_DATA, dict) and callable(_encode_key) else None


def enabled(environ: Mapping[str, str] = _ENVIRON) -> bool:
    if _stopped is not None:
        return False
    if environ is _ENVIRON and _FOLDER_KEY is not None:
        return _FOLDER_KEY in _ENVIRON_DATA
    return FOLDER in environ


def stopped() -> Optional[str]:
    """Why this process records no metrics of the pack any more, or None."""
    return _stopped


def _stop(why: str) -> None:
    global _stopped
    _stopped = why
    log.emit(f"metrics: none from the pack in this process: {why}", metrics="off", reason=why)


def _metric(kind: str, name: str, doc: str, labels):
    """The process's one metric of that name, made at its first use (prometheus_client
    refuses a second one); None when prometheus_client cannot be imported."""
    if name not in _made:
        try:
            import prometheus_client
        except ImportError as exc:  # the engine requires it; without it, the lines still say everything
            _stop(f"prometheus_client cannot be imported ({exc})")
            _made[name] = None
        else:
            mode = {"multiprocess_mode": "mostrecent"} if kind == "Gauge" else {}
            _made[name] = getattr(prometheus_client, kind)(PREFIX + name, doc, labelnames=(*RANK, *log.RANK_LABELS, *labels),
                                                           **mode)
    return _made[name]


def _record(kind: str, name: str, doc: str, labels: dict, value: float) -> None:
    """Set the gauge, or add to the counter, `name` for this rank and `labels`. The pack's
    boundary with prometheus_client: a failure is said once and recording stops, never
    raised into the engine's start-up or its decode step."""
    try:
        rank = log.process_label()
        key = (name, rank, *labels.items())
        child = _children.get(key)
        if child is None:
            metric = _metric(kind, name, doc, sorted(labels))
            if metric is None:
                return
            # opens the folder's file the first time
            child = _children[key] = metric.labels(rank=rank, **log.rank_labels(), **labels)
        if kind == "Gauge":
            child.set(value)
        else:
            child.inc(value)
    except Exception as exc:  # noqa: BLE001 - a metric is never worth a process
        failed = "cannot be written" if isinstance(exc, OSError) else "could not be recorded into"
        _stop(f"{FOLDER}={os.environ.get(FOLDER)!r} {failed} ({type(exc).__name__}: {exc})")


def mark(name: str, doc: str, **labels) -> None:
    """Gauge `name` at 1 for this rank and these labels."""
    if enabled():
        _record("Gauge", name, doc, labels, 1)


def count(name: str, doc: str, value: int = 1, **labels) -> None:
    """Counter `name` (served as `name`_total) up by `value` for this rank and these labels."""
    if enabled():
        _record("Counter", name, doc, labels, value)


def outcomes(decision, environ: Mapping[str, str] = os.environ) -> None:
    """Each adapter's outcome in this process (runtime.apply_once); nothing when the whole
    pack is off: the rollback leaves the metrics folder as the engine alone would."""
    if enabled(environ) and not decision.switched_off:
        for outcome in decision.outcomes:
            mark("adapter_outcome", "1 for the outcome of each adapter of the pack in this rank",
                 adapter=outcome.adapter, flag=outcome.flag, outcome=outcome.state)


def copy_mode(mode: str) -> None:
    """Which copy the fence uses in this rank (adapter.folded_fence.accept_snapshot, at its first result)."""
    mark("fence_copy_mode", "1 for the copy the folded fence uses in this rank: one-launch or clones", mode=mode)


def count_boundary_copy(route: str) -> None:
    """One result copied where it leaves the worker because it shared the verify graph's
    buffers (adapter.folded_fence.fence_boundary, at each copy): a route the fence does not copy itself."""
    count("fence_boundary_copies", "results the folded fence copied where they leave the DSpark worker, by route",
          route=route)
