"""Torch ops on the cache's own threads run on the calling thread alone.

With torch's OpenMP backend every thread that runs a parallel op (a copy or an `index_select` large
enough) is the master of an OpenMP team of its own, as many threads as the process's intra-op
setting. The cache's transfer workers copying pages in the background then start teams beside the
model's forward, on the same cores: more busy threads than cores, and the forward's parallel regions
wait at their barriers for threads the OS took off a core. On the 2-core CPU server that made a
small-step workload 1.7x slower in TTFT than SGLang's HiCache (docs/benchmarks.md, "Copy threads and
OpenMP"). A page copy gains little from a team; the forward loses a lot. So each of our worker
threads caps its own OpenMP team at one thread (`omp_set_num_threads` acts on the calling thread
only). On a GPU the copies are on streams and this changes nothing measurable.
"""

from __future__ import annotations

import ctypes
import logging
from functools import lru_cache

logger = logging.getLogger(__name__)

_OMP_LIBS = ("libgomp", "libiomp5", "libomp")


@lru_cache(maxsize=1)
def _omp_set_num_threads():
    """The process's `omp_set_num_threads` (the OpenMP runtime torch loaded), or None."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if any(name in line for name in _OMP_LIBS)}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            fn = ctypes.CDLL(path).omp_set_num_threads
        except (OSError, AttributeError):
            continue
        fn.argtypes = [ctypes.c_int]
        fn.restype = None
        return fn
    return None


def single_threaded_torch() -> bool:
    """Cap the OpenMP team of torch ops run from the calling thread at one thread; the process's
    other threads (the forward) keep theirs. True if the cap is in place."""
    import torch

    # torch sets a thread's OpenMP thread count lazily, at its first parallel op or this call: do it
    # first, so that it does not undo the cap below
    torch.get_num_threads()
    fn = _omp_set_num_threads()
    if fn is None or torch.__config__.parallel_info().find("OpenMP") < 0:
        return False
    fn(1)
    return torch.get_num_threads() == 1
