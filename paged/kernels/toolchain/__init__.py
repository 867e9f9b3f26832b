"""Building the kernels: NVRTC (cubins), the emulator and cpu libraries (host C++ compiler), the
on-disk cache both use, the instantiation list, and the ahead-of-time build CLI (`build.py`)."""
