"""How many free device pages a speculative promotion may take (a pure decision; it moves nothing).

A prediction or a client's prefetch that has landed on host is carried on to the device when the
device holds free pages nobody needs: the pages it takes are clean (their host copy stays) and
evictable once they land, so admission takes them back like any other cached page. What it may not
take is the room that keeps the running batches and the next admissions from evicting: the pages
the running requests still need (`reserved_pages`, what the engine knows of them) and a margin of
`headroom` of the tier.
"""

from __future__ import annotations

import math


def device_room_pages(free_pages: int, capacity_pages: int, reserved_pages: int, headroom: float) -> int:
    """Free device pages a speculative host -> device promotion may take now: the free pages less
    those the running requests still need (`reserved_pages`) and less `headroom` x the tier's
    capacity; never negative. `headroom >= 1` (or a tier with no capacity) gives none."""
    if capacity_pages <= 0 or headroom >= 1:
        return 0
    margin = math.ceil(headroom * capacity_pages)
    return max(0, free_pages - max(0, reserved_pages) - margin)
