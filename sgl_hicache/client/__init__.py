"""Client-side tooling that imports no sglang: launching and stopping a real SGLang server
(`launch`, `server`), reading its live stats (`stats_client`), what a client needs to know of the
served model (`model_facts`), and the backend settings a launcher writes and the backend reads
(`backend_settings`, `debug_settings`)."""
