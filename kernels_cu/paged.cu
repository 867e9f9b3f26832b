// The translation unit NVRTC compiles and the emulator includes: every kernel template, of which
// only the requested instantiations are generated.
#include "compat.cuh"

#include "attention.cuh"
#include "attention_mass.cuh"
#include "cache.cuh"
#include "decode_v3.cuh"
#include "layer_ops.cuh"
#include "prefill.cuh"
