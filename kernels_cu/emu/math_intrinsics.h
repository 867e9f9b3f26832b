// CUDA math intrinsics the layer-op kernels use, on the host (in progress).
#pragma once
