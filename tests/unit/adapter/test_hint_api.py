"""The server's hint API listener (`sglang/hint_server.py`) without SGLang: what a client POSTs is
validated on the listener's thread (a malformed batch queues nothing and the answer names the hint
and the field), and the scheduler thread drains the rest in order. The backend wiring is tested
with SGLang's real pool in tests/with_sglang/test_sglang_units.py."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from sgl_hicache.policy.hint_rules import HintError
from sgl_hicache.sglang.hints.hint_server import HintListener, parse_hint_batch


def _post(port: int, body) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/hints", data=data, method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture
def listener():
    lst = HintListener(0, status=lambda: {"applied": {"prefetch": 7}}, vocab_size=1000)
    yield lst
    lst.close()


def test_valid_hints_are_queued_in_order_and_drained_once(listener):
    code, out = _post(
        listener.port,
        {
            "hints": [
                {"action": "prefetch", "input_ids": [1, 2, 3]},
                {"action": "pin", "input_ids": [4, 5], "ttl_s": 30},
            ]
        },
    )
    assert (code, out) == (202, {"queued": 2})
    hints = listener.drain()
    assert (
        [h.action for h in hints] == ["prefetch", "pin"] and hints[1].ttl_s == 30.0 and hints[0].input_ids == (1, 2, 3)
    )
    assert listener.drain() == []
    with urllib.request.urlopen(f"http://127.0.0.1:{listener.port}/hints", timeout=5) as r:
        assert json.loads(r.read()) == {"queued": 0, "applied": {"prefetch": 7}}


@pytest.mark.parametrize(
    "body, words",
    [
        (
            {"hints": [{"action": "prefetch", "input_ids": [1]}, {"action": "evict", "input_ids": [1]}]},
            "hint 1: 'action'",
        ),
        ({"hints": [{"action": "retain", "session": "s1"}]}, "names prefixes by 'input_ids'"),
        ({"hints": [{"action": "pin", "input_ids": [1, 2]}]}, "'ttl_s' is required"),
        (
            {"hints": [{"action": "prefetch", "input_ids": [1, 2000]}]},
            "hint 0: 'input_ids' holds token id 2000, outside the vocabulary",
        ),
        ({"hints": [{"action": "prefetch", "input_ids": [1, -3]}]}, "non-negative"),
        ({"hints": [{"action": "prefetch", "input_ids": "1 2"}]}, "list of integer token ids"),
        ({"hints": [{"action": "prefetch", "input_ids": [1], "colour": 1}]}, "unknown field(s) colour"),
        (
            {"hints": [{"action": "pin", "input_ids": [1, 2], "ttl_s": 86400}]},
            "hint 0: 'ttl_s' of 86400 s exceeds the longest allowed, 600 s",
        ),
        ({"hint": []}, '{"hints": [...]}'),
        (b"{not json", "Expecting property name"),
    ],
)
def test_a_malformed_batch_is_refused_whole_with_the_reason(listener, body, words):
    code, out = _post(listener.port, body)
    assert code == 400 and words in out["error"], out
    assert listener.drain() == []


@pytest.mark.parametrize(
    "hint, words",
    [
        (
            {"action": "prefetch", "input_ids": [1, 2, 3]},
            "hint 0: 'input_ids': a hint's prefix must hold at least one whole page (4 tokens), got 3",
        ),
        (
            {"action": "pin", "input_ids": list(range(20)), "ttl_s": 5},
            "hint 0: pin of 20 tokens is over 50% of the 32-token host tier (16 tokens)",
        ),
    ],
)
def test_a_hint_no_tree_could_take_is_refused_at_the_door(hint, words):
    """With the page size and the host tier's capacity, a prefix shorter than a page and a pin larger
    than the pinned share on its own are refused by the listener (400), before the scheduler sees them;
    a pin within the share passes (whether it fits beside the other pins is decided when applied)."""
    lst = HintListener(0, vocab_size=1000, page_size=4, host_tokens=32)
    try:
        code, out = _post(lst.port, {"hints": [hint]})
        assert code == 400 and words in out["error"], out
        assert lst.drain() == []
        assert _post(lst.port, {"hints": [{"action": "pin", "input_ids": list(range(9)), "ttl_s": 5}]}) == (
            202,
            {"queued": 1},
        )
    finally:
        lst.close()


def test_parse_hint_batch_is_the_one_validator():
    with pytest.raises(HintError, match="hint 0: 'ttl_s' must be a number"):
        parse_hint_batch({"hints": [{"action": "pin", "input_ids": [1], "ttl_s": "long"}]})


def test_close_frees_the_port():
    lst = HintListener(0)
    port = lst.port
    lst.close()
    again = HintListener(port)  # the port can be bound again
    again.close()
    lst.close()  # twice is safe
