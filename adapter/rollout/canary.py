"""`sglang-adapters canary`: a canary judged against a baseline (the pack off: the rollback
state), from outside both servers.

For --window seconds it reads both servers' /metrics every --interval seconds and judges them
(watch.py), saying one progress line per read on stderr. Meanwhile it sends a fixed prompt set to
both, --rounds times, at temperature 0 (outputs.py), which is also traffic for the metrics to
judge where the servers have none of their own. Then on stdout the FAIL and INCONCLUSIVE lines,
the verdict line (`canary PASS`, `FAIL` or `INCONCLUSIVE`, with how much was compared), the notes
and the `ok` lines; or with --json the verdict as one JSON object (docs/canary-verdict.schema.json).
Exit statuses: verdict.EXIT_STATUSES."""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import urllib.parse

from . import exposition, fetch, outputs, verdict, watch
from .verdict import FAIL, NOTE, Finding

DEFAULTS = watch.Settings()
METRICS_TIMEOUT = 10.0  # seconds for one read of /metrics: a server that takes longer misses that read


def add_arguments(parser: argparse.ArgumentParser) -> None:
    servers = parser.add_argument_group("servers")
    servers.add_argument("--canary", metavar="URL", type=server_url, required=True,
                         help="the canary's base URL (http://host:port), the pack on")
    servers.add_argument("--baseline", metavar="URL", type=server_url,
                         help="the baseline's base URL: the same model and traffic, the pack off (DSV41_ADAPTERS=off). "
                              "Without it the canary is judged alone and its answers are not checked")
    servers.add_argument("--timeout", metavar="SECONDS", type=positive, default=300.0,
                         help=f"for one request of the answers (default 300: a long generation); a read of /metrics gets "
                              f"at most {METRICS_TIMEOUT:.0f}")
    metrics = parser.add_argument_group("metrics (the engine's /metrics: --enable-metrics "
                                        "--enable-metrics-for-all-schedulers)")
    metrics.add_argument("--window", metavar="SECONDS", type=positive, default=1800.0,
                         help="how long to watch (default 1800); longer while the prompt set is still being answered")
    metrics.add_argument("--interval", metavar="SECONDS", type=positive, default=15.0,
                         help="between reads of /metrics (default 15)")
    metrics.add_argument("--accept-floor", metavar="X", type=positive, default=DEFAULTS.accept_floor,
                         help="the lowest accept length (tokens per verify step) that passes (default 3.0; reference "
                              "3.51: DeepSeek-V4.1-Flash, DSpark, TP4, block 5, thinking on)")
    metrics.add_argument("--ranks", metavar="N", type=count(1), default=DEFAULTS.ranks,
                         help="the TP ranks that must export their series (default 4)")
    metrics.add_argument("--rank-tolerance", metavar="R", type=positive, default=DEFAULTS.rank_tolerance,
                         help="relative: each rank's decode tokens and mean accept length against rank 0's (default 0.02)")
    metrics.add_argument("--stall", metavar="SECONDS", type=positive, default=DEFAULTS.stall_seconds,
                         help="a rank decoding nothing this long while requests run or wait fails (default 60)")
    metrics.add_argument("--accept-min", metavar="R", type=positive, default=DEFAULTS.accept_min,
                         help="the canary's accept length at least this share of the baseline's (default 0.98)")
    metrics.add_argument("--rate-min", metavar="R", type=positive, default=DEFAULTS.rate_min,
                         help="the canary's generated tokens per second at least this share of the baseline's "
                              "(default 0.97)")
    metrics.add_argument("--no-metrics", action="store_true", help="do not read /metrics (answers only)")
    answers = parser.add_argument_group("answers (the engine's OpenAI-compatible API, against the baseline)")
    answers.add_argument("--identifiers", metavar="N", type=count(0), default=3000,
                         help="opaque identifiers to ask back verbatim (default 3000)")
    answers.add_argument("--per-prompt", metavar="N", type=count(1), default=20,
                         help="identifiers per prompt (default 20)")
    answers.add_argument("--long", metavar="N", type=count(0, len(outputs.LONG_PROMPTS)), default=4,
                         help=f"long generations (default 4, at most {len(outputs.LONG_PROMPTS)})")
    answers.add_argument("--long-tokens", metavar="N", type=count(1), default=512,
                         help="max_tokens of a long generation (default 512)")
    answers.add_argument("--rounds", metavar="N", type=count(2), default=2,
                         help="times the prompt set goes to each server (default 2): the baseline's runs measure its own "
                              "run-to-run difference, and every run of the canary is judged")
    answers.add_argument("--noise-max", metavar="R", type=share, default=0.05,
                         help="the share of prompts, and of identifiers, the baseline's runs may answer differently "
                              "before the answers are INCONCLUSIVE (default 0.05)")
    answers.add_argument("--seed", metavar="N", type=int, default=0,
                         help="makes the identifiers and is the requests' sampling seed (default 0)")
    answers.add_argument("--api", choices=("chat", "completions"), default="chat",
                         help="/v1/chat/completions (default) or /v1/completions (a model without a chat template)")
    answers.add_argument("--model", help="the model name to ask for (default: what each server's /v1/models lists)")
    answers.add_argument("--extra-body", metavar="JSON", type=json_object, default={},
                         help="fields added to every request, e.g. '{\"chat_template_kwargs\": {\"thinking\": false}}'")
    answers.add_argument("--concurrency", metavar="N", type=count(1), default=8,
                         help="requests in flight per server (default 8)")
    answers.add_argument("--no-outputs", action="store_true", help="do not send the prompt set (metrics only)")
    parser.add_argument("--json", action="store_true",
                        help=f"print the verdict as JSON (schema version {verdict.SCHEMA_VERSION}: "
                             "docs/canary-verdict.schema.json); the progress lines stay on stderr")


def nothing_to_judge(opts):
    """Why these options judge nothing (a usage error), or None."""
    if opts.no_metrics and (opts.no_outputs or not opts.baseline):
        return "--no-metrics leaves nothing to judge without the answers (--baseline URL, no --no-outputs)"
    if not opts.no_outputs and opts.baseline and opts.identifiers == 0 and opts.long == 0:
        return "--identifiers 0 --long 0 is an empty prompt set: say --no-outputs"
    return None


def server_url(text: str) -> str:
    parts = urllib.parse.urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.query or parts.fragment:
        raise argparse.ArgumentTypeError(f"{text!r} is not a server's base URL (http://host:port)")
    return text.rstrip("/")


def positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
    return value


def share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a share from 0 to 1")
    return value


def count(lowest: int, highest: int = None):
    def parsed(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = lowest - 1
        if value < lowest or (highest is not None and value > highest):
            span = f"{lowest} to {highest}" if highest is not None else f"{lowest} or more"
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number {span}")
        return value
    return parsed


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("not a JSON object")
    return value


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class Run:
    """One canary run: what was read and found, and the verdict it comes to."""

    def __init__(self, opts):
        self.opts = opts
        self.settings = watch.Settings(opts.accept_floor, opts.rank_tolerance, opts.ranks, opts.stall,
                                       opts.accept_min, opts.rate_min)
        self.servers = {"canary": opts.canary, **({"baseline": opts.baseline} if opts.baseline else {})}
        self.watched = {name: watch.Watched(name, url) for name, url in self.servers.items()}
        self.findings: list = []
        self.outputs_body = None
        self.started = time.time()

    # -- the start: every server answers, or nothing is judged --

    def first_reads(self) -> None:
        """The window's first read of each server: one that does not answer raises NoAnswer
        (exit 75); one that answers with no metrics is a finding."""
        for name in self.servers:
            try:
                self.read(name)
            except fetch.Unreachable as exc:
                raise NoAnswer(name, str(exc)) from None
            except (fetch.HTTPFailure, exposition.Unreadable) as exc:
                self.findings.append(Finding(name, "answered", FAIL, f"/metrics unreadable at the start: {exc} "
                                                                     "(--enable-metrics)", time=time.time()))

    def read(self, name: str) -> None:
        self.watched[name].reads.append(exposition.scrape(self.servers[name], min(self.opts.timeout, METRICS_TIMEOUT)))

    def models(self) -> dict:
        """Each server's model: --model, or the first that its /v1/models lists."""
        models = {}
        for name, url in self.servers.items():
            if self.opts.model:
                models[name] = self.opts.model
                continue
            try:
                listed = fetch.get_json(f"{url}/v1/models", self.opts.timeout)
                models[name] = listed["data"][0]["id"]
            except fetch.Unreachable as exc:
                raise NoAnswer(name, str(exc)) from None
            except fetch.HTTPFailure as exc:
                self.findings.append(Finding(name, "answers", FAIL, f"/v1/models: {exc}"))
            except (KeyError, IndexError, TypeError):
                self.findings.append(Finding(name, "answers", FAIL, f"/v1/models lists no model: {listed}"))
        return models

    # -- the answers, in a thread beside the window --

    def answers_plan(self):
        """The clients to ask, or None with a note or a failure saying why the answers are not checked."""
        if self.opts.no_outputs:
            self.findings.append(Finding("canary", "outputs", NOTE, "answers not checked (--no-outputs)"))
            return None
        if not self.opts.baseline:
            self.findings.append(Finding("canary", "outputs", NOTE, "answers not checked: they are judged against a "
                                                                    "baseline (--baseline URL)"))
            return None
        models = self.models()
        if len(models) < 2:
            return None
        if models["baseline"] != models["canary"]:
            self.findings.append(Finding("canary", "outputs", FAIL, f"the baseline serves {models['baseline']!r}, the "
                                                                    f"canary {models['canary']!r}: answers not compared"))
            return None
        opts = self.opts
        return {name: outputs.Client(name, url, opts.api, models[name], opts.extra_body, opts.seed, opts.timeout)
                for name, url in self.servers.items()}

    def ask(self, clients: dict) -> None:
        """The answers' findings, whatever happens in this thread: a check that stopped is a failure."""
        try:
            self._ask(clients)
        except Exception as exc:  # noqa: BLE001 - said as a finding, never a silent pass
            self.findings.append(Finding("canary", "outputs", FAIL, f"the answers' check stopped: {exc!r}"))

    def _ask(self, clients: dict) -> None:
        opts = self.opts
        prompts = outputs.prompt_set(opts.identifiers, opts.per_prompt, opts.long, opts.long_tokens, opts.seed)
        say(f"outputs: {len(prompts)} prompts ({opts.identifiers} identifiers, {opts.long} long generations), "
            f"{opts.rounds} rounds to both servers, {opts.concurrency} in flight each")
        runs = outputs.run_rounds(clients, prompts, opts.rounds, opts.concurrency, say)
        found, body = outputs.compare(prompts, runs["baseline"], runs["canary"], opts.noise_max)
        self.findings += found
        self.outputs_body = {"api": opts.api, "model": clients["canary"].model, "seed": opts.seed, **body}

    # -- the window --

    def watch_window(self, answering) -> None:
        """Read every server each interval until the window is over and `answering` (a thread) is done."""
        begin = time.monotonic()
        reads = 1
        while True:
            time.sleep(max(0.0, begin + reads * self.opts.interval - time.monotonic()))
            for name in self.servers:
                try:
                    self.read(name)
                except (fetch.Unreachable, fetch.HTTPFailure, exposition.Unreadable) as exc:
                    self.watched[name].misses.append((time.time(), str(exc)))
            reads += 1
            elapsed = time.monotonic() - begin
            waiting = " (the answers are still coming)" if elapsed >= self.opts.window and answering.is_alive() else ""
            say(f"canary: {elapsed:.0f}/{self.opts.window:.0f} s{waiting}: "
                + "; ".join(watch.progress_line(w) for w in self.watched.values()))
            if elapsed >= self.opts.window and not answering.is_alive():
                return

    def judge_window(self) -> None:
        canary, baseline = self.watched["canary"], self.watched.get("baseline")
        self.findings[:0] = watch.judge(canary, baseline, self.settings, self.started)

    # -- the verdict --

    def as_json(self, status: int) -> dict:
        opts = self.opts
        settings = {"window_s": opts.window, "interval_s": opts.interval, "accept_floor": opts.accept_floor,
                    "ranks": opts.ranks, "rank_tolerance": opts.rank_tolerance, "stall_s": opts.stall,
                    "accept_min": opts.accept_min, "rate_min": opts.rate_min, "identifiers": opts.identifiers,
                    "per_prompt": opts.per_prompt, "long": opts.long, "long_tokens": opts.long_tokens,
                    "seed": opts.seed, "api": opts.api, "concurrency": opts.concurrency, "rounds": opts.rounds,
                    "noise_max": opts.noise_max,
                    "metrics": not opts.no_metrics, "outputs": not opts.no_outputs}
        metrics = None
        if not opts.no_metrics and all(w.reads for w in self.watched.values()):
            metrics = {"reads": {n: len(w.reads) for n, w in self.watched.items()},
                       "misses": {n: len(w.misses) for n, w in self.watched.items()},
                       **{n: watch.figures(w).as_json() for n, w in self.watched.items()}}
            metrics.setdefault("baseline", None)
        return {"schema_version": verdict.SCHEMA_VERSION,
                "verdict": verdict.name(status),
                "exit_status": status, "canary": opts.canary, "baseline": opts.baseline,
                "started": verdict.stamp(self.started), "ended": verdict.stamp(time.time()), "settings": settings,
                "findings": [f.as_json() for f in self.findings], "metrics": metrics, "outputs": self.outputs_body}

    def compared(self) -> str:
        """What the verdict rests on, said on its line."""
        parts = []
        if self.outputs_body:
            parts.append(outputs.compared_text(self.outputs_body["compared"]))
        reads = [len(w.reads) for w in self.watched.values()]
        if not self.opts.no_metrics and all(reads):
            parts.append(f"{min(reads)} reads of /metrics" + (" each" if len(reads) > 1 else ""))
        return "compared " + "; ".join(parts) if parts else ""

    def report(self, status: int) -> int:
        if self.opts.json:
            print(json.dumps(self.as_json(status), indent=2, allow_nan=False), flush=True)
        else:
            problems, rest = verdict.ordered(self.findings)
            for finding in problems:
                print(finding.line())
            print(verdict.verdict_line(status, self.compared() if status in verdict.NAMES else ""))
            for finding in rest:
                print(finding.line())
            sys.stdout.flush()
        return status


class NoAnswer(Exception):
    def __init__(self, server: str, why: str):
        super().__init__(why)
        self.server = server


def run(opts) -> int:
    canary = Run(opts)
    try:
        if not opts.no_metrics:
            canary.first_reads()
        clients = canary.answers_plan()
    except NoAnswer as exc:
        say(f"canary: {exc}: nothing judged (exit {verdict.EXIT_UNREACHABLE})")
        canary.findings.append(Finding(exc.server, "answered", FAIL, str(exc)))
        return canary.report(verdict.EXIT_UNREACHABLE)
    if verdict.failed(canary.findings):
        return canary.report(verdict.EXIT_FAIL)
    answering = threading.Thread(target=canary.ask, args=(clients,), daemon=True)
    if clients:
        answering.start()
    if not opts.no_metrics:
        canary.watch_window(answering)
        canary.judge_window()
    if clients:
        answering.join()
    return canary.report(verdict.status_of(canary.findings))
