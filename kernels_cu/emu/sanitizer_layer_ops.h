// Sanitizer scenarios of kernels_cu/layer_ops.cuh, included by sanitizer_driver.cpp (in progress).
#pragma once

inline int layer_ops_scenarios(std::mt19937&) { return 0; }
