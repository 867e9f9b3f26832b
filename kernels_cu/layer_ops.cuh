// Fused elementwise ops of a Llama layer: RMSNorm, residual add + RMSNorm, RoPE and SiLU-and-mul,
// each one pass over its rows where the model's torch formulas (paged/model/layer_ops.py,
// `TorchLayerOps`) launch 2 to 7 kernels.
//
// Each kernel performs the torch formula's float operations in its order and rounds where it
// rounds: a product or sum torch stores in T is rounded to T here too, and every float product
// and sum is an explicit __fmul_rn / __fadd_rn, which the compiler never contracts into an FMA
// (NVRTC contracts a * b + c by default, and torch rounds the product before the sum).
//
// Exactness against the torch formulas, per op:
//   - residual add and RoPE: bit-identical in every dtype (the same operations, rounded the same);
//   - RMSNorm: the sum of squares is a block reduction (each thread's strided partial sum, warp
//     butterflies, then the warps' sums), not ATen's order, so the fp32 sum and then rstd may
//     differ from torch's in their last bits; the rest (mean = sum / H, + eps, 1 / sqrt, x * rstd
//     rounded to T, then weight * it rounded to T) is torch's. The order depends only on H and the
//     block size the plan picks from H, so a row's result does not depend on the batch;
//   - SiLU: g / (1 + expf(-g)) in fp32 as torch's CUDA silu computes it, with CUDA's expf (at
//     most 2 ulp from exp, CUDA C Programming Guide); torch on a CPU uses Sleef's expf_u10 (libm's
//     expf for a row's tail), and the emulator runs the host's libm expf, so on CPU tensors the
//     gate's SiLU may differ from torch's by an ulp of fp32 before it is rounded to T.
//
// Launch shape: one CTA per row (token); blockDim.x a multiple of 32, at most 1024. VEC is the
// number of elements per load and store: 16 / sizeof(T) where the plan found every row and the
// weight 16-byte aligned and the width a multiple of it, else 1.
#pragma once

#include "vec.cuh"

namespace paged {

constexpr int LAYER_MAX_WARPS = 32;

template <typename T, int N>
PAGED_DEVICE void write_vec(T* ptr, const Vec<T, N>& v) {
  typedef typename Words<sizeof(T) * N>::type W;
  *reinterpret_cast<W*>(ptr) = *reinterpret_cast<const W*>(&v);
}

// `v` rounded to T and back: the value torch holds after storing a float result in a T tensor.
template <typename T>
PAGED_DEVICE float round_to(float v) {
  return to_float(from_float<T>(v));
}

// The sum of `value` over the block. The butterflies leave every lane the same total (float
// addition is commutative), so no broadcast is needed.
PAGED_DEVICE float block_sum(float* red_smem, float value) {
  const int warp = threadIdx.x / WARP_SIZE;
  const int lane = threadIdx.x % WARP_SIZE;
  const int num_warps = blockDim.x / WARP_SIZE;
  value = warp_reduce<WARP_SIZE / 2>(value, SumOp());
  if (lane == 0) red_smem[warp] = value;
  __syncthreads();
  value = lane < num_warps ? red_smem[lane] : 0.f;
  return warp_reduce<WARP_SIZE / 2>(value, SumOp());
}

// rsqrt(mean(x²) + eps) as ATen computes it for a float row: sum / H, + eps, 1 / sqrt.
PAGED_DEVICE float rstd_of(float sum_squares, int hidden, float eps) {
  return __fdiv_rn(1.f, __fsqrt_rn(__fadd_rn(__fdiv_rn(sum_squares, static_cast<float>(hidden)), eps)));
}

template <typename T, int VEC>
PAGED_DEVICE float add_squares(float sum, const Vec<T, VEC>& v) {
#pragma unroll
  for (int e = 0; e < VEC; ++e) {
    const float f = to_float(v.val[e]);
    sum = __fadd_rn(sum, __fmul_rn(f, f));
  }
  return sum;
}

// weight * F.rms_norm(x.float()).to(T): x * rstd rounded to T, then its product with the weight.
template <typename T, int VEC>
PAGED_DEVICE Vec<T, VEC> scale_vec(const Vec<T, VEC>& x, const Vec<T, VEC>& w, float rstd) {
  Vec<T, VEC> out;
#pragma unroll
  for (int e = 0; e < VEC; ++e) {
    const float normed = round_to<T>(__fmul_rn(to_float(x.val[e]), rstd));
    out.val[e] = from_float<T>(__fmul_rn(to_float(w.val[e]), normed));
  }
  return out;
}

// Grid (rows): out[row] = weight * rms_norm(x[row]); out and x must not overlap.
template <typename T, int VEC>
__global__ void rms_norm_kernel(T* __restrict__ out, const T* __restrict__ x, const T* __restrict__ weight,
                                int out_stride, int x_stride, int hidden, float eps) {
  __shared__ float red_smem[LAYER_MAX_WARPS];
  const T* x_row = x + static_cast<int64>(blockIdx.x) * x_stride;
  T* out_row = out + static_cast<int64>(blockIdx.x) * out_stride;
  const int num_vecs = hidden / VEC;
  float sum = 0.f;
  for (int i = threadIdx.x; i < num_vecs; i += blockDim.x) sum = add_squares(sum, load_vec<T, VEC>(x_row + i * VEC));
  const float rstd = rstd_of(block_sum(red_smem, sum), hidden, eps);
  for (int i = threadIdx.x; i < num_vecs; i += blockDim.x) {
    write_vec(out_row + i * VEC,
              scale_vec(load_vec<T, VEC>(x_row + i * VEC), load_vec<T, VEC>(weight + i * VEC), rstd));
  }
}

// Grid (rows), vLLM's fused_add_rms_norm: residual[row] += x[row] (rounded to T, as torch's
// residual.add_(x)), then x[row] = weight * rms_norm(residual[row]). The second pass reads back
// only the residual elements its own thread wrote, so it needs no barrier of its own.
template <typename T, int VEC>
__global__ void add_rms_norm_kernel(T* __restrict__ x, T* __restrict__ residual, const T* __restrict__ weight,
                                    int x_stride, int residual_stride, int hidden, float eps) {
  __shared__ float red_smem[LAYER_MAX_WARPS];
  T* x_row = x + static_cast<int64>(blockIdx.x) * x_stride;
  T* r_row = residual + static_cast<int64>(blockIdx.x) * residual_stride;
  const int num_vecs = hidden / VEC;
  float sum = 0.f;
  for (int i = threadIdx.x; i < num_vecs; i += blockDim.x) {
    const Vec<T, VEC> xv = load_vec<T, VEC>(x_row + i * VEC);
    Vec<T, VEC> r = load_vec<T, VEC>(r_row + i * VEC);
#pragma unroll
    for (int e = 0; e < VEC; ++e) r.val[e] = from_float<T>(__fadd_rn(to_float(r.val[e]), to_float(xv.val[e])));
    write_vec(r_row + i * VEC, r);
    sum = add_squares(sum, r);
  }
  const float rstd = rstd_of(block_sum(red_smem, sum), hidden, eps);
  for (int i = threadIdx.x; i < num_vecs; i += blockDim.x) {
    write_vec(x_row + i * VEC,
              scale_vec(load_vec<T, VEC>(r_row + i * VEC), load_vec<T, VEC>(weight + i * VEC), rstd));
  }
}

// Grid (rows): out[row, i] = silu(x[row, i]) * x[row, inter + i], F.silu(gate) * up: SiLU in fp32
// rounded to T, then the product rounded to T.
template <typename T, int VEC>
__global__ void silu_and_mul_kernel(T* __restrict__ out, const T* __restrict__ x, int out_stride, int x_stride,
                                    int inter) {
  const T* gate = x + static_cast<int64>(blockIdx.x) * x_stride;
  const T* up = gate + inter;
  T* out_row = out + static_cast<int64>(blockIdx.x) * out_stride;
  for (int i = threadIdx.x; i < inter / VEC; i += blockDim.x) {
    const Vec<T, VEC> g = load_vec<T, VEC>(gate + i * VEC);
    const Vec<T, VEC> u = load_vec<T, VEC>(up + i * VEC);
    Vec<T, VEC> o;
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const float gf = to_float(g.val[e]);
      const float silu = round_to<T>(__fdiv_rn(gf, __fadd_rn(1.f, expf(-gf))));
      o.val[e] = from_float<T>(__fmul_rn(silu, to_float(u.val[e])));
    }
    write_vec(out_row + i * VEC, o);
  }
}

// Grid (rows): rotates the first num_heads heads of head_dim of each row of qk in place, HF's
// rotate_half layout (dimension i pairs with i + head_dim / 2), as torch's
// `x * cos + rotate_half(x) * sin` with the tables' [head_dim] rows at the row's position, which
// must lie in [0, P) of the [P, head_dim] tables. Each product and the sum are rounded to T;
// rotate_half's -x2 times sin is -(x2 * sin) exactly, and a + (-b) is a - b.
template <typename T>
__global__ void rotary_embedding_kernel(T* __restrict__ qk, const int64* __restrict__ positions,
                                        const T* __restrict__ cos_table, const T* __restrict__ sin_table,
                                        int row_stride, int num_heads, int head_dim) {
  const int half = head_dim / 2;
  const int64 position = positions[blockIdx.x];
  const T* c = cos_table + position * head_dim;
  const T* s = sin_table + position * head_dim;
  T* row = qk + static_cast<int64>(blockIdx.x) * row_stride;
  for (int i = threadIdx.x; i < num_heads * half; i += blockDim.x) {
    const int d = i % half;
    T* head = row + (i / half) * head_dim;
    const float x1 = to_float(head[d]), x2 = to_float(head[d + half]);
    const float a = round_to<T>(__fmul_rn(x1, to_float(c[d])));
    const float b = round_to<T>(__fmul_rn(x2, to_float(s[d])));
    const float e = round_to<T>(__fmul_rn(x2, to_float(c[d + half])));
    const float f = round_to<T>(__fmul_rn(x1, to_float(s[d + half])));
    head[d] = from_float<T>(__fsub_rn(a, b));
    head[d + half] = from_float<T>(__fadd_rn(e, f));
  }
}

}  // namespace paged
