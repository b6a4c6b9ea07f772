"""Paths every benchmark resolves the same way: the repository root and the shipped trace."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# The shipped Mooncake conversation trace: the shared checkout's copy, else this repo's.
DEFAULT_TRACE = REPO.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
if not DEFAULT_TRACE.exists():
    DEFAULT_TRACE = REPO / "traces" / "mooncake_conversation_trace.jsonl"
CPU_MODELS = REPO / "scripts" / "cpu"  # the tiny configs SGLang runs on CPU (dummy weights)
