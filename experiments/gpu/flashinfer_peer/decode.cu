// FlashInfer's batch decode over a paged KV cache (its CUDA-core template, as its Python
// BatchDecodeWithPagedKVCacheWrapper builds it for plain attention), behind a C ABI for ctypes, so
// that experiments/gpu/kernel_bench.py can time it beside ours without FlashInfer's Python package.
// Mirrors FlashInfer's csrc/batch_decode.cu and batch_decode_customize_config.jinja; built by
// build.py with -DPEER_DTYPE_Q=... -DPEER_DTYPE_KV=... -DPEER_HEAD_DIM=... for one configuration.
#include <flashinfer/attention/decode.cuh>
#include <flashinfer/attention/scheduler.cuh>
#include <flashinfer/attention/variants.cuh>
#include <flashinfer/page.cuh>

#include <cstdint>
#include <cstring>
#include <vector>

using namespace flashinfer;

using DTypeQ = PEER_DTYPE_Q;
using DTypeKV = PEER_DTYPE_KV;
using DTypeO = PEER_DTYPE_Q;
using IdType = int32_t;
constexpr uint32_t HEAD_DIM = PEER_HEAD_DIM;
constexpr auto POS_ENCODING_MODE = PosEncodingMode::kNone;
// no custom mask, no sliding window, no logits soft cap, no ALiBi: the attention our kernels compute
using Variant = DefaultAttention<false, false, false, false>;

struct Params {
  using DTypeQ = ::DTypeQ;
  using DTypeKV = ::DTypeKV;
  using DTypeO = ::DTypeO;
  using IdType = ::IdType;

  DTypeQ* q;
  paged_kv_t<DTypeKV, IdType> paged_kv;
  DTypeO* o;
  float* lse;
  // FlashInfer's default decode module's additional parameters
  float* maybe_alibi_slopes;
  double logits_soft_cap;
  double sm_scale;
  double rope_rcp_scale;
  double rope_rcp_theta;

  uint32_t padded_batch_size;
  uint32_t num_qo_heads;
  IdType q_stride_n;
  IdType q_stride_h;
  int32_t window_left;
  bool enable_pdl;

  IdType* request_indices;
  IdType* kv_tile_indices;
  IdType* o_indptr;
  IdType* kv_chunk_size_ptr;
  bool* block_valid_mask;
  bool partition_kv;

  __host__ __device__ __forceinline__ int32_t get_qo_len(int32_t batch_idx) const { return 1; }

  __host__ __device__ __forceinline__ int32_t get_kv_len(int32_t batch_idx) const {
    return paged_kv.get_length(batch_idx);
  }
};

namespace {

thread_local char last_error[512];

int fail(const char* what, cudaError_t status) {
  std::snprintf(last_error, sizeof(last_error), "%s: %s", what, cudaGetErrorString(status));
  return 1;
}

}  // namespace

extern "C" {

// The message of the last call that returned non-zero.
const char* peer_error() { return last_error; }

// Bytes of the float and int workspaces the plan needs for this batch (at most; FlashInfer sizes
// them for the grid it picks).
int peer_workspace_size(const IdType* indptr_h, uint32_t batch_size, uint32_t num_qo_heads,
                        uint32_t num_kv_heads, uint32_t page_size, int64_t* float_bytes,
                        int64_t* int_bytes) {
  size_t f = 0, i = 0;
  cudaError_t status = cudaSuccess;
  DISPATCH_GQA_GROUP_SIZE(num_qo_heads / num_kv_heads, GROUP_SIZE, {
    auto estimate = BatchDecodeWithPagedKVCacheWorkEstimationDispatched<GROUP_SIZE, HEAD_DIM,
                                                                        POS_ENCODING_MODE, Variant, Params>;
    status = DecodePlanWorkspaceSize<HEAD_DIM, POS_ENCODING_MODE, Variant, Params>(
        f, i, const_cast<IdType*>(indptr_h), batch_size, num_qo_heads, page_size,
        /*enable_cuda_graph=*/true, /*stream=*/nullptr, estimate);
  });
  if (status != cudaSuccess) return fail("DecodePlanWorkspaceSize", status);
  *float_bytes = static_cast<int64_t>(f);
  *int_bytes = static_cast<int64_t>(i);
  return 0;
}

// Plans the batch (host work, then one copy of the plan to `int_ws` on `stream`); `plan_out`
// receives DecodePlanInfo's 10 values. With enable_cuda_graph the plan's grid does not depend on
// the lengths on the device, so a captured graph can replay it.
int peer_plan(void* float_ws, int64_t float_bytes, void* int_ws, void* int_ws_host, int64_t int_bytes,
              const IdType* indptr_h, uint32_t batch_size, uint32_t num_qo_heads, uint32_t num_kv_heads,
              uint32_t page_size, int64_t* plan_out, cudaStream_t stream) {
  DecodePlanInfo plan;
  cudaError_t status = cudaSuccess;
  DISPATCH_GQA_GROUP_SIZE(num_qo_heads / num_kv_heads, GROUP_SIZE, {
    auto estimate = BatchDecodeWithPagedKVCacheWorkEstimationDispatched<GROUP_SIZE, HEAD_DIM,
                                                                        POS_ENCODING_MODE, Variant, Params>;
    status = DecodePlan<HEAD_DIM, POS_ENCODING_MODE, Variant, Params>(
        float_ws, float_bytes, int_ws, int_ws_host, int_bytes, plan, const_cast<IdType*>(indptr_h),
        batch_size, num_qo_heads, page_size, /*enable_cuda_graph=*/true, stream, estimate);
  });
  if (status != cudaSuccess) return fail("DecodePlan", status);
  std::vector<int64_t> values = plan.ToVector();
  std::memcpy(plan_out, values.data(), values.size() * sizeof(int64_t));
  return 0;
}

// One decode call: q [batch, num_qo_heads, HEAD_DIM] contiguous, k/v [pages, num_kv_heads,
// page_size, HEAD_DIM] (HND) contiguous, o like q.
int peer_run(const int64_t* plan_in, void* float_ws, void* int_ws, void* q, void* k, void* v,
             IdType* indptr, IdType* indices, IdType* last_page_len, void* o, uint32_t batch_size,
             uint32_t num_qo_heads, uint32_t num_kv_heads, uint32_t page_size, double sm_scale,
             cudaStream_t stream) {
  DecodePlanInfo plan;
  plan.FromVector(std::vector<int64_t>(plan_in, plan_in + 10));
  const int64_t strides[4] = {static_cast<int64_t>(num_kv_heads) * page_size * HEAD_DIM,
                              static_cast<int64_t>(page_size) * HEAD_DIM, HEAD_DIM, 1};
  paged_kv_t<DTypeKV, IdType> paged_kv(num_kv_heads, page_size, HEAD_DIM, batch_size, QKVLayout::kHND,
                                       static_cast<DTypeKV*>(k), static_cast<DTypeKV*>(v), strides,
                                       strides, indices, indptr, last_page_len);
  Params params;
  params.q = static_cast<DTypeQ*>(q);
  params.paged_kv = paged_kv;
  params.o = static_cast<DTypeO*>(o);
  params.lse = nullptr;
  params.maybe_alibi_slopes = nullptr;
  params.logits_soft_cap = 0.0;
  params.sm_scale = sm_scale;
  params.rope_rcp_scale = 1.0;
  params.rope_rcp_theta = 1.0 / 1e4;
  params.num_qo_heads = num_qo_heads;
  params.q_stride_n = num_qo_heads * HEAD_DIM;
  params.q_stride_h = HEAD_DIM;
  params.window_left = -1;
  params.enable_pdl = false;
  params.partition_kv = false;
  params.request_indices = GetPtrFromBaseOffset<IdType>(int_ws, plan.request_indices_offset);
  params.kv_tile_indices = GetPtrFromBaseOffset<IdType>(int_ws, plan.kv_tile_indices_offset);
  params.o_indptr = GetPtrFromBaseOffset<IdType>(int_ws, plan.o_indptr_offset);
  params.kv_chunk_size_ptr = GetPtrFromBaseOffset<IdType>(int_ws, plan.kv_chunk_size_ptr_offset);
  params.block_valid_mask = nullptr;
  DTypeO* tmp_v = nullptr;
  float* tmp_s = nullptr;
  if (plan.split_kv) {
    tmp_v = GetPtrFromBaseOffset<DTypeO>(float_ws, plan.v_offset);
    tmp_s = GetPtrFromBaseOffset<float>(float_ws, plan.s_offset);
    if (plan.enable_cuda_graph) {
      params.block_valid_mask = GetPtrFromBaseOffset<bool>(int_ws, plan.block_valid_mask_offset);
    }
  }
  params.padded_batch_size = plan.padded_batch_size;
  cudaError_t status = BatchDecodeWithPagedKVCacheDispatched<HEAD_DIM, POS_ENCODING_MODE, Variant>(
      params, tmp_v, tmp_s, /*enable_pdl=*/false, stream);
  if (status != cudaSuccess) return fail("BatchDecodeWithPagedKVCacheDispatched", status);
  return 0;
}

}  // extern "C"
