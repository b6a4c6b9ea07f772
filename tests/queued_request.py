"""The stand-in for SGLang's `Req` that the backend's unit tests match and load back (not a test
module): the fields `match_prefix` and `init_load_back` read and write, for a prompt of `tokens`
followed by one token to compute."""

from __future__ import annotations

from array import array
from types import SimpleNamespace


def queued_request(rid: str, tokens: array) -> SimpleNamespace:
    return SimpleNamespace(
        rid=rid,
        prefix_len=0,
        full_untruncated_fill_ids=tokens + array("q", [7]),
        last_node=None,
        storage_hit_length=0,
        storage_hit_start=None,
    )
