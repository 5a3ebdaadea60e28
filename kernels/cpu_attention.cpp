// The compiled decode step's attention on a CPU (issue 42): cpu_gemv.paged_attention's kernel.
//
// Why C++: traced by Inductor (kernels/paged_decode.py), the page gather is an indirect load in
// every loop that consumes it, the softmax three more passes over a score buffer, and the
// weighted V sum reads each page once per 8 lanes of D. Here a task reads each block's K and V
// rows once, where the page holds it, with its accumulators in registers (cpu_attention.h).
// Measured side by side (perf/paged_decode_bench.py, SmolLM2's heads, fp32, pages from memory in
// huge pages, as the engine allocates them): at batch 16 and 64, 17-19 GB/s on one core, 50-55%
// of the read roof, 3x Inductor's form; 26-36 GB/s on two. Its misses in flight held it at 7-8
// GB/s a core until the next block's lines were asked into L2 rather than L1 (cpu_attention.h);
// now each core's arithmetic is what bounds it: pages already in cache read at about 20 GB/s.

#include "cpu_attention.h"

// q [B, Hq, D] float32 or bfloat16; pages one layer's [blocks, 2, block_size, Hk, D] of the same
// dtype (block-major: graph_ops.fits); block_tables [B, nb]; context_lens [B] (0: a padding row,
// zeros out) -> [B, Hq, D] in q's dtype, the math in float32
torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& pages,
                              const torch::Tensor& block_tables,
                              const torch::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && pages.dim() == 5, "q [B, Hq, D], pages [blocks, 2, bs, Hk, D]");
  const int64_t rows = q.size(0), hq = q.size(1), d = q.size(2), hk = pages.size(3);
  TORCH_CHECK(pages.size(4) == d && hq % hk == 0 && d % 8 == 0, "heads: Hq a multiple of Hk");
  TORCH_CHECK(pages.stride(2) == hk * d && pages.stride(3) == d && pages.stride(4) == 1 &&
                  pages.stride(0) % (hk * d) == 0,
              "pages: block-major rows of Hk * D");
  TORCH_CHECK(block_tables.size(0) == rows && context_lens.numel() == rows,
              "a table row and a context length per query row");
  const auto qf = q.to(at::kFloat).contiguous();
  const auto tables = block_tables.to(at::kLong).contiguous();
  const auto lens = context_lens.to(at::kLong).contiguous();
  auto out = torch::empty({rows, hq * d}, qf.options());
  const HeadShape shape{hq, hk, d, float(scale)};
  const int64_t width = tables.size(1);
  if (pages.scalar_type() == at::kBFloat16) {
    attend_rows(PageView<at::BFloat16>(pages, hk * d), tables.data_ptr<int64_t>(), width,
                lens.data_ptr<int64_t>(), rows, shape, qf.data_ptr<float>(), hq * d,
                out.data_ptr<float>());
  } else {
    TORCH_CHECK(pages.scalar_type() == at::kFloat, "pages: float32 or bfloat16");
    attend_rows(PageView<float>(pages, hk * d), tables.data_ptr<int64_t>(), width,
                lens.data_ptr<int64_t>(), rows, shape, qf.data_ptr<float>(), hq * d,
                out.data_ptr<float>());
  }
  return out.view({rows, hq, d}).to(q.scalar_type());
}
