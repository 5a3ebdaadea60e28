// The few-row linear kernels of cpu_gemv.cpp, for the other files of the extension.
#pragma once

#include <torch/extension.h>

#include <optional>

// the widest row group the float32 column-major kernel keeps in registers (cpu_colmajor.cpp), and
// the most rows the INT8 kernel takes in one pass over the weight (cpu_gemv.py's MAX_ROWS)
constexpr int64_t kMaxRows = 4;
// the most rows the bfloat16 kernel takes in one pass over the weight (cpu_gemv.py's
// MAX_BF16_ROWS): each weight row, read once, serves them all from L1. SmolLM2's linears, one
// thread (perf/gemv_bench.py): 5 rows 1.5x as fast as oneDNN's bf16 matmul, 8 rows level; INT8
// stays at 4, where fbgemm already catches up (Zen 4: 11 against 14 ms at 4 rows)
constexpr int64_t kBf16Rows = 8;
// the most rows the float32 kernel takes (cpu_colmajor.cpp) before MKL's GEMM (cpu_gemv.py's
// MAX_GEMM_ROWS). SmolLM2's five linear shapes against F.linear on the same column-major
// weights (issue 42's Zen 4 VM): 1.4-1.6x at 16 rows, 1.1-1.2x at 24, 0.8-1.0x at 28 (one thread
// and two)
constexpr int64_t kMaxGemmRows = 24;
// from this many rows a float32 linear whose weight has a oneDNN-packed copy
// (cpu_packed_gemm.cpp) runs on it instead (cpu_gemv.py's PACKED_FROM_ROWS). A SmolLM2 pass's
// linears (perf/gemv_bench.py, perf/results/issue42/gemv_packed_rows_t*.json): one thread, 5 rows
// 30.0 against 35.5 ms, 16 rows 53 against 95; two threads, 5 rows 20.6 against 22.4, 16 rows 35
// against 83. At 1-3 rows oneDNN takes 1.1-1.6x as long as the column-major kernel, 4 is level.
constexpr int64_t kPackedFromRows = 5;

// x a contiguous float32 [B, K] and w a [N, K] weight on the CPU, row- or column-major
void check_linear(const torch::Tensor& x, const torch::Tensor& w, bool column_major);

// y = (x @ qweight.T) * scale: float32 x [B, K], int8 qweight [N, K], float32 scale [N]
torch::Tensor int8_gemv(torch::Tensor x, torch::Tensor qweight, torch::Tensor scale);
// y = x @ weight.T: float32 x [B, K], bfloat16 weight [N, K]
torch::Tensor bf16_gemv(torch::Tensor x, torch::Tensor weight);
// y = x @ weight.T: float32 x [B, K], float32 weight [N, K] stored column-major; block 0: auto
torch::Tensor f32_colmajor_gemv(torch::Tensor x, torch::Tensor weight, int64_t block);
// x @ weight.T + bias over such a weight, the form chosen by row count (cpu_ops.cpp): the packed
// copy from kPackedFromRows rows where there is one, the column-major kernel up to kMaxGemmRows,
// F.linear above. The graphs' op and the C++ decoder choose through it; the eager Linear
// chooses alike (cpu_gemv.f32_rows).
torch::Tensor cpu_f32_linear(const torch::Tensor& x, const torch::Tensor& weight,
                             const std::optional<torch::Tensor>& bias);

// rows of width values a layer's block-major pages [blocks, 2, block_size, Hk, D] hold, counted
// as graph_ops.kv_rows counts them: a K or V row index must stay below it
int64_t kv_row_limit(const torch::Tensor& pages, int64_t width);

// paged GQA decode attention over one layer's pages, in place (cpu_attention.cpp)
torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& pages,
                              const torch::Tensor& block_tables,
                              const torch::Tensor& context_lens, double scale);

// the oneDNN-packed copy of a float32 weight for many-row linears (cpu_packed_gemm.cpp):
// register it once; packed_linear answers x @ weight.T + bias through it, or nullopt where
// the weight has none
void register_packed_gemm(const torch::Tensor& weight, const torch::Tensor& packed);
int64_t packed_gemm_count();
int64_t packed_gemm_calls();
std::optional<torch::Tensor> packed_linear(const torch::Tensor& x, const torch::Tensor& weight,
                                           const std::optional<torch::Tensor>& bias);

// the fused decoder's Python class (cpu_decode.cpp)
void bind_cpu_decoder(pybind11::module& m);
