// Sanitizer scenarios of kernels_cu/prefill.cuh, included by sanitizer_driver.cpp (in progress).
#pragma once

inline int prefill_scenarios(std::mt19937&) { return 0; }
