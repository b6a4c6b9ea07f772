"""Where a hybrid request's recurrent state at a cacheable point is, under SGLang's two Mamba radix
cache strategies, and how its slot passes to the tree (`MambaCalls._mamba_commit`).

- `no_buffer` (`NoBuffer`): the request's own slot (`req.kv.mamba_pool_idx`) holds the state after
  all its tokens; only a finished request's is offered, at its end.
- `extra_buffer` (`ExtraBuffer`, SGLang's default with overlap scheduling or a page size above 1):
  the request keeps ping-pong track slots beside its own (`req.kv.mamba_ping_pong_track_buffer`),
  into which the forward copies the state at chunk-aligned points of a prefill and at
  `mamba_track_interval` points of decode (SGLang's `schedule_batch.py:3137`
  `_mamba_radix_cache_v2_req_prepare_for_extend`, `batch_result_processor.py:1400`);
  `mamba_last_track_idx` / `mamba_last_track_seqlen` name the latest, `mamba_prev_track_seqlen` the
  other slot's. A finished request offers the latest tracked state that its committed tokens cover,
  else the previous one (SGLang's `unified_cache/components/mamba.py:582`
  `_select_finished_checkpoint`); the tree takes that slot out of the buffer (`-1` there, so
  `free_mamba_cache` leaves it). A running request (SGLang checkpoints one after its prefill and
  after each chunk, `batch_result_processor.py:394`) offers its latest tracked state; the tree takes
  it by donation (`donate_mamba_ping_pong_slot`: a fresh slot replaces it in the buffer, and the
  request's track length is cleared, as SGLang's own tree does, `mamba.py:665` / `:726`).

Contract: every call runs on SGLang's scheduler thread; an `Offer` is valid until the request's next
forward; `hand_over` returns the slot the tree now owns (the request no longer names it), or None.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Offer:
    """The state after the first `depth` tokens of a request, in its slot at buffer `position`
    (None: the request's own slot, `req.kv.mamba_pool_idx`)."""

    depth: int
    position: int | None = None


class NoBuffer:
    """SGLang's `no_buffer` strategy: a finished request's own slot, at its end."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool

    def offer(self, req: Any, committed: int) -> Offer | None:
        """The state the request can give the tree now, within its first `committed` tokens."""
        if not req.finished() or req.kv.mamba_pool_idx is None:
            return None
        return Offer(committed)

    def hand_over(self, req: Any, offer: Offer, alloc: Callable[[], torch.Tensor | None]) -> int | None:
        """The offered slot, now the tree's; `alloc()` gives a fresh slot (shape [1]) or None."""
        slot = int(req.kv.mamba_pool_idx)
        req.kv.mamba_pool_idx = None
        return slot

    def release(self, req: Any) -> None:
        """The request is released: the slot it still holds goes back to SGLang's allocator."""
        if getattr(req.kv, "mamba_pool_idx", None) is None:
            return
        self.pool.mamba_allocator.free(req.kv.mamba_pool_idx.unsqueeze(-1))
        req.kv.mamba_pool_idx = None
        req.kv.mamba_cow_src_index = None
        req.kv.mamba_needs_clear = False


class ExtraBuffer(NoBuffer):
    """SGLang's `extra_buffer` strategy: the states its forward tracked into the request's ping-pong
    slots, finished or running (module docstring)."""

    def offer(self, req: Any, committed: int) -> Offer | None:
        kv = req.kv
        if kv.mamba_ping_pong_track_buffer is None or kv.mamba_last_track_idx is None:
            return None
        last, keep = kv.mamba_last_track_seqlen, int(kv.mamba_last_track_idx)
        if not req.finished():
            return Offer(int(last), keep) if last and last <= committed else None
        if last and last <= committed:
            return Offer(int(last), keep)
        # the latest state ran past the committed tokens (overlap scheduling): the other slot's
        prev = kv.mamba_prev_track_seqlen
        if self.pool.mamba_ping_pong_track_buffer_size != 2 or not prev or prev > committed:
            return None
        return Offer(int(prev), self.pool.get_mamba_ping_pong_other_idx(keep))

    def hand_over(self, req: Any, offer: Offer, alloc: Callable[[], torch.Tensor | None]) -> int | None:
        assert offer.position is not None
        kv = req.kv
        if req.finished():  # out of the buffer: `free_mamba_cache` leaves a -1 entry alone
            slot = int(kv.mamba_ping_pong_track_buffer[offer.position])
            self.pool.set_mamba_ping_pong_slot(req, offer.position, -1)
            return slot if slot >= 0 else None
        fresh = alloc()
        if fresh is None:
            return None
        donated = self.pool.donate_mamba_ping_pong_slot(req, fresh)
        kv.mamba_last_track_seqlen = None  # that slot is a fresh one now: nothing tracked in it
        kv.mamba_prev_track_seqlen = None
        return int(donated.view(-1)[0])

    def release(self, req: Any) -> None:
        """The request's own slot and its ping-pong slots (but those the tree took) go back."""
        if getattr(req.kv, "mamba_ping_pong_track_buffer", None) is None:
            super().release(req)  # a restore gave it a slot, and it never ran
            return
        if req.kv.mamba_pool_idx is None:
            return
        self.pool.free_mamba_cache(req)


def state_source(req_to_token_pool: Any) -> NoBuffer:
    """The strategy of SGLang's hybrid request pool `req_to_token_pool`."""
    if getattr(req_to_token_pool, "enable_mamba_extra_buffer", False):
        return ExtraBuffer(req_to_token_pool)
    return NoBuffer(req_to_token_pool)


__all__ = ["ExtraBuffer", "NoBuffer", "Offer", "state_source"]
