"""Where a profiled process spent its time: a summary of py-spy's collapsed stacks (`--format raw`).

    .venv-sglang/bin/python -m benchmarks.server.profile_summary PROFILE.txt [PROFILE2.txt ...] [--json out.json]

For each file: samples, the share of samples whose stack passes through each phase of SGLang's
scheduler loop (forward, batch formation, result processing, idle wait) and through any sgl_hicache
frame (our cache calls, by function), and the top functions by self time; under `threads`, the same
phases for the scheduler thread alone and how busy the other threads were (`thread_split`). `benchmarks/server/compare.py
--profile DIR` writes such files for the scheduler process of every run, so two servers can be compared
on the same slice.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

# a phase is the first frame of the stack matching one of these (function name, file fragment)
PHASES = {
    "forward": re.compile(r"\b(run_batch|forward_batch_generation|forward_extend|forward_decode)\b"),
    "batch formation": re.compile(r"\b(get_next_batch_to_run|get_new_batch_prefill)\b"),
    "result processing": re.compile(r"\b(process_batch_result\w*)\b"),
    "receive requests": re.compile(r"\b(recv_requests|process_input_requests)\b"),
}
_FRAME = re.compile(r"^(?P<func>[^ (]+) \((?P<file>[^:)]+)(?::\d+)?\)$")


def parse(path: Path) -> Counter[tuple[str, ...]]:
    stacks: Counter[tuple[str, ...]] = Counter()
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        stacks[tuple(stack.split(";"))] += int(count)
    return stacks


def summarize(stacks: Counter[tuple[str, ...]], top: int = 15) -> dict[str, Any]:
    total = sum(stacks.values()) or 1
    phases: Counter[str] = Counter()
    ours: Counter[str] = Counter()
    self_time: Counter[str] = Counter()
    for stack, n in stacks.items():
        phase = next((name for f in stack for name, rx in PHASES.items() if rx.search(f)), "other")
        phases[phase] += n
        mine = next((f for f in stack if "sgl_hicache" in f), None)  # the outermost cache frame
        if mine is not None:
            ours[mine.split(" (")[0] + " (" + mine.split("sgl_hicache/")[-1]] += n
        self_time[stack[-1]] += n
    share = lambda c: {k: round(v / total, 4) for k, v in c.most_common(top)}  # noqa: E731
    return {
        "samples": total,
        "phases": share(phases),
        "sgl_hicache_share": round(sum(ours.values()) / total, 4),
        "sgl_hicache_calls": share(ours),
        "top_self": share(self_time),
    }


# py-spy's raw stacks carry no thread id: the scheduler's own thread is the one started by the
# process's entry point; every other stack belongs to a helper thread (ours: transfer and disk
# workers; HiCache's: its cache controller's and storage threads)
MAIN_THREAD_ROOT = "<module> (<string>:1)"
IDLE_LEAVES = re.compile(
    r"\b(wait|Condition\.wait|Event\.wait|select|poll|epoll|accept|recv\w*|sleep|get|join|"
    r"_wait_for_tstate_lock|_watchdog_once|serve_forever|communicate|_worker)\b"
)


def thread_split(stacks: Counter[tuple[str, ...]]) -> dict[str, Any]:
    """The scheduler thread's own samples by phase (its idle waits included: a CPU server's loop
    rarely idles), and how busy the other threads were: their samples whose innermost frame is not
    a wait, as a share of the scheduler thread's samples (CPU taken from the forward on 2 cores)."""
    main: Counter[str] = Counter()
    busy: Counter[str] = Counter()
    for stack, n in stacks.items():
        if stack and stack[0] == MAIN_THREAD_ROOT:
            phase = next((name for f in stack for name, rx in PHASES.items() if rx.search(f)), "other")
            main[phase] += n
            if any("sgl_hicache" in f for f in stack):
                main["any sgl_hicache frame"] += n
        elif stack and not IDLE_LEAVES.search(stack[-1].split(" (")[0]):
            busy[stack[-1]] += n
    total = sum(v for k, v in main.items() if k != "any sgl_hicache frame") or 1
    return {
        "scheduler_thread_samples": total,
        "scheduler_thread": {k: round(v / total, 4) for k, v in main.most_common()},
        "other_threads_busy_over_scheduler": round(sum(busy.values()) / total, 4),
        "other_threads_top": {k: round(v / total, 4) for k, v in busy.most_common(6)},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("profiles", nargs="+", type=Path)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    missing = [str(f) for f in a.profiles if not f.is_file()]
    if missing:
        p.error(f"no such profile: {', '.join(missing)}")
    out = {}
    for f in a.profiles:
        stacks = parse(f)
        out[str(f)] = {**summarize(stacks, a.top), "threads": thread_split(stacks)}
    text = json.dumps(out, indent=1)
    if a.json:
        a.json.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
