"""Paths every benchmark resolves the same way: the repository root and the shipped trace."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_TRACE = REPO / "traces" / "mooncake_conversation_trace.jsonl"  # the Mooncake trace the repository ships
CPU_MODELS = REPO / "scripts" / "cpu"  # the tiny configs SGLang runs on CPU (dummy weights)
