// CUDA's 8-bit float types are not emulated. This header is here because
// candle's kernels include it; what they define with those types is built
// only from compute capability 8.9 (__CUDA_ARCH__ >= 890), which a harness
// leaves undefined.
#pragma once
