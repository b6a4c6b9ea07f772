"""The product changes nothing of SGLang in a process that did not ask for it.

`sgl_hicache`'s plugin runs in every SGLang process of an environment that installs the package. On
a CPU-only process (CUDA hidden) registering it must leave every attribute the CPU test layer patches
(scripts/cpu/layer) as SGLang defined it, and the environment and import machinery untouched; so must
the CPU test layer itself when it is installed but not asked for (`SGLANG_CPU_TEST_LAYER` unset).
The last case asks for the layer and sees the same snapshot change: the check can fail.

Each case runs in a fresh interpreter, so no earlier import or patch leaks into it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

# What the CPU test layer patches, as (module, class or None, attribute); the snapshot records the
# identity of each value (or its absence), every SGLANG_* / SGLHICACHE_* environment variable, and
# the import hooks in sys.meta_path.
_CHILD = r"""
import importlib, json, os, sys
TARGETS = [
    ("sglang.srt.mem_cache.pool_host.common", None, "_cuda_host_register"),
    ("sglang.srt.mem_cache.pool_host.mha", None, "transfer_kv_direct"),
    ("sglang.srt.mem_cache.pool_host.base", "HostKVCache", "__init__"),
    ("sglang.srt.mem_cache.pool_host.base", None, "HICACHE_HOST_MEMORY_RESERVE_BYTES"),
    ("sglang.srt.layers.attention.torch_native_backend", "TorchNativeAttnBackend", "forward_extend"),
    ("sglang.srt.layers.attention.torch_native_backend", "TorchNativeAttnBackend", "forward_decode"),
    ("sglang.srt.layers.attention.torch_native_backend", "TorchNativeAttnBackend", "get_cpu_graph_seq_len_fill_value"),
    ("sglang.srt.speculative.draft_utils", "DraftBackendFactory", "_create_backend"),
    ("sglang.srt.models.qwen2_moe", None, "fused_gate_sigmoid_mul"),
    ("sglang.srt.models.qwen2_moe", None, "fused_gate_sigmoid_mul_add"),
    ("torch.cpu", "Stream", "synchronize"),
]
LATE = [("sglang.srt.layers.rotary_embedding.base", "RotaryEmbedding", "forward_native")]

def snapshot(targets):
    out = {}
    for mod, cls, attr in targets:
        owner = importlib.import_module(mod)
        if cls is not None:
            owner = getattr(owner, cls)
        value = owner.__dict__.get(attr, "<absent>") if cls is not None else getattr(owner, attr, "<absent>")
        out[f"{mod}:{cls}.{attr}"] = value if isinstance(value, (str, int, float, bool)) else id(value)
    return out

def env():
    return {k: v for k, v in os.environ.items() if k.startswith(("SGLANG_", "SGLHICACHE_"))}

before = {"attrs": snapshot(TARGETS), "env": env(), "meta_path": [type(f).__name__ for f in sys.meta_path]}
mode = sys.argv[1]
if mode == "product":
    from sgl_hicache.sglang import plugin
    plugin.register()
else:  # every plugin the environment installs, as SGLang loads them in each of its processes
    from sglang.srt.plugins import load_plugins
    load_plugins()
after = {"attrs": snapshot(TARGETS), "env": env(), "meta_path": [type(f).__name__ for f in sys.meta_path]}
late = snapshot(LATE)  # a module imported after the plugins: a deferred patch would land here
print(json.dumps({"before": before, "after": after, "late_patched": any(
    getattr(importlib.import_module(m), c).__dict__.get(a) is not None
    and getattr(getattr(importlib.import_module(m), c).__dict__.get(a), "_sgl_hicache_empty_batch", False)
    for m, c, a in LATE)}))
"""


def _run(mode: str, *, layer: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_CPU_TEST_LAYER"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # CUDA hidden, as in any CPU-only process
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    if layer:
        env["SGLANG_CPU_TEST_LAYER"] = "1"
    run = subprocess.run([sys.executable, "-c", _CHILD, mode], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def _changed(result: dict) -> dict:
    before, after = result["before"], result["after"]
    out = {
        k: (before["attrs"][k], after["attrs"][k]) for k in before["attrs"] if before["attrs"][k] != after["attrs"][k]
    }
    if before["env"] != after["env"]:
        out["env"] = (before["env"], after["env"])
    if before["meta_path"] != after["meta_path"]:
        out["meta_path"] = (before["meta_path"], after["meta_path"])
    if result["late_patched"]:
        out["late import"] = "patched"
    return out


def test_registering_the_product_plugin_changes_nothing_of_sglang():
    assert _changed(_run("product", layer=False)) == {}


def test_installed_plugins_change_nothing_unless_the_cpu_layer_is_asked_for():
    assert _changed(_run("all", layer=False)) == {}


def test_the_check_sees_the_cpu_layer_when_it_is_asked_for():
    changed = _changed(_run("all", layer=True))
    assert "sglang.srt.mem_cache.pool_host.mha:None.transfer_kv_direct" in changed, changed
    assert "sglang.srt.layers.attention.torch_native_backend:TorchNativeAttnBackend.forward_extend" in changed
    assert changed.get("late import") == "patched"  # the rotary patch waits for SGLang to import its module
