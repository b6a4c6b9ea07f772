"""The walk every served model kind's server test takes (not a test module): one prompt served from
scratch, from a device hit, from a host hit, from a disk hit, and after a restart, with greedy
outputs and logprobs compared; plus the check that makes those equalities non-vacuous (a token
changed in the last cached page moves the logprobs) and the scheduler-thread check.

The server helpers (`_gen_lp`, `_flood`, `_settled_pool`, `_logprob_diff`) live in test_sglang_e2e.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from test_sglang_e2e import LOGPROB_TOL, VOCAB, _flood, _gen_lp, _logprob_diff, _settled_pool

TIERS = ("device", "host", "disk")


@dataclass
class TierWalk:
    """What one prompt gave from scratch and from each tier: `outputs[name]` the greedy ids,
    `logprobs[name]` as `_gen_lp` returns them, `hits[name]` the cached tokens by source, `metas[name]`
    the response's whole `meta_info`. Every request asks for `n` output tokens."""

    prompt: list[int]
    hit: int
    start: int
    n: int = 8
    outputs: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, dict] = field(default_factory=dict)
    hits: dict[str, dict] = field(default_factory=dict)
    metas: dict[str, dict] = field(default_factory=dict)

    def serve(self, srv, name: str, start: int) -> dict:
        """Serve the prompt with logprobs from `start` on, recorded as `name`; returns its hits by source."""
        meta: dict = {}
        self.outputs[name], self.hits[name], self.logprobs[name] = _gen_lp(srv, self.prompt, start, self.n, meta)
        self.metas[name] = meta
        return self.hits[name]


def walk_tiers(
    srv, prompt: list[int], hit: int, start: int | None = None, disk_flood: int = 20, n: int = 8
) -> TierWalk:
    """Serve `prompt` from scratch, then with its first `hit` tokens from the device, the host and the
    disk tier (floods of 300-token prompts push it down one tier at a time), asserting each hit came
    from that tier; at the disk step the whole hit, nothing of it from device or host. Logprobs are
    asked from `start` (default `hit`) on; every request generates `n` tokens."""
    walk = TierWalk(prompt, hit, hit if start is None else start, n)
    d = walk.serve(srv, "scratch", 0)
    assert sum(d.values()) == 0, d
    d = walk.serve(srv, "device", walk.start)
    assert d["device"] == hit, d
    _flood(srv, 2, 4)  # the prompt leaves the device, stays on host
    d = walk.serve(srv, "host", walk.start)
    assert d["host"] > 0 and d["host"] + d["storage"] == hit, d
    _flood(srv, 3, disk_flood)  # it leaves device and host, stays on disk
    d = walk.serve(srv, "disk", walk.start)
    # the flood left none of it above the disk: a page served from device or host here is a page the
    # tiers above kept (or a hit reported from the wrong tier), not a disk read
    assert d["storage"] == hit and d["device"] == d["host"] == 0, d
    return walk


def assert_tiers_equal(walk: TierWalk, reference: str = "scratch", label: str = "") -> None:
    """Every tier's greedy ids equal the reference run's and its logprobs are within `LOGPROB_TOL`."""
    names = [n for n in TIERS if n != reference]
    outs = {n: walk.outputs[n] for n in [reference, *names]}
    assert len({tuple(o) for o in outs.values()}) == 1, outs
    diffs = {n: _logprob_diff(walk.logprobs[reference], walk.logprobs[n]) for n in names}
    print(f"\n{label} logprob |diff| vs {reference}: {diffs}")
    assert all(d <= LOGPROB_TOL for d in diffs.values()), diffs


def assert_a_changed_cached_page_moves(srv, walk: TierWalk, reference: str = "scratch", where: str = "output") -> None:
    """One token changed in the last cached page moves the logprobs far past the tolerance, so the
    tier equalities are not vacuous. `where="output"` compares the output tokens' logprobs;
    `"input"` the prompt positions after `start` (where outputs are too short to show it)."""
    changed = list(walk.prompt)
    pos = walk.hit - 3
    changed[pos] = (walk.prompt[pos] - 16 + 1) % (VOCAB - 16) + 16
    lp = _gen_lp(srv, changed, walk.start, walk.n)[2]
    ref = walk.logprobs[reference]
    if where == "output":
        late = max(abs(a[1] - b[1]) for a, b in zip(lp["output"], ref["output"]))
    else:
        late = max(abs(lp["input"][q][1] - ref["input"][q][1]) for q in range(walk.start + 1, len(walk.prompt)))
    print(f"logprob |diff| with a token of the last cached page changed: {late:.4f}")
    assert late > 1000 * LOGPROB_TOL, late


def assert_settled_and_clean(srv, io: bool = True) -> dict:
    """No request holds pool pages, the tree's invariants hold, and (with `io`) the scheduler thread
    made no copy, disk write, sleep or wait and the loads went layer by layer. Returns the state."""
    st = _settled_pool(srv)
    pool = st["pool"]
    assert pool["request_held_tokens"] == 0 and pool["check"] == "ok", pool
    if io:
        calls = dict(st["scheduler_io"])
        offenders = calls.pop("first_offender")
        assert calls["copy"] == 0 and not calls.get("copy_by_link"), (calls, offenders)
        assert calls["disk_write"] == calls["sleep"] == calls["event_wait"] == 0, (calls, offenders)
        assert st["layer_loads"]["loads"] > 0, st["layer_loads"]
    return st


def assert_restart_serves_from_disk(again, walk: TierWalk, reference: str = "scratch") -> dict:
    """A restarted server (same disk directory) serves the prompt's whole hit from disk with the same
    greedy ids and logprobs as the reference run. Returns that response's `meta_info`."""
    meta: dict = {}
    out, d, lp = _gen_lp(again, walk.prompt, walk.start, walk.n, meta)
    assert d["storage"] == walk.hit and d["device"] == d["host"] == 0, d
    assert out == walk.outputs[reference], (out, walk.outputs[reference])
    diff = _logprob_diff(walk.logprobs[reference], lp)
    print(f"logprob |diff| after the restart: {diff}")
    assert diff <= LOGPROB_TOL, diff
    return meta
