"""One read of a server's /metrics: the engine's series the canary judges, per TP rank.

The text is parsed by prometheus_client's own parser (the library the engine exports with), so
labels in any order, escaped values, NaN and +Inf read as Prometheus defines them. sglang labels a
scheduler's series `tp_rank` (--enable-metrics-for-all-schedulers gives every rank its own); the
tokenizer's counters (sglang:generation_tokens_total, sglang:spec_verify_calls_total on 0.5.16 -
0.5.23) carry none and are one per server, read as rank "-". Every other label (is_streaming,
pp_rank, ...) is summed over."""

from __future__ import annotations

import dataclasses
import time

from prometheus_client.parser import text_string_to_metric_families

from . import fetch

SERVER = "-"  # the rank of a series without tp_rank: the server's own

# what the canary calls each series -> (the sample's name, the labels it must carry)
SERIES = {
    "tokens": ("sglang:generation_tokens_total", {}),
    "verify": ("sglang:spec_verify_calls_total", {}),
    "decode": ("sglang:realtime_tokens_total", {"mode": "decode"}),
    "accept": ("sglang:spec_accept_length", {}),
    "running": ("sglang:num_running_reqs", {}),
    "queued": ("sglang:num_queue_reqs", {}),
}
COUNTERS = ("tokens", "verify", "decode")  # only grow while the server lives: one that goes down is a restart


def series_name(what: str) -> str:
    """The series as `curl /metrics` shows it: name and the labels selected on."""
    name, labels = SERIES[what]
    return name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")


class Unreadable(Exception):
    """/metrics answered with text that is no Prometheus exposition."""


@dataclasses.dataclass(frozen=True)
class Read:
    time: float  # seconds since the epoch, when the read was asked
    values: dict  # (what, rank) -> value, summed over every other label


def parse(text: str, when: float) -> Read:
    wanted = {}
    for what, (name, labels) in SERIES.items():
        wanted.setdefault(name, []).append((what, labels))
    values: dict = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                for what, labels in wanted.get(sample.name, ()):
                    if all(sample.labels.get(k) == v for k, v in labels.items()):
                        key = (what, sample.labels.get("tp_rank", SERVER))
                        values[key] = values.get(key, 0.0) + sample.value
    except ValueError as exc:
        raise Unreadable(f"not Prometheus text: {exc}") from None
    return Read(when, values)


def scrape(url: str, timeout: float) -> Read:
    """GET URL/metrics now (fetch.Unreachable, fetch.HTTPFailure, Unreadable)."""
    when = time.time()
    return parse(fetch.get_text(f"{url}/metrics", timeout), when)
