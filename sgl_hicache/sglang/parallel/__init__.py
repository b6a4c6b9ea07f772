"""Multi-rank agreement: TP ranks taking the same decisions (`rank_consensus`), where a backend
sits under DP (`data_parallel`), and one copy of the KV for a replicated MLA group (`replicated_group`)."""
