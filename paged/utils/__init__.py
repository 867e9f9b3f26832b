"""Small runtime utilities with no knowledge of the engine: thread and OpenMP settings, clocks, the stop
flag SIGINT/SIGTERM set, whole-or-nothing file writes, and where the shipped `kernels_cu/` and `conf/`
trees live."""
