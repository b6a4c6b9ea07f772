"""Model and pool kinds: SGLang's KV pools as pages (`pool_adapters`), the DSA indexer keys,
speculative decoding's draft KV and bigram keys, and hybrid Mamba models (`mamba/`)."""
