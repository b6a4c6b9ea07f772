"""The command line as an operator meets it, without SGLang: `replay --url` against a tiny local HTTP
stand-in for a server (what it asks the server, honest exit codes), `stats` on a dead URL, progress
output in logs, and the tree view."""

from __future__ import annotations

import io
import json
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from sgl_hicache.cli import main

REPO = Path(__file__).resolve().parents[2]
TRACE = REPO / "traces" / "mooncake_conversation_trace.jsonl"
CLI = [sys.executable, "-m", "sgl_hicache.cli"]
VOCAB = 1024


class StandIn:
    """An HTTP server answering like SGLang 0.5.23 with the sgl_hicache plugin: /server_info (with
    `sgl_hicache_model`), /model_info, /health and streamed /generate. `fail(i)` decides, per request
    in arrival order, whether /generate answers HTTP 500."""

    def __init__(self, fail=lambda i: False, vocab: int | None = VOCAB, max_input: int = 1018) -> None:
        self.fail, self.vocab, self.max_input = fail, vocab, max_input
        self.max_id_seen = -1
        self.count = 0
        self.lock = threading.Lock()
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _json(self, obj, status=200):
                body = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path == "/server_info":
                    states = [
                        {
                            "sgl_hicache_model": {
                                "vocab_size": stand_in.vocab,
                                "context_len": 4096,
                                "special_token_ids": [1, 2],
                            }
                        }
                        if stand_in.vocab
                        else {}
                    ]
                    self._json(
                        {
                            "max_req_input_len": stand_in.max_input,
                            "page_size": 16,
                            "max_total_num_tokens": 1024,
                            "context_length": None,
                            "internal_states": states,
                        }
                    )
                elif self.path == "/model_info":
                    self._json({"model_path": "/nonexistent/model"})
                elif self.path == "/health":
                    self._json({})
                else:
                    self._json({"detail": "Not Found"}, 404)

            def do_POST(self):
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with stand_in.lock:
                    i = stand_in.count
                    stand_in.count += 1
                    stand_in.max_id_seen = max(stand_in.max_id_seen, *req["input_ids"])
                if stand_in.fail(i):
                    self._json({"error": {"message": f"boom {i}"}}, 500)
                    return
                n = req["sampling_params"]["max_new_tokens"]
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                chunk = {
                    "output_ids": list(range(3, 3 + n)),
                    "meta_info": {
                        "completion_tokens": n,
                        "cached_tokens": 0,
                        "cached_tokens_details": {"device": 0, "host": 0, "storage": 0},
                    },
                }
                self.wfile.write(f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode())

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


REPLAY = [
    "replay",
    str(TRACE),
    "--limit",
    "11",
    "--scale",
    "16",
    "--max-new-tokens",
    "2",
    "--concurrency",
    "2",
    "--quiet",
]


def _run(args, **kw):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, cwd=REPO, timeout=120, **kw)


def test_replay_takes_the_vocabulary_from_the_server_and_reports_skips(tmp_path):
    report = tmp_path / "r.json"
    with StandIn(max_input=300) as srv:
        proc = _run([*REPLAY, "--url", srv.url, "--report", str(report)])
        assert proc.returncode == 0, proc.stderr
        assert 0 <= srv.max_id_seen < VOCAB  # the trace reader's default vocabulary is 32,000
        assert f"vocab {VOCAB} (server)" in proc.stdout
        rep = json.loads(report.read_text())["policies"]["server"]
        assert rep["requests_failed"] == 0 and rep["server"]["vocab_size"] == VOCAB
        assert rep["requests_skipped"] > 0 and rep["requests_sent"] + rep["requests_skipped"] == 11
        assert "skipped" in proc.stdout and "bench_serving" in proc.stdout
    with StandIn() as srv:  # --vocab-size overrides the server's answer
        assert _run([*REPLAY, "--url", srv.url, "--vocab-size", "100"]).returncode == 0
        assert srv.max_id_seen < 100


def test_replay_against_a_server_that_does_not_tell_its_vocabulary_needs_vocab_size():
    with StandIn(vocab=None) as srv:
        proc = _run([*REPLAY, "--url", srv.url])
        assert proc.returncode == 2 and "--vocab-size" in proc.stderr and "Traceback" not in proc.stderr
        assert srv.count == 0
        assert _run([*REPLAY, "--url", srv.url, "--vocab-size", "512"]).returncode == 0


def test_some_failed_requests_exit_non_zero_with_the_first_error(tmp_path):
    report = tmp_path / "r.json"
    with StandIn(fail=lambda i: i % 3 == 1) as srv:
        proc = _run([*REPLAY, "--url", srv.url, "--report", str(report)])
    assert proc.returncode == 1
    assert "FAILED 4 of 11 requests; first error: RuntimeError: HTTP 500" in proc.stdout  # on the table
    assert "4 of 11 requests failed; first error:" in proc.stderr and "boom" in proc.stderr
    errors = json.loads(report.read_text())["policies"]["server"]["errors"]
    assert errors["requests_failed"] == 4 and "boom" in errors["first_error"]


def test_all_failed_is_an_error_not_a_table_of_zeros(tmp_path):
    report = tmp_path / "r.json"
    with StandIn(fail=lambda i: True) as srv:
        proc = _run([*REPLAY, "--url", srv.url, "--report", str(report)])
    assert proc.returncode == 1
    assert "hit%" not in proc.stdout  # no table
    assert "all 11 requests failed; first error: RuntimeError: HTTP 500" in proc.stderr
    assert json.loads(report.read_text())["policies"]["server"]["requests_failed"] == 11


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("cmd", [["stats"], ["stats", "--prometheus"], [*REPLAY[:2], "--url"]])
def test_a_dead_url_is_one_error_line(cmd):
    url = f"http://127.0.0.1:{_closed_port()}"
    proc = _run([*cmd[:2], url, *cmd[2:]] if cmd[0] == "stats" else [*cmd, url])
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "cannot reach" in proc.stderr and "is the server running?" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["stats", "http://127.0.0.1:1", "--plot", "x.png"], "--plot draws a replay report"),
        (["replay", str(TRACE), "--url", "http://127.0.0.1:1", "--compare"], "--compare runs the embedded engine"),
        (["replay", str(TRACE), "--max-new-tokens", "4"], "it needs --url"),
        (["stats", str(TRACE), "--tokenizer", "/nonexistent"], "--tokenizer"),
    ],
)
def test_other_misuse_is_a_clear_error(args, message, tmp_path):
    proc = _run(args)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


def test_stats_prometheus_of_a_report_is_refused(tmp_path):
    report = tmp_path / "r.json"
    assert (
        main(
            [
                "replay",
                str(TRACE),
                "--limit",
                "5",
                "--scale",
                "16",
                "--page-size",
                "16",
                "--quiet",
                "--report",
                str(report),
            ]
        )
        == 0
    )
    proc = _run(["stats", str(report), "--prometheus"])
    assert proc.returncode == 2 and "running server" in proc.stderr


EMBEDDED = [
    "replay",
    str(TRACE),
    "--limit",
    "20",
    "--scale",
    "16",
    "--page-size",
    "16",
    "--device-tokens",
    "4096",
    "--host-tokens",
    "4096",
    "--disk-tokens",
    "65536",
    "--policy",
    "demote",
]


def test_progress_in_a_log_is_plain_lines_and_quiet_is_silent():
    proc = _run(EMBEDDED)  # stderr is a pipe, not a terminal
    assert proc.returncode == 0, proc.stderr
    assert "\r" not in proc.stderr and "\r" not in proc.stdout
    assert "replay demote: 20/20 requests (100%)" in proc.stderr
    quiet = _run([*EMBEDDED, "--quiet"])
    assert quiet.returncode == 0 and quiet.stderr == ""


def test_progress_lines_are_periodic_and_a_terminal_gets_a_tqdm_bar():
    from sgl_hicache.progress import Progress

    log = io.StringIO()
    p = Progress(stream=log, interval_s=3600)
    for i in range(1, 101):
        p("x", i, 100)
    assert log.getvalue().count("\n") == 1 and "100/100" in log.getvalue()  # only the final line within the interval
    tty = io.StringIO()
    bar = Progress(stream=tty, terminal=True)
    for i in range(1, 11):
        bar("x", i, 10)
    bar.close()
    assert "10/10" in tty.getvalue() and "req" in tty.getvalue()
    silent = io.StringIO()
    Progress(quiet=True, stream=silent)("x", 1, 1)
    assert silent.getvalue() == ""


def _word_tokenizer(folder: Path) -> list[str]:
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    words = [
        "[UNK]",
        "system",
        "you",
        "are",
        "a",
        "helpful",
        "cache",
        "operator",
        "tell",
        "me",
        "about",
        "disks",
        "and",
        "hosts",
        "please",
        "now",
        "why",
        "is",
        "the",
        "sky",
        "blue",
        "today",
    ]
    tok = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    return words


def test_tree_view_shows_depth_tokens_hits_age_residency_and_text(tmp_path):
    tok = tmp_path / "tok"
    _word_tokenizer(tok)
    system = "system you are a helpful cache operator now "
    trace = tmp_path / "t.jsonl"
    lines = [
        {
            "session": "a",
            "prompt": system + "tell me about disks and hosts please now",
            "output_length": 2,
            "timestamp": 0,
        },
        {"session": "b", "prompt": system + "why is the sky blue today please now", "output_length": 2, "timestamp": 1},
        {
            "session": "a",
            "prompt": system + "tell me about disks and hosts please now why is the sky",
            "output_length": 2,
            "timestamp": 2,
        },
    ]
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    report = tmp_path / "r.json"
    args = [
        "replay",
        str(trace),
        "--tokenizer",
        str(tok),
        "--page-size",
        "4",
        "--device-tokens",
        "64",
        "--host-tokens",
        "64",
        "--disk-tokens",
        "0",
        "--policy",
        "demote",
        "--quiet",
        "--report",
        str(report),
    ]
    assert _run(args).returncode == 0
    tree = json.loads(report.read_text())["policies"]["demote"]["tree"]
    root = tree[0]
    assert root["depth"] == 1 and root["hits"] >= 2 and root["subtree_tokens"] >= 8 and root["age_s"] is not None
    assert root["children"][0]["depth"] == 2
    plain = _run(["stats", str(report)])
    assert plain.returncode == 0
    header = next(ln for ln in plain.stdout.splitlines() if ln.startswith("subtree"))
    for column in ("depth", "tokens", "hits", "last access", "device", "host", "disk", "tiers"):
        assert column in header
    assert "ago" in plain.stdout and "[" not in plain.stdout.split("largest subtrees")[1]  # no raw token-id lists
    text = _run(["stats", str(report), "--tokenizer", str(tok)])
    assert text.returncode == 0, text.stderr
    assert '"system you are a helpful cache operator now' in text.stdout  # the shared prefix
    assert '"tell me about' in text.stdout or '"why is the' in text.stdout  # a branch
