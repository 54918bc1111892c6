"""Child side of tests/test_audit.py on 0.5.18 (run through harness.ranks with that release):
rank0_broadcast applied, and a doctored copy of the real DSpark worker that imports the
wrapped accept_draft_tokens by name (the issue's example)."""

from __future__ import annotations

import sys

WORKER = "sglang.srt.speculative.dspark_components.dspark_worker_v2"
BINDING = ("from sglang.srt.speculative.dspark_components.dspark_verify import accept_draft_tokens as _accept\n"
           "def _new_accept_path(*args, **kwargs):\n    return _accept(*args, **kwargs)\n")


def imported_by_name(rank, world_size) -> dict:
    from sglang_dsv41_adapters.framework import audit, patching, runtime
    from harness.doctored import doctored_module

    decision = runtime.decide({"DSV41_SPEC_TP_SYNC": "all"})
    # The engine's modules as the rank has them, before the pack applies.
    worker = doctored_module(WORKER, tail=BINDING)  # removed when the rank exits
    sys.modules[WORKER] = worker
    runtime.apply(decision)
    clean = audit.problems([s for s in patching.applied()], decision.engine,
                           {k: v for k, v in sys.modules.items() if k != WORKER})
    found = audit.problems(patching.applied(), decision.engine)
    return {"states": {o.adapter: o.state for o in decision.outcomes}, "clean": clean, "found": found}
