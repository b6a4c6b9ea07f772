"""Hybrid Mamba / linear-attention models: the tree cache calls, the state snapshots and their movers."""
