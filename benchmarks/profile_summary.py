"""Where a profiled process spent its time: a summary of py-spy's collapsed stacks (`--format raw`).

    .venv-sglang/bin/python benchmarks/profile_summary.py PROFILE.txt [PROFILE2.txt ...] [--json out.json]

For each file: samples, the share of samples whose stack passes through each phase of SGLang's
scheduler loop (forward, batch formation, result processing, idle wait) and through any sgl_hicache
frame (our cache calls, by function), and the top functions by self time. `benchmarks/server_compare.py
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
    return {"samples": total, "phases": share(phases), "sgl_hicache_share": round(sum(ours.values()) / total, 4),
            "sgl_hicache_calls": share(ours), "top_self": share(self_time)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("profiles", nargs="+", type=Path)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    missing = [str(f) for f in a.profiles if not f.is_file()]
    if missing:
        p.error(f"no such profile: {', '.join(missing)}")
    out = {str(f): summarize(parse(f), a.top) for f in a.profiles}
    text = json.dumps(out, indent=1)
    if a.json:
        a.json.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
