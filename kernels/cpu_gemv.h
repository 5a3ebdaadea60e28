// The few-row linear kernels of cpu_gemv.cpp, for the other files of the extension.
#pragma once

#include <torch/extension.h>

// y = (x @ qweight.T) * scale: float32 x [B, K], int8 qweight [N, K], float32 scale [N]
torch::Tensor int8_gemv(torch::Tensor x, torch::Tensor qweight, torch::Tensor scale);
// y = x @ weight.T: float32 x [B, K], bfloat16 weight [N, K]
torch::Tensor bf16_gemv(torch::Tensor x, torch::Tensor weight);
// y = x @ weight.T: float32 x [B, K], float32 weight [N, K] stored column-major; block 0: auto
torch::Tensor f32_colmajor_gemv(torch::Tensor x, torch::Tensor weight, int64_t block);

// the fused decoder's Python class (cpu_decode.cpp)
void bind_cpu_decoder(pybind11::module& m);
