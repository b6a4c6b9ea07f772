"""The only part of sgl_hicache that imports sglang.

- ``plugin.register``: the ``sglang.srt.plugins`` entry point, run by SGLang in every process.
- ``backend.TieredRadixCache``: SGLang's tree cache over the core (built by ``factory.factory`` from
  the parts ``assembly`` composes; ``export`` shows its stats).
- ``cpu_compat``: workarounds that let SGLang (and its own HiCache) run on a CPU-only machine.
- ``server``: start / wait for / stop a real SGLang server in its own process group.

Nothing here is imported by ``sgl_hicache/__init__.py``; importing this package does not import sglang.
"""
