"""Diagnostics of the backend on SGLang's scheduler: the per-step batch log and the call timer."""
