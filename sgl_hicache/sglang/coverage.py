"""Which SGLang model and deployment kinds the backend serves, and for each one it refuses, why and
what to run instead (no sglang import).

One table, `REFUSED`, is the source of the refusal messages (`refusal(kind)`); the "Model coverage"
table in docs/sglang-backend.md gives the same reasons and lists what is supported. The factory, the backend and the device-pool adapters
refuse through it; nothing else words a refusal.
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "--radix-cache-backend sgl_hicache: "


@dataclass(frozen=True)
class Refusal:
    """A kind the backend refuses: `what` names it, `why` gives the reason, `instead` says what to run."""

    what: str
    why: str
    instead: str

    def message(self, detail: str = "") -> str:
        found = f" ({detail})" if detail else ""
        return f"{self.what}{found} is not supported: {self.why}. Instead: {self.instead}"


_SGLANG_HICACHE = "SGLang's own HiCache (drop --radix-cache-backend sgl_hicache, add --enable-hierarchical-cache)"

REFUSED: dict[str, Refusal] = {
    "eagle_draft_layout": Refusal(
        "a speculative draft model whose KV page layout differs from the target's",
        "a page of the tree holds the target's and the draft's rows of its tokens in one layout (planes, KV "
        "heads, head dim, dtype); a draft of another layout would need a page set of its own per node",
        f"a draft model with the target's attention shape, or {_SGLANG_HICACHE}",
    ),
    "pp": Refusal(
        "pipeline parallelism (--pp-size > 1)",
        "each PP stage holds only its layers' KV and schedules micro-batches the others see later; the page "
        "layout and the per-step agreement assume one rank holds every layer",
        "--pp-size 1 with --tp over the same GPUs",
    ),
    "swa": Refusal(
        "a sliding-window KV pool other than SGLang's SWAKVPool of two MHA sub-pools with a paged window "
        "allocator (DeepSeek V4's pool, MLA / DSA sub-pools, a per-request window ring, unified hybrid memory)",
        "the backend tiers a hybrid sliding-window model's window layers with its full layers, page by page, "
        "through SWAKVPool's full -> window slot mapping; these pools address the window otherwise",
        "--disable-hybrid-swa-memory (every layer in one full MHA pool, which the backend tiers), "
        f"or {_SGLANG_HICACHE}",
    ),
    "mamba": Refusal(
        "a hybrid Mamba / linear-attention model whose recurrent state is not in MambaPool slots the "
        "request holds from its start (--mamba-radix-cache-strategy extra_buffer_lazy, ReplaySSM, int8 mamba "
        "checkpoints, the unified hybrid pool)",
        "the backend keeps one state snapshot per tree point, taken from a slot the request holds (its own "
        "under no_buffer, a ping-pong track slot under extra_buffer) and tiered device -> host -> disk; these "
        "variants allocate track slots on demand, keep the state in rings or in another pool",
        f"--mamba-radix-cache-strategy extra_buffer or no_buffer (both served), or {_SGLANG_HICACHE}",
    ),
    "dsa": Refusal(
        "DSA sparse-attention models (DSATokenToKVPool: DeepSeek V3.2, GLM-5)",
        "SGLang runs DSA attention only on GPU kernels (on a CPU its server arguments already fail: "
        "arg_groups/overrides.py:512 calls torch.cuda.get_device_capability()), so no CPU server test can prove "
        "a DSA model's outputs from every tier; its pages are built (DSAPoolAdapter: the MLA latent and the "
        "indexer key pages as one page, bit for bit through host, disk and a restart on SGLang's real pool)",
        _SGLANG_HICACHE,
    ),
    "scaled_quant_kv": Refusal(
        "quantised KV with a quantisation method and scale buffers (--kv-cache-dtype nvfp4 / fp4_mx_block16 / "
        "mxfp8; fp8_e4m3 on CPU, whose pool takes SGLang's CPUFP8KVCacheMethod)",
        "their scale buffers are not carried through host and disk yet",
        "on a GPU --kv-cache-dtype fp8_e4m3 / fp8_e5m2 (tiered: bytes only, the scale is the model's); on CPU "
        "--kv-cache-dtype auto",
    ),
    "kv_layout": Refusal(
        "a KV pool layout other than NHD (SGLANG_USE_HND_KVCACHE, page-major, AITER vectorized_5d)",
        "the device adapter addresses per-token rows",
        "the default NHD layout (unset SGLANG_USE_HND_KVCACHE)",
    ),
    "sglang_hicache": Refusal(
        "--enable-hierarchical-cache together with this backend",
        "that flag is SGLang's own HiCache, a second tree cache",
        "drop --enable-hierarchical-cache (this backend is the tiered cache), or drop --radix-cache-backend",
    ),
}


def refusal(kind: str, detail: str = "") -> str:
    """The refusal message of one refused `kind` (a key of `REFUSED`), with an optional detail."""
    return REFUSED[kind].message(detail)


__all__ = ["PREFIX", "REFUSED", "Refusal", "refusal"]
