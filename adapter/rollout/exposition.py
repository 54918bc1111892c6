"""One read of a server's /metrics: the engine's series the canary judges, per TP rank.

The text is parsed by prometheus_client's own parser (the library the engine exports with), so
labels in any order, escaped values, NaN and +Inf read as Prometheus defines them. sglang labels a
scheduler's series `tp_rank` (--enable-metrics-for-all-schedulers gives every rank its own); the
tokenizer's counters (sglang:generation_tokens_total, sglang:spec_verify_calls_total on 0.5.16 -
0.5.23) carry none and are one per server, read as rank "-".

Each series is read as its exporter means it. A counter is summed over every other label
(is_streaming, pp_rank, ...): prometheus_client's multiprocess collector sums a counter over
processes too. A gauge is never summed where it is a mean. The engine's gauges use the
multiprocess mode `mostrecent` (one value per label set, the latest any process wrote) and a
`livesum` gauge is one value already summed: both are read as served. A gauge exported in mode
`all` or `liveall` carries a `pid` label, one sample per process: it is read per process
(Read.processes), and the rank's value is their mean for a mean (spec_accept_length: a process
that ended leaves its file under `all`, and a sum would double it) and their sum for a count of
requests (what `livesum` would serve)."""

from __future__ import annotations

import dataclasses
import statistics
import time

from prometheus_client.parser import text_string_to_metric_families

from . import fetch

SERVER = "-"  # the rank of a series without tp_rank: the server's own

# what the canary calls each series -> (the sample's name, the labels it must carry, how several samples of
# one rank combine: "sum" a counter or a count of requests, "mean" a gauge that is a mean)
SERIES = {
    "tokens": ("sglang:generation_tokens_total", {}, "sum"),
    "verify": ("sglang:spec_verify_calls_total", {}, "sum"),
    "decode": ("sglang:realtime_tokens_total", {"mode": "decode"}, "sum"),
    "accept": ("sglang:spec_accept_length", {}, "mean"),
    "running": ("sglang:num_running_reqs", {}, "sum"),
    "queued": ("sglang:num_queue_reqs", {}, "sum"),
}
PROCESS = "pid"  # the label prometheus_client's multiprocess modes `all` and `liveall` give each process's sample
COUNTERS = ("tokens", "verify", "decode")  # only grow while the server lives: one that goes down is a restart


def series_name(what: str) -> str:
    """The series as `curl /metrics` shows it: name and the labels selected on."""
    name, labels, _ = SERIES[what]
    return name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")


class Unreadable(Exception):
    """/metrics answered with text that is no Prometheus exposition."""


@dataclasses.dataclass(frozen=True)
class Read:
    time: float  # seconds since the epoch, when the read was asked
    values: dict  # (what, rank) -> value, as its exporter means it (the module's docstring)
    processes: dict = dataclasses.field(default_factory=dict)  # (what, rank) -> {pid: value} where several processes


def combine(how: str, values: list) -> float:
    return sum(values) if how == "sum" else statistics.fmean(values)


def parse(text: str, when: float) -> Read:
    wanted = {}
    for what, (name, labels, _) in SERIES.items():
        wanted.setdefault(name, []).append((what, labels))
    found: dict = {}  # (what, rank) -> {pid or None: [values]}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                for what, labels in wanted.get(sample.name, ()):
                    if all(sample.labels.get(k) == v for k, v in labels.items()):
                        key = (what, sample.labels.get("tp_rank", SERVER))
                        found.setdefault(key, {}).setdefault(sample.labels.get(PROCESS), []).append(sample.value)
    except ValueError as exc:
        raise Unreadable(f"not Prometheus text: {exc}") from None
    values, processes = {}, {}
    for key, by_process in found.items():
        how = SERIES[key[0]][2]
        if key[0] in COUNTERS:
            values[key] = sum(v for samples in by_process.values() for v in samples)
            continue
        each = {pid: combine(how, samples) for pid, samples in by_process.items()}
        values[key] = combine(how, list(each.values()))
        if len(each) > 1 or None not in each:
            processes[key] = each
    return Read(when, values, processes)


def scrape(url: str, timeout: float) -> Read:
    """GET URL/metrics now (fetch.Unreachable, fetch.HTTPFailure, Unreadable)."""
    when = time.time()
    return parse(fetch.get_text(f"{url}/metrics", timeout), when)
