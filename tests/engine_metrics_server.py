"""The engine's own /metrics, for the canary's test (tests/test_canary.py): this process builds
sglang's SchedulerMetricsCollector and TokenizerMetricsCollector from the engine's own server
arguments (--enable-metrics --enable-metrics-for-all-schedulers, TP 4), records through their own
methods into PROMETHEUS_MULTIPROC_DIR (set by the caller, as the engine's launcher sets it before
its ranks start) and serves the engine's own metrics route (add_prometheus_middleware) on a
loopback port, which it prints as `port N`. Each read of /metrics first moves every rank one
decode step on: decode tokens, the accept-length gauge and the request gauges per rank (the
scheduler's log_stats and increment_realtime_tokens), a finished request with its verify steps
(the tokenizer's observe_one_finished_request).

One collector records for every rank, its `labels` set to each rank's in turn (the methods read
them there): one process cannot register the engine's metric names twice, and in the
multiprocess registry a rank's series is its label set, whichever process wrote it.

    python tests/engine_metrics_server.py MODEL_DIR [--ranks 4] [--nan-rank R --nan-from N]

MODEL_DIR gets a tiny model config (tests/agreement_cases.py's), which is all the engine's
argument resolution reads of a model.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import socket
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from tests.agreement_cases import TINY_CONFIG  # noqa: E402

MODEL = "deepseek-v4.1-flash"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir", type=pathlib.Path)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--nan-rank", type=int)
    parser.add_argument("--nan-from", type=int, default=1)
    opts = parser.parse_args()

    import uvicorn
    from fastapi import FastAPI
    from sglang.srt.observability import metrics_collector as engine
    from sglang.srt.server_args import prepare_server_args, set_global_server_args_for_scheduler
    from sglang.srt.utils.common import add_prometheus_middleware

    (opts.model_dir / "config.json").write_text(json.dumps(TINY_CONFIG))
    server_args = prepare_server_args(["--model-path", str(opts.model_dir), "--device", "cpu", "--skip-tokenizer-init",
                                       f"--served-model-name={MODEL}", f"--tp-size={opts.ranks}", "--enable-metrics",
                                       "--enable-metrics-for-all-schedulers"])
    set_global_server_args_for_scheduler(server_args)
    served = {"model_name": MODEL, "engine_type": "unified"}  # as SchedulerMetricsCollector.init_new labels them
    per_rank = [{**served, "tp_rank": r, "pp_rank": 0, "moe_ep_rank": 0} for r in range(opts.ranks)]
    scheduler = engine.SchedulerMetricsCollector(labels=per_rank[0], server_args=server_args)
    tokenizer = engine.TokenizerMetricsCollector(server_args=server_args, labels=served)
    reads = 0

    def step() -> None:
        nonlocal reads
        reads += 1
        for rank, labels in enumerate(per_rank):
            scheduler.labels = labels
            scheduler.increment_realtime_tokens(None, decode_tokens=500)
            accept = math.nan if rank == opts.nan_rank and reads >= opts.nan_from else 3.6
            scheduler.log_stats(engine.SchedulerStats(num_running_reqs=engine.QueueCount(total=1),
                                                      spec_accept_length=accept))
        tokenizer.observe_one_finished_request(served, prompt_tokens=100, generation_tokens=360, cached_tokens=0,
                                               e2e_latency=1.0, has_grammar=False, spec_verify_ct=100)

    app = FastAPI()
    add_prometheus_middleware(app)

    @app.middleware("http")
    async def a_step_before_each_read(request, call_next):
        if request.url.path.startswith("/metrics"):
            step()
        return await call_next(request)

    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen(64)  # connections wait in the backlog until uvicorn has started
    print(f"port {listening.getsockname()[1]}", flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[listening])


if __name__ == "__main__":
    main()
