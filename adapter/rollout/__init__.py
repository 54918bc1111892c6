"""Judging a rollout from outside the engine: `sglang-adapters canary` reads two running
servers, a baseline (the pack off: the rollback state) and a canary, through what every
server offers (its Prometheus `/metrics` and its OpenAI-compatible API) and says whether the
canary may be widened.

    fetch        HTTP with the standard library: a server that does not answer is Unreachable
    exposition   one read of /metrics, parsed by prometheus_client's own text parser, per TP rank
    watch        the reads of a window judged: restarts, NaN, missing series, accept length,
                 ranks alike, progress, and the canary against the baseline
    identifiers  opaque identifiers from a seed, the prompt that asks them back, edits per identifier
    outputs      a fixed prompt set at temperature 0, sent twice to each server; what differs
                 beyond the baseline's own run-to-run difference
    verdict      findings, the readable lines, the JSON verdict (docs/canary-verdict.schema.json)
    canary       the command: its options, the window, the progress lines, the exit status

It imports nothing of the pack's other layers: the engine need not be importable where it runs.
"""
