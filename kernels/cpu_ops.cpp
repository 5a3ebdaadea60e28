// The dispatcher's CPU kernels for pdserve's ops, and the extension's Python module: the
// few-row kernels of cpu_gemv.cpp and the fused decoder of cpu_decode.cpp behind them.

#include <torch/extension.h>

#include <cstring>
#include <optional>

#include "cpu_gemv.h"

// The CPU kernels of the ops that cpu_gemv.py and graph_ops.py define, registered here so that
// a call (from a compiled decode step's wrapper, about 150 a SmolLM2 step) goes from the
// dispatcher straight to C++: through the Python impls each call cost 10-40 us more (the op's
// Python callback, then a few ATen calls for the KV store). The Python impls stay registered
// for every backend (CompositeExplicitAutograd): they serve where this file did not build.

torch::Tensor cpu_f32_linear(const torch::Tensor& x, const torch::Tensor& weight,
                             const std::optional<torch::Tensor>& bias) {
  if (x.dim() == 2 && x.size(0) >= kPackedFromRows) {
    if (auto y = packed_linear(x, weight, bias)) return *y;  // oneDNN on the packed copy
  }
  if (x.dim() != 2 || x.size(0) < 1 || x.size(0) > kMaxGemmRows) {
    return at::linear(x, weight, bias);  // MKL's GEMM catches up; as F.linear
  }
  auto y = f32_colmajor_gemv(x.contiguous(), weight, 0);
  return bias.has_value() ? y.add_(*bias) : y;
}

torch::Tensor cpu_bf16_linear(const torch::Tensor& x, const torch::Tensor& weight) {
  const auto x2 = x.reshape({-1, weight.size(1)});
  torch::Tensor y = x2.size(0) <= kBf16Rows
                        ? bf16_gemv(x2.to(at::kFloat).contiguous(), weight).to(x.scalar_type())
                        : at::linear(x2, weight);
  auto shape = x.sizes().vec();
  shape.back() = weight.size(0);
  return y.reshape(shape);
}

torch::Tensor int8_gemv_op(const torch::Tensor& x, const torch::Tensor& qweight,
                           const torch::Tensor& scale) {
  return int8_gemv(x.contiguous(), qweight, scale);
}

torch::Tensor bf16_gemv_op(const torch::Tensor& x, const torch::Tensor& weight) {
  return bf16_gemv(x.contiguous(), weight);
}

int64_t kv_row_limit(const torch::Tensor& pages, int64_t width) {
  return (pages.size(0) - 1) * (pages.stride(0) / width) + 2 * pages.size(2);
}

// key/value [T, Hk, D] into one layer's block-major pages [blocks, 2, block_size, Hk, D] at
// rows [2, T] of the pages seen as rows of Hk * D values (graph_ops.kv_rows): a copy per row
void store_kv_rows(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor pages,
                   const torch::Tensor& rows) {
  TORCH_CHECK(pages.dim() == 5 && pages.device().is_cpu(), "pages: [blocks, 2, bs, Hk, D]");
  const int64_t width = pages.size(3) * pages.size(4);
  const int64_t limit = kv_row_limit(pages, width);
  const auto k = key.reshape({-1, width}).to(pages.scalar_type()).contiguous();
  const auto v = value.reshape({-1, width}).to(pages.scalar_type()).contiguous();
  const auto at_rows = rows.to(at::kLong).contiguous();
  const int64_t tokens = k.size(0);
  TORCH_CHECK(v.size(0) == tokens && at_rows.numel() == 2 * tokens, "rows: [2, T]");
  const int64_t* r = at_rows.data_ptr<int64_t>();
  const int64_t row_bytes = width * pages.element_size();
  char* base = static_cast<char*>(pages.data_ptr());
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(0 <= r[t] && r[t] < limit && 0 <= r[tokens + t] && r[tokens + t] < limit,
                "a KV row outside the pages");
    std::memcpy(base + r[t] * row_bytes, static_cast<const char*>(k.data_ptr()) + t * row_bytes,
                row_bytes);
    std::memcpy(base + r[tokens + t] * row_bytes,
                static_cast<const char*>(v.data_ptr()) + t * row_bytes, row_bytes);
  }
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("cpu_f32_linear", &cpu_f32_linear);
  m.impl("cpu_bf16_linear", &cpu_bf16_linear);
  m.impl("int8_gemv", &int8_gemv_op);
  m.impl("bf16_gemv", &bf16_gemv_op);
  m.impl("store_kv_rows", &store_kv_rows);
  m.impl("paged_attention", &paged_attention);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_gemv", &int8_gemv);
  m.def("bf16_gemv", &bf16_gemv);
  m.def("f32_colmajor_gemv", &f32_colmajor_gemv, py::arg("x"), py::arg("weight"),
        py::arg("block") = 0);
  m.def("paged_attention", &paged_attention);
  m.def("register_packed_gemm", &register_packed_gemm);
  m.def("packed_gemm_count", &packed_gemm_count);
  m.def("packed_gemm_calls", &packed_gemm_calls);
  bind_cpu_decoder(m);
}
