// Fused elementwise ops of a Llama layer (filled in by the layer-ops work).
#pragma once

#include "vec.cuh"
