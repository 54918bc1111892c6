"""A stand-in for a running sglang server on a loopback port, for the recipe's run.sh
(tests/test_recipe.py) and the canary (tests/test_canary.py): what it serves is scripted, its
shapes are the engine's own.

  /health_generate       200 from the `healthy_after`-th request on (never when None)
  /metrics               `metrics(n)` for the n-th read, in the engine's exposition (metrics() below
                         writes the series sglang 0.5.23 exports, several TP ranks); None: 503
  /v1/models             the engine's ModelList with `model`
  /v1/chat/completions,  each request read with the engine's own request model
  /v1/completions        (sglang.srt.entrypoints.openai.protocol) and answered with its response
                         model: the text `answer(prompt, n)` gives for the n-th request of that
                         prompt, cut at max_tokens, with token ids from a toy tokenizer where the
                         request asks for them (`return_token_ids`) and `token_ids` is on
"""

from __future__ import annotations

import functools
import http.server
import json
import re
import threading
import time
import zlib

from prometheus_client.utils import floatToGoString

MODEL = "deepseek-v4.1-flash"
LABELS = f'model_name="{MODEL}",engine_type="unified"'
PIECES = re.compile(r"\s+|\w+|[^\w\s]")
PROSE = ("the", "draft", "block", "verifies", "every", "token", "rank", "commits", "same", "result", "and", "then")


def tokens(text: str) -> list:
    """A toy tokenizer: words, runs of whitespace and single marks, each a stable id."""
    return PIECES.findall(text)


def token_id(piece: str) -> int:
    return zlib.crc32(piece.encode()) % 129280


def echo(prompt: str, n: int) -> str:
    """A model that does what it is asked: numbered identifiers come back as asked; anything
    else gets prose that depends on the prompt only."""
    numbered = re.findall(r"^(\d+)\. (\S+)$", prompt, re.M)
    if numbered:
        return "\n".join(f"{k}. {identifier}" for k, identifier in numbered)
    start = zlib.crc32(prompt.encode())
    return " ".join(PROSE[(start + 7 * i) % len(PROSE)] for i in range(600))


@functools.cache
def engine_protocol():
    """The engine's OpenAI request and response models (imported at the first request that needs them: sglang
    with torch, seconds)."""
    from sglang.srt.entrypoints.openai import protocol

    return protocol


class Server:
    def __init__(self, healthy_after=0, metrics=None, answer=echo, model=MODEL, token_ids=True):
        self.reads = {"/health_generate": 0, "/metrics": 0}
        self.served = []  # when each /metrics read was answered (time.time())
        self.requests = []  # the OpenAI requests' bodies, as received
        asked = {}  # prompt -> how many times it was asked
        server = self

        def complete(path, body):
            protocol = engine_protocol()
            chat = path == "/v1/chat/completions"
            request = (protocol.ChatCompletionRequest if chat else protocol.CompletionRequest).model_validate(body)
            prompt = request.messages[-1].content if chat else request.prompt
            asked[prompt] = n = asked.get(prompt, 0) + 1
            pieces = tokens(answer(prompt, n))
            most = request.max_tokens if not chat or request.max_completion_tokens is None else \
                request.max_completion_tokens  # as the engine reads them (the chat's max_tokens is deprecated)
            cut = pieces[:most]
            text, finish = "".join(cut), "length" if len(pieces) > len(cut) else "stop"
            ids = [token_id(p) for p in cut] if token_ids and request.return_token_ids else None
            usage = protocol.UsageInfo(prompt_tokens=len(tokens(prompt)), completion_tokens=len(cut),
                                       total_tokens=len(tokens(prompt)) + len(cut))
            if chat:
                choice = protocol.ChatCompletionResponseChoice(
                    index=0, message=protocol.ChatMessage(role="assistant", content=text), finish_reason=finish,
                    response_token_ids=ids)
                return protocol.ChatCompletionResponse(id=f"chatcmpl-{n}", model=request.model, choices=[choice],
                                                       usage=usage)
            choice = protocol.CompletionResponseChoice(index=0, text=text, finish_reason=finish, token_ids=ids)
            return protocol.CompletionResponse(id=f"cmpl-{n}", model=request.model, choices=[choice], usage=usage)

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                n = server.reads[self.path] = server.reads.get(self.path, 0) + 1
                if self.path == "/health_generate":
                    ok = healthy_after is not None and n > healthy_after
                    self.reply(200 if ok else 503, b"" if ok else b"not ready")
                elif self.path == "/metrics" and metrics:
                    text = metrics(n)
                    server.served.append(time.time())
                    self.reply(503, b"") if text is None else self.reply(200, text.encode(), "text/plain")
                elif self.path == "/v1/models":
                    protocol = engine_protocol()
                    self.reply(200, protocol.ModelList(data=[protocol.ModelCard(id=model)]).model_dump_json().encode(),
                               "application/json")
                else:
                    self.reply(404, b"")

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append(body)
                if self.path not in ("/v1/chat/completions", "/v1/completions"):
                    return self.reply(404, b"")
                try:
                    done = complete(self.path, body)
                except ValueError as exc:  # pydantic's ValidationError: the engine answers 400 with its error model
                    error = engine_protocol().ErrorResponse(message=str(exc), type="BadRequestError", code=400)
                    return self.reply(400, error.model_dump_json().encode(), "application/json")
                self.reply(200, json.dumps(done.model_dump(mode="json")).encode(), "application/json")

            def reply(self, code, body, kind=None):
                self.send_response(code)
                if kind:
                    self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        class Listener(http.server.ThreadingHTTPServer):
            request_queue_size = 128  # the canary keeps 8 in flight per server: the default 5 resets some on a loaded machine

        self.http = Listener(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_port}"
        # closing waits for the loop's next poll: a short one keeps each test's teardown short
        threading.Thread(target=self.http.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def close(self):
        self.http.shutdown()
        self.http.server_close()


def metrics(accept=3.6, ranks=4, rank_accept=None, decode=None, running=1, queued=0, verify_step=100,
            restart_at=None, hide=lambda rank, series, n: False, pids=None):
    """The engine's series after n reads, in its exposition (HELP and TYPE as the engine's
    collectors declare them): the tokenizer's counters (one per server, by streaming), per rank
    the accept-length gauge, the decode token counter and the request gauges.
    decode(rank, n) -> that rank's decode tokens so far (default: all ranks alike);
    rank_accept(rank, n) -> its accept length gauge (a float('nan') is served as NaN);
    restart_at: from that read on the server counts from 0 again, as a restarted one does;
    hide(rank, series, n) -> True leaves that rank's series out of the n-th read;
    pids(rank) -> the processes whose gauges that rank serves, each with its `pid` label, as prometheus_client's
    multiprocess mode `all` serves a gauge (one sample per process file in the folder, a dead process's too)."""
    decode = decode or (lambda rank, n: 500 * n)
    rank_accept = rank_accept or (lambda rank, n: accept)

    def text(n):
        alive = n - restart_at + 1 if restart_at and n >= restart_at else n  # reads since the process started
        start = 0 if restart_at and n >= restart_at else 1000  # counts before the window
        verify = start + verify_step * alive
        tokens_so_far = 3.6 * start + accept * verify_step * alive
        out = ["# HELP sglang:generation_tokens_total Number of generation tokens processed.",
               "# TYPE sglang:generation_tokens_total counter",
               f'sglang:generation_tokens_total{{{LABELS},is_streaming="true"}} {tokens_so_far * 0.75}',
               f'sglang:generation_tokens_total{{{LABELS},is_streaming="false"}} {tokens_so_far * 0.25}',
               "# TYPE sglang:spec_verify_calls_total counter",
               f"sglang:spec_verify_calls_total{{{LABELS}}} {verify}"]
        series = {"sglang:spec_accept_length": ("gauge", lambda r: floatToGoString(rank_accept(r, n)), ""),
                  "sglang:realtime_tokens_total": ("counter", lambda r: decode(r, alive) + 5 * start, ',mode="decode"'),
                  "sglang:num_running_reqs": ("gauge", lambda r: running, ""),
                  "sglang:num_queue_reqs": ("gauge", lambda r: queued, "")}
        for name, (kind, value, extra) in series.items():
            out += [f"# HELP {name} x", f"# TYPE {name} {kind}"]
            for r in range(ranks):
                if hide(r, name, n):
                    continue
                processes = pids(r) if pids and kind == "gauge" else [None]
                for pid in processes:
                    process = "" if pid is None else f',pid="{pid}"'
                    out.append(f'{name}{{{LABELS},tp_rank="{r}",pp_rank="0",moe_ep_rank="0"{extra}{process}}} {value(r)}')
            if name == "sglang:realtime_tokens_total":
                out += [f'{name}{{{LABELS},tp_rank="{r}",pp_rank="0",moe_ep_rank="0",mode="prefill_compute"}} '
                        f"{100 * alive}" for r in range(ranks)]
        return "\n".join(out) + "\n"
    return text
