"""FlashInfer's batch decode as a peer in experiments/gpu/kernel_bench.py, built on the GPU machine with its
nvcc from FlashInfer's header-only sources (build.py) and called through ctypes (decode.py).
Optional: nothing under paged/ imports it, and the bench reports "not built: <reason>" without it."""
