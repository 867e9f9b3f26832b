"""The kernel backends, one module each, looked up by name in `paged.kernels.registry`: `torch_ref`
(the reference), `cpu` (C++/OpenMP), `cuda` (NVRTC) and `emu` (the CUDA sources on the CPU), with
the contract in `base.py` and the launch plans cuda and emu share in `launch.py`."""
