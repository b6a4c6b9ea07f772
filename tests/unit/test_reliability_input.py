"""Bad input from users: bad configuration values raise ConfigError naming the field; random
flag values given to `sgl-hicache replay` end with status 0 or 2 and a one-line message, never an
uncaught exception (hypothesis, in-process through `sgl_hicache.cli.main`, a three-request trace)."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SMALL_LAYOUT
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from sgl_hicache.cache import TieredCache
from sgl_hicache.cli import main
from sgl_hicache.config import CacheConfig, ConfigError, KVLayout
from sgl_hicache.tiers.base import TierIOError

TINY_TRACE = (
    '{"timestamp": 0, "input_length": 700, "output_length": 3, "hash_ids": [0, 1]}\n'
    '{"timestamp": 10, "input_length": 1100, "output_length": 2, "hash_ids": [0, 1, 2]}\n'
    '{"timestamp": 20, "input_length": 300, "output_length": 2, "hash_ids": [5]}\n'
)


def cfg(**kw) -> CacheConfig:
    base = dict(layout=SMALL_LAYOUT, device_tokens=64, host_tokens=64, disk_tokens=0, page_size=4)
    base.update(kw)
    return CacheConfig(**base)


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(device_tokens=-64), "device_tokens"),
        (dict(host_tokens=-1), "host_tokens"),
        (dict(disk_tokens=-4), "disk_tokens"),
        (dict(host_tokens="64"), "host_tokens"),
        (dict(device_tokens=2.5), "device_tokens"),
        (dict(device_tokens=2), "device_tokens"),  # less than one page
        (dict(page_size=0), "page_size"),
        (dict(page_size=-16), "page_size"),
        (dict(eviction_policy="fifo"), "eviction policy 'fifo'"),
        (dict(eviction_policy=None), "eviction policy None"),
        (dict(write_policy="always"), "write policy 'always'"),
        (dict(disk_write_policy="sometimes"), "disk write policy 'sometimes'"),
        (dict(predictor="oracle"), "predictor 'oracle'"),
        (dict(write_through_threshold=0), "write_through_threshold"),
        (dict(write_through_threshold="2"), "write_through_threshold"),
        (dict(disk_tokens=64), "disk_dir"),  # a disk tier needs a directory
    ],
)
def test_bad_cache_config_names_the_field(kw, words) -> None:
    with pytest.raises(ConfigError) as info:
        cfg(**kw)
    assert words in str(info.value), str(info.value)


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(num_layers=0), "num_layers"),
        (dict(num_kv_heads=-2), "num_kv_heads"),
        (dict(head_dim="8"), "head_dim"),
        (dict(dtype="int8"), "dtype"),
        (dict(architecture=""), "architecture"),
    ],
)
def test_bad_layout_names_the_field(kw, words) -> None:
    base = dict(num_layers=2, num_kv_heads=2, head_dim=8)
    base.update(kw)
    with pytest.raises(ConfigError) as info:
        KVLayout(**base)
    assert words in str(info.value)


def test_disk_dir_that_is_a_file_or_under_a_file(tmp_path: Path) -> None:
    f = tmp_path / "a-file"
    f.write_text("x")
    with pytest.raises(ConfigError, match=r"disk_dir .* not a directory"):
        cfg(disk_dir=f, disk_tokens=64)
    # a path that cannot be created fails when the cache opens it, naming the path (never later)
    with pytest.raises(TierIOError, match="a-file"):
        TieredCache(cfg(disk_dir=f / "tier", disk_tokens=64))


# ---- the command line, fuzzed -----------------------------------------------------------------
JUNK = [
    "",
    "-1",
    "0",
    "1e3",
    "1e9",
    "abc",
    "nan",
    "inf",
    "-0",
    "1.5",
    " 7",
    "0x10",
    "99999999999999999999",
    "--",
    "\u00e9",
    "1_000",
]
INT_FLAGS = [
    "--limit",
    "--block-size",
    "--page-size",
    "--concurrency",
    "--max-batch-tokens",
    "--device-tokens",
    "--host-tokens",
    "--disk-tokens",
    "--predictor-budget",
    "--max-new-tokens",
]
CHOICE_FLAGS = {
    "--format": ["auto", "mooncake", "sharegpt", "plain"],
    "--policy": ["recompute", "demote", "prefetch", "predict"],
    "--model": ["llama3-8b", "qwen3-480b"],
    "--hardware": ["h200", "cpu-measured"],
    "--eviction": ["lru", "lfu"],
    "--write-policy": ["write_back", "write_through", "write_through_selective"],
}
SWITCHES = ["--compare", "--trace-clock", "--quiet"]

int_value = st.one_of(st.integers(-3, 70_000).map(str), st.sampled_from(JUNK), st.text(max_size=4))
flag = st.one_of(
    st.tuples(st.sampled_from(INT_FLAGS), int_value),
    # --scale: small values only -- it multiplies every prompt's length (a value above --block-size is refused)
    st.tuples(st.just("--scale"), st.one_of(st.integers(-2, 600).map(str), st.sampled_from(JUNK[:12]))),
    st.tuples(
        st.just("--time-scale"),
        st.one_of(st.floats(allow_nan=True, allow_infinity=True).map(repr), st.sampled_from(JUNK)),
    ),
    st.sampled_from(sorted(CHOICE_FLAGS)).flatmap(
        lambda f: st.tuples(st.just(f), st.one_of(st.sampled_from(CHOICE_FLAGS[f]), st.text(max_size=6)))
    ),
    st.tuples(st.sampled_from(SWITCHES)),
    st.tuples(st.sampled_from(["--disk-dir", "--report"]), st.sampled_from(["DIR", "FILE", "MISSING/x"])),
)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("cli-fuzz")
    (d / "trace.jsonl").write_text(TINY_TRACE)
    (d / "FILE").write_text("not a directory")
    (d / "DIR").mkdir()
    return d


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(flags=st.lists(flag, max_size=5))
def test_random_replay_flags_exit_0_or_2_never_a_traceback(flags, workdir: Path, capsys) -> None:
    argv = [
        "replay",
        str(workdir / "trace.jsonl"),
        "--quiet",
        "--device-tokens",
        "4096",
        "--host-tokens",
        "4096",
        "--disk-tokens",
        "16384",
        "--page-size",
        "16",
        "--scale",
        "16",
    ]
    for f in flags:
        argv.append(f[0])
        if len(f) > 1:
            value = f[1]
            if f[0] in ("--disk-dir", "--report"):
                value = str(workdir / value) if value != "DIR" else str(workdir / "DIR" / f"run{len(argv)}")
            argv.append(value)
    cwd = os.getcwd()
    try:
        os.chdir(workdir)  # whatever a flag makes, it makes here
        try:
            status = main(argv)
        except SystemExit as exc:  # argparse's own errors
            status = exc.code
    finally:
        os.chdir(cwd)
    out, err = capsys.readouterr()
    event(f"exit status {status}")
    assert status in (0, 2), (argv, status, err)
    assert "Traceback" not in err and "Traceback" not in out
    if status == 2:
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert lines and "error" in lines[-1], (argv, err)
    else:
        assert "requests" in out


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--device-tokens", "100000000000000"], "GiB of RAM"),
        (["--host-tokens", "1e9", "--device-tokens", "400000000"], "GiB of RAM"),
        (["--scale", "100000000"], "--scale"),
    ],
)
def test_sizes_that_cannot_fit_are_refused_before_allocating(tmp_path: Path, extra, words) -> None:
    """Capacities or a --scale that would need more memory than the machine has: a one-line error,
    status 2, before anything is allocated (run under a 3 GiB address-space limit, so a regression
    fails fast instead of swapping the machine)."""
    trace = tmp_path / "t.jsonl"
    trace.write_text(TINY_TRACE)

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

    proc = subprocess.run(
        [sys.executable, "-m", "sgl_hicache.cli", "replay", str(trace), "--quiet", *extra],
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=limit,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert words in proc.stderr and "Traceback" not in proc.stderr


def test_a_token_count_too_large_to_be_real_is_a_trace_error(tmp_path):
    """Found by the fuzz test: a 32-digit input length reached the token synthesiser (OverflowError)."""
    from sgl_hicache.replay import load_trace
    from sgl_hicache.replay.trace import TraceError

    bad = tmp_path / "bench.jsonl"
    bad.write_text(
        '{"request_rate": 4.0, "input_lens": [99999999999999999999999999999912, 30], "output_lens": [5, 0]}\n'
    )
    with pytest.raises(TraceError, match=r"bench.jsonl:1: .*input_lens\[0\].* must be <= 100,000,000"):
        load_trace(bad, fmt="sglang-bench")
