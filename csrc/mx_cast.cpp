// MXFP8 cast on CPU: float32 [M, K] -> FP8 data [M, K] + E8M0 scale plane, rowwise (1x32 blocks,
// scale [M, K/32]) or columnwise (32x1 blocks, scale [M/32, K]), floor or rceil, E4M3 or E5M2.
//
// The bytes are those of the pure-PyTorch reference mfsdp_core/mx.py (itself torchao's to_mx);
// every rule below is documented there. One pass over the input per block: amax as an integer max
// of |x|'s bits (NaN bits sort above inf, so a NaN anywhere makes the block NaN), the scale byte
// from amax's exponent field by integer operations, then x * 2^-e in float32 and a branch-free
// float32 -> FP8 round-to-nearest-even identical to c10's scalar conversion. No -ffast-math:
// subnormals, signed zeros and NaN bits must come out exactly as torch computes them.
//
// Threads: at::parallel_for (torch's intra-op pool, torch.set_num_threads; with an OpenMP build of
// torch that is an inlined `omp parallel`, so the loader compiles this file with -fopenmp, without
// which everything would run on one thread); inner loops are plain
// fixed-length loops over uint32 lanes that GCC vectorizes (#pragma omp simd, -fopenmp-simd). With
// GCC on x86-64 the two hot loops are compiled three times (AVX-512, AVX2, baseline) and the CPU
// picks one when the module loads (target_clones); the bytes are the same whichever runs.
//
// rceil needs one input the integer rule cannot know: torchao evaluates ceil(log2(d)) in float32
// with torch.log2, which rounds log2(d) down to exactly e for d a few ulps above 2^e. The loader
// (mfsdp_core/mx_native.py) measures, from torch.log2 itself, the largest such mantissa per
// exponent and passes that table (int32[256]) to every call.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <atomic>
#include <cstdint>
#include <cstring>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace {

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
// one copy of each hot loop per instruction set, chosen at load time by the CPU (GCC function
// multiversioning): AVX2 / AVX-512 where present, the portable build elsewhere
#define MX_CLONES __attribute__((target_clones("arch=skylake-avx512", "avx2", "default")))
#else
#define MX_CLONES
#endif

constexpr int64_t kBlock = 32;
constexpr int64_t kColTile = 256;  // columns per task in the columnwise kernel
constexpr int64_t kRowGroup = 64;  // blocks per step of the rowwise kernel

inline uint32_t bits_of(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float float_of(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

// Per-block parameters: the scale byte, the float32 factor every element is multiplied by, and a
// byte OR-ed over the result with a mask that keeps or drops it (rceil NaN blocks: all 0x7F).
struct BlockParams {
  uint8_t byte;
  float recip;
  uint8_t keep;   // 0xFF keeps the cast element, 0x00 drops it
  uint8_t force;  // OR-ed in afterwards
};

template <bool E4M3>
struct Elem {
  static constexpr int emax = E4M3 ? 8 : 15;
  static constexpr float max = E4M3 ? 448.0f : 57344.0f;
  static constexpr uint32_t max_bits = E4M3 ? 0x43E00000u : 0x47600000u;
  // below this |x| (bits) the FP8 result is subnormal: 2^-6 (E4M3) / 2^-14 (E5M2)
  static constexpr uint32_t denorm_thresh = E4M3 ? (121u << 23) : (113u << 23);
  static constexpr uint32_t denorm_mask = E4M3 ? (141u << 23) : (134u << 23);
  static constexpr int mant_shift = E4M3 ? 20 : 21;
  static constexpr uint32_t exp_adjust = E4M3 ? (uint32_t)(7 - 127) << 23 : (uint32_t)(15 - 127) << 23;
  static constexpr uint32_t round_bias = E4M3 ? 0x7FFFFu : 0xFFFFFu;
};

// clamp(v, -max, max) then c10's fp8 conversion (torch/headeronly/util/Float8_e4m3fn.h /
// Float8_e5m2.h) for a v that is not NaN, written without branches so the loops vectorize. The
// saturated maximum maps to 0x7E in E4M3, so c10's check for 0x7F (its NaN) never fires here.
template <bool E4M3>
__attribute__((always_inline)) inline uint8_t clamp_cast_no_nan(float v) {
  using T = Elem<E4M3>;
  // |v|'s bits fit in 31 bits, so signed int32 arithmetic and compares are exact here; they keep
  // the loop vectorizable on plain SSE2 (which has no unsigned 32-bit compare or min).
  uint32_t u = bits_of(v);
  uint32_t sign = u & 0x80000000u;
  int32_t a = (int32_t)(u ^ sign);
  a = a > (int32_t)T::max_bits ? (int32_t)T::max_bits : a;  // saturate (inf included)
  int32_t den = (int32_t)(bits_of(float_of((uint32_t)a) + float_of(T::denorm_mask)) - T::denorm_mask);
  int32_t odd = (a >> T::mant_shift) & 1;
  int32_t nor = (int32_t)(((uint32_t)a + T::exp_adjust + T::round_bias + (uint32_t)odd) >> T::mant_shift);
  int32_t r = a < (int32_t)T::denorm_thresh ? den : nor;
  return (uint8_t)((uint32_t)r | (sign >> 24));
}

// The same for any v: NaN becomes 0x7F with NaN's sign bit, as in c10. Blocks without NaN (their
// amax is at most inf: no element becomes NaN once scaled) take clamp_cast_no_nan, one select less.
template <bool E4M3>
__attribute__((always_inline)) inline uint8_t clamp_cast(float v) {
  uint32_t u = bits_of(v);
  uint8_t nan_byte = (uint8_t)(0x7Fu | ((u & 0x80000000u) >> 24));
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? nan_byte : clamp_cast_no_nan<E4M3>(v);
}

// Scale byte and factor of a block from the bits of its amax (already |x|, NaN above inf).
template <bool E4M3, bool FLOOR>
__attribute__((always_inline)) inline BlockParams block_params(uint32_t amax_bits, const int32_t* thr) {
  using T = Elem<E4M3>;
  BlockParams p{0, 1.0f, 0xFF, 0x00};
  if (amax_bits > 0x7F800000u) {  // NaN
    p.byte = 255;
    if (FLOOR) {
      p.recip = 0.0f;  // x / inf: finite -> +-0, NaN kept, inf -> default NaN (same as x * 0)
    } else {
      p.recip = 0.0f;  // x * NaN(d): torch returns d's NaN, positive: every element 0x7F
      p.keep = 0x00;
      p.force = 0x7F;
    }
    return p;
  }
  int byte;
  if (FLOOR) {
    int e = (int)(amax_bits >> 23);  // 255 for inf: 247 / 240, an ordinary scale
    byte = e - T::emax;
    byte = byte < 0 ? 0 : byte;
    // byte 0 divides by 2^-126 (torchao's clamp to the smallest normal), else by 2^(byte-127)
    p.recip = float_of((uint32_t)(byte == 0 ? 253 : 254 - byte) << 23);
  } else {
    if (amax_bits == 0x7F800000u) {  // inf
      byte = 254;
    } else {
      uint32_t d = bits_of(float_of(amax_bits) / T::max);
      int e = (int)(d >> 23);
      int32_t m = (int32_t)(d & 0x7FFFFF);
      if (e == 0) {  // d subnormal: ceil(log2 d) is -126 only above 2^-127 (+ the log2 slack)
        byte = m > 0x400000 + thr[0] ? 1 : 0;
      } else {
        byte = e + (m > thr[e] ? 1 : 0);
        byte = byte > 254 ? 254 : byte;
      }
    }
    p.recip = byte == 0 ? 1.0f : byte == 254 ? float_of(0x00400000u) : float_of((uint32_t)(254 - byte) << 23);
  }
  p.byte = (uint8_t)byte;
  return p;
}

// every entry of the rceil table (but the subnormal one) is at most this: the loader measures it
// over 4096 mantissas per exponent; quantize() checks it on every call
constexpr int32_t kRceilNear = 4095;
constexpr int64_t kScaleGroup = 256;  // the most blocks scales_no_nan is given at once
static_assert(kRowGroup <= kScaleGroup && kColTile <= kScaleGroup, "scales_no_nan gets at most kScaleGroup blocks");

// block_params' rule for n NaN-free amaxes at once, in vector loops: scale bytes into sc, factors
// into recip. rceil's table lookup thr[e] would be a gather per block; instead the loop decides
// with the table's bound (thr[e] <= kRceilNear for every e: a mantissa above it always rounds up)
// and marks the blocks whose mantissa is at or under the bound, or whose d is subnormal, for an
// exact scalar pass with the table (about one block in 2000 of random data).
template <bool E4M3, bool FLOOR>
__attribute__((always_inline)) inline void scales_no_nan(const uint32_t* amax, int64_t n, uint8_t* sc, float* recip,
                                                         const int32_t* thr) {
  int32_t byte[kScaleGroup];
  int32_t near_any = 0;
#pragma omp simd reduction(| : near_any)
  for (int64_t j = 0; j < n; ++j) {
    if (FLOOR) {
      int32_t b = (int32_t)(amax[j] >> 23) - Elem<E4M3>::emax;
      byte[j] = b < 0 ? 0 : b;
    } else {
      uint32_t d = bits_of(float_of(amax[j]) / Elem<E4M3>::max);
      int32_t e = (int32_t)(d >> 23);  // 255 for an inf amax: replaced below
      int32_t m = (int32_t)(d & 0x7FFFFF);
      int32_t b = e + (m > kRceilNear ? 1 : 0);
      b = b > 254 ? 254 : b;
      int32_t near = (m <= kRceilNear) | (e == 0);
      near = amax[j] == 0x7F800000u ? 0 : near;
      b = amax[j] == 0x7F800000u ? 254 : b;
      byte[j] = near ? -1 : b;
      near_any |= near;
    }
  }
  if (!FLOOR && near_any) {
    for (int64_t j = 0; j < n; ++j) {
      if (byte[j] < 0) byte[j] = block_params<E4M3, FLOOR>(amax[j], thr).byte;
    }
  }
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const int32_t b = byte[j];
    if (FLOOR) recip[j] = float_of((uint32_t)(b == 0 ? 253 : 254 - b) << 23);
    else recip[j] = b == 0 ? 1.0f : b == 254 ? float_of(0x00400000u) : float_of((uint32_t)(254 - b) << 23);
    sc[j] = (uint8_t)b;
  }
}

// A group of blocks at a time: their amaxes (one reduction each), then every block's scale in one
// loop over the group, then the casts; a group holding a NaN block takes the general path.
template <bool E4M3, bool FLOOR>
MX_CLONES void rowwise_range(const float* x, uint8_t* data, uint8_t* scale, int64_t b0, int64_t b1, const int32_t* thr) {
  uint32_t amax[kRowGroup];
  float recip[kRowGroup];
  for (int64_t g0 = b0; g0 < b1; g0 += kRowGroup) {
    const int64_t n = b1 - g0 < kRowGroup ? b1 - g0 : kRowGroup;
    uint32_t group_max = 0;
    for (int64_t j = 0; j < n; ++j) {
      const uint32_t* xb = reinterpret_cast<const uint32_t*>(x + (g0 + j) * kBlock);
      uint32_t m = 0;
#pragma omp simd reduction(max : m)
      for (int i = 0; i < kBlock; ++i) {
        uint32_t a = xb[i] & 0x7FFFFFFFu;
        m = a > m ? a : m;
      }
      amax[j] = m;
      group_max = m > group_max ? m : group_max;
    }
    if (group_max > 0x7F800000u) {  // a NaN block: the general path, block by block
      for (int64_t j = 0; j < n; ++j) {
        BlockParams p = block_params<E4M3, FLOOR>(amax[j], thr);
        scale[g0 + j] = p.byte;
        const float* xf = x + (g0 + j) * kBlock;
        uint8_t* out = data + (g0 + j) * kBlock;
        if (amax[j] <= 0x7F800000u) {
#pragma omp simd
          for (int i = 0; i < kBlock; ++i) out[i] = clamp_cast_no_nan<E4M3>(xf[i] * p.recip);
        } else {
#pragma omp simd
          for (int i = 0; i < kBlock; ++i) out[i] = (uint8_t)((clamp_cast<E4M3>(xf[i] * p.recip) & p.keep) | p.force);
        }
      }
      continue;
    }
    scales_no_nan<E4M3, FLOOR>(amax, n, scale + g0, recip, thr);
    for (int64_t j = 0; j < n; ++j) {
      const float* xf = x + (g0 + j) * kBlock;
      uint8_t* out = data + (g0 + j) * kBlock;
      const float r = recip[j];
#pragma omp simd
      for (int i = 0; i < kBlock; ++i) out[i] = clamp_cast_no_nan<E4M3>(xf[i] * r);
    }
  }
}

template <bool E4M3, bool FLOOR>
void rowwise(const float* x, uint8_t* data, uint8_t* scale, int64_t nblocks, const int32_t* thr) {
  at::parallel_for(0, nblocks, 2048, [&](int64_t b0, int64_t b1) {
    rowwise_range<E4M3, FLOOR>(x, data, scale, b0, b1, thr);
  });
}

template <bool E4M3, bool FLOOR>
MX_CLONES void colwise_range(const float* x, uint8_t* data, uint8_t* scale, int64_t M, int64_t K, const int32_t* thr,
                             int64_t t0, int64_t t1) {
    const int64_t tiles = (K + kColTile - 1) / kColTile;
    uint32_t amax[kColTile];
    float recip[kColTile];
    uint8_t keep[kColTile], force[kColTile];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t s = t / tiles, k0 = (t % tiles) * kColTile;
      const int64_t w = K - k0 < kColTile ? K - k0 : kColTile;
      const float* xs = x + s * kBlock * K + k0;
      for (int64_t j = 0; j < w; ++j) amax[j] = 0;
      for (int64_t r = 0; r < kBlock; ++r) {
        const uint32_t* row = reinterpret_cast<const uint32_t*>(xs + r * K);
#pragma omp simd
        for (int64_t j = 0; j < w; ++j) {
          uint32_t a = row[j] & 0x7FFFFFFFu;
          amax[j] = a > amax[j] ? a : amax[j];
        }
      }
      uint8_t* sc = scale + s * K + k0;
      uint32_t tile_max = 0;
      for (int64_t j = 0; j < w; ++j) tile_max = amax[j] > tile_max ? amax[j] : tile_max;
      if (tile_max <= 0x7F800000u) {  // no NaN column: every scale in vector loops, casts without selects
        scales_no_nan<E4M3, FLOOR>(amax, w, sc, recip, thr);
        for (int64_t r = 0; r < kBlock; ++r) {
          const float* row = xs + r * K;
          uint8_t* out = data + (s * kBlock + r) * K + k0;
#pragma omp simd
          for (int64_t j = 0; j < w; ++j) out[j] = clamp_cast_no_nan<E4M3>(row[j] * recip[j]);
        }
        continue;
      }
      for (int64_t j = 0; j < w; ++j) {
        BlockParams p = block_params<E4M3, FLOOR>(amax[j], thr);
        sc[j] = p.byte;
        recip[j] = p.recip;
        keep[j] = p.keep;
        force[j] = p.force;
      }
      for (int64_t r = 0; r < kBlock; ++r) {
        const float* row = xs + r * K;
        uint8_t* out = data + (s * kBlock + r) * K + k0;
#pragma omp simd
        for (int64_t j = 0; j < w; ++j) {
          out[j] = (uint8_t)((clamp_cast<E4M3>(row[j] * recip[j]) & keep[j]) | force[j]);
        }
      }
    }
}

template <bool E4M3, bool FLOOR>
void colwise(const float* x, uint8_t* data, uint8_t* scale, int64_t M, int64_t K, const int32_t* thr) {
  const int64_t strips = M / kBlock;
  const int64_t tiles = (K + kColTile - 1) / kColTile;
  at::parallel_for(0, strips * tiles, 1, [&](int64_t t0, int64_t t1) {
    colwise_range<E4M3, FLOOR>(x, data, scale, M, K, thr, t0, t1);
  });
}

template <bool E4M3, bool FLOOR>
void dispatch_axis(const float* x, uint8_t* data, uint8_t* scale, int64_t M, int64_t K, bool col,
                   const int32_t* thr) {
  if (col) colwise<E4M3, FLOOR>(x, data, scale, M, K, thr);
  else rowwise<E4M3, FLOOR>(x, data, scale, M * K / kBlock, thr);
}

// Outputs of many MB are fresh memory: the allocator maps them anew for each call, and the first
// write to each 4 KiB page costs a page fault (measured here: 32 MiB of fresh uint8 took 17 ms to
// fill, about as long as the whole cast). Asking for transparent huge pages on the 2 MiB-aligned
// part of such an output makes that one fault per 2 MiB (8 ms for the same fill). Only a hint: where
// THP is off, or not on Linux, nothing changes.
void prefer_huge_pages(const torch::Tensor& t) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = 2u << 20;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(t.data_ptr());
  const uintptr_t end = begin + (uintptr_t)t.nbytes();
  const uintptr_t first = (begin + kHuge - 1) & ~(kHuge - 1), last = end & ~(kHuge - 1);
  if (t.nbytes() >= (8u << 20) && last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
#endif
}

}  // namespace

// x: float32 [M, K] (CPU); elem 0 = E4M3, 1 = E5M2; rule 0 = floor, 1 = rceil; col: blocks down
// columns. rceil_thr: int32[256], see the header. Returns (data uint8 [M, K], scale uint8).
std::tuple<torch::Tensor, torch::Tensor> quantize(const torch::Tensor& x_in, int64_t elem, int64_t rule, bool col,
                                                  const torch::Tensor& rceil_thr) {
  TORCH_CHECK(x_in.device().is_cpu(), "mx_cast (CPU): input must be on the CPU");
  TORCH_CHECK(x_in.scalar_type() == torch::kFloat32 && x_in.dim() == 2, "mx_cast: expected a 2-D float32 tensor");
  TORCH_CHECK(elem == 0 || elem == 1, "mx_cast: elem must be 0 (e4m3) or 1 (e5m2)");
  TORCH_CHECK(rule == 0 || rule == 1, "mx_cast: rule must be 0 (floor) or 1 (rceil)");
  TORCH_CHECK(rceil_thr.scalar_type() == torch::kInt32 && rceil_thr.numel() == 256 && rceil_thr.is_contiguous(),
              "mx_cast: rceil_thr must be a contiguous int32[256]");
  {
    const int32_t* t = rceil_thr.data_ptr<int32_t>();
    for (int e = 1; e < 255; ++e) TORCH_CHECK(t[e] >= 0 && t[e] <= kRceilNear, "mx_cast: rceil_thr[", e, "] out of range");
  }
  const int64_t M = x_in.size(0), K = x_in.size(1);
  TORCH_CHECK((col ? M : K) % kBlock == 0, "mx_cast: the blocked dimension must be a multiple of 32");
  torch::Tensor x = x_in.contiguous();
  auto opts = torch::TensorOptions().dtype(torch::kUInt8);
  torch::Tensor data = torch::empty({M, K}, opts);
  torch::Tensor scale = col ? torch::empty({M / kBlock, K}, opts) : torch::empty({M, K / kBlock}, opts);
  if (M == 0 || K == 0) return {data, scale};
  prefer_huge_pages(data);
  const float* xp = x.data_ptr<float>();
  uint8_t* dp = data.data_ptr<uint8_t>();
  uint8_t* sp = scale.data_ptr<uint8_t>();
  const int32_t* thr = rceil_thr.data_ptr<int32_t>();
  if (elem == 0 && rule == 0) dispatch_axis<true, true>(xp, dp, sp, M, K, col, thr);
  else if (elem == 0) dispatch_axis<true, false>(xp, dp, sp, M, K, col, thr);
  else if (rule == 0) dispatch_axis<false, true>(xp, dp, sp, M, K, col, thr);
  else dispatch_axis<false, false>(xp, dp, sp, M, K, col, thr);
  return {data, scale};
}

// How many threads a parallel_for of this module runs on (torch.get_num_threads() when the module
// was built with the threading torch uses; 1 when the loop fell back to serial): for the tests.
int64_t parallel_threads() {
  std::atomic<uint64_t> seen{0};
  at::parallel_for(0, 64, 1, [&](int64_t, int64_t) { seen.fetch_or(uint64_t{1} << (at::get_thread_num() & 63)); });
  return __builtin_popcountll(seen.load());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "MXFP8 cast (float32 -> E4M3/E5M2 + E8M0 scales), CPU; bitwise equal to mfsdp_core.mx";
  m.def("parallel_threads", &parallel_threads, "threads a parallel_for of this module runs on");
  m.def("quantize", &quantize, "quantize(x, elem, rule, col, rceil_thr) -> (data uint8, scale uint8)");
}
