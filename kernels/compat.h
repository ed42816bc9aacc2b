// The one place that knows LibTorch versions apart: Debian's 1.13 (the CPU machines) and the 2.x
// inside an installed PyTorch (the GPU machines).
#pragma once

#include <torch/version.h>

// LibTorch 2.x ships varlen flash attention (at::_flash_attention_forward/backward with
// cumulative sequence lengths and sliding windows); 1.13 does not.
#if TORCH_VERSION_MAJOR >= 2
#define TINKERD_HAS_FLASH_ATTENTION 1
#else
#define TINKERD_HAS_FLASH_ATTENTION 0
#endif

// LibTorch 2.8 and later multiply bf16/fp16 matrices into an fp32 result on CUDA (aten::mm.dtype:
// cuBLAS with fp32 output); earlier versions, and the CPU, widen the inputs first.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 8)
#define TINKERD_HAS_MM_OUT_DTYPE 1
#else
#define TINKERD_HAS_MM_OUT_DTYPE 0
#endif
