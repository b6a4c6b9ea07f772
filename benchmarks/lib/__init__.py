"""What the benchmarks share: repo paths (`paths`), report helpers (`report`), the server runs
(`server_runs`), request and trace rewrites for a server (`traces`), tree workloads and allocators
(`trees`) and the embedded engine's trace slices (`slices`)."""
