// Warp-level matrix multiply-accumulate on the host (in progress).
#pragma once
