"""Agents on the real server: sgl_hicache with and without the framework's hints against SGLang HiCache.

    .venv-sglang/bin/python -m benchmarks.server.agents --json benchmarks/results/agent_server.json
    .venv-sglang/bin/python -m benchmarks.server.agents --quick --json /tmp/agent_server_quick.json   # 1 repeat, tiny
    .venv-sglang/bin/python -m benchmarks.server.agents --agent-sessions ../shared/traces/agent-sessions \
        --configs hicache_pt16,sgl_hicache,sgl_hicache_hints --json benchmarks/results/agent_server_sessions.json

Workload: the `agent` shape (`sgl_hicache/replay/shapes.py`) scaled to this CPU: agents of a few
steps over a shared tool spec and a private task, each step's answer a tool call, the next step
`decode_s` + the tool's duration later with the tool's result appended; 70 % short tools, 30 % long
ones; beside them other users' one-shot prompts at a steady rate. The tiers are sized so that a
paused session leaves the device during any pause and, during a long one, the host too (the other
users' prompts write the host tier over several times in a long pause): the turn after a long tool
finds its conversation on disk (HiCache: its file store) unless something kept or brought it back.
Token ids are folded into the model's vocabulary (`benchmarks.lib.traces.fold_into_vocab`).

The same requests run three ways, each on a fresh server (`benchmarks.lib.server_runs.run_one`: the model,
flags, pool sizes and file / disk stores of `benchmarks/server/compare.py`):

- `hicache`: SGLang's HiCache with its file storage backend, host = `--host-ratio` x the device pool;
- `sgl_hicache`: `--radix-cache-backend sgl_hicache`, the same host capacity, disk on, no hints;
- `sgl_hicache_hints`: the same server; the trace is the shape with `pins=True, estimate_sigma=0.5`
  (the framework knows its tools' durations only roughly), sent as an agent framework sends it
  (`replay_http(hints_in_request=True)`, `replay/in_request.py`): each turn followed by a tool call
  carries ``custom_params.agent_hints`` {workflow_id, agent_id, step_id, expected_tool_duration_ms:
  the estimate}, a one-token prefetch call naming ``"<workflow_id>/<agent_id>"`` goes `lead_s`
  before the estimate runs out, and the session's last turn says ``reuse_hint: "end"``;
- `hicache_pt16` (only with `--configs`): `hicache` with its storage prefetch threshold lowered from
  256 tokens (SGLang's default: a miss shorter than that is never loaded from storage) to one page,
  `--hicache-storage-backend-extra-config '{"prefetch_threshold": 16}'`: this trace's sessions are a
  few hundred tokens, so at the default HiCache recomputes what its file store holds.

`--agent-sessions PATH` replaces the shape with a slice of recorded coding-agent sessions
(kv-cache-tester files, `replay/agent_sessions.py`; `benchmarks.lib.traces.agent_session_slice`):
the sessions `--pick` names, each cut to its first `--calls-per-session` calls, one token per
recorded 64-token block (`--block-scale`: contexts of a few hundred tokens to ~1k), a gap between a
call's end and the next cut to `--gap-cap` s, the sessions' starts spread over `--session-spread`
s, time x `--time-scale` (default 0.18: the slice's ~630 s of trace in ~2 min), every call
decoding `--output-tokens` (the next call's prompt holds the recorded answer). The hints are the
reader's: a retention on each call that stops on a tool call (1.25x the time to the next call, off
by up to `--estimate-error`) and an end on a session's last call, which a cut session does not
reach; no prefetch calls. Post-pause
are the calls after a tool (``preceded_by == "tool"``), ``after_person`` those after a person's
message; every session is a job. Device pool 1,024 tokens by default: the four sessions' contexts
(~2.5k tokens at their last kept call) do not fit it, so a paused conversation leaves the device
while the others run, and the host (2x) holds most of them.

Open loop at the trace's times x `--time-scale` (`replay_http`, `trace_clock`; at most
`--concurrency` in flight). Per run: TTFT of the turns that follow a long tool (``post-pause``:
mean, p50, and their hit tokens per tier), all requests' TTFT mean / p50 / p99, job completion time
(per agent: its last turn's send time + TTFT minus its first turn's send time; the mean), hit tokens
per tier, and the server's hint counters (``agent_hints`` in its stats). Runs are interleaved: repeat
r runs the configurations rotated by r. The summary gives medians over repeats with the range, and
the ratios of the medians, `sgl_hicache_hints / hicache` and `sgl_hicache / hicache`, with the
per-repeat paired ratios. Targets: post-pause TTFT with hints <= 0.7x HiCache's and a lower JCT;
without hints <= 1.0x.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.lib.report import git_rev
from benchmarks.lib.server_runs import DEFAULT_MODEL, run_one, warm_up
from benchmarks.lib.traces import agent_session_slice, fold_into_vocab
from sgl_hicache.client.backend_settings import BackendSettings
from sgl_hicache.client.server import SGLangServer
from sgl_hicache.records import PRECEDED_BY
from sgl_hicache.replay.http import replay_http
from sgl_hicache.replay.shapes import agent

CONFIGS = ("hicache", "sgl_hicache", "sgl_hicache_hints", "hicache_pt16")
DEFAULT_CONFIGS = CONFIGS[:3]
SERVER_OF = {
    "hicache": "hicache",
    "sgl_hicache": "sgl_hicache",
    "sgl_hicache_hints": "sgl_hicache",
    "hicache_pt16": "hicache",
}
# HiCache loads from its storage only a miss of at least `prefetch_threshold` tokens (256 by default,
# hybrid_cache_controller.parse_storage_backend_extra_config); this trace's sessions are a few hundred
# tokens, so `hicache_pt16` lowers it to one page, as the trace's sizes are scaled down.
EXTRA_ARGS = {"hicache_pt16": ["--hicache-storage-backend-extra-config", '{"prefetch_threshold": 16}']}
LABELS = {
    "hicache": "SGLang HiCache (host + file)",
    "hicache_pt16": "SGLang HiCache, storage prefetch threshold 16",
    "sgl_hicache": "sgl_hicache, no hints",
    "sgl_hicache_hints": "sgl_hicache, hints in the request",
}
TIERS = ("device", "host", "disk")
PEERS = ("hicache", "hicache_pt16")  # ratios: each sgl_hicache config against each HiCache config run

# The agent shape on this CPU (bench-llama, 2 cores): one run ~2 min of trace. See the module docstring.
SHAPE: dict[str, Any] = {
    "sessions": 8,
    "steps": 5,
    "system_tokens": 32,
    "task_tokens": 64,
    "result_tokens": (16, 48),
    "output_tokens": 16,
    "decode_s": 1.0,
    "short_s": (0.5, 3.0),
    "long_s": (30.0, 60.0),
    "long_share": 0.4,
    "session_gap_s": 4.0,
    "other_tokens": 32,
    "other_gap_s": 2.5,
    "lead_s": 2.0,
    "page_size": 16,
}
QUICK: dict[str, Any] = {
    **SHAPE,
    "sessions": 2,
    "steps": 3,
    "long_s": (6.0, 8.0),
    "long_share": 1.0,
    "session_gap_s": 1.0,
    "other_gap_s": 2.0,
}
SIGMA = 0.5  # the framework's estimate of a tool's duration: the true one x lognormal(0, SIGMA)

# `--agent-sessions`: a slice of the recorded sessions on this CPU (module docstring). Four sessions
# whose contexts stay under ~1k tokens at one token a 64-token block, 24 calls each (~96 calls).
SESSIONS: dict[str, Any] = {
    "pick": ("trace_0403", "trace_0455", "trace_0462", "trace_0472"),
    "calls": 24,
    "block_scale": 1,
    "gap_cap_s": 30.0,
    "session_spread_s": 20.0,
    "estimate_error": 0.5,
    "time_scale": 0.18,
    "device_tokens": 1024,
}


# ------------------------------------------------------------------------------------------ workload
def workload(shape: dict[str, Any], seed: int, vocab: int) -> tuple[list, list]:
    """(the requests without hints, the same requests with the framework's hints), folded into `vocab`."""
    plain = agent(**shape, seed=seed)
    hinted = agent(**shape, seed=seed, pins=True, estimate_sigma=SIGMA)
    assert [r.request_id for r in plain] == [r.request_id for r in hinted]
    return fold_into_vocab(plain, vocab), fold_into_vocab(hinted, vocab)


def post_pause_ids(reqs: list, shape: dict[str, Any]) -> set[str]:
    """The turns that follow a long tool: the gap from the previous turn, less the answer's
    `decode_s`, is at least the long tools' shortest duration (the short ones are all shorter)."""
    last: dict[str, float] = {}
    out: set[str] = set()
    for r in sorted(reqs, key=lambda r: r.arrival_s):
        if not r.session.startswith("agent"):
            continue
        if r.session in last and r.arrival_s - last[r.session] - shape["decode_s"] >= shape["long_s"][0] - 1e-6:
            out.add(r.request_id)
        last[r.session] = r.arrival_s
    return out


def regime(reqs: list, shape: dict[str, Any], pool: int, host: int) -> dict[str, Any]:
    """What the trace asks of the tiers: sizes, rates, and how often a long pause's writes turn the host over."""
    agents = [r for r in reqs if r.session.startswith("agent")]
    span = max(r.arrival_s for r in reqs) - min(r.arrival_s for r in reqs)
    prompt = sum(len(r.input_ids) for r in reqs)
    longest = max(len(r.input_ids) for r in reqs)
    # tokens a request adds that no earlier one had: the others' whole prompts, a step's new part
    seen: dict[str, int] = {}
    new = 0
    for r in sorted(reqs, key=lambda r: r.arrival_s):
        new += len(r.input_ids) - seen.get(r.session, 0)
        seen[r.session] = len(r.input_ids) + shape["output_tokens"]
    rate = new / span if span else 0.0
    return {
        "requests": len(reqs),
        "agent_turns": len(agents),
        "others": len(reqs) - len(agents),
        "trace_s": span,
        "prompt_tokens": prompt,
        "new_tokens": new,
        "new_tokens_per_s": rate,
        "longest_prompt": longest,
        "last_turn_tokens_mean": statistics.mean(
            max(len(r.input_ids) for r in agents if r.session == s) for s in {r.session for r in agents}
        ),
        "device_tokens": pool,
        "host_tokens": host,
        "host_turnover_s": host / rate if rate else None,
        "device_turnover_s": pool / rate if rate else None,
        "post_pause_turns": len(post_pause_ids(reqs, shape)),
    }


def session_workload(a: argparse.Namespace, vocab: int, workdir: Path) -> tuple[list, list, set[str], set[str]]:
    """`--agent-sessions`: (the calls without hints, with hints, those after a tool, those after a
    person), each call decoding `a.output_tokens` tokens (the next call's prompt holds the recorded answer)."""
    plain, hinted = agent_session_slice(
        a.agent_sessions,
        a.pick,
        a.calls_per_session,
        workdir,
        block_scale=a.block_scale,
        gap_cap_s=a.gap_cap,
        session_spread_s=a.session_spread,
        hint_estimate_error=a.estimate_error,
        hint_seed=a.seed,
        vocab_size=vocab,
    )
    plain = [dataclasses.replace(r, output_length=a.output_tokens) for r in plain]
    hinted = [dataclasses.replace(r, output_length=a.output_tokens) for r in hinted]
    tool = {r.request_id for r in plain if r.preceded_by == "tool"}
    person = {r.request_id for r in plain if r.preceded_by == "person"}
    return plain, hinted, tool, person


def session_regime(reqs: list, pool: int, host: int, time_scale: float) -> dict[str, Any]:
    """What a slice of recorded sessions asks of the tiers (as `regime`, in wall seconds at `time_scale`)."""
    span = (max(r.arrival_s for r in reqs) - min(r.arrival_s for r in reqs)) * time_scale
    seen: dict[str, int] = {}
    new = 0
    for r in sorted(reqs, key=lambda r: r.arrival_s):
        new += max(0, len(r.input_ids) - seen.get(r.session, 0))
        seen[r.session] = len(r.input_ids)
    rate = new / span if span else 0.0
    last = {r.session: len(r.input_ids) for r in sorted(reqs, key=lambda r: r.arrival_s)}
    return {
        "requests": len(reqs),
        "sessions": len(last),
        "preceded_by": {k: sum(1 for r in reqs if r.preceded_by == k) for k in PRECEDED_BY},
        "hints": sum(len(r.hints) for r in reqs),
        "trace_s": span,
        "prompt_tokens": sum(len(r.input_ids) for r in reqs),
        "new_tokens": new,
        "new_tokens_per_s": rate,
        "longest_prompt": max(len(r.input_ids) for r in reqs),
        "last_call_tokens_mean": statistics.mean(last.values()),
        "last_call_tokens_sum": sum(last.values()),
        "device_tokens": pool,
        "host_tokens": host,
        "host_turnover_s": host / rate if rate else None,
        "device_turnover_s": pool / rate if rate else None,
    }


# ------------------------------------------------------------------------------------------ one run
def _pct(xs: list[float], q: float) -> float | None:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


def is_agent(session: str | None) -> bool:
    """Whether a request of the `agent` shape belongs to an agent (not another user's one-shot prompt)."""
    return bool(session) and session.startswith("agent")


def figures(
    rep: dict[str, Any], reqs: list, post: set[str], person: set[str] | None = None, job=is_agent
) -> dict[str, Any]:
    """One run's figures (module docstring) from `replay_http`'s report with `keep_outputs`: `post`
    the post-pause requests, `person` (when given) those after a person's message, `job(session)`
    whether a session counts as a job."""
    recs = [r for r in rep["records"] if r["error"] is None]
    ttft = [r["ttft_s"] for r in recs]
    pp = [r for r in recs if r["request_id"] in post]
    session = {r.request_id: r.session for r in reqs}
    jobs: dict[str, list[dict]] = {}
    for r in recs:
        s = session.get(r["request_id"], "")
        if job(s):
            jobs.setdefault(s, []).append(r)
    turns = {r.session: sum(1 for q in reqs if q.session == r.session) for r in reqs if job(r.session)}
    jct = [
        max(x["arrival_s"] + x["ttft_s"] for x in rs) - min(x["arrival_s"] for x in rs)
        for s, rs in jobs.items()
        if len(rs) == turns[s]  # a job with a failed turn has no completion time
    ]

    def hits(rs: list[dict]) -> dict[str, int]:
        return {t: sum(r[f"hit_{t}"] for r in rs) for t in TIERS}

    ap = [r for r in recs if r["request_id"] in (person or ())]
    out: dict[str, Any] = {
        "requests": len(recs),
        "requests_failed": rep["requests_failed"],
        "first_error": rep["errors"].get("first_error"),
        "ttft_mean_s": statistics.mean(ttft) if ttft else None,
        "ttft_p50_s": _pct(ttft, 0.5),
        "ttft_p99_s": _pct(ttft, 0.99),
        "post_pause_turns": len(pp),
        "post_pause_ttft_mean_s": statistics.mean(r["ttft_s"] for r in pp) if pp else None,
        "post_pause_ttft_p50_s": _pct([r["ttft_s"] for r in pp], 0.5),
        "post_pause_prompt_tokens": sum(r["prompt_tokens"] for r in pp),
        "post_pause_hit_tokens": hits(pp),
        "after_person_turns": len(ap),
        "after_person_ttft_mean_s": statistics.mean(r["ttft_s"] for r in ap) if ap else None,
        "after_person_ttft_p50_s": _pct([r["ttft_s"] for r in ap], 0.5),
        "jct_mean_s": statistics.mean(jct) if jct else None,
        "jobs_complete": len(jct),
        "hit_tokens": hits(recs),
        "prompt_tokens": sum(r["prompt_tokens"] for r in recs),
        "duration_s": rep["duration_s"],
        "per_request": [
            {k: r[k] for k in ("request_id", "arrival_s", "ttft_s", "hit_device", "hit_host", "hit_disk")}
            for r in sorted(recs, key=lambda r: r["arrival_s"])
        ],
    }
    stats = rep.get("server_stats") if isinstance(rep.get("server_stats"), dict) else None
    if stats:  # sgl_hicache only
        out["agent_hints"] = stats.get("agent_hints")
        out["prefetch"] = rep.get("prefetch")
        out["speculation"] = stats.get("speculation")
        out["bytes_moved"] = rep.get("bytes_moved")
        out["backend"] = stats.get("backend")  # admission holds, loads waited, evictions: where time went
    if "in_request_hints" in rep:
        out["in_request_hints"] = {k: v for k, v in rep["in_request_hints"].items() if k != "server"}
    return out


def replayer(
    reqs: list,
    post: set[str],
    a: argparse.Namespace,
    hints: bool,
    vocab: int,
    person: set[str] | None = None,
    job=is_agent,
):
    def replay(srv: SGLangServer) -> dict[str, Any]:
        warm_up(srv.url, vocab, a.output_tokens)
        rep = replay_http(
            reqs,
            srv.url,
            concurrency=a.concurrency,
            max_new_tokens=a.output_tokens,
            timeout_s=a.request_timeout,
            trace_clock=True,
            time_scale=a.time_scale,
            keep_outputs=True,
            hints_in_request=hints,
        )
        return figures(rep, reqs, post, person, job)

    return replay


# ------------------------------------------------------------------------------------------ summary
def _med(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _rng(xs: list) -> list | None:
    xs = [x for x in xs if x is not None]
    return [min(xs), max(xs)] if xs else None


METRICS = (
    "post_pause_ttft_mean_s",
    "post_pause_ttft_p50_s",
    "after_person_ttft_mean_s",
    "after_person_ttft_p50_s",
    "ttft_mean_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "jct_mean_s",
)


def summarize(samples: list[dict[str, Any]], configs: list[str]) -> dict[str, Any]:
    per: dict[str, Any] = {}
    for c in configs:
        ok = [s for s in samples if s["config"] == c and "error" not in s]
        per[c] = {
            "runs": len(ok),
            "runs_failed": len([s for s in samples if s["config"] == c]) - len(ok),
            "requests_failed": sum(s["requests_failed"] for s in ok),
            **{m: {"median": _med([s[m] for s in ok]), "range": _rng([s[m] for s in ok])} for m in METRICS},
            "hit_tokens": {t: _med([s["hit_tokens"][t] for s in ok]) for t in TIERS},
            "post_pause_hit_tokens": {t: _med([s["post_pause_hit_tokens"][t] for s in ok]) for t in TIERS},
            "hit_tokens_range": {t: _rng([s["hit_tokens"][t] for s in ok]) for t in TIERS},
        }
        if any("agent_hints" in s for s in ok):
            ah = [s.get("agent_hints") or {} for s in ok]
            per[c]["agent_hints"] = {
                "applied": [a.get("applied") for a in ah],
                "refused": [a.get("refused") for a in ah],
                "precision": [a.get("precision") for a in ah],
                "requests": [a.get("requests") for a in ah],
            }
    ratios: dict[str, Any] = {}
    pairs = [(c, peer) for peer in PEERS if peer in per for c in configs if c not in PEERS]
    for c, peer in pairs:
        key = f"{c} / {peer}"
        ratios[key] = {}
        for m in METRICS:
            mine, theirs = per[c][m]["median"], per[peer][m]["median"]
            paired = []
            for r in sorted({s["repeat"] for s in samples}):
                x = [s[m] for s in samples if s["repeat"] == r and s["config"] == c and "error" not in s]
                y = [s[m] for s in samples if s["repeat"] == r and s["config"] == peer and "error" not in s]
                if x and y and x[0] is not None and y[0]:
                    paired.append(x[0] / y[0])
            ratios[key][m] = {
                "of_medians": mine / theirs if mine is not None and theirs else None,
                "paired": paired,
                "paired_range": _rng(paired),
            }
    return {"configs": per, "ratios": ratios}


def _f(x: Any, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def render(summary: dict[str, Any]) -> str:
    lines = [
        f"{'config':<34} {'post-pause TTFT mean':>22} {'p50':>7} {'after person':>12} {'TTFT mean':>10} {'p99':>7}"
        f" {'JCT mean':>9} {'hits dev/host/disk (post-pause)':>34}"
    ]
    for c, r in summary["configs"].items():
        pp = r["post_pause_hit_tokens"]
        lines.append(
            f"{LABELS[c]:<34} {_f(r['post_pause_ttft_mean_s']['median'], '22.3f')} {_f(r['post_pause_ttft_p50_s']['median'], '7.3f')}"
            f" {_f(r['after_person_ttft_mean_s']['median'], '12.3f')} {_f(r['ttft_mean_s']['median'], '10.3f')} {_f(r['ttft_p99_s']['median'], '7.3f')} {_f(r['jct_mean_s']['median'], '9.2f')}"
            f" {_f(pp['device'], ',.0f'):>12}/{_f(pp['host'], ',.0f')}/{_f(pp['disk'], ',.0f')}"
        )
    for k, rr in summary["ratios"].items():
        lines.append(
            f"{k:<34} {_f(rr['post_pause_ttft_mean_s']['of_medians'], '22.2f')} {_f(rr['post_pause_ttft_p50_s']['of_medians'], '7.2f')}"
            f" {_f(rr['after_person_ttft_mean_s']['of_medians'], '12.2f')} {_f(rr['ttft_mean_s']['of_medians'], '10.2f')} {_f(rr['ttft_p99_s']['of_medians'], '7.2f')} {_f(rr['jct_mean_s']['of_medians'], '9.2f')}"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats (default 3)")
    p.add_argument(
        "--configs",
        default=",".join(DEFAULT_CONFIGS),
        help=f"subset of {','.join(CONFIGS)} (default {','.join(DEFAULT_CONFIGS)})",
    )
    p.add_argument("--quick", action="store_true", help="tiny: 3 agents of 3 steps, 1 repeat (proves it runs)")
    p.add_argument("--json", help="write all samples and the summary here")
    p.add_argument("--seed", type=int, default=1, help="the trace's seed (the same trace in every run; default 1)")
    p.add_argument("--sessions", type=int, default=None, help=f"agents (default {SHAPE['sessions']})")
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument(
        "--device-tokens", type=int, default=None, help="device pool, --max-total-tokens (default 512; --quick 384)"
    )
    p.add_argument("--host-ratio", type=float, default=2.0, help="host tier = R x the device pool (both caches)")
    p.add_argument("--disk-tokens", type=int, default=None, help="sgl_hicache disk tier (default 2x the prompts)")
    p.add_argument(
        "--output-tokens",
        type=int,
        default=4,
        help="tokens each request decodes (default 4; the trace's answers are a page of ids in the next prompt)",
    )
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight at most (default 32)")
    p.add_argument(
        "--time-scale",
        type=float,
        default=None,
        help=f"send at trace time x S (default 1; --agent-sessions {SESSIONS['time_scale']})",
    )
    g = p.add_argument_group("recorded sessions (instead of the synthetic agent shape)")
    g.add_argument("--agent-sessions", type=Path, default=None, metavar="PATH", help="kv-cache-tester session files")
    g.add_argument(
        "--pick",
        default=",".join(SESSIONS["pick"]),
        help="the sessions replayed, file names without .json, or 'all' (default %(default)s)",
    )
    for flag, typ, key, text in (
        ("--calls-per-session", int, "calls", "first N calls of each session (0: all)"),
        ("--block-scale", int, "block_scale", "tokens a recorded 64-token block becomes"),
        ("--gap-cap", float, "gap_cap_s", "a longer gap between calls is cut to S s"),
        ("--session-spread", float, "session_spread_s", "the sessions start over S s"),
        ("--estimate-error", float, "estimate_error", "the framework's tool-time estimate is off by up to this share"),
    ):
        g.add_argument(flag, type=typ, default=SESSIONS[key], help=f"{text} (default %(default)s)")
    p.add_argument(
        "--sgl-hicache-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a sgl_hicache backend setting for both sgl_hicache configs (a BackendSettings field, JSON value), repeatable",
    )
    p.add_argument(
        "--profile",
        metavar="DIR",
        default=None,
        help="py-spy each run's scheduler process (collapsed stacks DIR/<run>.txt; benchmarks/server/profile_summary.py)",
    )
    p.add_argument("--workdir", default=None)
    p.add_argument("--keep-logs", default=None, help="copy every server log into this directory")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--request-timeout", type=float, default=600.0)
    a = p.parse_args(argv)
    shape = dict(QUICK if a.quick else SHAPE)
    if a.sessions is not None:
        shape["sessions"] = a.sessions
    if a.quick:
        a.repeats = 1
    if a.device_tokens is None:
        a.device_tokens = SESSIONS["device_tokens"] if a.agent_sessions else 384 if a.quick else 512
    if a.time_scale is None:
        a.time_scale = SESSIONS["time_scale"] if a.agent_sessions else 1.0
    a.pick = None if a.pick == "all" else [x.strip() for x in a.pick.split(",") if x.strip()]
    a.calls_per_session = a.calls_per_session or None
    configs = [c.strip() for c in a.configs.split(",") if c.strip()]
    bad = [c for c in configs if c not in CONFIGS]
    if bad or not configs:
        p.error(f"--configs: unknown {bad}; choose from {','.join(CONFIGS)}")
    if a.agent_sessions and (a.block_scale < 1 or a.gap_cap <= 0 or a.session_spread < 0 or a.estimate_error < 0):
        p.error("--block-scale >= 1, --gap-cap > 0, --session-spread >= 0, --estimate-error >= 0")
    if a.repeats < 1 or a.time_scale <= 0 or a.device_tokens < 128 or a.host_ratio <= 1 or a.output_tokens < 1:
        p.error("--repeats >= 1, --time-scale > 0, --device-tokens >= 128, --host-ratio > 1, --output-tokens >= 1")
    # the fields run_one reads
    a.page_size, a.sgl_hicache_extra = shape["page_size"], {}
    for item in a.sgl_hicache_set:
        key, sep, raw = item.partition("=")
        if not sep:
            p.error(f"--sgl-hicache-set wants KEY=VALUE, got {item!r}")
        try:
            a.sgl_hicache_extra[key.strip()] = json.loads(raw)
        except ValueError:
            a.sgl_hicache_extra[key.strip()] = raw
    try:
        BackendSettings().replace(**a.sgl_hicache_extra)
    except (TypeError, ValueError) as e:
        p.error(f"--sgl-hicache-set: {e}")
    for k in [k for k in os.environ if k.startswith("SGLHICACHE_") or k == "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"]:
        del os.environ[k]  # no caller's setting leaks into a run

    vocab = json.loads((a.model / "config.json").read_text())["vocab_size"]
    workdir = Path(a.workdir or tempfile.gettempdir())
    workdir.mkdir(parents=True, exist_ok=True)
    host = int(a.device_tokens * a.host_ratio) // a.page_size * a.page_size
    person: set[str] | None = None
    job = is_agent
    if a.agent_sessions:
        try:
            plain, hinted, post, person = session_workload(a, vocab, workdir)
        except (OSError, ValueError) as e:  # TraceError is a ValueError
            p.error(f"--agent-sessions: {e}")
        job = bool
        reg = session_regime(plain, a.device_tokens, host, a.time_scale)
        workload_desc: dict[str, Any] = {
            "agent_sessions": str(a.agent_sessions),
            "pick": a.pick,
            "calls_per_session": a.calls_per_session,
            "block_scale": a.block_scale,
            "gap_cap_s": a.gap_cap,
            "session_spread_s": a.session_spread,
            "hint_estimate_error": a.estimate_error,
            "hint_seed": a.seed,
        }
        print(
            f"recorded sessions: {reg['requests']} calls of {reg['sessions']} sessions (after a tool "
            f"{reg['preceded_by']['tool']}, after a person {reg['preceded_by']['person']}), {reg['trace_s']:.0f} s at "
            f"x{a.time_scale:g}, {reg['new_tokens_per_s']:.0f} new tokens/s, longest {reg['longest_prompt']}, last calls "
            f"{reg['last_call_tokens_sum']} tokens in all; device {a.device_tokens} (turned over in "
            f"{reg['device_turnover_s']:.1f} s), host {host} ({reg['host_turnover_s']:.1f} s)",
            flush=True,
        )
    else:
        plain, hinted = workload(shape, a.seed, vocab)
        post = post_pause_ids(plain, shape)
        reg = regime(plain, shape, a.device_tokens, host)
        workload_desc = {"shape": {**shape, "seed": a.seed, "estimate_sigma": SIGMA}}
        print(
            f"agent trace: {reg['requests']} requests ({reg['agent_turns']} agent turns, {reg['post_pause_turns']} after a "
            f"long tool), {reg['trace_s']:.0f} s, {reg['new_tokens_per_s']:.0f} new tokens/s, longest {reg['longest_prompt']}; "
            f"device {a.device_tokens} (turned over in {reg['device_turnover_s']:.1f} s), host {host} "
            f"({reg['host_turnover_s']:.1f} s); long tools {shape['long_s']} s",
            flush=True,
        )
    if a.disk_tokens is None:
        a.disk_tokens = 2 * sum(len(r.input_ids) for r in plain)
    if reg["longest_prompt"] + a.output_tokens > a.device_tokens:
        p.error(f"--device-tokens {a.device_tokens} is below the longest prompt + output ({reg['longest_prompt']})")

    def _terminate(signum, _frame):  # SIGTERM -> unwind, so every `finally` stops its server
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _terminate)
    samples: list[dict[str, Any]] = []
    t_start = time.monotonic()
    base = {
        "benchmark": "agent_server_sessions" if a.agent_sessions else "agent_server",
        **workload_desc,
        "regime": reg,
    }
    for r in range(a.repeats):
        order = configs[r % len(configs) :] + configs[: r % len(configs)]
        for pos, c in enumerate(order):
            tag = f"r{r}-{c}"
            reqs = hinted if c == "sgl_hicache_hints" else plain
            s = run_one(
                SERVER_OF[c],
                a.device_tokens,
                reqs,
                a,
                workdir,
                tag,
                replay=replayer(reqs, post, a, hints=c == "sgl_hicache_hints", vocab=vocab, person=person, job=job),
                extra_args=EXTRA_ARGS.get(c, ()),
            )
            s.update(config=c, repeat=r, order_pos=pos)
            samples.append(s)
            if "error" in s:
                msg = "ERROR " + s["error"].splitlines()[0][:200]
            else:
                h = s["post_pause_hit_tokens"]
                msg = (
                    f"post-pause TTFT {_f(s['post_pause_ttft_mean_s'], '.3f')}s (p50 {_f(s['post_pause_ttft_p50_s'], '.3f')}), "
                    f"TTFT {s['ttft_mean_s']:.3f}s p99 {s['ttft_p99_s']:.3f}s, JCT {_f(s['jct_mean_s'], '.1f')}s, "
                    f"post-pause hits {h['device']}/{h['host']}/{h['disk']} of {s['post_pause_prompt_tokens']}, "
                    f"failed {s['requests_failed']}"
                )
            print(
                f"[{time.monotonic() - t_start:6.0f}s] {tag:<24} {msg} (run {s['wall_s']:.0f}s, load {s['loadavg_before'][0]:.1f})",
                flush=True,
            )
            if a.json:  # partial results survive an interrupted run
                Path(a.json).write_text(json.dumps({**base, "partial": True, "samples": samples}, indent=1))

    summary = summarize(samples, configs)
    print(render(summary))
    result = {
        **base,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()},
        "config": {
            "quick": a.quick,
            "repeats": a.repeats,
            "configs": configs,
            "model": str(a.model),
            "device_tokens": a.device_tokens,
            "host_ratio": a.host_ratio,
            "host_tokens": host,
            "disk_tokens": a.disk_tokens,
            "concurrency": a.concurrency,
            "output_tokens": a.output_tokens,
            "time_scale": a.time_scale,
            "sgl_hicache_extra": a.sgl_hicache_extra,
            "git": git_rev(),
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
        },
        "wall_s": time.monotonic() - t_start,
        "summary": summary,
        "samples": samples,
        "note": (
            "ratios are config / hicache of the medians across repeats (paired: per repeat); < 1 favours the "
            "config. post-pause: the turns after a long tool. Hit tokens from each reply's cached_tokens_details "
            "(storage -> disk)."
        ),
    }
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(result, indent=1))
    return 1 if all("error" in s for s in samples) else 0


if __name__ == "__main__":
    raise SystemExit(main())
