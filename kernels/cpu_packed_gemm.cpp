// Float32 linears of 5 rows and more (a speculative verification, a decode batch, a prefill
// chunk), through oneDNN on a copy of the weight packed once (issue 42; cpu_gemv.h's
// kPackedFromRows says where it overtakes the column-major kernel).
//
// Why: the engine keeps float32 weights column-major for the few-row kernels
// (cpu_colmajor.cpp). Given such a weight, MKL's SGEMM copies it into its own panels on every
// call: at 64 rows the copy was 28% of a SmolLM2 decode step (perf record: sgemm_scopy_down16).
// oneDNN's linear on a weight reordered once into its blocked layout ran SmolLM2's four
// projections 1.5x as fast as F.linear at 64 rows, 1.7-1.9x at 25-32, 1.2x at 512 (two threads,
// Zen 4), for any row count with one copy. The copy doubles the float32 weights' memory
// (--cpu-packed-gemm turns it off).
//
// The copy is found by its weight: a compiled decode step calls pdserve::cpu_f32_linear with the
// module's own weight, and an opaque oneDNN tensor cannot pass through Inductor's graph. An
// entry holds the weight's storage weakly: once that storage is freed, its address may be reused
// by another weight, and the entry no longer answers.

#include <torch/extension.h>

#include <ATen/core/dispatch/Dispatcher.h>

#include <atomic>
#include <mutex>
#include <optional>
#include <unordered_map>

#include "cpu_gemv.h"

namespace {

struct PackedWeight {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;  // the weight's, weakly
  std::vector<int64_t> shape;                         // the weight's [N, K]
  torch::Tensor packed;                               // oneDNN's blocked copy
};

std::mutex registry_mutex;
std::unordered_map<const void*, PackedWeight> registry;
std::atomic<int64_t> calls{0};  // products made on a packed copy (tests: which path ran)

bool still_holds(const PackedWeight& entry, const torch::Tensor& weight) {
  const auto alive = entry.storage.lock();
  return alive && alive.get() == weight.storage().unsafeGetStorageImpl() &&
         weight.sizes() == c10::IntArrayRef(entry.shape);
}

void drop_freed() {
  for (auto it = registry.begin(); it != registry.end();) {
    it = it->second.storage.expired() ? registry.erase(it) : std::next(it);
  }
}

}  // namespace

void register_packed_gemm(const torch::Tensor& weight, const torch::Tensor& packed) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "weight: float32 [N, K]");
  TORCH_CHECK(packed.is_mkldnn() && packed.sizes() == weight.sizes(),
              "packed: mkldnn._reorder_linear_weight of the weight");
  std::lock_guard<std::mutex> lock(registry_mutex);
  drop_freed();
  registry.insert_or_assign(
      weight.data_ptr(),
      PackedWeight{weight.storage().getWeakStorageImpl(), weight.sizes().vec(), packed});
}

int64_t packed_gemm_count() {
  std::lock_guard<std::mutex> lock(registry_mutex);
  drop_freed();
  return static_cast<int64_t>(registry.size());
}

int64_t packed_gemm_calls() { return calls.load(std::memory_order_relaxed); }

std::optional<torch::Tensor> packed_linear(const torch::Tensor& x, const torch::Tensor& weight,
                                           const std::optional<torch::Tensor>& bias) {
  torch::Tensor packed;
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    const auto it = registry.find(weight.data_ptr());
    if (it == registry.end() || !still_holds(it->second, weight)) return std::nullopt;
    packed = it->second.packed;
  }
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x.contiguous(),
                          packed,
                          bias.has_value() ? c10::IValue(*bias) : c10::IValue(),
                          c10::IValue(std::string("none")),
                          c10::IValue(c10::List<std::optional<at::Scalar>>()),
                          c10::IValue()};
  op.callBoxed(&stack);
  calls.fetch_add(1, std::memory_order_relaxed);
  return stack.back().toTensor();
}
