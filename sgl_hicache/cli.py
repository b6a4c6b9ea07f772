"""`sgl-hicache serve | replay | stats`: the command line.

Errors a user can cause (a bad flag, a malformed trace, a bad capacity, an unreachable server) end
the process with a one-line message naming the problem and a non-zero status, never a traceback.

Exit status: 0 success; 1 the run happened but failed (a replay with failed requests: the table, the
report and the first error are still written) or an I/O error; 2 a usage error (bad flag, bad input,
unreachable or unsuitable server); 130 interrupted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

from .argtypes import int_at_least as _int_at_least
from .argtypes import non_negative_float as _non_negative_float
from .argtypes import positive_float as _positive_float
from .config import DEFAULT_POLICY, EVICTION_POLICIES, PREDICTORS, WRITE_POLICIES, ConfigError
from .progress import Progress
from .replay.agent_cli import add_agent_flags, agent_options, format_preceding
from .replay.trace import TraceError

DEFAULT_TRACE_HINT = "traces/mooncake_conversation_trace.jsonl"


class UserError(Exception):
    """A problem with what the user asked for; printed as `error: ...`, exit status 2."""


class ReplayFailed(Exception):
    """The replay ran but requests failed; printed as `error: ...`, exit status 1."""


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


# ---- replay ----------------------------------------------------------------------------------
def _add_replay(sub: argparse._SubParsersAction) -> None:
    from .replay import FORMATS
    from .sim.presets import HARDWARE, MODELS
    from .sim.simulator import POLICIES

    p = sub.add_parser(
        "replay",
        help="replay a trace through the embedded engine (default) or a server (--url)",
        description="Replay a multi-turn trace and report per-tier hits, TTFT and throughput.",
    )
    p.add_argument(
        "trace",
        help="trace file: Mooncake/LMBench JSONL, ShareGPT or vLLM multi-turn JSON, plain JSONL, "
        "Azure CSV, SGLang bench output; or recorded agent sessions (kv-cache-tester JSON): a file or "
        "a folder of them (docs/trace-formats.md)",
    )
    p.add_argument("--format", default="auto", choices=["auto", *FORMATS])
    p.add_argument("--limit", type=_positive_int, help="replay only the first N requests")
    p.add_argument("--block-size", type=_positive_int, default=512, help="Mooncake: tokens per hash id (default 512)")
    p.add_argument(
        "--scale", type=_positive_int, help="Mooncake: synthesise each block as this many tokens (shrinks the trace)"
    )
    add_agent_flags(p)
    p.add_argument("--tokenizer", help="ShareGPT/plain text: a folder with tokenizer.json (default: byte-level)")
    p.add_argument(
        "--vocab-size",
        type=_int_at_least(18),
        help="Mooncake: synthesise token ids below this (default: with --url "
        "the server's vocabulary, else 32000); with --url it overrides what the server says",
    )
    group = p.add_mutually_exclusive_group()
    group.add_argument("--policy", choices=POLICIES, default="predict", help="cache policy (default: predict)")
    group.add_argument("--compare", action="store_true", help="run every policy on the same trace and capacities")
    p.add_argument("--model", default="llama3-8b", choices=sorted(MODELS), help="model preset for the cost model")
    p.add_argument("--hardware", default="h200", choices=sorted(HARDWARE) + ["cpu-measured"], help="hardware preset")
    p.add_argument("--device-tokens", type=_positive_int, default=500_000, help="device (GPU) tier capacity in tokens")
    p.add_argument(
        "--host-tokens", type=_non_negative_int, default=2_000_000, help="host DRAM tier capacity in tokens (0: off)"
    )
    p.add_argument(
        "--disk-tokens", type=_non_negative_int, default=16_000_000, help="disk tier capacity in tokens (0: off)"
    )
    p.add_argument(
        "--disk-dir", type=Path, help="disk tier directory (default: a temporary one, removed after the run)"
    )
    p.add_argument("--page-size", type=_positive_int, default=256, help="tokens per page (default 256)")
    p.add_argument("--concurrency", type=_positive_int, default=16, help="closed-loop concurrency (default 16)")
    p.add_argument(
        "--trace-clock",
        action="store_true",
        help="send requests at the trace's timestamps instead of at a fixed concurrency",
    )
    p.add_argument(
        "--time-scale", type=_positive_float, default=1.0, help="with --trace-clock: multiply the trace's timestamps"
    )
    p.add_argument("--max-batch-tokens", type=_positive_int, default=16384, help="prefill tokens per scheduler step")
    p.add_argument("--eviction", default=DEFAULT_POLICY.eviction_policy, choices=EVICTION_POLICIES)
    p.add_argument(
        "--write-policy",
        default=DEFAULT_POLICY.write_policy,
        choices=WRITE_POLICIES,
        help=f"device -> host copies (default {DEFAULT_POLICY.write_policy}: a background copy at commit)",
    )
    p.add_argument(
        "--predictor",
        default=DEFAULT_POLICY.predictor,
        choices=PREDICTORS,
        help=f"what --policy predict runs (default {DEFAULT_POLICY.predictor}; none: predict runs as prefetch)",
    )
    p.add_argument(
        "--admission",
        type=float,
        default=DEFAULT_POLICY.admission_min_probability,
        help="write-back admission: keep an evicted page one tier down only if its "
        "expected reuse (reuse model) is at least this (default 0: keep all)",
    )
    p.add_argument(
        "--predictor-budget",
        type=_non_negative_int,
        default=DEFAULT_POLICY.predictor_budget_tokens,
        help="tokens the predictor may promote per request",
    )
    p.add_argument(
        "--fleet",
        type=_positive_int,
        help="what-if: N simulated servers replaying the trace together, without and "
        "with a shared store in the disk tier's place (docs/store.md); prints both and the ratios",
    )
    p.add_argument(
        "--route",
        default="session",
        choices=["round_robin", "session"],
        help="with --fleet: how requests reach servers (default session)",
    )
    p.add_argument(
        "--store-bandwidth",
        type=_positive_float,
        default=1.0,
        help="with --fleet: each server's link to the store, GB/s (default 1.0)",
    )
    p.add_argument(
        "--store-latency-us",
        type=_non_negative_float,
        default=200.0,
        help="with --fleet: per-transfer store latency, microseconds (default 200)",
    )
    p.add_argument(
        "--url", help="replay against a running SGLang server (http://HOST:PORT) instead of the embedded engine"
    )
    p.add_argument("--max-new-tokens", type=_positive_int, help="with --url: cap each request's output length")
    p.add_argument(
        "--hint-url",
        help="with --url: the server's hint API (http://HOST:PORT) that a trace line's hints go to "
        "(default: the port the server's stats name, from sgl-hicache serve --hint-port)",
    )
    p.add_argument(
        "--bytes",
        dest="byte_mode",
        default="real",
        choices=["real", "metadata"],
        help="embedded engine: 'real' copies every page's bytes through the real stores (proves the data path); "
        "'metadata' accounts and times the same transfers without holding or copying bytes (capacity "
        "planning at scale); hits and virtual times are identical (default: real)",
    )
    p.add_argument(
        "--workers",
        type=_positive_int,
        help="with --compare: processes running the policies side by side "
        "(default: one per policy, at most the CPUs available; 1: one after another)",
    )
    p.add_argument(
        "--checkpoint-every",
        type=_positive_int,
        help="with --report: every N finished requests write a partial "
        "report to REPORT.<policy>.partial.json (removed when the run ends), so a killed run is not lost",
    )
    p.add_argument("--report", type=Path, help="write the JSON report here")
    p.add_argument(
        "--quiet",
        action="store_true",
        help="no progress output (a tqdm bar on a terminal, plain lines every 10 s otherwise)",
    )
    p.set_defaults(func=cmd_replay)


def _load_requests(args: argparse.Namespace, vocab_size: int | None = None, stream: bool = False) -> Any:
    """The trace's requests; Mooncake ids are synthesised below `vocab_size`, plain-JSONL ids are checked against it.
    With `stream`, a Mooncake trace in arrival order is streamed (`replay/stream.py`), not held in memory."""
    from .replay import detect_format, load_trace
    from .replay.stream import open_mooncake

    path = Path(args.trace)
    if not path.exists():
        raise UserError(
            f"trace file {str(path)!r} does not exist"
            + (f" (the shipped trace is {DEFAULT_TRACE_HINT})" if "mooncake" in str(path) else "")
        )
    fmt = args.format if args.format != "auto" else detect_format(path)
    if path.is_dir() and fmt != "agent-sessions":
        raise UserError(f"trace {str(path)!r} is a directory, not a file")
    agent = agent_options(args, fmt)
    if args.scale is not None and args.scale > args.block_size:  # it would synthesise prompts larger than the trace's
        raise UserError(
            f"--scale {args.scale} must be <= --block-size {args.block_size} (it shrinks each block to that many tokens)"
        )
    opts: dict[str, Any] = {"limit": args.limit, **agent}
    if fmt in ("mooncake", "agent-sessions"):
        if fmt == "mooncake":
            opts.update(block_size=args.block_size, scale=args.scale)
        if vocab_size is not None:
            opts["vocab_size"] = vocab_size
    else:
        if args.tokenizer:
            opts["tokenizer"] = args.tokenizer
        if fmt == "plain" and vocab_size is not None:
            opts["vocab_size"] = vocab_size
    requests = open_mooncake(path, **opts) if stream and fmt == "mooncake" else load_trace(path, fmt=fmt, **opts)
    if agent:  # sessions replay at their recorded times; a server gets the hints in the requests
        args.trace_clock = True
        args.hints_in_request = not args.no_hints
        print(
            "sgl-hicache replay: note: agent sessions replay at their recorded times (--trace-clock)", file=sys.stderr
        )
    for note in requests.notes:  # each lenient choice of the reader, once
        print(f"sgl-hicache replay: note: {note}", file=sys.stderr)
    return requests


def cmd_replay(args: argparse.Namespace) -> int:
    if args.report is not None and args.report.is_dir():  # refuse before a long replay, not after
        raise UserError(f"--report {str(args.report)!r} is a directory; give a file path")
    if args.max_new_tokens is not None and not args.url:
        raise UserError(
            "--max-new-tokens caps a server's outputs; it needs --url (the embedded engine replays the trace's output lengths)"
        )
    if args.hint_url is not None and not args.url:
        raise UserError(
            "--hint-url names a server's hint API; it needs --url (the embedded engine applies a trace's hints itself)"
        )
    if args.fleet and args.url:
        raise UserError("--fleet simulates a fleet in the embedded engine; it does not take --url")
    if args.url and (args.byte_mode != "real" or args.checkpoint_every or args.workers):
        raise UserError(
            "--bytes, --checkpoint-every and --workers are embedded-engine options; a server (--url) takes none of them"
        )
    if args.checkpoint_every and args.report is None:
        raise UserError("--checkpoint-every writes partial reports beside the report: give --report FILE")
    progress = Progress(quiet=args.quiet)
    try:
        if args.url:
            result = _replay_server(args, progress)
        else:
            result = _replay_embedded(args, progress)
    finally:
        progress.close()
    failed = sum(rep.get("requests_failed", 0) for rep in result["policies"].values())
    sent = sum(rep.get("requests_sent", rep.get("requests", 0)) for rep in result["policies"].values())
    if failed and failed == sent:  # nothing was served: an error, not a table of zeros
        _write_report(args.report, result, "with the failures ")
        raise ReplayFailed(f"all {sent} requests failed; first error: {_first_error(result)}")
    print(format_report(result))
    _write_report(args.report, result)
    if failed:
        raise ReplayFailed(f"{failed} of {sent} requests failed; first error: {_first_error(result)}")
    hints = next((rep["hints"] for rep in result["policies"].values() if rep.get("hints")), None)
    if hints and hints.get("endpoint_error"):
        raise ReplayFailed(
            f"the hint API failed during the replay ({hints['unsent']} hints not sent): {hints['endpoint_error']}"
        )
    return 0


def _write_report(path: Path | None, result: dict[str, Any], what: str = "") -> None:
    if not path:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(result, indent=2))  # policy order kept: recompute, demote, prefetch, predict
    os.replace(tmp, path)
    print(f"report {what}written to {path}", file=sys.stdout if not what else sys.stderr)


def _first_error(result: dict[str, Any]) -> str:
    return next(
        (
            rep["errors"]["first_error"]
            for rep in result["policies"].values()
            if (rep.get("errors") or {}).get("first_error")
        ),
        "?",
    )


def _replay_server(args: argparse.Namespace, progress: Progress) -> dict[str, Any]:
    """Replay against a running server: ask it what it serves, synthesise ids inside its vocabulary,
    skip what it cannot take (counted), replay."""
    from .replay.http import ServerError, probe_server, replay_http

    if args.compare:
        raise UserError(
            "--compare runs the embedded engine's policies side by side; a server (--url) runs the configuration it was started with"
        )
    try:
        server = probe_server(args.url, vocab_size=args.vocab_size)
    except ServerError as exc:
        raise UserError(str(exc)) from None
    requests = _load_requests(args, vocab_size=server.usable_vocab)
    if not requests:
        raise UserError(f"trace {args.trace!r} holds no requests")
    print(f"server {server.url}: {server.describe()}")
    try:
        report = replay_http(
            requests,
            args.url,
            concurrency=args.concurrency,
            max_new_tokens=args.max_new_tokens,
            trace_clock=args.trace_clock,
            time_scale=args.time_scale,
            server=server,
            progress=progress.callback("server"),
            hint_url=args.hint_url,
            hints_in_request=getattr(args, "hints_in_request", False),
        )
    except ServerError as exc:  # e.g. the trace carries hints and no hint API answers: nothing was sent
        raise UserError(str(exc)) from None
    if report["requests_sent"] == 0:
        raise UserError(
            f"none of the {len(requests)} requests fits the server ({server.describe()}); "
            f"first: {report['skipped'].get('first')}; use a smaller --scale"
        )
    report.setdefault("version", 1)
    report.setdefault("kind", "http")
    result = {"version": 1, "kind": "http", "policies": {"server": report}}
    result["trace"] = {
        "path": str(args.trace),
        "requests": len(requests),
        "limit": args.limit,
        "notes": requests.notes.lines(),
    }
    return result


def _replay_embedded(args: argparse.Namespace, progress: Progress) -> dict[str, Any]:
    requests = _load_requests(args, vocab_size=args.vocab_size, stream=True)
    if not requests:
        raise UserError(f"trace {args.trace!r} holds no requests")
    from .sim.presets import get_hardware, get_model
    from .sim.run import compare, run_policy
    from .sim.simulator import POLICIES, EngineConfig

    if args.disk_dir is not None and args.disk_dir.exists() and not args.disk_dir.is_dir():
        raise UserError(f"--disk-dir {str(args.disk_dir)!r} exists and is not a directory")
    base = EngineConfig(
        policy=args.policy,
        model=get_model(args.model),
        hardware=get_hardware(args.hardware),
        device_tokens=args.device_tokens,
        host_tokens=args.host_tokens,
        disk_tokens=args.disk_tokens,
        page_size=args.page_size,
        disk_dir=args.disk_dir,
        concurrency=None if args.trace_clock else args.concurrency,
        time_scale=args.time_scale,
        max_batch_tokens=args.max_batch_tokens,
        eviction_policy=args.eviction,
        write_policy=args.write_policy,
        predictor_budget_tokens=args.predictor_budget,
        byte_mode=args.byte_mode,
        predictor=args.predictor,
        admission_min_probability=args.admission,
    )
    # the embedded engine holds the device and host tiers in RAM: refuse sizes that cannot fit
    # (a MemoryError traceback at best, the machine swapping or OOM-killed at worst)
    need = (
        (args.device_tokens + args.host_tokens) * base.storage_layout.bytes_per_token if args.byte_mode == "real" else 0
    )
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > ram // 2:
        raise UserError(
            f"--device-tokens {args.device_tokens} and --host-tokens {args.host_tokens} need {need / 2**30:.1f} GiB "
            f"of RAM for the embedded engine's tiers; this machine has {ram / 2**30:.1f} GiB"
        )
    if args.fleet:
        if args.compare or args.disk_dir is not None:
            raise UserError(
                "--fleet compares the fleet without and with a store under one --policy; leave --compare and --disk-dir out"
            )
        if args.policy == "recompute" or args.host_tokens < args.page_size:
            raise UserError(
                "--fleet needs a tiered policy (demote, prefetch, predict) and a host tier (--host-tokens >= --page-size)"
            )
        from .sim.fleet import fleet_whatif

        base = dataclasses.replace(
            base, store_bandwidth=args.store_bandwidth * 1e9, store_latency_s=args.store_latency_us * 1e-6
        )
        result = fleet_whatif(requests, base, args.fleet, args.route, progress=progress)
    elif args.compare:
        if args.disk_dir is not None:
            raise UserError("--compare runs every policy on a fresh disk tier; leave --disk-dir out")
        result = compare(
            requests,
            base,
            POLICIES,
            progress=None if args.quiet else progress,
            workers=args.workers,
            checkpoint=args.report if args.checkpoint_every else None,
            checkpoint_every=args.checkpoint_every or 0,
        )
    else:
        from .sim.run import checkpoint_path

        ckpt = checkpoint_path(args.report, args.policy) if args.checkpoint_every else None
        rep = run_policy(requests, base, progress.callback(args.policy), ckpt, args.checkpoint_every or 0)
        result = {"version": 1, "kind": "replay", "policies": {args.policy: rep}}
    result["trace"] = {
        "path": str(args.trace),
        "requests": len(requests),
        "limit": args.limit,
        "notes": requests.notes.lines(),
    }
    return result


# ---- stats -----------------------------------------------------------------------------------
def format_report(result: dict[str, Any]) -> str:
    """The per-tier table of a replay or compare report."""
    rows = [
        (
            "policy",
            "requests",
            "hit%",
            "device",
            "host",
            "disk",
            "miss",
            "ttft mean",
            "p50",
            "p90",
            "p99",
            "tok/s",
            "pf prec",
            "pf cov",
        )
    ]
    for name, rep in result.get("policies", {}).items():
        h = rep["hit_tokens"]
        pf = rep.get("prefetch") or {}
        rows.append(
            (
                name,
                str(rep["requests"]),
                f"{100 * rep['hit_rate']:.1f}",
                str(h.get("device", 0)),
                str(h.get("host", 0)),
                str(h.get("disk", 0)),
                str(rep["miss_tokens"]),
                f"{rep['ttft_s']['mean']:.3f}",
                f"{rep['ttft_s']['p50']:.3f}",
                f"{rep['ttft_s']['p90']:.3f}",
                f"{rep['ttft_s']['p99']:.3f}",
                f"{rep['throughput_tok_s']:.0f}",
                _fmt(pf.get("precision")),
                _fmt(pf.get("coverage")),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for key, r in (result.get("ratios") or {}).items():
        lines.append(
            f"{key:<22} ttft mean x{_fmt(r['ttft_mean'])}  p90 x{_fmt(r['ttft_p90'])}  throughput x{_fmt(r['throughput'])}"
        )
    for name, rep in result.get("policies", {}).items():
        skipped = rep.get("skipped") or {}
        if skipped.get("requests"):
            total = skipped["requests"] + rep.get("requests_sent", rep["requests"])
            lines.append(
                f"{name}: skipped {skipped['requests']} of {total} requests the server cannot take "
                f"(prompt + output > context {skipped.get('context_len')}: {skipped.get('over_context', 0)}, "
                f"prompt >= its limit {skipped.get('max_input_len')}: {skipped.get('over_max_input', 0)}), "
                f"as SGLang's bench_serving drops them; first: {skipped.get('first')}"
            )
        if rep.get("requests_failed"):
            lines.append(
                f"{name}: FAILED {rep['requests_failed']} of {rep.get('requests_sent', '?')} requests; "
                f"first error: {(rep.get('errors') or {}).get('first_error')}"
            )
        if rep.get("hints"):
            lines.append(format_hints(name, rep["hints"]))
        if rep.get("ttft_by_preceding"):
            lines.append(format_preceding(name, rep["ttft_by_preceding"]))
    return "\n".join(lines)


def format_hints(name: str, h: dict[str, Any]) -> str:
    """One line on the hints a server replay sent (`replay_http`'s report `hints`)."""
    line = (
        f"{name}: hints to {h['url']}: sent {h['sent']}, accepted {h['accepted']}, refused {h['refused']}, "
        f"unresolved {h['unresolved']}, not sent {h['unsent']}"
    )
    srv = h.get("server")
    if srv:
        applied = ", ".join(f"{k} {v}" for k, v in (srv.get("applied") or {}).items() if v)
        line += f"; the server applied {applied or 'none'}, rejected {srv.get('rejected', 0)} when applied"
    if h.get("first_error"):
        line += f"; first error: {h['first_error']}"
    if h.get("endpoint_error"):
        line += f"; HINT API FAILED: {h['endpoint_error']}"
    return line


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def _add_stats(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "stats",
        help="show the per-tier table of a report file or a running server",
        description="Per-tier hit table, prefetch figures and tree view of a replay report or a running server.",
    )
    p.add_argument("source", help="a report JSON written by `replay --report`, or http://HOST:PORT of a server")
    p.add_argument(
        "--plot", type=Path, help="write a PNG: hit rate per tier over time and the TTFT distribution per policy"
    )
    p.add_argument("--json", action="store_true", help="print the raw JSON")
    p.add_argument("--prometheus", action="store_true", help="print Prometheus text (server stats only)")
    p.add_argument(
        "--tokenizer", help="a folder with tokenizer.json (a local HF tokenizer): show the first words of each subtree"
    )
    p.set_defaults(func=cmd_stats)


def _decoder(path: str | None):
    if path is None:
        return None
    from .replay.trace import HFTokenizer

    try:
        return HFTokenizer(path)
    except ImportError:
        raise UserError("--tokenizer needs the `tokenizers` package (pip install tokenizers)") from None
    except FileNotFoundError as exc:
        raise UserError(f"--tokenizer: {exc}") from None
    except Exception as exc:  # tokenizers raises its own exception for a malformed file
        raise UserError(f"--tokenizer {path!r}: cannot read its tokenizer.json: {exc}") from None


def cmd_stats(args: argparse.Namespace) -> int:
    from .tree.view import format_tree

    decoder = _decoder(args.tokenizer)
    if args.source.startswith(("http://", "https://")):
        from .client.stats_client import StatsError, fetch_stats

        if args.plot:
            raise UserError(
                "--plot draws a replay report; give the report JSON written by `replay --report`, not a server URL"
            )
        try:
            stats = fetch_stats(args.source)
        except StatsError as exc:
            raise UserError(str(exc)) from None
        if args.prometheus:
            from .stats import prometheus_text

            print(prometheus_text(stats), end="")
            return 0
        if args.json:
            print(json.dumps(stats, indent=2, sort_keys=True))
            return 0
        print(format_snapshot(stats))
        if stats.get("tree"):
            print("\nlargest subtrees (tokens per tier; last access on the server's clock):")
            print(format_tree(stats["tree"], decoder))
        return 0
    if args.prometheus:
        raise UserError("--prometheus prints a running server's metrics; give http://HOST:PORT, not a report file")
    path = Path(args.source)
    if not path.is_file():
        raise UserError(f"report {args.source!r} is not a file (give a report JSON or http://HOST:PORT)")
    try:
        result = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"report {args.source!r} is not valid JSON: {exc}") from None
    if not isinstance(result, dict) or "policies" not in result:
        raise UserError(f"{args.source!r} is not an sgl-hicache report (no 'policies' key)")
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
        return 0
    print(format_report(result))
    for name, rep in result["policies"].items():
        if rep.get("tree"):
            print(
                f"\n[{name}] largest subtrees at the end of the replay (tokens per tier; age on the replay's virtual clock):"
            )
            print(format_tree(rep["tree"], decoder))
    if args.plot:
        from .plot import plot_report

        try:
            plot_report(result, args.plot)
        except ImportError as exc:  # matplotlib is a dependency; a broken or stripped install says so, not a traceback
            raise UserError(f"--plot needs matplotlib ({exc}); pip install matplotlib") from None
        print(f"plot written to {args.plot}")
    return 0


def format_snapshot(snap: dict[str, Any]) -> str:
    h = snap.get("hit_tokens", {})
    lines = [
        f"requests {snap.get('requests', 0)}   prompt tokens {snap.get('prompt_tokens', 0)}   hit rate {100 * snap.get('hit_rate', 0):.1f}%",
        f"{'tier':<8}{'hit tokens':>12}{'stored':>12}{'capacity':>12}{'evicted':>12}{'promoted':>12}",
    ]
    for t in ("device", "host", "disk"):
        lines.append(
            f"{t:<8}{h.get(t, 0):>12}{snap.get('stored_tokens', {}).get(t, 0):>12}{snap.get('capacity_tokens', {}).get(t, 0):>12}"
            f"{snap.get('evicted_tokens', {}).get(t, 0):>12}{snap.get('promoted_tokens', {}).get(t, 0):>12}"
        )
    for kind, d in (snap.get("prefetch") or {}).items():
        lines.append(
            f"{kind:<8} promoted {d.get('promoted_tokens', 0)}  used {d.get('used_tokens', 0)}  wasted {d.get('wasted_tokens', 0)}  precision {_fmt(d.get('precision'))}"
        )
    lines.append(
        f"coverage {_fmt(snap.get('coverage'))}   bytes moved "
        + ", ".join(f"{k} {v}" for k, v in (snap.get("bytes_moved") or {}).items())
    )
    if snap.get("errors"):
        lines.append("errors " + ", ".join(f"{k}={v}" for k, v in snap["errors"].items()))
    return "\n".join(lines)


# ---- synth -----------------------------------------------------------------------------------
def _add_synth(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "synth",
        help="grow a Mooncake trace to N requests for scale tests (same session lengths, gaps, sharing)",
        description="Write a Mooncake JSONL trace of N requests grown from SOURCE: sessions resampled, private "
        "hash ids shifted per drawn session, shared ids kept (method: sgl_hicache/replay/synth.py).",
    )
    p.add_argument("source", nargs="?", help="a Mooncake JSONL trace (e.g. the shipped one); not with --shape")
    p.add_argument(
        "--requests", type=_positive_int, help="requests to write (1e6-style accepted); required without --shape"
    )
    p.add_argument(
        "--shape",
        choices=("chain", "branch", "agent"),
        help="instead: a generated shape where prediction can pay, as "
        "plain JSONL (sgl_hicache/replay/shapes.py: chain = cold restore with a probe, branch = sibling branches "
        "revisited, agent = tool-call pauses beside other traffic)",
    )
    p.add_argument("--sessions", type=_positive_int, default=24, help="with --shape: sessions (default 24)")
    p.add_argument(
        "--lead",
        type=float,
        default=2.0,
        help="with --shape: seconds from the probe (agent: the hint) to the request it announces",
    )
    p.add_argument(
        "--hints",
        action="store_true",
        help="with --shape chain: each probe carries the client's prefetch hint; with "
        "--shape agent: each step before a tool call carries the framework's prefetch of its prompt, --lead before the tool returns",
    )
    p.add_argument("--out", type=Path, required=True, help="the JSONL file to write")
    p.add_argument("--seed", type=int, default=0, help="resampling seed (default 0)")
    p.add_argument("--block-size", type=_positive_int, default=512, help="tokens per hash id (default 512)")
    p.set_defaults(func=cmd_synth)


def cmd_synth(args: argparse.Namespace) -> int:
    from .replay.synth import synthesise, write_trace

    if args.shape is not None:
        return _synth_shape(args)
    if args.source is None or args.requests is None:
        raise UserError("synth needs SOURCE and --requests (or --shape)")
    src = Path(args.source)
    if not src.is_file():
        raise UserError(f"source trace {str(src)!r} is not a file")
    if args.out.is_dir():
        raise UserError(f"--out {str(args.out)!r} is a directory; give a file path")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(args.out.suffix + ".tmp")
    with tmp.open("w") as f:
        n = write_trace(synthesise(src, args.requests, seed=args.seed, block_size=args.block_size), f)
    tmp.replace(args.out)
    print(f"wrote {n} requests to {args.out}")
    return 0


def _synth_shape(args: argparse.Namespace) -> int:
    from .replay.shapes import SHAPES, write_plain

    if args.source is not None or args.requests is not None:
        raise UserError("--shape generates its own requests: leave SOURCE and --requests out")
    if args.hints and args.shape not in ("chain", "agent"):
        raise UserError("--hints goes with --shape chain or --shape agent")
    kw = {"hints": True} if args.hints else {}
    requests = SHAPES[args.shape](sessions=args.sessions, lead_s=args.lead, seed=args.seed, **kw)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as f:
        n = write_plain(requests, f)
    print(f"wrote {n} requests ({args.shape}) to {args.out}")
    return 0


# ---- serve -----------------------------------------------------------------------------------
def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve", help="launch SGLang with sgl_hicache tiering (flags after -- go to SGLang)", add_help=False
    )
    p.set_defaults(func=None)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sgl-hicache", description="A memory hierarchy for SGLang's radix prefix cache."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_replay(sub)
    _add_stats(sub)
    _add_synth(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "serve":
        try:
            from .client.launch import main as serve_main
        except ImportError as exc:
            print(
                f"sgl-hicache serve: SGLang is not installed ({exc}); run scripts/install_sglang_cpu.sh",
                file=sys.stderr,
            )
            return 2
        return serve_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (UserError, TraceError, ConfigError) as exc:
        print(f"sgl-hicache {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except ReplayFailed as exc:
        print(f"sgl-hicache {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"sgl-hicache {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"sgl-hicache {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
