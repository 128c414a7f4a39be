// CPU kernels of tandem's step path (see tandem_kernels/cpu/__init__.py for the contracts).
//
// Registered as torch ops in the `tandem_cpu` namespace (no pybind11: the JIT build stays
// short). Every kernel computes in float32 and rounds once to the tensor dtype; the float32
// operation order of the pure-torch references is kept where parity depends on it (build with
// -ffp-contract=off: no fused multiply-adds the references do not do).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <omp.h>
#include <sched.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

// MKL's packed sgemm (a weight packed once into MKL's blocked layout, then multiplied by any
// number of rows without MKL repacking it on every call). torch's x86 builds link MKL into
// libtorch_cpu and export these; declared weak, so a build without MKL (aarch64, a source
// build) still loads and `has_packed_sgemm` says false. LP64 (int) interface, CBLAS enums.
extern "C" {
size_t cblas_sgemm_pack_get_size(int identifier, int m, int n, int k) __attribute__((weak));
void cblas_sgemm_pack(int layout, int identifier, int trans, int m, int n, int k, float alpha,
                      const float* src, int ld, float* dest) __attribute__((weak));
void cblas_sgemm_compute(int layout, int transa, int transb, int m, int n, int k, const float* a,
                         int lda, const float* b, int ldb, float beta, float* c, int ldc)
    __attribute__((weak));
#if defined(__AVX512F__)
// SLEEF's 1-ulp exp over 16 floats: the one ATen's AVX512 kernels (silu, softmax) use; torch's
// x86 builds export it. Weak, as above: without it the kernels take std::exp.
__m512 Sleef_expf16_u10(__m512 x) __attribute__((weak));
#endif
}

namespace {

template <typename T>
inline float to_f(T x) {
  return static_cast<float>(x);
}

// Rows per parallel chunk for row-wise kernels of `row_elems` elements a row: at least about
// 64K elements a chunk, so a decode step's few rows run on the calling thread. A parallel
// region costs a wake-up of the other threads and a barrier; on a busy machine the barrier
// waits for a descheduled thread (measured: 0.3-0.6 ms a call for 64 rows of 576, 10-50 us
// of work).
inline int64_t row_grain(int64_t row_elems) {
  return std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, row_elems));
}

// x[i] <- exp(x[i] - shift) for i < n; 16 lanes at a time where SLEEF is there (see above).
inline void exp_shifted(float* x, int64_t n, float shift) {
  int64_t i = 0;
#if defined(__AVX512F__)
  if (Sleef_expf16_u10 != nullptr) {
    const __m512 sh = _mm512_set1_ps(shift);
    for (; i + 16 <= n; i += 16)
      _mm512_storeu_ps(x + i, Sleef_expf16_u10(_mm512_sub_ps(_mm512_loadu_ps(x + i), sh)));
  }
#endif
  for (; i < n; ++i) x[i] = std::exp(x[i] - shift);
}

// x[i] <- silu(x[i]) = x / (1 + exp(-x)) for i < n, float32, as ATen's vectorized silu.
inline void silu_inplace(float* x, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  if (Sleef_expf16_u10 != nullptr) {
    const __m512 one = _mm512_set1_ps(1.f);
    const __m512 zero = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) {
      const __m512 v = _mm512_loadu_ps(x + i);
      const __m512 e = Sleef_expf16_u10(_mm512_sub_ps(zero, v));
      _mm512_storeu_ps(x + i, _mm512_div_ps(v, _mm512_add_ps(one, e)));
    }
  }
#endif
  for (; i < n; ++i) x[i] = x[i] / (1.f + std::exp(-x[i]));
}

#if defined(__AVX512F__)
// ---------------------------------------------------------------------------- 16 lanes

// 16 values of C at p as float32.
template <typename C>
inline __m512 load16(const C* p);
template <>
inline __m512 load16<float>(const float* p) {
  return _mm512_loadu_ps(p);
}
template <>
inline __m512 load16<at::BFloat16>(const at::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
template <>
inline __m512 load16<at::Half>(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Whether T has the 16-lane helpers (float32, bf16, half; not double).
template <typename T>
constexpr bool kLanes16 = std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16> ||
                          std::is_same_v<T, at::Half>;

// v rounded to T as c10's conversion does (round to nearest even; NaN -> c10's NaN), as float32.
template <typename T>
inline __m512 round16(__m512 v);
template <>
inline __m512 round16<float>(__m512 v) {
  return v;
}
inline __m512i bf16_bits(__m512 v) {  // the bf16 of each lane in its low 16 bits
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, bias), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7FC0));
}
template <>
inline __m512 round16<at::BFloat16>(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16));
}
template <>
inline __m512 round16<at::Half>(__m512 v) {
  return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// p[0..15] <- v rounded to T (as round16).
template <typename T>
inline void store16(T* p, __m512 v);
template <>
inline void store16<float>(float* p, __m512 v) {
  _mm512_storeu_ps(p, v);
}
template <>
inline void store16<at::BFloat16>(at::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(v)));
}
template <>
inline void store16<at::Half>(at::Half* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#endif  // __AVX512F__

// ---------------------------------------------------------------------------- RMSNorm

// x: [T, H] rows with stride x_stride. If residual is given: residual <- x + residual (in the
// input dtype), then out <- weight * round(residual * rsqrt(mean(residual^2) + eps)).
template <typename T>
void rms_norm_rows(T* out, const T* x, T* residual, const T* weight, int64_t rows, int64_t h,
                   int64_t x_stride, int64_t out_stride, int64_t res_stride, double eps) {
  at::parallel_for(0, rows, row_grain(h), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(h);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * x_stride;
      T* orow = out + r * out_stride;
#if defined(__AVX512F__)
      if constexpr (kLanes16<T>) if (h % 16 == 0) {  // the same arithmetic in 16 lanes
        __m512 acc = _mm512_setzero_ps();
        T* rr = residual != nullptr ? residual + r * res_stride : nullptr;
        for (int64_t i = 0; i < h; i += 16) {
          __m512 v = load16<T>(xr + i);
          if (rr != nullptr) {
            v = round16<T>(_mm512_add_ps(v, load16<T>(rr + i)));
            store16<T>(rr + i, v);
          }
          _mm512_storeu_ps(buf.data() + i, v);
          acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
        }
        const float ss = _mm512_reduce_add_ps(acc);
        const __m512 inv = _mm512_set1_ps(
            1.f / std::sqrt(ss / static_cast<float>(h) + static_cast<float>(eps)));
        for (int64_t i = 0; i < h; i += 16) {
          const __m512 normed = round16<T>(_mm512_mul_ps(_mm512_loadu_ps(buf.data() + i), inv));
          store16<T>(orow + i, _mm512_mul_ps(load16<T>(weight + i), normed));
        }
        continue;
      }
#endif
      if (residual != nullptr) {
        T* rr = residual + r * res_stride;
        for (int64_t i = 0; i < h; ++i) {
          T s = static_cast<T>(to_f(xr[i]) + to_f(rr[i]));
          rr[i] = s;
          buf[i] = to_f(s);
        }
      } else {
        for (int64_t i = 0; i < h; ++i) buf[i] = to_f(xr[i]);
      }
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < h; ++i) ss += buf[i] * buf[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(h) + static_cast<float>(eps));
      for (int64_t i = 0; i < h; ++i) {
        T normed = static_cast<T>(buf[i] * inv);
        orow[i] = static_cast<T>(to_f(weight[i]) * to_f(normed));
      }
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rms_norm: x must be [T, H], rows contiguous");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "rms_norm: weight [H]");
  auto out = at::empty_like(x, at::MemoryFormat::Contiguous);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(out.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), nullptr,
                            weight.data_ptr<scalar_t>(), x.size(0), x.size(1), x.stride(0),
                            out.stride(0), 0, eps);
  });
  return out;
}

// Returns the normed rows; `residual` is updated in place (residual += x).
at::Tensor fused_add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                              double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "fused_add_rms_norm: x must be [T, H]");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.stride(1) == 1, "residual like x");
  TORCH_CHECK(residual.scalar_type() == x.scalar_type(), "residual dtype");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "weight [H]");
  auto out = at::empty_like(x, at::MemoryFormat::Contiguous);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms", [&] {
    rms_norm_rows<scalar_t>(out.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(),
                            residual.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(),
                            x.size(0), x.size(1), x.stride(0), out.stride(0), residual.stride(0),
                            eps);
  });
  return out;
}

// ---------------------------------------------------------------------------- rotary

// qkv: [T, (H + 2 KVH) * D] rows (the fused projection's output). Writes q_out [T, H, D]
// (rotated), and K (rotated) and V of every token with slot >= 0 into kv_cache
// [num_blocks, 2, block_size, KVH, D] (any strides on dim 0; the rest contiguous). Returns
// nothing; the rotation is x * cos + rotate_half(x) * sin with cos/sin rounded to the dtype.
template <typename T, typename C>
void rotary_qkv_cache_impl(const at::Tensor& qkv, const at::Tensor& positions,
                           const at::Tensor& cos_cache, const at::Tensor& sin_cache,
                           at::Tensor& q_out, at::Tensor& k_out, at::Tensor& v_out,
                           at::Tensor& kv_cache, const at::Tensor& slot_mapping, int64_t nh,
                           int64_t nkv, int64_t d, bool write_cache) {
  const int64_t tokens = qkv.size(0);
  const int64_t half = d / 2;
  const T* src = qkv.data_ptr<T>();
  const int64_t row = qkv.stride(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cosp = cos_cache.data_ptr<float>();
  const float* sinp = sin_cache.data_ptr<float>();
  const int64_t cs = cos_cache.stride(0);
  T* qo = q_out.data_ptr<T>();
  T* ko = k_out.data_ptr<T>();
  T* vo = v_out.data_ptr<T>();
  const int64_t* slots = write_cache ? slot_mapping.data_ptr<int64_t>() : nullptr;
  C* cache = write_cache ? kv_cache.data_ptr<C>() : nullptr;
  const int64_t bs = write_cache ? kv_cache.size(2) : 1;
  const int64_t blk_stride = write_cache ? kv_cache.stride(0) : 0;
  const int64_t kv_stride = write_cache ? kv_cache.stride(1) : 0;
  at::parallel_for(0, tokens, row_grain((nh + 2 * nkv) * d), [&](int64_t begin, int64_t end) {
    std::vector<T> c(half), s(half);
#if defined(__AVX512F__)
    std::vector<__m512> cv((half + 15) / 16), sv((half + 15) / 16);
#endif
    for (int64_t t = begin; t < end; ++t) {
      const int64_t p = pos[t];
      const T* x = src + t * row;
      auto rotate = [&](const T* in, T* out) {
        for (int64_t i = 0; i < half; ++i) {
          const T x1 = in[i], x2 = in[i + half];
          // x * cos + cat(-x2, x1) * sin, each product rounded to T as torch does.
          const T a1 = static_cast<T>(to_f(x1) * to_f(c[i]));
          const T b1 = static_cast<T>(-to_f(x2) * to_f(s[i]));
          const T a2 = static_cast<T>(to_f(x2) * to_f(c[i]));
          const T b2 = static_cast<T>(to_f(x1) * to_f(s[i]));
          out[i] = static_cast<T>(to_f(a1) + to_f(b1));
          out[i + half] = static_cast<T>(to_f(a2) + to_f(b2));
        }
      };
      T* kt = ko + t * nkv * d;
      T* vt = vo + t * nkv * d;
      const T* vin = x + (nh + nkv) * d;
      bool rotated = false;
#if defined(__AVX512F__)
      if constexpr (kLanes16<T>) if (half % 16 == 0) {  // the same arithmetic in 16 lanes
        for (int64_t i = 0; i < half; i += 16) {
          cv[i / 16] = round16<T>(_mm512_loadu_ps(cosp + p * cs + i));
          sv[i / 16] = round16<T>(_mm512_loadu_ps(sinp + p * cs + i));
        }
        auto rotate16 = [&](const T* in, T* out) {
          for (int64_t i = 0; i < half; i += 16) {
            const __m512 x1 = load16<T>(in + i), x2 = load16<T>(in + i + half);
            const __m512 c16 = cv[i / 16], s16 = sv[i / 16];
            const __m512 a1 = round16<T>(_mm512_mul_ps(x1, c16));
            const __m512 neg_x2 = _mm512_castsi512_ps(
                _mm512_xor_si512(_mm512_castps_si512(x2), _mm512_set1_epi32(INT32_MIN)));
            const __m512 b1 = round16<T>(_mm512_mul_ps(neg_x2, s16));
            const __m512 a2 = round16<T>(_mm512_mul_ps(x2, c16));
            const __m512 b2 = round16<T>(_mm512_mul_ps(x1, s16));
            store16<T>(out + i, _mm512_add_ps(a1, b1));
            store16<T>(out + i + half, _mm512_add_ps(a2, b2));
          }
        };
        for (int64_t h = 0; h < nh; ++h) rotate16(x + h * d, qo + (t * nh + h) * d);
        for (int64_t h = 0; h < nkv; ++h) rotate16(x + (nh + h) * d, kt + h * d);
        rotated = true;
      }
#endif
      if (!rotated) {
        for (int64_t i = 0; i < half; ++i) {
          c[i] = static_cast<T>(cosp[p * cs + i]);
          s[i] = static_cast<T>(sinp[p * cs + i]);
        }
        for (int64_t h = 0; h < nh; ++h) rotate(x + h * d, qo + (t * nh + h) * d);
        for (int64_t h = 0; h < nkv; ++h) rotate(x + (nh + h) * d, kt + h * d);
      }
      std::copy(vin, vin + nkv * d, vt);
      if (write_cache && slots[t] >= 0) {
        const int64_t slot = slots[t];
        C* kc = cache + (slot / bs) * blk_stride + (slot % bs) * nkv * d;
        C* vc = kc + kv_stride;
        if constexpr (std::is_same_v<T, C>) {
          std::copy(kt, kt + nkv * d, kc);
          std::copy(vt, vt + nkv * d, vc);
        } else {
          for (int64_t i = 0; i < nkv * d; ++i) {
            kc[i] = static_cast<C>(kt[i]);
            vc[i] = static_cast<C>(vt[i]);
          }
        }
      }
    }
  });
}

std::vector<at::Tensor> rotary_qkv_cache(const at::Tensor& qkv, const at::Tensor& positions,
                                         const at::Tensor& cos_cache, const at::Tensor& sin_cache,
                                         at::Tensor kv_cache, const at::Tensor& slot_mapping,
                                         int64_t nh, int64_t nkv, int64_t d) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) == (nh + 2 * nkv) * d,
              "rotary_qkv_cache: qkv must be [T, (H + 2 KVH) * D]");
  TORCH_CHECK(d % 2 == 0 && cos_cache.size(1) == d / 2, "rotary dim must be the head size");
  TORCH_CHECK(cos_cache.scalar_type() == at::kFloat && cos_cache.stride(1) == 1 &&
                  sin_cache.strides() == cos_cache.strides(),
              "cos/sin caches: float32 [P, D/2]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(), "positions");
  const int64_t t = qkv.size(0);
  auto opts = qkv.options();
  auto q = at::empty({t, nh, d}, opts);
  auto k = at::empty({t, nkv, d}, opts);
  auto v = at::empty({t, nkv, d}, opts);
  const bool write = kv_cache.numel() > 0;
  if (write) {
    TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(1) == 2 && kv_cache.size(3) == nkv &&
                    kv_cache.size(4) == d && kv_cache.stride(4) == 1 &&
                    kv_cache.stride(3) == d && kv_cache.stride(2) == nkv * d,
                "kv_cache: [num_blocks, 2, block_size, KVH, D], each block half contiguous");
    TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                    slot_mapping.numel() >= t,
                "slot_mapping: int64 [T]");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rotary", [&] {
    using T = scalar_t;
    if (!write || kv_cache.scalar_type() == qkv.scalar_type()) {
      rotary_qkv_cache_impl<T, T>(qkv, positions, cos_cache, sin_cache, q, k, v, kv_cache,
                                  slot_mapping, nh, nkv, d, write);
    } else if (kv_cache.scalar_type() == at::kFloat) {
      rotary_qkv_cache_impl<T, float>(qkv, positions, cos_cache, sin_cache, q, k, v, kv_cache,
                                      slot_mapping, nh, nkv, d, write);
    } else if (kv_cache.scalar_type() == at::kBFloat16) {
      rotary_qkv_cache_impl<T, at::BFloat16>(qkv, positions, cos_cache, sin_cache, q, k, v,
                                             kv_cache, slot_mapping, nh, nkv, d, write);
    } else {
      rotary_qkv_cache_impl<T, at::Half>(qkv, positions, cos_cache, sin_cache, q, k, v,
                                         kv_cache, slot_mapping, nh, nkv, d, write);
    }
  });
  return {q, k, v};
}

// ---------------------------------------------------------------------------- attention

constexpr int64_t kMaxHead = 512;

// One paged-attention call's tensors as pointers and strides (layouts: see paged_attention).
template <typename T, typename C>
struct PagedArgs {
  int64_t num_reqs, nh, d, nkv, bs, group, blk_stride, kv_stride, bt_stride, q_row, q_head;
  const int32_t* bt;
  const int32_t* lens;
  const int32_t* qsl;
  const T* q;
  T* o;
  const C* cache;

  PagedArgs(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
            const at::Tensor& block_table, const at::Tensor& seq_lens,
            const at::Tensor& query_start_loc)
      : num_reqs(seq_lens.size(0)),
        nh(query.size(1)),
        d(query.size(2)),
        nkv(kv_cache.size(3)),
        bs(kv_cache.size(2)),
        group(nh / nkv),
        blk_stride(kv_cache.stride(0)),
        kv_stride(kv_cache.stride(1)),
        bt_stride(block_table.stride(0)),
        q_row(query.stride(0)),
        q_head(query.stride(1)),
        bt(block_table.data_ptr<int32_t>()),
        lens(seq_lens.data_ptr<int32_t>()),
        qsl(query_start_loc.data_ptr<int32_t>()),
        q(query.data_ptr<T>()),
        o(out.data_ptr<T>()),
        cache(kv_cache.data_ptr<C>()) {}
};

// Paged attention read in place. query [T, H, D]; kv_cache [num_blocks, 2, block_size, KVH, D];
// request r owns query rows query_start_loc[r]..[r+1], its context is seq_lens[r] tokens whose
// block b is block_table[r, b]; query row j of r attends to positions 0..seq_len - qlen + j,
// with a sliding window (window > 0) only to the last `window` of them; positions left of an
// item's first row's window are not read (their blocks may be freed: the null block).
// One work item is (request, KV head, tile of query rows); items are taken dynamically, so a
// thread descheduled by a busy machine does not hold the others at a static split.
template <typename T, typename C>
void paged_attention_impl(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                          const at::Tensor& block_table, const at::Tensor& seq_lens,
                          const at::Tensor& query_start_loc, double scale, int64_t window) {
  const PagedArgs<T, C> args(out, query, kv_cache, block_table, seq_lens, query_start_loc);
  const auto [num_reqs, nh, d, nkv, bs, group, blk_stride, kv_stride, bt_stride, q_row, q_head,
              bt, lens, qsl, q, o, cache] = args;
  constexpr int64_t kTile = 16;
  TORCH_CHECK(d <= kMaxHead, "paged_attention: head size above ", kMaxHead);
  struct Item {
    int64_t req, kvh, row0, rows;
  };
  std::vector<Item> items;
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t qlen = qsl[r + 1] - qsl[r];
    for (int64_t j = 0; j < qlen; j += kTile)
      for (int64_t h = 0; h < nkv; ++h) items.push_back({r, h, j, std::min(kTile, qlen - j)});
  }
  const float sc = static_cast<float>(scale);
  const int64_t n_items = static_cast<int64_t>(items.size());
  const int nthreads = at::get_num_threads();
#pragma omp parallel num_threads(nthreads)
  {
    std::vector<float> scores, acc(group * d), qf(group * d), sums(group);
    std::vector<const C*> krows, vrows;
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < n_items; ++it) {
      const Item& w = items[it];
      const int64_t qlen = qsl[w.req + 1] - qsl[w.req];
      const int64_t seq = lens[w.req];
      const int64_t ctx_max = seq - qlen + w.row0 + w.rows;  // positions seen by the last row
      // The first position any row of the item sees (its first row's window start).
      const int64_t ctx_lo = window > 0 ? std::max<int64_t>(0, ctx_max - w.rows - window + 1) : 0;
      krows.resize(ctx_max);
      vrows.resize(ctx_max);
      const int32_t* blocks = bt + w.req * bt_stride;
      for (int64_t p = ctx_lo; p < ctx_max; ++p) {
        const C* kb = cache + static_cast<int64_t>(blocks[p / bs]) * blk_stride +
                      (p % bs) * nkv * d + w.kvh * d;
        krows[p] = kb;
        vrows[p] = kb + kv_stride;
      }
      scores.resize(group * ctx_max);
      for (int64_t jr = 0; jr < w.rows; ++jr) {
        const int64_t j = w.row0 + jr;
        const int64_t tok = qsl[w.req] + j;
        const int64_t ctx = seq - qlen + j + 1;
        const int64_t lo = window > 0 ? std::max<int64_t>(0, ctx - window) : 0;
        for (int64_t g = 0; g < group; ++g) {
          const T* qh = q + tok * q_row + (w.kvh * group + g) * q_head;
          for (int64_t i = 0; i < d; ++i) qf[g * d + i] = to_f(qh[i]) * sc;
        }
        // Scores of every query head of the group against each K row (one read of the row
        // for the group): scores[g * ctx_max + p].
        for (int64_t p = lo; p < ctx; ++p) {
          const C* kr = krows[p];
          for (int64_t g = 0; g < group; ++g) {
            const float* qg = qf.data() + g * d;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t i = 0; i < d; ++i) s += qg[i] * to_f(kr[i]);
            scores[g * ctx_max + p] = s;
          }
        }
        for (int64_t g = 0; g < group; ++g) {
          float* sg = scores.data() + g * ctx_max;
          float mx = -std::numeric_limits<float>::infinity();
          for (int64_t p = lo; p < ctx; ++p) mx = std::max(mx, sg[p]);
          exp_shifted(sg + lo, ctx - lo, mx);
          float sum = 0.f;
          for (int64_t p = lo; p < ctx; ++p) sum += sg[p];
          sums[g] = sum;
        }
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t p = lo; p < ctx; ++p) {
          const C* vr = vrows[p];
          float vf[kMaxHead];
          for (int64_t i = 0; i < d; ++i) vf[i] = to_f(vr[i]);
          for (int64_t g = 0; g < group; ++g) {
            const float e = scores[g * ctx_max + p];
            float* a = acc.data() + g * d;
#pragma omp simd
            for (int64_t i = 0; i < d; ++i) a[i] += e * vf[i];
          }
        }
        for (int64_t g = 0; g < group; ++g) {
          const float inv = 1.f / sums[g];
          const float* a = acc.data() + g * d;
          T* oh = o + tok * nh * d + (w.kvh * group + g) * d;
          for (int64_t i = 0; i < d; ++i) oh[i] = static_cast<T>(a[i] * inv);
        }
      }
    }
  }
}

#if defined(__AVX512F__)
// ------------------------------------------------ attention, AVX-512 path (head size 32-256)
//
// The same work items and contract as `paged_attention_impl`, computed in tiles:
// - the item's query vectors (its rows x the KV head's query heads, scaled) sit in `qf`;
// - K is read 16 positions at a time, transposed in registers into `kt` [D][16], so every
//   score of a query vector against the 16 positions is D multiply-adds of one broadcast and
//   one load (no horizontal sums);
//   with a bf16 query and cache (and AVX512_BF16), K is transposed as pairs of bf16 and the
//   scores are dpbf16 dot products: half the shuffles, no conversion of K;
// - softmax per query vector over its own causal limit, probabilities past it set to zero;
// - P V register-blocked: NV query vectors x DV vectors of 16 dims of accumulators, one V row
//   loaded per position for all NV vectors.

// r[i][j] <- r[j][i] for a 16x16 block of floats held in 16 registers.
inline void transpose16(__m512* r) {
  __m512 t[16];
  for (int k = 0; k < 8; ++k) {
    t[2 * k] = _mm512_unpacklo_ps(r[2 * k], r[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_ps(r[2 * k], r[2 * k + 1]);
  }
  for (int k = 0; k < 4; ++k) {
    const __m512d a = _mm512_castps_pd(t[4 * k]), b = _mm512_castps_pd(t[4 * k + 2]);
    const __m512d c = _mm512_castps_pd(t[4 * k + 1]), e = _mm512_castps_pd(t[4 * k + 3]);
    r[4 * k] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
    r[4 * k + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    r[4 * k + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, e));
    r[4 * k + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, e));
  }
  // r[4k + m], 128-bit lane l, holds rows 4k..4k+3 of column 4l + m: transpose the lanes.
  for (int m = 0; m < 4; ++m) {
    const __m512 ab_lo = _mm512_shuffle_f32x4(r[m], r[4 + m], 0x44);
    const __m512 ab_hi = _mm512_shuffle_f32x4(r[m], r[4 + m], 0xEE);
    const __m512 cd_lo = _mm512_shuffle_f32x4(r[8 + m], r[12 + m], 0x44);
    const __m512 cd_hi = _mm512_shuffle_f32x4(r[8 + m], r[12 + m], 0xEE);
    t[m] = _mm512_shuffle_f32x4(ab_lo, cd_lo, 0x88);
    t[4 + m] = _mm512_shuffle_f32x4(ab_lo, cd_lo, 0xDD);
    t[8 + m] = _mm512_shuffle_f32x4(ab_hi, cd_hi, 0x88);
    t[12 + m] = _mm512_shuffle_f32x4(ab_hi, cd_hi, 0xDD);
  }
  for (int k = 0; k < 16; ++k) r[k] = t[k];
}

// s[0..lim) <- exp(s - max(s[0..lim))), s[lim..cpad) <- 0; returns 1 / the sum of the exps.
inline float softmax_row(float* s, int64_t lim, int64_t cpad) {
  const __mmask16 tail = static_cast<__mmask16>((1u << (lim % 16)) - 1);
  const int64_t full = lim - lim % 16;
  __m512 mv = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t p = 0; p < full; p += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + p));
  if (tail) mv = _mm512_mask_max_ps(mv, tail, mv, _mm512_maskz_loadu_ps(tail, s + full));
  exp_shifted(s, lim, _mm512_reduce_max_ps(mv));
  __m512 sv = _mm512_setzero_ps();
  for (int64_t p = 0; p < full; p += 16) sv = _mm512_add_ps(sv, _mm512_loadu_ps(s + p));
  if (tail) sv = _mm512_add_ps(sv, _mm512_maskz_loadu_ps(tail, s + full));
  std::fill(s + lim, s + cpad, 0.f);
  return 1.f / _mm512_reduce_add_ps(sv);
}

// Walks the K and V of a request's first positions (all heads, one layer: K rows are
// contiguous within a block, V at + kv_stride) in position order, a cache line at a time,
// asking for each to be brought into L2. A request's blocks lie anywhere in the pool, so the
// hardware's prefetchers, which follow addresses within a page, stall at each block's start.
// Two run per item: one over the item itself, some tiles ahead of the first head's scores
// (the other heads' passes and P V then read L2), and one over the item this thread takes
// next, a few lines per tile of this one, so its blocks stream in while this one computes.
template <typename C>
struct PrefetchCursor {
  const C* cache = nullptr;
  const int32_t* blocks = nullptr;
  int64_t blk_stride = 0, kv_stride = 0, block_bytes = 0, total_bytes = 0;
  int64_t done = 0;  // bytes of K (and as many of V) asked for
  // The block of `done` and the offset in it, kept as `done` moves (no division a line).
  int64_t block = 0, off = 0;

  void step(int64_t lines) {
    const int64_t v_off = kv_stride * static_cast<int64_t>(sizeof(C));
    for (; lines > 0 && done < total_bytes; --lines, done += 64) {
      const char* k = reinterpret_cast<const char*>(cache + blocks[block] * blk_stride) + off;
      _mm_prefetch(k, _MM_HINT_T1);
      _mm_prefetch(k + v_off, _MM_HINT_T1);
      off += 64;
      if (off >= block_bytes) {
        off -= block_bytes;
        ++block;
      }
    }
  }
};

// r[t] <- at(t) for t < n, zero for t >= n (n <= 16); a full tile without per-row branches.
template <typename Load>
inline void load_tile16(__m512* r, int64_t n, Load at) {
  if (n == 16) {
    for (int t = 0; t < 16; ++t) r[t] = at(t);
  } else {
    for (int t = 0; t < 16; ++t) r[t] = t < n ? at(t) : _mm512_setzero_ps();
  }
}

// r[t] <- 16 values at rows[t] + off as float32 (n rows of the tile; see load_tile16).
template <typename C>
inline void load_rows16(__m512* r, const C* const* rows, int64_t off, int64_t n) {
  load_tile16(r, n, [&](int t) { return load16<C>(rows[t] + off); });
}

// r[t] <- the 32 bf16 at rows[t] + off as 16 32-bit words (n rows of the tile).
inline void load_pairs16(__m512* r, const at::BFloat16* const* rows, int64_t off, int64_t n) {
  load_tile16(r, n, [&](int t) {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(rows[t] + off));
  });
}

// s[k * s_stride + 0..15] <- q[k] . kt[:, 0..15] for k < NV (q rows of d floats).
// With few query vectors (decode: one row times the GQA group), each keeps two sums (even and
// odd i): enough independent multiply-adds in flight to hide their latency. d is even.
template <int NV>
inline void qk_block(const float* q, int64_t d, const float* kt, float* s, int64_t s_stride) {
  constexpr int NB = NV <= 4 ? 2 : 1;
  __m512 acc[NB][NV];
  for (int b = 0; b < NB; ++b)
    for (int k = 0; k < NV; ++k) acc[b][k] = _mm512_setzero_ps();
  for (int64_t i = 0; i < d; i += NB) {
    for (int b = 0; b < NB; ++b) {
      const __m512 kv = _mm512_loadu_ps(kt + (i + b) * 16);
      for (int k = 0; k < NV; ++k)
        acc[b][k] = _mm512_fmadd_ps(_mm512_set1_ps(q[k * d + i + b]), kv, acc[b][k]);
    }
  }
  for (int k = 0; k < NV; ++k) {
    __m512 sum = acc[0][k];
    if constexpr (NB == 2) sum = _mm512_add_ps(sum, acc[1][k]);
    _mm512_storeu_ps(s + k * s_stride, sum);
  }
}

template <int NV>
inline void qk_rows(const float* q, int64_t nq, int64_t d, const float* kt, float* s,
                    int64_t s_stride) {
  if constexpr (NV > 0) {
    for (; nq >= NV; nq -= NV, q += NV * d, s += NV * s_stride)
      qk_block<NV>(q, d, kt, s, s_stride);
    if (nq > 0) qk_rows<NV - 1>(q, nq, d, kt, s, s_stride);
  }
}

// The 16 lane sums of a[0..15] as one vector: lane t <- sum of a[t]'s lanes (a is clobbered).
// A tree of 15 pairwise steps (unpack, then 128-bit lane shuffles, each with one add): about
// half the shuffles of transposing the 16 rows.
inline __m512 lane_sums16(__m512* a) {
  for (int t = 0; t < 8; ++t)  // lane quads hold (a[2t], a[2t + 1], a[2t], a[2t + 1])
    a[t] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * t], a[2 * t + 1]),
                         _mm512_unpackhi_ps(a[2 * t], a[2 * t + 1]));
  for (int t = 0; t < 4; ++t) {  // lane quads hold (a[4t] .. a[4t + 3]) of the input
    const __m512d x = _mm512_castps_pd(a[2 * t]), y = _mm512_castps_pd(a[2 * t + 1]);
    a[t] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int t = 0; t < 2; ++t)  // 128-bit lanes (a[2t] quads 0+2, 1+3, a[2t+1] quads 0+2, 1+3)
    a[t] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * t], a[2 * t + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * t], a[2 * t + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(a[0], a[1], 0x88),
                       _mm512_shuffle_f32x4(a[0], a[1], 0xDD));
}

// s[k * s_stride + t] <- q[k] . rows[t][off .. off + 16 DV) for k < nq, t < n (n <= 16; the
// scores of positions t >= n are 0): each K row read as it lies (no transpose), each score one
// 16-lane multiply-add chain over the head's DV vectors, then its lanes summed (lane_sums16).
// For decode (one query row: the GQA group's few vectors), where transposing K cost more than
// the products.
template <typename C, int DV>
inline void qk_direct(const float* q, int64_t nq, const C* const* rows, int64_t off, int64_t n,
                      float* s, int64_t s_stride) {
  for (int64_t k = 0; k < nq; ++k) {
    __m512 qv[DV];
    for (int j = 0; j < DV; ++j) qv[j] = _mm512_loadu_ps(q + k * DV * 16 + 16 * j);
    __m512 a[16];
    load_tile16(a, n, [&](int t) {
      const C* kr = rows[t] + off;
      __m512 acc = _mm512_mul_ps(qv[0], load16<C>(kr));
      for (int j = 1; j < DV; ++j) acc = _mm512_fmadd_ps(qv[j], load16<C>(kr + 16 * j), acc);
      return acc;
    });
    _mm512_storeu_ps(s + k * s_stride, lane_sums16(a));
  }
}

#if defined(__AVX512BF16__)
// As qk_block for bf16 queries and keys: q holds each query vector's d / 2 pairs of bf16 (as
// 32-bit words), ktp [d / 2][16] the 16 positions' pairs; one dpbf16 instruction does a pair
// of multiply-adds per lane (exact products, float32 sums). Scores are scaled here.
template <int NV>
inline void qk_block_bf16(const uint32_t* q, int64_t npairs, const float* ktp, __m512 scale,
                          float* s, int64_t s_stride) {
  constexpr int NB = NV <= 4 ? 2 : 1;  // as qk_block; npairs is even
  __m512 acc[NB][NV];
  for (int b = 0; b < NB; ++b)
    for (int k = 0; k < NV; ++k) acc[b][k] = _mm512_setzero_ps();
  for (int64_t i = 0; i < npairs; i += NB) {
    for (int b = 0; b < NB; ++b) {
      const __m512bh kv = (__m512bh)_mm512_castps_si512(_mm512_loadu_ps(ktp + (i + b) * 16));
      for (int k = 0; k < NV; ++k)
        acc[b][k] = _mm512_dpbf16_ps(acc[b][k],
                                     (__m512bh)_mm512_set1_epi32(q[k * npairs + i + b]), kv);
    }
  }
  for (int k = 0; k < NV; ++k) {
    __m512 sum = acc[0][k];
    if constexpr (NB == 2) sum = _mm512_add_ps(sum, acc[1][k]);
    _mm512_storeu_ps(s + k * s_stride, _mm512_mul_ps(sum, scale));
  }
}

template <int NV>
inline void qk_rows_bf16(const uint32_t* q, int64_t nq, int64_t npairs, const float* ktp,
                         __m512 scale, float* s, int64_t s_stride) {
  if constexpr (NV > 0) {
    for (; nq >= NV; nq -= NV, q += NV * npairs, s += NV * s_stride)
      qk_block_bf16<NV>(q, npairs, ktp, scale, s, s_stride);
    if (nq > 0) qk_rows_bf16<NV - 1>(q, nq, npairs, ktp, scale, s, s_stride);
  }
}
#endif

// o[k * DV * 16 ...] <- sum_p p_k[p] * v_p for k < NV, p_k = s + k * s_stride, v_p the 16 * DV
// values at rows[p] + off (converted to float32 as loaded).
template <typename C, int DV, int NV>
inline void pv_block(const C* const* rows, int64_t off, int64_t n, const float* s,
                     int64_t s_stride, float* o) {
  __m512 acc[NV][DV];
  for (int k = 0; k < NV; ++k)
    for (int j = 0; j < DV; ++j) acc[k][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < n; ++p) {
    __m512 vv[DV];
    for (int j = 0; j < DV; ++j) vv[j] = load16<C>(rows[p] + off + 16 * j);
    for (int k = 0; k < NV; ++k) {
      const __m512 e = _mm512_set1_ps(s[k * s_stride + p]);
      for (int j = 0; j < DV; ++j) acc[k][j] = _mm512_fmadd_ps(e, vv[j], acc[k][j]);
    }
  }
  for (int k = 0; k < NV; ++k)
    for (int j = 0; j < DV; ++j) _mm512_storeu_ps(o + k * DV * 16 + 16 * j, acc[k][j]);
}

template <typename C, int DV, int NV>
inline void pv_rows(const C* const* rows, int64_t off, int64_t n, const float* s,
                    int64_t s_stride, int64_t nq, float* o) {
  if constexpr (NV > 0) {
    for (; nq >= NV; nq -= NV, s += NV * s_stride, o += NV * DV * 16)
      pv_block<C, DV, NV>(rows, off, n, s, s_stride, o);
    if (nq > 0) pv_rows<C, DV, NV - 1>(rows, off, n, s, s_stride, nq, o);
  }
}

template <typename T, typename C, int DV>
void paged_attention_simd(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                          const at::Tensor& block_table, const at::Tensor& seq_lens,
                          const at::Tensor& query_start_loc, double scale, int64_t window) {
  constexpr int64_t d = DV * 16;
  constexpr int kNvQk = 8;
  constexpr int kNvPv = std::max(1, 24 / DV);
  constexpr int64_t kTile = 16;
  constexpr int64_t kAhead = 32;  // positions prefetched ahead of the first head's scores
#if defined(__AVX512BF16__)
  // bf16 query and cache: scores by bf16 dot products (qk_block_bf16).
  constexpr bool kDotBf16 = std::is_same_v<T, at::BFloat16> && std::is_same_v<C, at::BFloat16>;
#endif
  const PagedArgs<T, C> args(out, query, kv_cache, block_table, seq_lens, query_start_loc);
  [[maybe_unused]] const auto [num_reqs, nh, d_unused, nkv, bs, group, blk_stride, kv_stride,
                               bt_stride, q_row, q_head, bt, lens, qsl, q, o, cache] = args;
  // One item is (request, tile of query rows) over every KV head: it streams the request's
  // blocks once (a position's K of all heads is one contiguous row), not once per head.
  struct Item {
    int64_t req, row0, rows;
  };
  std::vector<Item> items;
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t qlen = qsl[r + 1] - qsl[r];
    for (int64_t j = 0; j < qlen; j += kTile) items.push_back({r, j, std::min(kTile, qlen - j)});
  }
  const float sc = static_cast<float>(scale);
  const int64_t n_items = static_cast<int64_t>(items.size());
  const int nthreads = n_items > 1 ? at::get_num_threads() : 1;
#pragma omp parallel num_threads(nthreads)
  {
    std::vector<float> qf, scores, acc, inv_sum;
    std::vector<float> kt(d * 16);
    std::vector<uint32_t> qpairs;
    std::vector<int64_t> limit, first;
    std::vector<const C*> rows;  // position p's K row (all heads); its V row is + kv_stride
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < n_items; ++it) {
      const Item& w = items[it];
      const int64_t qlen = qsl[w.req + 1] - qsl[w.req];
      const int64_t seq = lens[w.req];
      const int64_t nq = w.rows * group;  // query vectors of one KV head: (row, head of group)
      // Positions ctx_lo..ctx_max of the context are read (ctx_lo: the item's first row's
      // window start, 0 without a window); rows[i], scores[v * cpad + i] are position
      // ctx_lo + i. Query vector v sees rows first[v] .. limit[v].
      const int64_t ctx_end = seq - qlen + w.row0 + w.rows;
      const int64_t ctx_lo = window > 0 ? std::max<int64_t>(0, ctx_end - w.rows - window + 1) : 0;
      const int64_t ctx_max = ctx_end - ctx_lo;
      const int64_t cpad = (ctx_max + 15) / 16 * 16;
      rows.resize(ctx_max);
      const int32_t* blocks = bt + w.req * bt_stride;
      for (int64_t i = 0; i < ctx_max; ++i) {
        const int64_t p = ctx_lo + i;
        rows[i] = cache + static_cast<int64_t>(blocks[p / bs]) * blk_stride + (p % bs) * nkv * d;
      }
      limit.resize(nq);
      first.resize(nq);
      for (int64_t jr = 0; jr < w.rows; ++jr) {
        const int64_t end = seq - qlen + w.row0 + jr + 1;  // this row's positions end
        const int64_t lo = window > 0 ? std::max<int64_t>(0, end - window) : 0;
        for (int64_t g = 0; g < group; ++g) {
          limit[jr * group + g] = end - ctx_lo;
          first[jr * group + g] = lo - ctx_lo;
        }
      }
      qf.resize(nq * d);
      qpairs.resize(nq * d / 2);
      scores.resize(nq * cpad);
      acc.resize(nq * d);
      inv_sum.resize(nq);
      const int64_t row_bytes = nkv * d * static_cast<int64_t>(sizeof(C));
      const int64_t tile_lines = 16 * row_bytes / 64;
      const int64_t lo_block = ctx_lo / bs;  // prefetch from the block holding ctx_lo
      PrefetchCursor<C> own{cache, blocks + lo_block, blk_stride, kv_stride, bs * row_bytes,
                            (ctx_end - lo_block * bs) * row_bytes, 0};
      own.step(kAhead / 16 * tile_lines);
      // The item this thread likely takes next (items go out in order, one to each thread
      // that asks): its lines spread over this item's tiles, all heads.
      PrefetchCursor<C> next;
      int64_t next_per_tile = 0;
      if (it + nthreads < n_items) {
        const Item& w2 = items[it + nthreads];
        const int64_t qlen2 = qsl[w2.req + 1] - qsl[w2.req];
        const int64_t end2 = lens[w2.req] - qlen2 + w2.row0 + w2.rows;
        const int64_t lo2 =
            window > 0 ? std::max<int64_t>(0, end2 - w2.rows - window + 1) / bs * bs : 0;
        const int64_t ctx2 = end2 - lo2;
        next = {cache, bt + w2.req * bt_stride + lo2 / bs, blk_stride, kv_stride, bs * row_bytes,
                ctx2 * row_bytes, 0};
        const int64_t tiles = nkv * ((ctx_max + 15) / 16);
        next_per_tile = (ctx2 * row_bytes / 64 + tiles - 1) / tiles;
      }
      // A tile's rows kAhead positions on while the first head scores the tile at p0; some
      // of the next item's lines at every tile.
      auto ahead = [&](int64_t kvh) {
        if (kvh == 0) own.step(tile_lines);
        next.step(next_per_tile);
      };
      for (int64_t kvh = 0; kvh < nkv; ++kvh) {
        const int64_t koff = kvh * d;
        bool scored = false;  // by the bf16 dot-product path
#if defined(__AVX512BF16__)
        if constexpr (kDotBf16) {
          // Scores from bf16 pairs: the query's bits as they are (scaled in the sum), K's
          // pairs transposed as 32-bit words (half the shuffles of float32, no conversion).
          for (int64_t jr = 0; jr < w.rows; ++jr) {
            const int64_t tok = qsl[w.req] + w.row0 + jr;
            for (int64_t g = 0; g < group; ++g) {
              const T* qh = q + tok * q_row + (kvh * group + g) * q_head;
              std::memcpy(qpairs.data() + (jr * group + g) * (d / 2), qh, d * sizeof(T));
            }
          }
          for (int64_t p0 = 0; p0 < ctx_max; p0 += 16) {
            const int64_t n = std::min<int64_t>(16, ctx_max - p0);
            ahead(kvh);
            for (int j = 0; j < DV / 2; ++j) {
              __m512 r[16];  // 16 bf16 pairs of each row as 32-bit words
              load_pairs16(r, rows.data() + p0, koff + 32 * j, n);
              transpose16(r);
              for (int t = 0; t < 16; ++t) _mm512_storeu_ps(kt.data() + (16 * j + t) * 16, r[t]);
            }
            qk_rows_bf16<kNvQk>(qpairs.data(), nq, d / 2, kt.data(), _mm512_set1_ps(sc),
                                scores.data() + p0, cpad);
          }
          scored = true;
        }
#endif
        if (!scored) {
          for (int64_t jr = 0; jr < w.rows; ++jr) {
            const int64_t tok = qsl[w.req] + w.row0 + jr;
            for (int64_t g = 0; g < group; ++g) {
              const T* qh = q + tok * q_row + (kvh * group + g) * q_head;
              float* dst = qf.data() + (jr * group + g) * d;
              for (int64_t i = 0; i < d; i += 16)
                _mm512_storeu_ps(dst + i, _mm512_mul_ps(load16<T>(qh + i), _mm512_set1_ps(sc)));
            }
          }
          // Scores: 16 positions at a time against every query vector.
          for (int64_t p0 = 0; p0 < ctx_max; p0 += 16) {
            const int64_t n = std::min<int64_t>(16, ctx_max - p0);
            ahead(kvh);
            if (qlen == 1) {  // decode: K rows as they lie (qk_direct)
              qk_direct<C, DV>(qf.data(), nq, rows.data() + p0, koff, n, scores.data() + p0,
                               cpad);
              continue;
            }
            for (int j = 0; j < DV; ++j) {
              __m512 r[16];
              load_rows16<C>(r, rows.data() + p0, koff + 16 * j, n);
              transpose16(r);
              for (int t = 0; t < 16; ++t) _mm512_storeu_ps(kt.data() + (16 * j + t) * 16, r[t]);
            }
            qk_rows<kNvQk>(qf.data(), nq, d, kt.data(), scores.data() + p0, cpad);
          }
        }
        // Softmax of each query vector over its window first..limit; zero outside it.
        for (int64_t v = 0; v < nq; ++v) {
          float* sv = scores.data() + v * cpad;
          inv_sum[v] = softmax_row(sv + first[v], limit[v] - first[v], cpad - first[v]);
          std::fill(sv, sv + first[v], 0.f);
        }
        pv_rows<C, DV, kNvPv>(rows.data(), kv_stride + koff, ctx_max, scores.data(), cpad, nq,
                              acc.data());
        for (int64_t jr = 0; jr < w.rows; ++jr) {
          const int64_t tok = qsl[w.req] + w.row0 + jr;
          for (int64_t g = 0; g < group; ++g) {
            const int64_t v = jr * group + g;
            const float* a = acc.data() + v * d;
            const __m512 f = _mm512_set1_ps(inv_sum[v]);
            T* oh = o + tok * nh * d + (kvh * group + g) * d;
            for (int64_t i = 0; i < d; i += 16)
              store16<T>(oh + i, _mm512_mul_ps(_mm512_loadu_ps(a + i), f));
          }
        }
      }
    }
  }
}

// The AVX-512 path for head sizes 32, 64, 128 and 256 with a float32, bf16 or half cache (and
// query: T has `kLanes16`);
// false: not taken (the generic kernel runs).
template <typename T>
bool paged_attention_fast(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                          const at::Tensor& block_table, const at::Tensor& seq_lens,
                          const at::Tensor& query_start_loc, double scale, int64_t window) {
  const auto ct = kv_cache.scalar_type();
  const int64_t d = query.size(2);
  // The cache in the query's dtype, or a 16-bit cache under a float32 query (--kv-cache-dtype);
  // other pairs (a 16-bit query over a float32 cache) take the generic kernel. Each pair is 4
  // instantiations: fewer keep the JIT build short.
  auto run = [&](auto dv) -> bool {
    constexpr int DV = decltype(dv)::value;
    if (ct == query.scalar_type()) {
      paged_attention_simd<T, T, DV>(out, query, kv_cache, block_table, seq_lens,
                                     query_start_loc, scale, window);
      return true;
    }
    if constexpr (std::is_same_v<T, float>) {
      if (ct == at::kBFloat16) {
        paged_attention_simd<T, at::BFloat16, DV>(out, query, kv_cache, block_table, seq_lens,
                                                  query_start_loc, scale, window);
        return true;
      }
      if (ct == at::kHalf) {
        paged_attention_simd<T, at::Half, DV>(out, query, kv_cache, block_table, seq_lens,
                                              query_start_loc, scale, window);
        return true;
      }
    }
    return false;
  };
  switch (d) {
    case 32: return run(std::integral_constant<int, 2>{});
    case 64: return run(std::integral_constant<int, 4>{});
    case 128: return run(std::integral_constant<int, 8>{});
    case 256: return run(std::integral_constant<int, 16>{});
    default: return false;
  }
}
#endif  // __AVX512F__

at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& kv_cache,
                           const at::Tensor& block_table, const at::Tensor& seq_lens,
                           const at::Tensor& query_start_loc, double scale, int64_t window) {
  TORCH_CHECK(window >= 0, "paged_attention: window must be >= 0 (0: full attention)");
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query [T, H, D]");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(1) == 2 && kv_cache.stride(4) == 1 &&
                  kv_cache.stride(3) == kv_cache.size(4) &&
                  kv_cache.stride(2) == kv_cache.size(3) * kv_cache.size(4),
              "kv_cache: [num_blocks, 2, block_size, KVH, D], each block half contiguous");
  TORCH_CHECK(kv_cache.size(4) == query.size(2) && query.size(1) % kv_cache.size(3) == 0,
              "head sizes / GQA groups");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.stride(1) == 1,
              "block_table int32 [R, B]");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(), "seq_lens int32");
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && query_start_loc.is_contiguous() &&
                  query_start_loc.numel() == seq_lens.numel() + 1,
              "query_start_loc int32 [R + 1]");
  // Rows past the last request's (none on the step path) stay zero.
  const bool all_rows = query_start_loc.numel() > 0 &&
                        query_start_loc[-1].item<int64_t>() == query.size(0) &&
                        query_start_loc[0].item<int64_t>() == 0;
  auto out = all_rows ? at::empty({query.size(0), query.size(1), query.size(2)}, query.options())
                      : at::zeros({query.size(0), query.size(1), query.size(2)}, query.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "attn", [&] {
    using T = scalar_t;
    const auto ct = kv_cache.scalar_type();
#if defined(__AVX512F__)
    if constexpr (kLanes16<T>)  // not a double query
      if (paged_attention_fast<T>(out, query, kv_cache, block_table, seq_lens, query_start_loc,
                                  scale, window))
        return;
#endif
    if (ct == query.scalar_type()) {
      paged_attention_impl<T, T>(out, query, kv_cache, block_table, seq_lens, query_start_loc,
                                 scale, window);
    } else if (ct == at::kFloat) {
      paged_attention_impl<T, float>(out, query, kv_cache, block_table, seq_lens,
                                     query_start_loc, scale, window);
    } else if (ct == at::kBFloat16) {
      paged_attention_impl<T, at::BFloat16>(out, query, kv_cache, block_table, seq_lens,
                                            query_start_loc, scale, window);
    } else {
      paged_attention_impl<T, at::Half>(out, query, kv_cache, block_table, seq_lens,
                                        query_start_loc, scale, window);
    }
  });
  return out;
}

// ---------------------------------------------------------------------------- linear

constexpr int kCblasRowMajor = 101, kCblasNoTrans = 111, kCblasTrans = 112, kCblasPacked = 151;
constexpr int kCblasBMatrix = 162;
// The row count MKL packs for (a hint for its blocking; the packed weight serves any count):
// decode-sized batches, where packing pays most.
constexpr int kPackRowsHint = 64;

bool has_packed_sgemm() {
  return cblas_sgemm_pack_get_size != nullptr && cblas_sgemm_pack != nullptr &&
         cblas_sgemm_compute != nullptr;
}

// weight [N, K] float32 (an nn.Linear weight) -> MKL's packed form of weight^T, as a flat
// float32 tensor that only `packed_linear` reads.
at::Tensor sgemm_pack_weight(const at::Tensor& weight) {
  TORCH_CHECK(has_packed_sgemm(), "sgemm_pack_weight: this torch build has no MKL packed sgemm");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.is_contiguous(),
              "sgemm_pack_weight: weight must be float32 [N, K], contiguous");
  const int n = static_cast<int>(weight.size(0)), k = static_cast<int>(weight.size(1));
  const size_t bytes = cblas_sgemm_pack_get_size(kCblasBMatrix, kPackRowsHint, n, k);
  auto packed = at::empty({static_cast<int64_t>((bytes + 63) / 4)}, weight.options());
  cblas_sgemm_pack(kCblasRowMajor, kCblasBMatrix, kCblasTrans, kPackRowsHint, n, k, 1.0f,
                   weight.data_ptr<float>(), k, packed.data_ptr<float>());
  return packed;
}

// x [M, K] (rows contiguous) @ weight^T (+ bias) -> [M, N] float32, weight packed by
// `sgemm_pack_weight`. With a bias, the output starts as the bias rows and MKL adds x W^T to
// it (beta = 1), as addmm does.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed,
                         const std::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kFloat,
              "packed_linear: x must be float32 [M, K], rows contiguous");
  TORCH_CHECK(packed.scalar_type() == at::kFloat && packed.is_contiguous(), "packed weight");
  const int64_t m = x.size(0), k = x.size(1);
  auto out = at::empty({m, n}, x.options());
  float beta = 0.f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n && bias->scalar_type() == at::kFloat, "bias [N] float32");
    out.copy_(bias->reshape({1, n}).expand({m, n}));  // a copy: MKL writes into it
    beta = 1.f;
  }
  if (m == 0) return out;
  cblas_sgemm_compute(kCblasRowMajor, kCblasNoTrans, kCblasPacked, static_cast<int>(m),
                      static_cast<int>(n), static_cast<int>(k), x.data_ptr<float>(),
                      static_cast<int>(x.stride(0)), packed.data_ptr<float>(),
                      static_cast<int>(k), beta, out.data_ptr<float>(), static_cast<int>(n));
  return out;
}

// ---------------------------------------------------------------------------- panel GEMM
// A float32 GEMM for decode-sized batches (a few to ~128 rows) whose weights stream from
// memory: at such row counts a step reads every weight once, from DRAM (the model's weights
// are many times the L3), and the libraries' kernels wait on it. The weight [N, K] is packed
// once into panels of 32 output features, [N / 32][K][32]; each thread takes a contiguous run
// of panels; a panel's products for all rows run 8 rows at a time (16 accumulators: 8 rows x
// 32 features), the panel read from L2 after the first tile, while the thread's next panel is
// prefetched into L2 a few lines per 4 k-steps. Each output sums k in blocks of
// `kPanelKBlock`, each block one float32 multiply-add chain in k order added to the running
// sum (bias first): the same result whatever the thread count or row count.

constexpr int64_t kPanel = 32;
constexpr int kPanelRows = 8;  // 8 rows x 32 features: 16 accumulators
// k-steps summed in one chain before being added to the output (blocked summation).
constexpr int64_t kPanelKBlock = 64;

bool has_panel_gemm() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

// weight [N, K] float32, N % 32 == 0 -> [N / 32, K, 32]: panel p, row k holds
// weight[32 p .. 32 p + 31][k].
at::Tensor panel_pack_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat,
              "panel_pack_weight: weight must be float32 [N, K]");
  TORCH_CHECK(weight.size(0) % kPanel == 0, "panel_pack_weight: N must be a multiple of 32");
  const int64_t n = weight.size(0), k = weight.size(1);
  return weight.reshape({n / kPanel, kPanel, k}).transpose(1, 2).contiguous();
}

#if defined(__AVX512F__)
// y[r][0..31] = bias + sum_k x[r][k] * panel[k][0..31] for MR rows; `pf`, `pf_end`: lines of
// the next panel to prefetch, `pf_per4` of them every 4 k-steps.
template <int MR>
inline void panel_tile(const float* x, int64_t ldx, const float* panel, int64_t k_total,
                       const float* bias, float* y, int64_t ldy, const char*& pf,
                       const char* pf_end, int64_t pf_per4) {
  // Blocked summation: each block of kPanelKBlock k-steps is its own chain, added to y.
  for (int64_t kb = 0; kb < k_total; kb += kPanelKBlock) {
    const int64_t ke = std::min(k_total, kb + kPanelKBlock);
    __m512 acc[MR][2];
    for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    int64_t k = kb;
    for (; k + 4 <= ke; k += 4) {
      for (int64_t i = 0; i < pf_per4 && pf < pf_end; ++i, pf += 64) _mm_prefetch(pf, _MM_HINT_T1);
      for (int kk = 0; kk < 4; ++kk) {
        const float* w = panel + (k + kk) * kPanel;
        const __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 16);
        for (int r = 0; r < MR; ++r) {
          const __m512 xv = _mm512_set1_ps(x[r * ldx + k + kk]);
          acc[r][0] = _mm512_fmadd_ps(xv, w0, acc[r][0]);
          acc[r][1] = _mm512_fmadd_ps(xv, w1, acc[r][1]);
        }
      }
    }
    for (; k < ke; ++k) {
      const float* w = panel + k * kPanel;
      const __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 16);
      for (int r = 0; r < MR; ++r) {
        const __m512 xv = _mm512_set1_ps(x[r * ldx + k]);
        acc[r][0] = _mm512_fmadd_ps(xv, w0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(xv, w1, acc[r][1]);
      }
    }
    for (int r = 0; r < MR; ++r) {
      float* yr = y + r * ldy;
      if (kb == 0) {
        const __m512 b0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
        const __m512 b1 = bias ? _mm512_loadu_ps(bias + 16) : _mm512_setzero_ps();
        _mm512_storeu_ps(yr, _mm512_add_ps(b0, acc[r][0]));
        _mm512_storeu_ps(yr + 16, _mm512_add_ps(b1, acc[r][1]));
      } else {
        _mm512_storeu_ps(yr, _mm512_add_ps(_mm512_loadu_ps(yr), acc[r][0]));
        _mm512_storeu_ps(yr + 16, _mm512_add_ps(_mm512_loadu_ps(yr + 16), acc[r][1]));
      }
    }
  }
}

template <int MR>
inline void panel_rows(int64_t rows, const float* x, int64_t ldx, const float* panel,
                       int64_t k_total, const float* bias, float* y, int64_t ldy, const char*& pf,
                       const char* pf_end, int64_t pf_per4) {
  if constexpr (MR > 0) {
    if (rows == MR) {
      panel_tile<MR>(x, ldx, panel, k_total, bias, y, ldy, pf, pf_end, pf_per4);
    } else {
      panel_rows<MR - 1>(rows, x, ldx, panel, k_total, bias, y, ldy, pf, pf_end, pf_per4);
    }
  }
}
#endif

// How a panel product of m rows over k is scheduled: rows are taken a block at a time, each
// block's x (about 512 KB, at least 128 rows: a decode batch passes over the weight once)
// staying near while the thread's panels pass over it (a prefill chunk's x is megabytes); the
// next panel's lines are asked for `pf_per4` at a time every 4 k-steps, so that the whole of
// it is asked for over one panel's tiles of a block.
struct PanelSchedule {
  int64_t row_block;
  int64_t pf_per4;
};

inline PanelSchedule panel_schedule(int64_t m, int64_t k) {
  const int64_t row_block =
      std::max<int64_t>(128, (int64_t{1} << 19) / (4 * k) / kPanelRows * kPanelRows);
  const int64_t tiles = (std::min(m, row_block) + kPanelRows - 1) / kPanelRows;
  const int64_t panel_lines = k * kPanel * 4 / 64;
  const int64_t steps = tiles * std::max<int64_t>(1, k / 4);
  return {row_block, std::max<int64_t>(1, (panel_lines + steps - 1) / steps)};
}

void check_panel_args(const char* op, const at::Tensor& x, const at::Tensor& packed,
                      const std::optional<at::Tensor>& bias, const float*& bias_ptr) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kFloat, op,
              ": x must be float32 [M, K], rows contiguous");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous() &&
                  packed.scalar_type() == at::kFloat && packed.size(1) == x.size(1),
              op, ": packed weight [N / 32, K, 32] float32 of x's K");
  bias_ptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == packed.size(0) * kPanel && bias->scalar_type() == at::kFloat &&
                    bias->is_contiguous(),
                op, ": bias [N] float32");
    bias_ptr = bias->data_ptr<float>();
  }
}

#if defined(__AVX512F__)
// What both panel ops read of their tensors: x's rows, the packed panels, the output, and the
// schedule of an m x k product.
struct PanelOperands {
  const float* x;
  int64_t ldx;
  const float* w;
  float* y;
  int64_t k, panel_floats;
  PanelSchedule sched;
};

inline PanelOperands panel_operands(const at::Tensor& x, const at::Tensor& packed,
                                    at::Tensor& out) {
  const int64_t k = x.size(1);
  return {x.data_ptr<float>(), x.stride(0), packed.data_ptr<float>(), out.data_ptr<float>(),
          k, k * kPanel, panel_schedule(x.size(0), k)};
}

// The threads and row blocks of a panel product of m rows over k: each thread takes a
// contiguous run of the `units` (a unit: one output panel, or a gate / up pair) and, a block
// of rows at a time (`panel_schedule`), calls `unit(u, has_next, rb, rb_end)` for each of its
// units; `has_next`: the thread computes unit u + 1 after this one (its panels are worth
// prefetching).
template <typename Unit>
void for_panel_units(int64_t m, int64_t units, int64_t row_block, const Unit& unit) {
  const int nthreads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), units));
#pragma omp parallel num_threads(nthreads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t u0 = units * t / nt, u1 = units * (t + 1) / nt;
    for (int64_t rb = 0; rb < m; rb += row_block) {
      const int64_t rb_end = std::min(m, rb + row_block);
      for (int64_t u = u0; u < u1; ++u) unit(u, u + 1 < u1, rb, rb_end);
    }
  }
}

// The prefetch range of the panel after `panel` (nothing when there is none to compute).
inline std::pair<const char*, const char*> next_panel_lines(const float* panel,
                                                            int64_t panel_floats, bool has_next) {
  if (!has_next) return {nullptr, nullptr};
  const char* begin = reinterpret_cast<const char*>(panel + panel_floats);
  return {begin, begin + panel_floats * 4};
}
#endif

// x [M, K] (rows contiguous) @ weight^T (+ bias) -> [M, N] float32, `packed` from
// `panel_pack_weight(weight)`.
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& packed,
                        const std::optional<at::Tensor>& bias) {
  const float* bias_ptr;
  check_panel_args("panel_linear", x, packed, bias, bias_ptr);
  const int64_t m = x.size(0), panels = packed.size(0), n = panels * kPanel;
  auto out = at::empty({m, n}, x.options());
  if (m == 0) return out;
#if defined(__AVX512F__)
  const PanelOperands a = panel_operands(x, packed, out);
  for_panel_units(m, panels, a.sched.row_block, [&](int64_t p, bool has_next, int64_t rb,
                                                    int64_t rb_end) {
    const float* panel = a.w + p * a.panel_floats;
    auto [pf, pf_end] = next_panel_lines(panel, a.panel_floats, has_next);
    const float* b = bias_ptr ? bias_ptr + p * kPanel : nullptr;
    for (int64_t r0 = rb; r0 < rb_end; r0 += kPanelRows) {
      const int64_t rows = std::min<int64_t>(kPanelRows, rb_end - r0);
      panel_rows<kPanelRows>(rows, a.x + r0 * a.ldx, a.ldx, panel, a.k, b,
                             a.y + r0 * n + p * kPanel, n, pf, pf_end, a.sched.pf_per4);
    }
  });
#else
  TORCH_CHECK(false, "panel_linear: built without AVX-512");
#endif
  return out;
}

// silu(x @ gate^T + b_gate) * (x @ up^T + b_up) -> [M, D] float32: `silu_and_mul(panel_linear(x,
// packed, bias))` bit for bit, without the [M, 2 D] product. `packed` is a [gate | up] weight
// [2 D, K] packed by `panel_pack_weight` (gate panels 0 .. D / 32 - 1, then up's), bias [2 D].
// Each thread takes a contiguous run of the D / 32 (gate, up) panel pairs; per tile of 8 rows
// the gate sums and the up sums (panel_tile's, the same chains) go to two buffers on the stack,
// the gate sums through `silu_inplace` (silu_and_mul's arithmetic), and their product is
// stored. While a pair is computed, the gate tiles ask for the next gate panel and the up
// tiles for the next up panel.
at::Tensor panel_linear_silu_mul(const at::Tensor& x, const at::Tensor& packed,
                                 const std::optional<at::Tensor>& bias) {
  const float* bias_ptr;
  check_panel_args("panel_linear_silu_mul", x, packed, bias, bias_ptr);
  TORCH_CHECK(packed.size(0) % 2 == 0,
              "panel_linear_silu_mul: a [gate | up] weight of 2 D rows, D a multiple of 32");
  const int64_t m = x.size(0), pairs = packed.size(0) / 2, d = pairs * kPanel;
  auto out = at::empty({m, d}, x.options());
  if (m == 0) return out;
#if defined(__AVX512F__)
  const PanelOperands a = panel_operands(x, packed, out);
  for_panel_units(m, pairs, a.sched.row_block, [&](int64_t p, bool has_next, int64_t rb,
                                                   int64_t rb_end) {
    const float* gate = a.w + p * a.panel_floats;
    const float* up = a.w + (pairs + p) * a.panel_floats;
    auto [pf_gate, pf_gate_end] = next_panel_lines(gate, a.panel_floats, has_next);
    auto [pf_up, pf_up_end] = next_panel_lines(up, a.panel_floats, has_next);
    const float* b_gate = bias_ptr ? bias_ptr + p * kPanel : nullptr;
    const float* b_up = bias_ptr ? bias_ptr + d + p * kPanel : nullptr;
    alignas(64) float gate_sums[kPanelRows * kPanel];
    alignas(64) float up_sums[kPanelRows * kPanel];
    for (int64_t r0 = rb; r0 < rb_end; r0 += kPanelRows) {
      const int64_t rows = std::min<int64_t>(kPanelRows, rb_end - r0);
      const float* xr = a.x + r0 * a.ldx;
      panel_rows<kPanelRows>(rows, xr, a.ldx, gate, a.k, b_gate, gate_sums, kPanel, pf_gate,
                             pf_gate_end, a.sched.pf_per4);
      panel_rows<kPanelRows>(rows, xr, a.ldx, up, a.k, b_up, up_sums, kPanel, pf_up, pf_up_end,
                             a.sched.pf_per4);
      silu_inplace(gate_sums, rows * kPanel);
      float* y = a.y + r0 * d + p * kPanel;
      for (int64_t r = 0; r < rows; ++r)
#pragma omp simd
        for (int64_t j = 0; j < kPanel; ++j)
          y[r * d + j] = gate_sums[r * kPanel + j] * up_sums[r * kPanel + j];
    }
  });
#else
  TORCH_CHECK(false, "panel_linear_silu_mul: built without AVX-512");
#endif
  return out;
}

// x [T, 2 D] (rows contiguous; [gate | up]) -> silu(gate) * up [T, D], one pass. Each step
// rounds to the dtype as the torch ops (F.silu, then the product) do; silu(g) = g / (1 + e^-g)
// in float32 as ATen's CPU kernel computes it.
template <typename T>
void silu_and_mul_rows(T* out, const T* x, int64_t rows, int64_t d, int64_t x_stride) {
  at::parallel_for(0, rows, row_grain(3 * d), [&](int64_t begin, int64_t end) {
    std::vector<float> act(d);
    for (int64_t r = begin; r < end; ++r) {
      const T* g = x + r * x_stride;
      const T* u = g + d;
      T* o = out + r * d;
#if defined(__AVX512F__)
      if constexpr (kLanes16<T>) if (d % 16 == 0 && Sleef_expf16_u10 != nullptr) {  // as below
        const __m512 one = _mm512_set1_ps(1.f);
        for (int64_t i = 0; i < d; i += 16) {
          const __m512 v = load16<T>(g + i);
          const __m512 e = Sleef_expf16_u10(_mm512_sub_ps(_mm512_setzero_ps(), v));
          const __m512 a = round16<T>(_mm512_div_ps(v, _mm512_add_ps(one, e)));
          store16<T>(o + i, _mm512_mul_ps(a, load16<T>(u + i)));
        }
        continue;
      }
#endif
      for (int64_t i = 0; i < d; ++i) act[i] = to_f(g[i]);
      silu_inplace(act.data(), d);
#pragma omp simd
      for (int64_t i = 0; i < d; ++i)
        o[i] = static_cast<T>(to_f(static_cast<T>(act[i])) * to_f(u[i]));
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0,
              "silu_and_mul: x must be [T, 2 D], rows contiguous");
  const int64_t d = x.size(1) / 2;
  auto out = at::empty({x.size(0), d}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_mul", [&] {
    silu_and_mul_rows<scalar_t>(out.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), x.size(0), d,
                                x.stride(0));
  });
  return out;
}

// ---------------------------------------------------------------------------- argmax

// The index of each row's largest value, as torch.argmax(x, -1): the first of equal maxima, the
// first NaN where a row has one. x [N, V] float32, rows contiguous; rows are split among the
// threads (torch's CPU argmax reads a decode step's [64, 49152] logits at a few GB/s).
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kFloat &&
                  x.size(1) > 0,
              "argmax_rows: x must be float32 [N, V > 0], rows contiguous");
  const int64_t n = x.size(0), v = x.size(1), stride = x.stride(0);
  auto out = at::empty({n}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, n, std::max<int64_t>(1, 4096 / v), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * stride;
      int64_t i = 0;
      float best = -std::numeric_limits<float>::infinity();
      bool nan = false;
#if defined(__AVX512F__)
      __m512 mv = _mm512_set1_ps(best);
      __mmask16 unord = 0;
      for (; i + 16 <= v; i += 16) {
        const __m512 xv = _mm512_loadu_ps(row + i);
        unord |= _mm512_cmp_ps_mask(xv, xv, _CMP_UNORD_Q);
        mv = _mm512_max_ps(mv, xv);
      }
      best = _mm512_reduce_max_ps(mv);
      nan = unord != 0;
#endif
      for (; i < v; ++i) {
        nan = nan || std::isnan(row[i]);
        best = std::max(best, row[i]);
      }
      int64_t at = 0;
      if (nan) {
        while (!std::isnan(row[at])) ++at;
      } else {
        while (row[at] != best) ++at;  // every value was compared: the maximum is there
      }
      op[r] = at;
    }
  });
  return out;
}

// ---------------------------------------------------------------------------- decoder stack

// A run of Llama decoder layers in one call, each the ops the layer modules run on the CPU step
// path, in their order and with their arguments (so the same bits):
//   x = residual is none ? (residual = hidden, rms_norm(hidden)) : fused_add_rms_norm(hidden)
//   q = rotary_qkv_cache(panel_linear(x, qkv)) (K/V written at slot_mapping)
//   hidden = panel_linear(paged_attention(q), o)
//   x = fused_add_rms_norm(hidden)          (residual += hidden)
//   hidden = panel_linear(panel_linear_silu_mul(x, gate_up), down)
// Weights are the panel-packed ones, no biases; every list holds one entry per layer. A decode
// step of a small model spends several milliseconds in the Python between these ops; here
// there is none. Returns [hidden, residual].
std::vector<at::Tensor> decoder_stack(
    at::Tensor hidden, const std::optional<at::Tensor>& residual_in, const at::Tensor& positions,
    const at::Tensor& cos_cache, const at::Tensor& sin_cache, at::TensorList input_norms,
    at::TensorList qkv, at::TensorList o, at::TensorList post_norms, at::TensorList gate_up,
    at::TensorList down, at::TensorList kv_caches, const at::Tensor& slot_mapping,
    const at::Tensor& block_table, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
    int64_t nh, int64_t nkv, int64_t d, double eps, double scale) {
  const size_t layers = qkv.size();
  TORCH_CHECK(input_norms.size() == layers && o.size() == layers &&
                  post_norms.size() == layers && gate_up.size() == layers &&
                  down.size() == layers && kv_caches.size() == layers,
              "decoder_stack: one norm, weight and KV cache of each kind per layer");
  at::Tensor residual = residual_in.has_value() ? *residual_in : at::Tensor();
  const int64_t tokens = hidden.size(0);
  for (size_t i = 0; i < layers; ++i) {
    at::Tensor x;
    if (!residual.defined()) {
      residual = hidden;
      x = rms_norm(hidden, input_norms[i], eps);
    } else {
      x = fused_add_rms_norm(hidden, residual, input_norms[i], eps);
    }
    const auto qkv_rows = panel_linear(x, qkv[i], std::nullopt);
    const auto q = rotary_qkv_cache(qkv_rows, positions, cos_cache, sin_cache, kv_caches[i],
                                    slot_mapping, nh, nkv, d)[0];
    const auto attn =
        paged_attention(q, kv_caches[i], block_table, seq_lens, query_start_loc, scale, 0);
    hidden = panel_linear(attn.reshape({tokens, nh * d}), o[i], std::nullopt);
    x = fused_add_rms_norm(hidden, residual, post_norms[i], eps);
    hidden = panel_linear(panel_linear_silu_mul(x, gate_up[i], std::nullopt), down[i],
                          std::nullopt);
  }
  return {hidden, residual};
}

// ---------------------------------------------------------------------------- threads

// Bind OpenMP thread i of this process's pool to cores[i]; sets the pool to len(cores) threads.
// Returns the core each thread ended on (sched_getcpu) for the caller to log.
std::vector<int64_t> bind_threads(const std::vector<int64_t>& cores) {
  const int n = static_cast<int>(cores.size());
  TORCH_CHECK(n > 0, "bind_threads: no cores");
  at::set_num_threads(n);
  std::vector<int64_t> got(n, -1);
  std::vector<int> errs(n, 0);
#pragma omp parallel num_threads(n)
  {
    const int i = omp_get_thread_num();
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(static_cast<int>(cores[i]), &set);
    errs[i] = sched_setaffinity(0, sizeof(set), &set);
    got[i] = sched_getcpu();
  }
  for (int i = 0; i < n; ++i)
    TORCH_CHECK(errs[i] == 0, "bind_threads: sched_setaffinity failed for core ", cores[i]);
  return got;
}

}  // namespace

TORCH_LIBRARY(tandem_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
  m.def(
      "rotary_qkv_cache(Tensor qkv, Tensor positions, Tensor cos_cache, Tensor sin_cache, "
      "Tensor(a!) kv_cache, Tensor slot_mapping, int num_heads, int num_kv_heads, "
      "int head_size) -> Tensor[]");
  m.def(
      "paged_attention(Tensor query, Tensor kv_cache, Tensor block_table, Tensor seq_lens, "
      "Tensor query_start_loc, float scale, int window=0) -> Tensor");
  m.def("has_packed_sgemm() -> bool", &has_packed_sgemm);
  m.def("sgemm_pack_weight(Tensor weight) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
  m.def("has_panel_gemm() -> bool", &has_panel_gemm);
  m.def("panel_pack_weight(Tensor weight) -> Tensor");
  m.def("panel_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
  m.def("panel_linear_silu_mul(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def(
      "decoder_stack(Tensor hidden, Tensor? residual, Tensor positions, Tensor cos_cache, "
      "Tensor sin_cache, Tensor[] input_norms, Tensor[] qkv, Tensor[] o, Tensor[] post_norms, "
      "Tensor[] gate_up, Tensor[] down, Tensor(a!)[] kv_caches, Tensor slot_mapping, "
      "Tensor block_table, Tensor seq_lens, Tensor query_start_loc, int num_heads, "
      "int num_kv_heads, int head_size, float eps, float scale) -> Tensor[]");
  m.def("bind_threads(int[] cores) -> int[]", [](c10::IntArrayRef cores) {
    return bind_threads(std::vector<int64_t>(cores.begin(), cores.end()));
  });
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("rotary_qkv_cache", &rotary_qkv_cache);
  m.impl("paged_attention", &paged_attention);
  m.impl("sgemm_pack_weight", &sgemm_pack_weight);
  m.impl("packed_linear", &packed_linear);
  m.impl("panel_pack_weight", &panel_pack_weight);
  m.impl("panel_linear", &panel_linear);
  m.impl("panel_linear_silu_mul", &panel_linear_silu_mul);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("decoder_stack", &decoder_stack);
}
