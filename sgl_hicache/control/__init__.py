"""The request lifecycle, written once for the SGLang backend and the embedded engine: arrival,
matching, promotion and commit (`lifecycle`), client hints (`hint_desk`), speculative prefetch of
predicted and hinted pages (`speculative_prefetch`), and the one composition root (`composition`)."""
