"""Cost of the runtime binding audit (adapter.framework.audit) in a rank-sized process: the scheduler
and every module of sglang.srt.speculative imported, every adapter decided and applied with
its broadest setting, the pack's Scheduler.__init__ guard in place, as in a rank.

    .venv/bin/python bench/audit_cost.py [--repeat 9]     (PYTHONPATH picks the release, as tests/engines.py)
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's adapter
from sglang_dsv41_adapters import ADAPTERS, load
from sglang_dsv41_adapters.framework import audit, patching, plugin, runtime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=9)
    opts = parser.parse_args()
    import sglang.srt.managers.scheduler as scheduler
    import sglang.srt.speculative as spec

    for found in pkgutil.walk_packages(spec.__path__, spec.__name__ + "."):
        try:
            importlib.import_module(found.name)
        except Exception:  # a module that needs a GPU library: a rank would not have it either
            pass
    decision = runtime.decide({load(name).flag: load(name).check_value for name in ADAPTERS})
    runtime.apply(decision)
    plugin._guard_scheduler(scheduler)
    wall, cpu = [], []
    for _ in range(opts.repeat):
        start, start_cpu = time.perf_counter(), time.process_time()
        found = audit.problems(patching.applied(), decision.engine)
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    print(json.dumps({
        "engine": decision.engine, "states": {o.adapter: o.state for o in decision.outcomes},
        "engine_modules": sum(1 for name in sys.modules if name.split(".")[0] == "sglang"),
        "patches": len(patching.applied()), "stale_bindings": found,
        "audit_ms_median": round(statistics.median(wall) * 1000, 1), "audit_ms_min": round(min(wall) * 1000, 1),
        "audit_cpu_ms_min": round(min(cpu) * 1000, 1),
    }))


if __name__ == "__main__":
    main()
