"""The DSpark verify window a rank's Scheduler receives, resolved by the engine itself on a GPU
host, and what DSV41_KNOWN_BAD_CONFIG does with it there.

For the engine this interpreter imports (PYTHONPATH picks the release) and a tree of its
sources (for doctor --engine), with a tiny target and draft config written here: the block
size given on the command line, only in the draft checkpoint's config, and nowhere (the
engine's default). Each case goes through the engine's own prepare_server_args and launcher
resolution (tests.known_bad_config_cases.deciders: doctor, doctor --engine, the wrapper and
the rank), then the last one through the engine's plugin loader into Scheduler(server_args),
where the pack judges the window the rank received.

    python3 bench/gpu/resolved_window.py SOURCE_TREE OUT.json
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.known_bad_config_cases import DRAFT_CONFIG, deciders  # noqa: E402

CASES = {"block 3 on the command line": ["--speculative-dspark-block-size", "3"],
         "block 4 on the command line": ["--speculative-dspark-block-size", "4"],
         "block only in the draft config": []}


def main(source_tree: str, out: str) -> None:
    import sglang.version
    import torch

    from sglang_dsv41_adapters.framework import runtime

    found = {"engine": sglang.version.__version__, "device": torch.cuda.get_device_name(0) if torch.cuda.is_available()
             else "no CUDA device", "runs": {}}
    nowhere = {k: v for k, v in DRAFT_CONFIG.items() if k != "dspark_block_size"}
    for name, draft, cases in (("draft config says 5", DRAFT_CONFIG, CASES),
                               ("block size nowhere", nowhere, {"block nowhere": []})):
        runtime.reset()  # each run's rank decides anew (a process decides once)
        with tempfile.TemporaryDirectory() as model, tempfile.TemporaryDirectory() as draft_dir:
            found["runs"][name] = deciders(0, 1, model, draft_dir, source_tree, cases, through_plugin=True,
                                           draft_config=draft)
        print(f"== sglang {found['engine']} on {found['device']}: {name}", flush=True)
        for case, row in found["runs"][name].items():
            if case == "plugin":
                print(f"  Scheduler(server_args) through the plugin loader, last case: {row}", flush=True)
                continue
            print(f"  {case}: the rank received speculative_num_draft_tokens="
                  f"{row['resolved']['speculative_num_draft_tokens']} (command: {row['command']['speculative_num_draft_tokens']});"
                  f" rank {row['rank'][0]}, doctor -- COMMAND {row['doctor'][0]}, wrapper {row['wrapper'][0]}", flush=True)
    with open(out, "w") as handle:
        json.dump(found, handle, indent=1, default=str)


if __name__ == "__main__":
    main(*sys.argv[1:])
