"""The only part of sgl_hicache that imports sglang: the radix-cache backend, split by job.

- ``plugin.register``: the ``sglang.srt.plugins`` entry point, run by SGLang in every process; it
  registers the backend and hooks that act only when the backend is in use, and patches nothing.
- ``backend.TieredRadixCache``: SGLang's tree cache over the core (built by ``factory.factory`` from
  the parts ``assembly`` composes; ``export`` shows its stats).
- ``parallel/``: rank agreement under TP, DP placement, one copy for a replicated (MLA) group.
- ``kinds/``: SGLang's pool kinds as pages, the DSA indexer, speculative decoding, ``mamba/``.
- ``hints/``: hints in the request and the hint listener.
- ``debug/``: the batch log and the scheduler-thread call timer.

Server launch, the stats client and the settings file live in ``sgl_hicache.client`` (no sglang
import). Nothing here is imported by ``sgl_hicache/__init__.py``; importing this package does not
import sglang.
"""
