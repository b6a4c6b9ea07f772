"""Seven hooks on SGLang 0.5.23's scheduler, registered through its `HookRegistry` by `plugin.register`.
Both do nothing unless the scheduler's tree cache is ours.

1. Admission that never stalls the queue (AROUND `PrefillAdder.add_one_req`). When our
   `init_load_back` answers "not yet" (the request's disk -> host prefetch is still in flight),
   SGLang's adder returns `AddReqResult.OTHER` and the scheduler ends its admission loop, so one
   waiting request blocks every request behind it. The hook turns exactly that answer into
   `AddReqResult.CONTINUE`: the request stays in the waiting queue (retried next round) and the
   requests behind it are still admitted this round. Nothing was committed for it: `add_one_req`
   returns before committing when `init_load_back` returns None.
   Demand preempts prefetch (as in the embedded engine): when the request is refused for want of
   device room (`AddReqResult.NO_TOKEN` before its commit: the same answer after a commit is the
   budget's verdict on the next candidate), `TieredRadixCache.yield_to_demand` ends the waiting
   requests' prefetch jobs that hold the device pages it lacks (`demand_shortfall_tokens`; the
   controller decides which) and, if any ended, the request is tried once more.
   Before any of that, a request offered for the first time to a batch that already has requests
   may wait one round (`hold_new`, `admission_hold`): where the measured prefill cost says a
   smaller batch reaches its first tokens sooner in sum.
2. After the prefill batch is formed (AFTER `Scheduler.get_new_batch_prefill`, every scheduling step):
   `TieredRadixCache.after_batch_formed` (the batch's requests are admitted: their queueing delay is
   measured; background write-back starts here, once the batch's
   allocations are done), then the consumer index of layer-wise loads. SGLang sets
   `batch.hicache_consumer_index` itself only with its own HiCache or the unified-cache linker; the
   hook sets it to the index of the batch whose admissions queued layer-wise loads (-1 when none), so
   the TP worker hands it to our counter (`layer_loads.LayerLoads`) before the forward.
3. Before the prefill batch is formed (BEFORE `Scheduler.get_new_batch_prefill`):
   `TieredRadixCache.before_batch_formed` records the write-through copies that landed since the
   last step (started at commit, `RequestController.commit`), so this admission counts their pages
   as evictable (clean) rather than protected by the copy; it starts nothing but the carry of landed
   speculative promotions on to the device, into free pages beyond what the running requests may
   still decode (`running_reserve_tokens`).
4. After a prefill batch's result is processed (AFTER `Scheduler.process_batch_result`): its seconds
   from launch (`batch.launch_ts`, set by SGLang's `run_batch`) to its end (`step_end`: on a CPU,
   where the overlap scheduler's next launch runs the next forward, the next batch's launch; else
   now), against its new tokens and attention pairs (`step_pairs`), feed `cache.prefill_cost_fit`,
   the prefill cost that admission (1, `hold_new`) weighs. On an accelerator with the overlap
   scheduler this also counts the CPU work overlapped with the forward: an upper bound there.
6. After the scheduler is built (AFTER `Scheduler.__init__`): SGLang turns its own HiCache storage
   prefetch on whenever `--hicache-storage-backend` is set (`scheduler.py:516`, read by
   `_prefetch_kvcache`), even with another radix cache. With ours that flag only chooses our lower
   tier (`hicache_flags.py`), so the scheduler's storage path is switched off again.
7. Before a new request is queued (BEFORE `Scheduler._add_request_to_queue`): the hints it carries
   in `custom_params` (`request_hints.on_add_request`).
8. When a request is queued (AFTER `Scheduler._prefetch_kvcache`, called by `_add_request_to_queue`
   for a request it accepted): its first match (`match_on_arrival`), where SGLang matches a request
   for its own HiCache storage prefetch. The match starts the disk -> host read of its disk-only
   pages then, not when it is first offered to a batch: a request that arrives while a forward runs
   finds its pages on host when that forward ends, rather than waiting through one more.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ..policy.admission import attention_pairs, hold_pays

logger = logging.getLogger(__name__)

ADD_ONE_REQ = "sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req"
GET_NEW_BATCH_PREFILL = "sglang.srt.managers.scheduler.Scheduler.get_new_batch_prefill"
PROCESS_BATCH_RESULT = "sglang.srt.managers.scheduler.Scheduler.process_batch_result"
SCHEDULER_INIT = "sglang.srt.managers.scheduler.Scheduler.__init__"
ADD_REQUEST = "sglang.srt.managers.scheduler.Scheduler._add_request_to_queue"
PREFETCH_KVCACHE = "sglang.srt.managers.scheduler.Scheduler._prefetch_kvcache"


def _our_cache(cache: Any) -> Any:
    from .backend import TieredRadixCache

    return cache if isinstance(cache, TieredRadixCache) else None


def extend_tokens(req) -> int:
    """`req`'s tokens past its device prefix, as `add_one_req` counts them (host and disk hits
    included: they need device pages too)."""
    return len(req.full_untruncated_fill_ids) - req.prefix_len


def demand_shortfall_tokens(adder, req, clip_max_new_tokens: int | None = None) -> int:
    """Device tokens `req` lacks beyond what `adder` can still give (`rem_total_tokens`: free plus
    evictable, less what running and admitted requests reserve), sized as `add_one_req` sizes it:
    its extend input (host hits included: they are loaded into device pages), its output clipped to
    `CLIP_MAX_NEW_TOKENS`, the per-request overhead and one page of alignment. <= 0 when the tokens
    fit (it was refused for another reason)."""
    if clip_max_new_tokens is None:
        from sglang.srt.managers.schedule_policy import CLIP_MAX_NEW_TOKENS

        clip_max_new_tokens = CLIP_MAX_NEW_TOKENS
    max_new = min(max(req.sampling_params.max_new_tokens - len(req.output_ids), 0), clip_max_new_tokens)
    need = extend_tokens(req) + max_new + getattr(adder, "per_req_token_overhead", 0) + getattr(adder, "page_size", 1)
    return int(need - adder.rem_total_tokens)


def computed_tokens(req) -> int:
    """The tokens `req`'s prefill will compute if admitted now: `extend_tokens` less the host and
    disk hits it will load (`host_hit_length`). SGLang sets `extend_input_len` only once admitted."""
    return extend_tokens(req) - int(req.host_hit_length or 0)


def context_tokens(req) -> int:
    """The cached tokens `req`'s computed ones will attend to: its device prefix and host/disk hits."""
    return req.prefix_len + int(req.host_hit_length or 0)


def keep_admitting(original, adder, req, *args, **kwargs):
    """AROUND `PrefillAdder.add_one_req` (module docstring, 1)."""
    cache = _our_cache(getattr(adder, "tree_cache", None))
    if cache is None:
        return original(adder, req, *args, **kwargs)
    from sglang.srt.managers.schedule_policy import AddReqResult

    if hold_new(cache, req, adder.can_run_list):
        return AddReqResult.CONTINUE
    cache.deferred_rid = None
    result = original(adder, req, *args, **kwargs)
    # NO_TOKEN is also the verdict for the next candidate once `req` is committed (admitted, its tree
    # lock taken: `PrefillAdder.budget_state`): only a request refused before its commit is retried.
    # A second commit of one request would take a second tree lock that nothing releases: its pages
    # stay protected and, on a small pool, no later request fits (admission stalls)
    if (
        result == AddReqResult.NO_TOKEN
        and req not in adder.can_run_list
        and cache.yield_to_demand(req, demand_shortfall_tokens(adder, req))
    ):
        cache.deferred_rid = None
        result = original(adder, req, *args, **kwargs)
    if not cache.settings.skip_waiting_admission:
        return result
    if cache.deferred_rid is not None and cache.deferred_rid == getattr(req, "rid", None):
        cache.deferred_rid = None

        if result == AddReqResult.OTHER and req not in adder.can_run_list:
            cache.counters.admission_skips += 1
            return AddReqResult.CONTINUE
    return result


def hold_new(cache, req, batch: list) -> bool:
    """Whether `req`, offered for the first time while the prefill batch being formed has a request
    already, waits one round (`admission_hold`; its second offer always goes through). `cost` (the
    default) holds it when `policy.admission.hold_pays` says the split lowers the batch's summed
    time to first token at the measured prefill cost (`cache.prefill_cost()`, agreed by the ranks
    at TP >= 2), counting only the tokens it will compute (`computed_tokens`); `always` holds every
    such request (the split SGLang HiCache's storage lookups make); `off`
    holds none. The same on every TP rank: the rids, the batch, the tree and the agreed cost are."""
    mode = cache.settings.admission_hold
    if mode == "off":
        return False
    rid = getattr(req, "rid", None)
    if rid is None or rid in cache.held_rids:
        cache.held_rids.discard(rid)
        return False
    if not batch:
        return False
    if mode == "cost" and not hold_pays(len(batch), computed_tokens(req), cache.prefill_cost(), context_tokens(req)):
        return False
    if len(cache.held_rids) > 65536:  # rids held and then aborted never come back: bound the set
        cache.held_rids.clear()
    cache.held_rids.add(rid)
    cache.counters.admission_holds += 1
    return True


def step_pairs(batch) -> float:
    """Attention pairs a prefill batch computes (`policy.admission.attention_pairs`), from SGLang's
    per-request `extend_lens` and `prefix_lens`; 0 when the batch does not carry them."""
    ext, pre = getattr(batch, "extend_lens", None), getattr(batch, "prefix_lens", None)
    if not ext or not pre or len(ext) != len(pre):
        return 0.0
    return sum(attention_pairs(int(e), int(p)) for e, p in zip(ext, pre))


def step_end(scheduler, batch, now: float) -> float:
    """When `batch`'s forward ended, as seen from its result's processing at `now`. With SGLang's
    overlap scheduler the next batch is launched before this one's result is processed; on a CPU
    the launch runs that forward to completion, so this step ended when the next one was launched
    (its `launch_ts`), not `now` (which would count two forwards). On an accelerator the launch is
    asynchronous and `now` is the bound."""
    loc = getattr(batch, "out_cache_loc", None)
    if getattr(getattr(loc, "device", None), "type", None) != "cpu":
        return now
    launched = getattr(batch, "launch_ts", None)
    for later, _ in getattr(scheduler, "result_queue", None) or ():
        ts = getattr(later, "launch_ts", None)
        if ts is not None and launched is not None and launched < ts < now:
            return ts
    return now


def time_prefill(result, scheduler, batch=None, *args, **kwargs):
    """AFTER `Scheduler.process_batch_result` (module docstring, 4)."""
    cache = _our_cache(getattr(scheduler, "tree_cache", None))
    mode = getattr(batch, "forward_mode", None)
    if cache is None or mode is None or not mode.is_extend():
        return result
    launched = getattr(batch, "launch_ts", None)
    if launched is not None:
        end = step_end(scheduler, batch, time.monotonic())
        cache.prefill_cost_fit.record(
            int(getattr(batch, "extend_num_tokens", 0) or 0), end - launched, step_pairs(batch)
        )
    return result


def running_reserve_tokens(scheduler, clip_max_new_tokens: int | None = None) -> int:
    """Device tokens the running requests may still decode, as SGLang's `PrefillAdder` reserves
    them (`_get_running_request_total_token_offset`): per request its remaining `max_new_tokens`,
    clipped to `CLIP_MAX_NEW_TOKENS`, times the scheduler's `new_token_ratio` (1 with `ignore_eos`)."""
    if clip_max_new_tokens is None:
        from sglang.srt.managers.schedule_policy import CLIP_MAX_NEW_TOKENS

        clip_max_new_tokens = CLIP_MAX_NEW_TOKENS
    batch = getattr(scheduler, "running_batch", None)
    ratio = float(getattr(scheduler, "new_token_ratio", 1.0))
    total = 0.0
    for req in getattr(batch, "reqs", None) or ():
        sp = req.sampling_params
        left = min(max(0, sp.max_new_tokens - len(req.output_ids)), clip_max_new_tokens)
        total += left * (1.0 if getattr(sp, "ignore_eos", False) else ratio)
    return int(total)


def record_landed_copies(scheduler, *args, **kwargs):
    """BEFORE `Scheduler.get_new_batch_prefill` (module docstring, 3). Also measures what the
    running requests may still decode (`running_reserve_tokens`), the room a speculative promotion
    to the device leaves them."""
    cache = _our_cache(getattr(scheduler, "tree_cache", None))
    if cache is not None:
        cache.running_reserve_tokens = running_reserve_tokens(scheduler)
        cache.before_batch_formed()
    return None


def set_consumer_index(result, scheduler, *args, **kwargs):
    """AFTER `Scheduler.get_new_batch_prefill` (module docstring, 2)."""
    cache = _our_cache(getattr(scheduler, "tree_cache", None))
    if cache is None:
        return result
    batch = getattr(result, "batch_to_run", None)  # a NextBatchPlan
    cache.after_batch_formed(getattr(batch, "reqs", None) or ())
    if cache.layer_loads is None:
        return result
    index = cache.layer_loads.batch_index()
    if batch is not None and hasattr(batch, "hicache_consumer_index") and index >= 0:
        batch.hicache_consumer_index = index
    return result


def disown_hicache_storage(result, scheduler, *args, **kwargs):
    """AFTER `Scheduler.__init__` (module docstring, 6)."""
    if _our_cache(getattr(scheduler, "tree_cache", None)) is not None:
        scheduler.enable_hicache_storage = False
    return result


def match_on_arrival(result, scheduler, req=None, *args, **kwargs):
    """AFTER `Scheduler._prefetch_kvcache` (module docstring, 8): `req`'s first match, as SGLang makes
    it there for its own storage prefetch (`req.init_next_round_input(tree_cache, cow_mamba=False)`).
    Nothing without our cache, with prefetch off, or for a request already finished (aborted)."""
    cache = _our_cache(getattr(scheduler, "tree_cache", None))
    if cache is None or req is None or cache.disable or not cache.settings.prefetch:
        return result
    if getattr(req, "finished", lambda: False)():
        return result
    req.init_next_round_input(cache, cow_mamba=False)
    return result


def register_hooks() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(ADD_ONE_REQ, keep_admitting, HookType.AROUND)
    HookRegistry.register(GET_NEW_BATCH_PREFILL, record_landed_copies, HookType.BEFORE)
    HookRegistry.register(GET_NEW_BATCH_PREFILL, set_consumer_index, HookType.AFTER)
    HookRegistry.register(PROCESS_BATCH_RESULT, time_prefill, HookType.AFTER)
    HookRegistry.register(SCHEDULER_INIT, disown_hicache_storage, HookType.AFTER)
    HookRegistry.register(PREFETCH_KVCACHE, match_on_arrival, HookType.AFTER)
    from .kinds.speculative_decoding import register_hooks as register_speculative_hooks  # the draft model's KV pools

    register_speculative_hooks()
    from .hints.request_hints import on_add_request  # hints in the request (`request_hints.py`)

    HookRegistry.register(ADD_REQUEST, on_add_request, HookType.BEFORE)


__all__ = [
    "disown_hicache_storage",
    "computed_tokens",
    "context_tokens",
    "step_end",
    "step_pairs",
    "demand_shortfall_tokens",
    "extend_tokens",
    "hold_new",
    "keep_admitting",
    "match_on_arrival",
    "record_landed_copies",
    "register_hooks",
    "set_consumer_index",
    "time_prefill",
]
