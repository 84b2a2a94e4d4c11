// MXFP8 cast on CUDA: the same contract and rules as mx_cast.cpp (see there and mfsdp_core/mx.py).
//
// UNTESTED. It is built only where a CUDA toolkit and a GPU are both present
// (mfsdp_core/mx_native.py checks torch.cuda.is_available() and CUDA_HOME first), and this
// project's development machine has neither a GPU nor a run of this file behind it. Nothing in the
// test suite exercises it; treat its first run on a GPU as its first test:
//     pytest tests/mfsdp_core/test_mx_native.py  (CPU only today) and compare
//     mx.quantize(x.cuda(), fmt, axis, backend="native") with mx.quantize_reference(x.cuda(), ...).
//
// Expected differences from the CPU bytes, by design: the GPU's default NaN is positive, so an inf
// element of a floor NaN block becomes 0x7F here (torch on the GPU does the same), and the rceil
// table must be measured from torch.log2 *on the GPU* (the loader passes a per-device table).
//
// Layout: one thread per 32-element block. Columnwise threads take adjacent columns of one 32-row
// strip, so their loads coalesce; rowwise threads read 128 contiguous bytes each (not coalesced
// across a warp; a warp-per-block version would be faster, not written yet).

#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>

namespace {

constexpr int64_t kBlock = 32;

template <bool E4M3>
struct Elem {
  static constexpr int emax = E4M3 ? 8 : 15;
  static constexpr uint32_t max_bits = E4M3 ? 0x43E00000u : 0x47600000u;
  static constexpr uint32_t denorm_thresh = E4M3 ? (121u << 23) : (113u << 23);
  static constexpr uint32_t denorm_mask = E4M3 ? (141u << 23) : (134u << 23);
  static constexpr int mant_shift = E4M3 ? 20 : 21;
  static constexpr uint32_t exp_adjust = E4M3 ? (uint32_t)(7 - 127) << 23 : (uint32_t)(15 - 127) << 23;
  static constexpr uint32_t round_bias = E4M3 ? 0x7FFFFu : 0xFFFFFu;
};

template <bool E4M3>
__device__ __forceinline__ uint8_t clamp_cast(float v) {
  using T = Elem<E4M3>;
  uint32_t u = __float_as_uint(v);
  uint32_t sign = u & 0x80000000u;
  uint32_t a = u ^ sign;
  bool is_nan = a > 0x7F800000u;
  a = a > T::max_bits ? T::max_bits : a;
  uint32_t den = __float_as_uint(__fadd_rn(__uint_as_float(a), __uint_as_float(T::denorm_mask))) - T::denorm_mask;
  uint32_t odd = (a >> T::mant_shift) & 1u;
  uint32_t nor = (a + T::exp_adjust + T::round_bias + odd) >> T::mant_shift;
  uint32_t r = a < T::denorm_thresh ? den : nor;
  if (E4M3 && r == 0x7Fu) r = 0x7Eu;
  r = is_nan ? 0x7Fu : r;
  return (uint8_t)((r & 0xFFu) | (sign >> 24));
}

struct Params {
  uint8_t byte;
  float recip;
  uint8_t keep, force;
};

template <bool E4M3, bool FLOOR>
__device__ __forceinline__ Params block_params(uint32_t amax_bits, const int32_t* thr) {
  using T = Elem<E4M3>;
  Params p{0, 1.0f, 0xFF, 0x00};
  if (amax_bits > 0x7F800000u) {
    p.byte = 255;
    p.recip = 0.0f;
    if (!FLOOR) { p.keep = 0x00; p.force = 0x7F; }
    return p;
  }
  int byte;
  if (FLOOR) {
    byte = (int)(amax_bits >> 23) - T::emax;
    byte = byte < 0 ? 0 : byte;
    p.recip = __uint_as_float((uint32_t)(byte == 0 ? 253 : 254 - byte) << 23);
  } else {
    if (amax_bits == 0x7F800000u) {
      byte = 254;
    } else {
      const float maxv = E4M3 ? 448.0f : 57344.0f;
      uint32_t d = __float_as_uint(__fdiv_rn(__uint_as_float(amax_bits), maxv));
      int e = (int)(d >> 23);
      int32_t m = (int32_t)(d & 0x7FFFFF);
      if (e == 0) byte = m > 0x400000 + thr[0] ? 1 : 0;
      else { byte = e + (m > thr[e] ? 1 : 0); byte = byte > 254 ? 254 : byte; }
    }
    p.recip = byte == 0 ? 1.0f : byte == 254 ? __uint_as_float(0x00400000u) : __uint_as_float((uint32_t)(254 - byte) << 23);
  }
  p.byte = (uint8_t)byte;
  return p;
}

// blocks: rowwise -> M*K/32 blocks, block b at x + 32b, stride 1; columnwise -> (M/32)*K blocks,
// block (s, k) at x + 32*s*K + k, stride K.
template <bool E4M3, bool FLOOR>
__global__ void cast_kernel(const float* __restrict__ x, uint8_t* __restrict__ data, uint8_t* __restrict__ scale,
                            int64_t nblocks, int64_t K, bool col, const int32_t* __restrict__ thr) {
  int64_t b = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= nblocks) return;
  int64_t base, stride;
  if (col) { int64_t s = b / K, k = b % K; base = s * kBlock * K + k; stride = K; }
  else { base = b * kBlock; stride = 1; }
  uint32_t amax = 0;
#pragma unroll
  for (int i = 0; i < kBlock; ++i) {
    uint32_t a = __float_as_uint(x[base + i * stride]) & 0x7FFFFFFFu;
    amax = a > amax ? a : amax;
  }
  Params p = block_params<E4M3, FLOOR>(amax, thr);
  scale[b] = p.byte;  // rowwise: [M, K/32] row-major == block order; columnwise: [M/32, K] == (s, k)
#pragma unroll
  for (int i = 0; i < kBlock; ++i) {
    float v = __fmul_rn(x[base + i * stride], p.recip);
    data[base + i * stride] = (uint8_t)((clamp_cast<E4M3>(v) & p.keep) | p.force);
  }
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> quantize(const torch::Tensor& x_in, int64_t elem, int64_t rule, bool col,
                                                  const torch::Tensor& rceil_thr) {
  TORCH_CHECK(x_in.is_cuda(), "mx_cast (CUDA): input must be on a CUDA device");
  TORCH_CHECK(x_in.scalar_type() == torch::kFloat32 && x_in.dim() == 2, "mx_cast: expected a 2-D float32 tensor");
  TORCH_CHECK(rceil_thr.is_cuda() && rceil_thr.scalar_type() == torch::kInt32 && rceil_thr.numel() == 256,
              "mx_cast: rceil_thr must be a CUDA int32[256] measured on this device");
  const int64_t M = x_in.size(0), K = x_in.size(1);
  TORCH_CHECK((col ? M : K) % kBlock == 0, "mx_cast: the blocked dimension must be a multiple of 32");
  c10::cuda::CUDAGuard guard(x_in.device());
  torch::Tensor x = x_in.contiguous();
  torch::Tensor thr = rceil_thr.contiguous();
  auto opts = torch::TensorOptions().dtype(torch::kUInt8).device(x.device());
  torch::Tensor data = torch::empty({M, K}, opts);
  torch::Tensor scale = col ? torch::empty({M / kBlock, K}, opts) : torch::empty({M, K / kBlock}, opts);
  const int64_t nblocks = M * K / kBlock;
  if (nblocks == 0) return {data, scale};
  const int threads = 256;
  const int64_t grid = (nblocks + threads - 1) / threads;
  auto stream = at::cuda::getCurrentCUDAStream();
  const float* xp = x.data_ptr<float>();
  uint8_t* dp = data.data_ptr<uint8_t>();
  uint8_t* sp = scale.data_ptr<uint8_t>();
  const int32_t* tp = thr.data_ptr<int32_t>();
#define MX_LAUNCH(E, F) cast_kernel<E, F><<<grid, threads, 0, stream>>>(xp, dp, sp, nblocks, K, col, tp)
  if (elem == 0 && rule == 0) MX_LAUNCH(true, true);
  else if (elem == 0) MX_LAUNCH(true, false);
  else if (rule == 0) MX_LAUNCH(false, true);
  else MX_LAUNCH(false, false);
#undef MX_LAUNCH
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {data, scale};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "MXFP8 cast (float32 -> E4M3/E5M2 + E8M0 scales), CUDA; untested, see the file header";
  m.def("quantize", &quantize, "quantize(x, elem, rule, col, rceil_thr) -> (data uint8, scale uint8)");
}
