"""The reads of one window judged, the way a divergence shows on the engine's metrics.

Both servers, read alike:
  answered     every read of /metrics answered (a server that stopped answering mid-window failed)
  restart      a counter never goes down while its process lives: one that does is a restart, named
               with its rank and time (the last read minus the first would hide it)
  number       every value read is a number: NaN or an infinity fails, naming rank and time
The canary also (the baseline is the pack off, where ranks may well diverge: that is the bug):
  ranks        every expected TP rank exports every per-rank series, from its first read on
  accept       tokens per verify step from the counters (per rank where they carry tp_rank), at least
               the floor (3.0; reference: DeepSeek-V4.1-Flash, DSpark, TP4, block 5, thinking on: 3.51)
  alike        each rank's decode tokens and mean spec_accept_length within a relative tolerance of
               rank 0's: ranks that commit different token counts diverge
  progress     no rank's decode tokens stand still for `stall_seconds` while requests run or wait
               (a wedged rank still answers /health)
And against the baseline: the canary's accept length and generated tokens per second at least a
share of the baseline's; a baseline without traffic leaves them uncompared (INCONCLUSIVE). Counters are read as Prometheus' increase() reads them: a reset
adds the value after it, so the figures of a restarted server still count (the restart fails anyway)."""

from __future__ import annotations

import dataclasses
import math
import statistics

from prometheus_client.utils import floatToGoString
from typing import Optional

from .exposition import COUNTERS, SERIES, SERVER, series_name
from .verdict import FAIL, INCONCLUSIVE, NOTE, OK, Finding, stamp

PER_RANK = ("decode", "accept", "running", "queued")


@dataclasses.dataclass(frozen=True)
class Settings:
    accept_floor: float = 3.0
    rank_tolerance: float = 0.02
    ranks: int = 4
    stall_seconds: float = 60.0
    accept_min: float = 0.98
    rate_min: float = 0.97


@dataclasses.dataclass
class Watched:
    """What was read from one server over the window."""

    name: str  # "canary" or "baseline"
    url: str
    reads: list = dataclasses.field(default_factory=list)  # Read, in time order
    misses: list = dataclasses.field(default_factory=list)  # (time, why) of each read that got no answer

    def keys(self, what: str) -> list:
        found = {key for read in self.reads for key in read.values if key[0] == what}
        return sorted(found, key=lambda key: rank_order(key[1]))

    def ranks(self) -> list:
        return sorted({rank for read in self.reads for (_, rank) in read.values if rank != SERVER}, key=rank_order)


def rank_order(rank: str):
    return (0, int(rank)) if rank.isdigit() else (1, rank)


def at(when: float, start: float) -> str:
    return f"at {stamp(when)[11:19]}Z ({when - start:.0f} s into the window)"


def finite(values) -> list:
    return [v for v in values if math.isfinite(v)]


def present(watched: Watched, key) -> list:
    """(time, value) of each read that has `key`."""
    return [(read.time, read.values[key]) for read in watched.reads if key in read.values]


def increase(watched: Watched, key) -> float:
    """How much a counter grew over the window, as Prometheus' increase(): after a reset
    (a value below the one before) the new value is what it grew by."""
    values = finite(v for _, v in present(watched, key))
    return sum(b - a if b >= a else b for a, b in zip(values, values[1:]))


@dataclasses.dataclass(frozen=True)
class Figures:
    window_s: float
    generated_tokens: float
    verify_steps: float
    accept_length: Optional[float]
    tokens_per_s: Optional[float]
    ranks: dict  # rank -> {"decode_tokens": ..., "mean_accept_length": ...}

    def as_json(self) -> dict:
        return dataclasses.asdict(self)


def figures(watched: Watched) -> Figures:
    window = watched.reads[-1].time - watched.reads[0].time if watched.reads else 0.0
    tokens = sum(increase(watched, key) for key in watched.keys("tokens"))
    verify = sum(increase(watched, key) for key in watched.keys("verify"))
    ranks = {rank: {"decode_tokens": increase(watched, ("decode", rank)),
                    "mean_accept_length": mean_accept(watched, rank)} for rank in watched.ranks()}
    return Figures(window, tokens, verify, tokens / verify if verify > 0 else None,
                   tokens / window if window > 0 else None, ranks)


def mean_accept(watched: Watched, rank: str) -> Optional[float]:
    values = finite(v for _, v in present(watched, ("accept", rank)))
    return statistics.fmean(values) if values else None


# --- both servers --------------------------------------------------------------------------------

def integrity(watched: Watched, start: float) -> list:
    """Whether the window's reads describe one living server: answered, no restart, numbers."""
    found = []
    if watched.misses:
        when, why = watched.misses[0]
        more = f" and {len(watched.misses) - 1} more of {len(watched.reads) + len(watched.misses)} reads" \
            if len(watched.misses) > 1 else ""
        found.append(Finding(watched.name, "answered", FAIL, f"/metrics not read {at(when, start)}{more}: {why}",
                             time=when))
    found += restarts(watched, start)
    found += not_numbers(watched, start)
    return found


def restarts(watched: Watched, start: float) -> list:
    first_drop = {}  # rank -> (time, what, before, after, time before)
    for what in COUNTERS:
        for key in watched.keys(what):
            values = [(t, v) for t, v in present(watched, key) if math.isfinite(v)]
            for (t0, a), (t1, b) in zip(values, values[1:]):
                if b < a:
                    if key[1] not in first_drop or t1 < first_drop[key[1]][0]:
                        first_drop[key[1]] = (t1, what, a, b, t0)
                    break
    found = []
    for rank in sorted(first_drop, key=rank_order):
        t1, what, a, b, t0 = first_drop[rank]
        whose = "server-wide" if rank == SERVER else f"rank {rank}:"
        found.append(Finding(
            watched.name, "restart", FAIL,
            f"{whose} {series_name(what)} went down from {a:g} to {b:g} between {stamp(t0)[11:19]}Z and "
            f"{stamp(t1)[11:19]}Z ({t1 - start:.0f} s into the window): the server restarted (its counters "
            "started again from 0)", rank=rank, time=t1))
    return found


def not_numbers(watched: Watched, start: float) -> list:
    """The first read of each series whose value is NaN or infinite."""
    found, said = [], set()
    for read in watched.reads:
        for (what, rank), value in sorted(read.values.items(), key=lambda kv: (rank_order(kv[0][1]), kv[0][0])):
            if not math.isfinite(value) and (what, rank) not in said:
                said.add((what, rank))
                whose = "server-wide" if rank == SERVER else f"rank {rank}:"
                found.append(Finding(watched.name, "number", FAIL,
                                     f"{whose} {series_name(what)} is {floatToGoString(value)} {at(read.time, start)}: "
                                     "not a number",
                                     rank=rank, time=read.time))
    return found


# --- the canary ----------------------------------------------------------------------------------

def canary_checks(watched: Watched, settings: Settings, start: float) -> list:
    return (ranks_present(watched, settings, start) + accept_lengths(watched, settings)
            + ranks_alike(watched, settings) + progress(watched, settings, start))


def ranks_present(watched: Watched, settings: Settings, start: float) -> list:
    seen = watched.ranks()
    expected = [str(r) for r in range(settings.ranks)]
    found = []
    absent = [r for r in expected if r not in seen]
    for rank in absent:
        found.append(Finding(
            watched.name, "ranks", FAIL,
            f"rank {rank} exports no series in {len(watched.reads)} reads ({len(expected) - len(absent)} of "
            f"{len(expected)} ranks do: {', '.join(r for r in expected if r in seen) or 'none'}; every rank exports its "
            "own with --enable-metrics-for-all-schedulers)", rank=rank))
    for rank in seen:
        for what in PER_RANK:
            has = [(read.time, (what, rank) in read.values) for read in watched.reads]
            if not any(there for _, there in has):
                found.append(Finding(watched.name, "ranks", FAIL,
                                     f"rank {rank} exports no {series_name(what)} (its other series are there)",
                                     rank=rank))
                continue
            since = next(t for t, there in has if there)
            gone = next((t for t, there in has if not there and t > since), None)
            if gone is not None:
                found.append(Finding(watched.name, "ranks", FAIL,
                                     f"rank {rank}: {series_name(what)} missing from the read {at(gone, start)} "
                                     f"(there since {stamp(since)[11:19]}Z)", rank=rank, time=gone))
    if not absent and not found:
        found.append(Finding(watched.name, "ranks", OK, f"{len(seen)} of {len(expected)} ranks export every series, "
                                                        f"none lost in the window ({', '.join(seen)})"))
    return found


def accept_lengths(watched: Watched, settings: Settings) -> list:
    window = figures(watched).window_s
    keys = watched.keys("tokens")
    if not keys:
        return [Finding(watched.name, "accept", FAIL, f"no {series_name('tokens')} in any read (start the server with "
                                                     "--enable-metrics)")]
    found = []
    for _, rank in keys:
        tokens, verify = increase(watched, ("tokens", rank)), increase(watched, ("verify", rank))
        whose = "server-wide" if rank == SERVER else f"rank {rank}"
        if verify <= 0:
            found.append(Finding(watched.name, "accept", FAIL, f"no speculative verify steps counted over {window:.0f} s "
                                                              f"({whose}): no traffic, or not speculative decoding",
                                 rank=rank))
            continue
        accept = tokens / verify
        found.append(Finding(
            watched.name, "accept", OK if accept >= settings.accept_floor else FAIL,
            f"accept length {accept:.3f} ({whose}: {tokens:.0f} tokens / {verify:.0f} verify steps), floor "
            f"{settings.accept_floor:.2f} (reference 3.51)", rank=rank))
    return found


def ranks_alike(watched: Watched, settings: Settings) -> list:
    ranks = figures(watched).ranks
    if not ranks:
        return []
    reference = "0" if "0" in ranks else next(iter(ranks))
    d0, a0 = ranks[reference]["decode_tokens"], ranks[reference]["mean_accept_length"]
    tolerance = settings.rank_tolerance
    found = []
    for rank, figure in ranks.items():
        d, a = figure["decode_tokens"], figure["mean_accept_length"]
        off = (abs(d - d0) > tolerance * (d0 if d0 > 0 else 1) or a is None or a0 is None
               or abs(a - a0) > tolerance * (a0 if a0 > 0 else 1))
        mean = "none that is a number" if a is None else f"{a:.3f}"
        mean0 = "none" if a0 is None else f"{a0:.3f}"
        found.append(Finding(watched.name, "alike", FAIL if off else OK,
                             f"rank {rank}: {d:.0f} decode tokens, mean spec_accept_length {mean} (rank {reference}: "
                             f"{d0:.0f}, {mean0})", rank=rank))
    return found


def progress(watched: Watched, settings: Settings, start: float) -> list:
    found = []
    for rank in watched.ranks():
        before = None  # (time, decode tokens, requests running or queued) at the previous read
        since = None
        for read in watched.reads:
            decode = read.values.get(("decode", rank))
            if decode is None:
                continue
            busy = sum(v for what in ("running", "queued") if math.isfinite(v := read.values.get((what, rank), 0.0)))
            if before is not None and decode == before[1] and before[2] > 0:
                since = since if since is not None else before[0]
            else:
                since = None
            if since is not None and read.time - since >= settings.stall_seconds:
                found.append(Finding(watched.name, "progress", FAIL,
                                     f"rank {rank} decoded nothing for {read.time - since:.0f} s from "
                                     f"{stamp(since)[11:19]}Z ({since - start:.0f} s into the window) while requests "
                                     "were running or queued", rank=rank, time=since))
                break
            before = (read.time, decode, busy)
    return found


def against_baseline(canary: Figures, baseline: Figures, settings: Settings) -> list:
    if baseline.verify_steps <= 0 or baseline.generated_tokens <= 0:
        return [Finding("baseline", "traffic", INCONCLUSIVE,
                        f"no traffic over the window ({baseline.generated_tokens:.0f} generated tokens, "
                        f"{baseline.verify_steps:.0f} verify steps in {baseline.window_s:.0f} s): the canary's accept "
                        "length and rate are not compared with it; send both servers the same traffic (the prompt set "
                        "does, without --no-outputs) and check the baseline runs speculative decoding with "
                        "--enable-metrics")]
    if canary.accept_length is None or canary.tokens_per_s is None:
        return [Finding("canary", "against", FAIL, "not compared with the baseline: the canary counted no verify steps")]
    accept, rate = canary.accept_length, canary.tokens_per_s
    ok = accept >= settings.accept_min * baseline.accept_length and rate >= settings.rate_min * baseline.tokens_per_s
    return [Finding("canary", "against", OK if ok else FAIL,
                    f"against the baseline: accept length {accept:.3f} vs {baseline.accept_length:.3f} (min "
                    f"{settings.accept_min:.2f}x), tokens/s {rate:.1f} vs {baseline.tokens_per_s:.1f} (min "
                    f"{settings.rate_min:.2f}x)")]


def per_process(watched: Watched) -> list:
    """A note for each rank's gauge served per process (a `pid` label: multiprocess mode `all`), saying how it was read."""
    seen: dict = {}
    for read in watched.reads:
        for key, each in read.processes.items():
            seen.setdefault(key, set()).update(each)
    found = []
    for (what, rank), pids in sorted(seen.items(), key=lambda kv: (rank_order(kv[0][1]), kv[0][0])):
        combined = "their mean judged, never their sum" if SERIES[what][2] == "mean" else "summed, as livesum serves it"
        found.append(Finding(watched.name, "processes", NOTE,
                             f"rank {rank}: {series_name(what)} served per process ({len(pids)} pids: "
                             f"{', '.join(sorted(map(str, pids)))}; multiprocess mode all): {combined}", rank=rank))
    return found


def judge(canary: Watched, baseline: Optional[Watched], settings: Settings, start: float) -> list:
    """Every finding of the window, the canary's first."""
    found = integrity(canary, start) + canary_checks(canary, settings, start) + per_process(canary)
    if baseline is not None:
        found += (integrity(baseline, start) + per_process(baseline)
                  + against_baseline(figures(canary), figures(baseline), settings))
    return found


def progress_line(watched: Watched) -> str:
    """One server's state so far, for the line printed while the window runs."""
    figure = figures(watched)
    accept = "-" if figure.accept_length is None else f"{figure.accept_length:.2f}"
    decode = sum(r["decode_tokens"] for r in figure.ranks.values())
    missed = f", {len(watched.misses)} reads unanswered" if watched.misses else ""
    return (f"{watched.name} {len(watched.reads)} reads, {len(figure.ranks)} ranks, +{figure.generated_tokens:.0f} "
            f"generated tokens, +{decode:.0f} decode tokens, accept length {accept}{missed}")
