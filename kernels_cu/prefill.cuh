// Paged varlen prefill attention (in progress).
#pragma once

#include "attention.cuh"
