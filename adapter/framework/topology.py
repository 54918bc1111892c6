"""The deployment a verdict is judged for: the server arguments it depends on.

Whether the engine's own fix covers a deployment can depend on how the ranks are laid
out: sglang 0.5.19+ builds `SpecTpSync` over the group that runs one batch (the
attention-TP group under DP attention), and with attention-TP 1 that group has one
rank, so the engine's rank-0 broadcast and its group-minimum memory probe do nothing
there although the draft graph can still be captured over several ranks.

`Topology` holds the few server arguments the verdicts read: the layout, and the
arguments the adapters declare (each surface's `server_args`), as the deployment sets them.
It is taken from the real `server_args` each rank's Scheduler receives (values the engine
resolved included), from a wrapped command parsed with the engine's own argument parser
(`from_command`: what the command says, None where it leaves a value to the engine), or,
where no deployment is known (doctor without a command), from the representative layouts
in `REPRESENTATIVE`, which read no argument. Nothing here imports the engine until a command
is parsed.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Optional

SERVER_MODULES = ("sglang.launch_server", "sglang.srt.server")  # `python3 -m <module> ARGS`


@dataclass(frozen=True)
class Topology:
    """tp_size: ranks of one model replica; attn_dp_size: attention-DP width (1: no DP
    attention); attn_cp_size: attention context-parallel width; server_args: the arguments
    the adapters declare -> their value (None: unset), None where no argument was read (a
    representative layout)."""

    tp_size: int
    attn_dp_size: int = 1
    attn_cp_size: int = 1
    speculative_algorithm: Optional[str] = None
    server_args: Optional[Mapping[str, object]] = field(default=None, hash=False)

    @property
    def dp_attention(self) -> bool:
        return self.attn_dp_size > 1

    @property
    def attn_tp_size(self) -> int:
        return max(self.tp_size // self.attn_dp_size // self.attn_cp_size, 1)

    @property
    def batch_group_size(self) -> int:
        """Ranks that run one batch together: the group the engine's SpecTpSync (0.5.19+)
        and the pack's broadcast use (attention-TP under DP attention, else TP)."""
        return self.attn_tp_size if self.dp_attention else self.tp_size

    def describe(self) -> str:
        layout = (f"DP attention {self.attn_dp_size} x attention-TP {self.attn_tp_size}" if self.dp_attention
                  else "no DP attention")
        cp = f", attention-CP {self.attn_cp_size}" if self.attn_cp_size > 1 else ""
        algorithm = f", {self.speculative_algorithm}" if self.speculative_algorithm else ""
        return f"TP {self.tp_size}, {layout}{cp}{algorithm}"


# Layouts doctor judges when no command is given, and the compatibility matrix's columns:
# a verdict that holds only on some of them is shown per layout.
REPRESENTATIVE = {
    "tp": Topology(4),
    "dp-attention-tp1": Topology(4, attn_dp_size=4),
    "dp-attention-tp2": Topology(4, attn_dp_size=2),
}


def _int(value, default: int = 1) -> int:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else default


def from_server_args(args) -> Topology:
    """The topology of a ServerArgs (what a Scheduler receives) or of the namespace the
    engine's parser gives. The attention-DP width is `attn_dp_size` (0.5.22+) or, in the
    older spelling every release takes, `dp_size` with `enable_dp_attention`. A record the
    engine has resolved (0.5.23: `resolve_once`) is read through its own resolved view."""
    args = _resolved(args)
    tp = _int(getattr(args, "tp_size", 1))
    attn_dp = _int(getattr(args, "attn_dp_size", 1))
    if attn_dp == 1 and getattr(args, "enable_dp_attention", False):
        attn_dp = _int(getattr(args, "dp_size", 1))
    algorithm = getattr(args, "speculative_algorithm", None)
    return Topology(tp, attn_dp, _int(getattr(args, "attn_cp_size", 1)),
                    str(algorithm).upper() if algorithm else None,
                    {name: _plain(getattr(args, name, None)) for name in declared_server_args()})


def declared_server_args() -> list[str]:
    """Every server argument a registered adapter declares it reads (its surface's server_args)."""
    from .. import ADAPTERS, load

    return sorted({name for adapter in ADAPTERS for name in load(adapter).server_args})


def _plain(value):
    """A value as JSON carries it (the report, the tests' ranks): an enum or path as its text."""
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)


def _resolved(args):
    if not getattr(args, "_resolution_finished", False):
        return args
    try:
        from sglang.srt.arg_groups.overrides import resolving_view
    except ImportError:  # a release without resolution: the record is what it says
        return args
    return resolving_view(args)


def server_argv(command: list[str]) -> Optional[list[str]]:
    """The engine server's arguments in a command, in the forms the official image
    documents: `python3 -m sglang.launch_server ARGS`, `sglang serve [MODEL] ARGS`, bare
    `ARGS`; None for a command that does not start the engine's server."""
    if not command:
        return None
    if command[0].startswith("-"):
        return list(command)
    name = os.path.basename(command[0])
    if name.startswith("python") and len(command) >= 3 and command[1] == "-m" and command[2] in SERVER_MODULES:
        return list(command[3:])
    if name == "sglang" and command[1:2] == ["serve"]:
        rest = list(command[2:])
        if rest and not rest[0].startswith("-"):
            rest = ["--model-path", rest[0], *rest[1:]]  # sglang serve MODEL ...
        return rest
    return None


class UnreadableArguments(ValueError):
    """The engine's parser rejected the server arguments."""


def parse_server_argv(argv: list[str]):
    """The namespace the installed engine's own argument parser gives for `argv` (what
    `prepare_server_args` parses before it builds ServerArgs, whose construction probes
    the hardware on some releases)."""
    from sglang.srt.server_args import ServerArgs

    parser = _Parser(prog="sglang server arguments", add_help=False)
    ServerArgs.add_cli_args(parser)
    if "--config" in argv:
        from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger

        argv = ConfigArgumentMerger(parser).merge_config_with_args(argv)
    return parser.parse_args(argv)


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UnreadableArguments(message)


def from_command(command: list[str]) -> tuple[Optional[Topology], str]:
    """(the topology, where it came from) for a command the wrapper or doctor is given;
    (None, why) when it is not the engine's server or its arguments cannot be read."""
    argv = server_argv(command)
    if argv is None:
        return None, f"{command[0] if command else 'no command'} does not start the engine's server"
    try:
        namespace = parse_server_argv(argv)
    except UnreadableArguments as exc:
        return None, f"the engine's argument parser rejects the server arguments ({exc})"
    except Exception as exc:  # no engine to parse with, or a parser that fails: unknown
        return None, f"the server arguments could not be read with the engine's parser ({type(exc).__name__}: {exc})"
    return from_server_args(namespace), "the command's server arguments, read with the engine's own parser"
