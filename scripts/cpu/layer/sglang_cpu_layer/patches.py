"""CPU-only workarounds for SGLang 0.5.23: the CPU test layer, not product code.

Applied by :func:`sglang_cpu_layer.plugin.register` in every SGLang process of an environment that
installed this package (``scripts/install_sglang_cpu.sh``), only when ``SGLANG_CPU_TEST_LAYER=1`` is
set and ``torch.cuda.is_available()`` is false; otherwise :func:`apply` is never called.

SGLang's own HiCache (``--enable-hierarchical-cache``) fails on CPU torch because
  * ``mem_cache/pool_host/common.py:_cuda_host_register`` calls ``cudaHostRegister``;
  * the host pool pins its buffer (``pin_memory=True``), which needs CUDA;
  * the KV copy op ``transfer_kv_direct`` comes from the CUDA ``sgl_kernel`` build.
With these three replaced (no registration, no pinning, a pure-torch copy) it runs with
``--hicache-io-backend direct --hicache-mem-layout layer_first``, which is what lets the project
measure SGLang's own HiCache as a baseline on CPU.

Hybrid linear-attention models (Qwen3-Next) run on CPU only with the CPU test layer's torch
references of the ``sgl_kernel`` linear-attention ops (scripts/cpu/shim/sgl_kernel/mamba.py) and, on a
CPU without AMX, :func:`hybrid_linear_attention_without_amx`, which routes two layers SGLang would
otherwise run as Triton kernels (no CPU driver) to CPU ops.

EAGLE speculative decoding (EAGLE3, DeepSeek MTP) on ``torch_native`` attention: ``speculative_patches``
(applied from here). SGLang's Mamba ``extra_buffer`` strategy (its default for a hybrid model at
overlap scheduling or a page size above 1): ``mamba_extra_buffer`` (applied from here).

It also gives SGLang's ``torch_native`` attention what hybrid sliding-window models with attention
sinks (gpt-oss, Granite SWA) need on CPU: the ``sinks`` argument and window-layer reads of an
``SWAKVPool`` (``reference_attention``, a float32 reference implementation).

One opt-in knob for benchmarks on a shared machine: HiCache refuses to start unless the host has
10 GiB free beyond its host pool (``HICACHE_HOST_MEMORY_RESERVE_BYTES``, a margin sized for GPU
nodes). ``SGLHICACHE_CPU_HICACHE_HOST_RESERVE_BYTES=N`` sets that margin to N bytes in this process;
the pool HiCache allocates is unchanged. Unset (the default): SGLang's own margin.

DP attention (``--enable-dp-attention``) on CPU fails in the idle DP rank's padded batch
(:func:`patch_dp_attention`): ``TorchNativeAttnBackend`` lacks the CPU graph fill value the padding
asks for, and the native rotary embedding cannot reshape a batch of 0 tokens.

PD disaggregation's prefill server fails on CPU at its first KV send with the Mooncake sender (it
stages the page indices in pinned memory behind a CUDA event), and at its first prefix hit (the early
send of the cached prefix records a CUDA event): :func:`patch_pd_prefill`.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import os
import sys

logger = logging.getLogger(__name__)

_applied = False


def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size) -> None:
    """Pure-torch ``transfer_kv_direct``: copy token rows ``src_indices`` -> ``dst_indices`` per layer."""
    import torch

    src_idx = src_indices.to(torch.long)
    dst_idx = dst_indices.to(torch.long)
    for src, dst in zip(src_layers, dst_layers):
        rows = src.index_select(0, src_idx.to(src.device))
        dst.index_copy_(0, dst_idx.to(dst.device), rows.to(dst.device))


def _gate_sigmoid_mul(hidden_states, gate_weight, shared_output, output=None):
    """Torch reference of SGLang's Triton ``fused_gate_sigmoid_mul(_add)``
    (``kernels/ops/elementwise/elementwise.py:256``, ``:273``): the shared expert's output scaled per
    token by ``sigmoid(hidden_states @ gate_weight)``, added into ``output`` when one is given."""
    import torch

    gate = torch.sigmoid(hidden_states.float() @ gate_weight.float()).unsqueeze(-1)
    gated = (gate * shared_output.float()).to(shared_output.dtype)
    if output is None:
        return gated
    output.add_(gated)
    return None


def hybrid_linear_attention_without_amx() -> bool:
    """Hybrid linear-attention models (Qwen3-Next) on a CPU without AMX. SGLang's CPU path assumes
    AMX and otherwise launches Triton kernels, which have no CPU driver ("0 active drivers"):
    * ``FusedRMSNormGated`` takes the CPU op only when ``_use_cpu = is_cpu() and
      cpu_has_amx_support()`` (``kernels/ops/attention/fla/fused_norm_gate.py:20``): set it on CPU, so
      it calls ``torch.ops.sgl_kernel.fused_rmsnorm_gated_cpu`` (``fused_norm_gate.py:447``), which the
      CPU test layer's ``sgl_kernel`` provides (scripts/cpu/shim/sgl_kernel/mamba.py);
    * the shared-expert gate (``models/qwen2_moe.py:821``, ``use_fused_gate`` unless AMX) calls the
      Triton ``fused_gate_sigmoid_mul(_add)`` (``qwen2_moe.py:731``, ``:877``): replaced in that module
      by a torch reference."""
    try:
        from sglang.kernels.ops.attention.fla import fused_norm_gate
        from sglang.srt.models import qwen2_moe
        from sglang.srt.utils import is_cpu
    except ImportError as e:
        logger.warning("sglang_cpu_layer: SGLang's linear-attention modules not found (%s); not patched", e)
        return False
    if not is_cpu():
        return False
    fused_norm_gate._use_cpu = True
    qwen2_moe.fused_gate_sigmoid_mul = _gate_sigmoid_mul
    qwen2_moe.fused_gate_sigmoid_mul_add = _gate_sigmoid_mul
    return True


def _reference_attention() -> None:
    """Attention sinks and window-layer reads for ``torch_native`` (``reference_attention``: SGLang's
    ``layers/attention/torch_native_backend.py:279/338`` take no ``sinks``, and lines 137/238 read a
    window layer of an ``SWAKVPool`` at the full pool's slots)."""
    try:
        from sglang.srt.layers.attention import torch_native_backend
    except ImportError as e:
        logger.warning("sglang_cpu_layer: torch_native attention not found (%s); not patched", e)
        return
    from sglang_cpu_layer.reference_attention import install

    install(torch_native_backend.TorchNativeAttnBackend)


def needed() -> bool:
    import torch

    return not torch.cuda.is_available()


def _fill_value(module) -> None:
    # model_executor/forward_batch_info.py:2014 pads the idle DP rank's batch with
    # attn_backend.get_cpu_graph_seq_len_fill_value(), which TorchNativeAttnBackend lacks
    # (layers/attention/intel_amx_backend.py:198 has it and returns 1)
    backend = module.TorchNativeAttnBackend
    if not hasattr(backend, "get_cpu_graph_seq_len_fill_value"):
        backend.get_cpu_graph_seq_len_fill_value = lambda self: 1


def _rotary_empty_batch(module) -> None:
    # layers/rotary_embedding/base.py:347 (RotaryEmbedding.forward_native) views the query as
    # (num_tokens, -1, head_size), which fails for the idle rank's 0 tokens: nothing to rotate
    rotary = module.RotaryEmbedding
    native = rotary.forward_native
    if getattr(native, "_sgl_hicache_empty_batch", False):
        return

    def forward_native(self, positions, query, key, *args, **kwargs):
        if positions.numel() == 0:
            return query, key
        return native(self, positions, query, key, *args, **kwargs)

    forward_native._sgl_hicache_empty_batch = True  # type: ignore[attr-defined]  # (the marker that it is patched)
    rotary.forward_native = forward_native


def patch_dp_attention() -> bool:
    """Two gaps of SGLang 0.5.23's CPU path that stop DP attention at the first forward (both in the
    idle DP rank's padded batch); each patch names the line it works around. Applied when SGLang
    imports the module patched."""
    _when_imported("sglang.srt.layers.attention.torch_native_backend", _fill_value)
    _when_imported("sglang.srt.layers.rotary_embedding.base", _rotary_empty_batch)
    return True


def _disable_host_tensor_indices(conn) -> None:
    # disaggregation/prefill.py:1753 (_send_kv_chunk), taken when the sender has
    # `supports_host_tensor_indices` (mooncake/conn.py:3312): torch.empty(..., pin_memory=True) and
    # torch.cuda.Event(), both of which fail without CUDA; the `else` branch (kv_to_page_indices) is
    # the one every other sender uses
    conn.MooncakeKVSender.supports_host_tensor_indices = False


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `patch(module)` once `name` is imported: importing the modules up front would cost every
    SGLang process (HTTP server, detokenizer) their import, which only some use (Mooncake's took 36 s
    here at a load average of ~30)."""

    def __init__(self, name: str, patch) -> None:
        self.name, self.patch = name, patch

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # find the real spec, then wrap its loader
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader, patch = spec.loader, self.patch

        class Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                try:
                    patch(module)
                except Exception:  # a different SGLang layout: never break SGLang's own import
                    logger.exception("sglang_cpu_layer: patching %s failed; left as it is", module.__name__)

            def __getattr__(self, attr):  # get_source and the rest: the real loader's
                return getattr(loader, attr)

        spec.loader = Loader()
        return spec


def _when_imported(name: str, patch) -> None:
    """`patch(module)` now if `name` is imported, else right after SGLang imports it."""
    if name in sys.modules:
        patch(sys.modules[name])
    else:
        sys.meta_path.insert(0, _AfterImport(name, patch))


def patch_pd_prefill() -> bool:
    """The Mooncake sender's host-staged page indices need CUDA; on CPU the prefill server takes
    SGLang's other path (page indices computed on the host). Applied when SGLang imports the sender."""
    # disaggregation/prefill.py:1496 (maybe_send_cached_prefix_chunk): the early send of a cached
    # prefix, under overlap scheduling, records a torch.cuda.Event, which fails without CUDA. The
    # early send is an optimisation (the request's final send covers the whole range): off on CPU
    # unless set explicitly
    os.environ.setdefault("SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX", "false")
    _when_imported("sglang.srt.disaggregation.mooncake.conn", _disable_host_tensor_indices)
    return True


def apply() -> bool:
    """Patch SGLang's host KV pool for CPU torch. Idempotent; returns True if patches are in place."""
    global _applied
    if _applied:
        return True
    if not needed():
        return False
    import torch

    _reference_attention()
    try:
        patch_dp_attention()
    except (ImportError, AttributeError) as e:  # a different SGLang layout: leave it alone
        logger.warning("sglang_cpu_layer: DP attention's CPU gaps not patched (%s)", e)
    try:
        patch_pd_prefill()
    except (ImportError, AttributeError) as e:  # no Mooncake transfer backend in this SGLang
        logger.debug("sglang_cpu_layer: PD prefill's Mooncake sender not patched (%s)", e)
    try:
        from sglang.srt.mem_cache.pool_host import common, mha
        from sglang.srt.mem_cache.pool_host.base import HostKVCache
    except ImportError as e:  # a different SGLang layout: leave it alone rather than break start-up
        logger.warning("sglang_cpu_layer: SGLang host pool not found (%s); not patched", e)
        return False

    common._cuda_host_register = lambda *args, **kwargs: None
    mha.transfer_kv_direct = transfer_kv_direct

    original_init = HostKVCache.__init__

    def init_without_pinning(self, *args, **kwargs):
        if "pin_memory" in kwargs:
            kwargs["pin_memory"] = False
        original_init(self, *args, **kwargs)
        self.pin_memory = False

    HostKVCache.__init__ = init_without_pinning
    hybrid_linear_attention_without_amx()
    reserve = os.environ.get("SGLHICACHE_CPU_HICACHE_HOST_RESERVE_BYTES")
    if reserve:
        from sglang.srt.mem_cache.pool_host import base as host_base

        host_base.HICACHE_HOST_MEMORY_RESERVE_BYTES = int(reserve)
        logger.info("sglang_cpu_layer: HiCache host memory reserve set to %s bytes", reserve)
    if not hasattr(torch.cpu.Stream, "synchronize"):
        torch.cpu.Stream.synchronize = lambda self: None  # type: ignore[attr-defined]  # (the patch adds it)
    from sglang_cpu_layer import mamba_extra_buffer, speculative_patches  # EAGLE / MTP on torch_native

    speculative_patches.apply()
    mamba_extra_buffer.apply(_when_imported)  # the Mamba extra_buffer strategy on CPU
    _applied = True
    logger.info("sglang_cpu_layer: SGLang HiCache host pool patched for CPU")
    return True
