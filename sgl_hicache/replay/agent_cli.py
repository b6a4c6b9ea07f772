"""The command line's part for recorded agent sessions (`agent_sessions.py`): the replay's flags,
the reader options they give, and the line that prints a report's TTFT split.

A flag of this group given for another format, or `--scale` (Mooncake's) given for agent sessions,
is a ValueError naming it (the command line prints it as a usage error, exit status 2).
"""

from __future__ import annotations

import argparse
from typing import Any

from ..argtypes import int_at_least, non_negative_float

_positive_int = int_at_least(1)


def add_agent_flags(p: argparse.ArgumentParser) -> None:
    """The flags of agent-session traces (`replay/agent_sessions.py`); they replay at their recorded times."""
    g = p.add_argument_group(
        "agent sessions",
        "recorded agent sessions (kv-cache-tester JSON, a file or a folder) replay at their recorded times "
        "(--trace-clock implied), with the hints an agent framework sends (in the requests with --url)",
    )
    g.add_argument(
        "--block-scale",
        type=_positive_int,
        metavar="TOKENS",
        help="replay each hash id (64 tokens in kv-cache-tester files) as this many tokens: contexts scale down "
        "by that ratio (default: kept whole)",
    )
    g.add_argument(
        "--gap-cap",
        type=non_negative_float,
        metavar="SECONDS",
        help="cut a longer gap between a call's end and the session's next call to this (default: kept)",
    )
    g.add_argument(
        "--session-spread",
        type=non_negative_float,
        default=0.0,
        metavar="SECONDS",
        help="start the sessions evenly over this many seconds, in file-name order (default 0: together)",
    )
    g.add_argument(
        "--hint-estimate-error",
        type=non_negative_float,
        metavar="E",
        default=0.0,
        help="a tool-call hint's duration estimate is the real gap x (1 + u), u uniform in [-E, E] (default 0)",
    )
    g.add_argument("--hint-seed", type=int, default=0, metavar="SEED", help="seed of the estimate errors (default 0)")
    g.add_argument(
        "--no-hints",
        action="store_true",
        help="replay without the derived hints (tool-call retention on tool_use calls, end on each session's last call)",
    )


AGENT_FLAGS = ("block_scale", "gap_cap", "hint_estimate_error", "hint_seed", "session_spread", "no_hints")
AGENT_DEFAULTS = {"session_spread": 0.0, "hint_estimate_error": 0.0, "hint_seed": 0, "no_hints": False}


def agent_options(args: argparse.Namespace, fmt: str) -> dict[str, Any]:
    """The agent-session reader's options from the flags; a flag given for another format is a ValueError."""
    given = [f for f in AGENT_FLAGS if getattr(args, f, None) not in (None, AGENT_DEFAULTS.get(f))]
    if fmt != "agent-sessions":
        if given:
            flags = ", ".join("--" + f.replace("_", "-") for f in given)
            raise ValueError(f"{flags}: only for agent-session traces (kv-cache-tester JSON); this trace is {fmt}")
        return {}
    if args.scale is not None:
        raise ValueError("--scale is for Mooncake traces; agent sessions take --block-scale")
    return {
        "block_scale": args.block_scale,
        "gap_cap_s": args.gap_cap,
        "session_spread_s": args.session_spread,
        "hints": not args.no_hints,
        "hint_estimate_error": args.hint_estimate_error,
        "hint_seed": args.hint_seed,
    }


def format_preceding(name: str, split: dict[str, Any]) -> str:
    """One line: TTFT by what preceded each call in its session (the report's `ttft_by_preceding`)."""
    parts = [
        f"{kind} {d['requests']}: mean {d['mean']:.3f} p50 {d['p50']:.3f} p99 {d['p99']:.3f}"
        for kind, d in split.items()
        if d.get("requests")
    ]
    return f"{name}: ttft by what preceded the call: " + "; ".join(parts)


__all__ = ["AGENT_FLAGS", "add_agent_flags", "agent_options", "format_preceding"]
