"""The flags an image is built to serve (`doctor --strict --require SPEC`), and their verdict.

An image build runs `doctor --strict`: it must fail for what the image is built to serve
and for nothing else, so that an upgrade the pack cannot fully judge still builds and the
flag it refuses still stops the start. SPEC is a comma or space separated list of:

- a pack flag (DSV41_FOLDED_FENCE) or an adapter's name (folded_fence): judged switched on
  at its broadest setting, as doctor's engine check column;
- `@PATH`: an env file (docker's `--env-file` form, the recipe's adapters.env): every pack
  flag it sets to a value that is not off, judged at that value, all of them together;
- `all`: every adapter of the pack, as the engine check column.

A required flag that is refused fails the build; one "decided at launch" does not (each
rank decides it, and refuses there if it must).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from .. import ADAPTERS, load
from . import flags


class RequireError(ValueError):
    """A SPEC naming nothing the pack knows, or an env file that cannot be read: EXIT_FLAGS."""


@dataclass(frozen=True)
class Required:
    adapter: str
    flag: str
    value: Optional[str]  # None: at its broadest setting (the engine check)
    source: str  # where it was required: "--require" or the env file's path


def env_file(path: str) -> dict[str, str]:
    """The KEY=VALUE lines of a docker env file (comments and blank lines skipped; docker
    reads values literally)."""
    try:
        with open(path, encoding="utf-8") as handle:
            lines = handle.read().splitlines()
    except OSError as exc:
        raise RequireError(f"--require @{path}: cannot be read ({exc.strerror or exc})") from None
    found = {}
    for line in lines:
        if not line.strip() or line.lstrip().startswith("#") or "=" not in line:
            continue
        key, value = line.split("=", 1)
        found[key.strip()] = value
    return found


def parse(specs: list[str]) -> list[Required]:
    """Each SPEC's required flags, in the pack's order, a flag named twice kept once (an env
    file's value over a bare name)."""
    by_name = {key: name for name in ADAPTERS for key in (name, load(name).flag)}
    found: dict[str, Required] = {}
    for spec in specs:
        for token in re.split(r"[,\s]+", spec.strip()):
            if not token:
                continue
            if token.startswith("@"):
                path = token[1:]
                values = env_file(path)
                for name in ADAPTERS:
                    flag = load(name).flag
                    raw = values.get(flag)
                    if raw is not None and raw.strip().lower() not in ("", *flags.OFF_WORDS):
                        found[name] = Required(name, flag, raw, path)
            elif token.lower() == "all":
                for name in ADAPTERS:
                    found.setdefault(name, Required(name, load(name).flag, None, "--require all"))
            elif token in by_name:
                name = by_name[token]
                found.setdefault(name, Required(name, load(name).flag, None, "--require"))
            else:
                raise RequireError(f"--require {token}: no adapter of this pack has that name or flag "
                                   f"(its flags: {', '.join(load(n).flag for n in ADAPTERS)}; an env file: @PATH)")
    return [found[name] for name in ADAPTERS if name in found]


def judge(required: list[Required], engine, engine_checks: dict, topology=None) -> list[dict]:
    """Each required flag's verdict: a bare name's is its engine check (`engine_checks`:
    adapter -> (state, reason, short reason)); an env file's flags are decided together at
    their values, as the image's ranks will read them (`topology`: the deployment, if known)."""
    from . import runtime

    files: dict[str, dict] = {}
    for item in required:
        if item.value is not None:
            files.setdefault(item.source, {})[item.flag] = item.value
    decided = {}
    for source, values in files.items():
        decision = runtime.decide(values, engine, topology=topology)
        if decision.flag_errors:
            raise RequireError(f"--require @{source}: {' | '.join(decision.flag_errors)}")
        decided[source] = {o.adapter: o for o in decision.outcomes}
    rows = []
    for item in required:
        if item.value is None:
            state, reason, short = engine_checks[item.adapter]
        else:
            outcome = decided[item.source][item.adapter]
            state, reason, short = outcome.state, outcome.reason, outcome.short_reason
        rows.append({"adapter": item.adapter, "flag": item.flag, "value": item.value, "source": item.source,
                     "outcome": str(state), "reason": reason, "short_reason": short})
    return rows
