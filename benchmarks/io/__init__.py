"""Host and disk bandwidth, the disk tier's CPU per page, and the GPU check (core environment)."""
