"""Runtime adapters for SGLang speculative decoding under tensor parallelism.

Installed as `sglang_dsv41_adapters` (the repository keeps the folder `adapter/`; a link
of that name beside it makes a checkout importable the same way). Layers, each importing
only those before it (tests/test_layout.py enforces it):

  engine/       reading the engine: its files, a module's syntax, an installed engine or one
                read from a release's sources, the contracts an adapter checks, the census
  framework/    deciding, applying, recording, reporting: the declared adapter surface and
                its ledger, flags, the runtime, patching, the plugin, delivery, the audit,
                the deployment's topology, the lines and metrics the pack emits
  spectpsync/   what the adapters share about rank-0 broadcast: upstream's site grammar, the
                engine's own SpecTpSync and the proofs that it does the job, one concern a module
                (broadcast_proof, memory_probe_proof, groups_proof, callers_proof), the pack's
                broadcast on the decode path
  <adapter>/    one folder per adapter (ADAPTERS below): its `SURFACE`, its ledger and its
                code; adapters never import one another, they declare what they read
  rollout/      judging a rollout from outside the servers (`sglang-adapters canary`): their
                /metrics and their answers; it imports no other layer (cli.py imports it)

Registering an adapter is one line: its folder's name in ADAPTERS. This table imports
none of them: choosing what to patch costs nothing in processes that patch nothing.
"""

import functools
import importlib

ADAPTERS = ("folded_fence", "rank0_broadcast", "group_min_memory", "tp_divergence", "known_bad_config")


@functools.cache
def load(name: str):
    """The adapter's declared surface (framework.surface.Surface), checked as it loads."""
    from .framework.surface import validate

    module = importlib.import_module(f"{__name__}.{name}")
    return validate(getattr(module, "SURFACE", None), name, ADAPTERS)
