"""The tree against SGLang's own trees, in one process (`.venv-sglang`; some run ours alone without it)."""
