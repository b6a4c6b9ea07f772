"""SGLang's Mamba ``extra_buffer`` strategy on CPU (SGLang 0.5.23's default for a hybrid model with
overlap scheduling on or a page size above 1): CPU test layer only, not product code.

SGLang refuses it on CPU and, let through, would fail in two kernels; each patch names the line:

* ``arg_groups/mamba_hook.py:120`` asserts ``_platform_supports_mamba_cache_extra_buffer()``
  (``mamba_hook.py:102``: CUDA, MUSA, NPU, HIP, XPU or an out-of-tree platform that says so): true
  here, on CPU, once the two kernels below are there;
* decode tracking (``layers/attention/hybrid_linear_attn_backend.py:1000`` and ``:1009``) copies a
  request's conv and SSM state into its ping-pong track slot with the Triton kernels
  ``track_mamba_states_all_layers`` / ``track_mamba_states_if_needed``
  (``kernels/ops/mamba/mamba_state_scatter_triton.py:914`` / ``:192``), which have no CPU driver:
  replaced in that module by :func:`track_all_layers` / :func:`track_one_layer` (the same
  per-row copies, in torch);
* ``managers/schedule_batch.py:3830`` (``prepare_for_decode``) stages the decode track mask with an
  unconditional ``Tensor.pin_memory()``, which raises without an accelerator: on CPU torch (no
  accelerator) :func:`apply` makes ``pin_memory()`` return the tensor itself (pinning is only a
  staging optimisation for an H2D copy, and there is no device to copy to);
* prefill tracking at a chunk boundary inside an extend reads the per-chunk states ``h`` of the
  chunked delta rule, which SGLang's CPU op returns as None: the CPU test layer's ``sgl_kernel``
  reference returns them (scripts/cpu/shim/sgl_kernel/mamba.py, ``chunk_gated_delta_rule_cpu``).
"""

from __future__ import annotations

import torch


def _tracked(cache_indices, mask, track_indices, batch_size: int, check_freed_slots: bool):
    """(source slots, destination slots) of the rows ``i < batch_size`` with ``mask[i]``; with
    ``check_freed_slots`` a row with a negative (freed) slot is skipped, as the kernel does."""
    rows = torch.nonzero(mask[:batch_size], as_tuple=True)[0]
    src = cache_indices[rows].to(torch.int64)
    dst = track_indices[rows].to(torch.int64)
    if check_freed_slots:
        ok = (src >= 0) & (dst >= 0)
        src, dst = src[ok], dst[ok]
    return src, dst


def track_all_layers(conv_pool, ssm_pool, cache_indices, mask, track_indices, batch_size, check_freed_slots=False):
    """Torch reference of ``track_mamba_states_all_layers``: every layer's conv and SSM state
    (``[layers, slots, ...]`` pools) of each tracked row's slot copied into its track slot."""
    src, dst = _tracked(cache_indices, mask, track_indices, batch_size, check_freed_slots)
    for pool in (conv_pool, ssm_pool):
        pool[:, dst] = pool[:, src]


def track_one_layer(conv, ssm, cache_indices, mask, track_indices, batch_size, check_freed_slots=False):
    """Torch reference of ``track_mamba_states_if_needed``: one layer's (``[slots, ...]`` pools)."""
    src, dst = _tracked(cache_indices, mask, track_indices, batch_size, check_freed_slots)
    for pool in (conv, ssm):
        pool[dst] = pool[src]


def _decode_tracking(module) -> None:
    module.track_mamba_states_all_layers = track_all_layers
    module.track_mamba_states_if_needed = track_one_layer


def _platform(module) -> None:
    module._platform_supports_mamba_cache_extra_buffer = lambda: True


def _unpinned(self: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return self


def apply(when_imported) -> None:
    """Install the patches, each when SGLang imports its module (`when_imported(name, patch)`)."""
    if not torch.accelerator.is_available():
        torch.Tensor.pin_memory = _unpinned  # type: ignore[method-assign]
    when_imported("sglang.srt.arg_groups.mamba_hook", _platform)
    when_imported("sglang.srt.layers.attention.hybrid_linear_attn_backend", _decode_tracking)
