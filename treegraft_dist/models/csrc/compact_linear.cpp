// y = x @ W^T + b in fp32 arithmetic over weights stored compactly and exactly (compact.py):
//   kind 0  bf16 bits [N, K]         w = bf16 -> fp32 (exact)
//   kind 1  fp16 bits [N, K]         w = fp16 -> fp32 (exact)
//   kind 2  int8 q [N, K] with fp32 scale A and offset B per group of G columns [N, K / G]:
//           w = fl(fl(A * q) - B), each step rounded to fp32, as GGUF's k-quant and q8 formats dequantize
//           (B = 0 for the formats without an offset: fl(x - 0) = x).
// Every output is the same sequence of fp32 operations whatever the number of rows M: 8-lane partial sums
// over K in order, then one fixed horizontal sum. A tree pass and a one-token pass therefore compute the
// same products bit for bit.
//
// Work is split over blocks of NB output rows. Up to FUSED_MAX input rows (a one-token pass, a small tree)
// are multiplied while the block's weights are decoded in registers, two weight rows at a time, with the
// weight stream prefetched PREFETCH bytes ahead (a pass reads the whole model from memory: measured on a
// 2-core EPYC, prefetching made a one-row pass 1.4x faster). More rows decode the block to fp32 once into
// a per-thread buffer and multiply every input row against it (3 rows at a time); a long input (prefill)
// is taken ROW_CHUNK rows at a time.
// Compiled with -ffp-contract=off: the decode's multiply and subtract must round separately.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <vector>

namespace {

constexpr int NB = 4;      // output rows per block
constexpr int64_t ROW_CHUNK = 96;  // input rows per pass over the weight
constexpr int MR_MAX = 3;  // input rows per buffered product (12 accumulators, 3 inputs and 1 weight in 16 registers)
constexpr int FUSED_MAX = 6;  // input rows multiplied while the weight is decoded in registers (2 x 6 accumulators)
constexpr int PREFETCH = 2048;  // bytes ahead in a weight row's stream (best of 512 to 8192 measured)

inline __m256 load_bf16(const uint16_t* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline __m256 load_fp16(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __m256 load_q8(const int8_t* p, __m256 a, __m256 b) {
  __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  __m256 qf = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
  return _mm256_sub_ps(_mm256_mul_ps(a, qf), b);
}

inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  __m128 s = _mm_add_ps(lo, hi);                 // lanes (0+4, 1+5, 2+6, 3+7)
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));        // (0+4)+(2+6), (1+5)+(3+7)
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 0x55));
  return _mm_cvtss_f32(s);
}

struct Weight {
  int kind;
  int64_t n, k, group;
  const uint16_t* w16;
  const int8_t* q;
  const float* a;
  const float* b;
};

// Decode rows [n0, n0 + rows) into buf[rows][k] (fp32); rows past n are zeros.
void decode_rows(const Weight& w, int64_t n0, int64_t rows, float* buf) {
  const int64_t k = w.k;
  for (int64_t r = 0; r < rows; ++r) {
    float* out = buf + r * k;
    const int64_t n = n0 + r;
    if (n >= w.n) {
      std::fill(out, out + k, 0.0f);
      continue;
    }
    if (w.kind == 0) {
      const uint16_t* src = w.w16 + n * k;
      for (int64_t c = 0; c < k; c += 8) {
        if (c % 32 == 0) _mm_prefetch(reinterpret_cast<const char*>(src + c) + PREFETCH, _MM_HINT_T0);
        _mm256_storeu_ps(out + c, load_bf16(src + c));
      }
    } else if (w.kind == 1) {
      const uint16_t* src = w.w16 + n * k;
      for (int64_t c = 0; c < k; c += 8) {
        if (c % 32 == 0) _mm_prefetch(reinterpret_cast<const char*>(src + c) + PREFETCH, _MM_HINT_T0);
        _mm256_storeu_ps(out + c, load_fp16(src + c));
      }
    } else {
      const int8_t* src = w.q + n * k;
      const int64_t groups = k / w.group;
      const float* a = w.a + n * groups;
      const float* b = w.b ? w.b + n * groups : nullptr;
      const __m256 zero = _mm256_setzero_ps();
      for (int64_t g = 0; g < groups; ++g) {
        const __m256 av = _mm256_set1_ps(a[g]);
        const __m256 bv = b ? _mm256_set1_ps(b[g]) : zero;
        _mm_prefetch(reinterpret_cast<const char*>(src + g * w.group) + PREFETCH, _MM_HINT_T0);
        for (int64_t c = g * w.group; c < (g + 1) * w.group; c += 8) _mm256_storeu_ps(out + c, load_q8(src + c, av, bv));
      }
    }
  }
}

// Two weight rows' int8 groups against MR inputs, decoded in registers as they are used. G is the group
// size when known at compile time (its loop then unrolls), 0 for any other (w.group).
template <int MR, int G>
inline void fused_groups(const Weight& w, int64_t na, int64_t nb, const float* x, int64_t ldx, __m256 (&acc)[MR][2]) {
  const int64_t group = G ? G : w.group;
  const int64_t k = w.k, groups = k / group;
  const int8_t* qa = w.q + na * k;
  const int8_t* qb = w.q + nb * k;
  const float* sa = w.a + na * groups;
  const float* sb = w.a + nb * groups;
  const float* oa = w.b ? w.b + na * groups : nullptr;
  const float* ob = w.b ? w.b + nb * groups : nullptr;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t c0 = g * group;
    _mm_prefetch(reinterpret_cast<const char*>(qa + c0 + PREFETCH), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(qb + c0 + PREFETCH), _MM_HINT_T0);
    const __m256 aa = _mm256_set1_ps(sa[g]), ab = _mm256_set1_ps(sb[g]);
    const __m256 ba = oa ? _mm256_set1_ps(oa[g]) : _mm256_setzero_ps();
    const __m256 bb = ob ? _mm256_set1_ps(ob[g]) : _mm256_setzero_ps();
#pragma GCC unroll 4
    for (int64_t c = 0; c < group; c += 8) {
      const __m256 wa = load_q8(qa + c0 + c, aa, ba), wb = load_q8(qb + c0 + c, ab, bb);
      for (int m = 0; m < MR; ++m) {
        const __m256 xv = _mm256_loadu_ps(x + m * ldx + c0 + c);
        acc[m][0] = _mm256_fmadd_ps(xv, wa, acc[m][0]);
        acc[m][1] = _mm256_fmadd_ps(xv, wb, acc[m][1]);
      }
    }
  }
}

// MR input rows (a one-token pass, a small tree) against the NB weight rows of one block, decoded in
// registers as they are used, two weight rows at a time: the same operations in the same order per
// output as decode_rows followed by block_product.
template <int MR>
inline void fused_product(const Weight& w, int64_t n0, const float* x, int64_t ldx, float* sums) {
  const int64_t k = w.k;
  const int64_t rows = std::min<int64_t>(NB, w.n - n0);
  for (int jp = 0; jp < NB; jp += 2) {
    const int64_t na = n0 + (jp < rows ? jp : 0), nb = n0 + (jp + 1 < rows ? jp + 1 : 0);
    __m256 acc[MR][2];
    for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    if (w.kind == 2) {
      if (w.group == 32) fused_groups<MR, 32>(w, na, nb, x, ldx, acc);
      else if (w.group == 16) fused_groups<MR, 16>(w, na, nb, x, ldx, acc);
      else if (w.group == 64) fused_groups<MR, 64>(w, na, nb, x, ldx, acc);
      else fused_groups<MR, 0>(w, na, nb, x, ldx, acc);
    } else {
      const uint16_t* pa = w.w16 + na * k;
      const uint16_t* pb = w.w16 + nb * k;
      for (int64_t c = 0; c < k; c += 8) {
        if (c % 32 == 0) {  // a cache line of each row
          _mm_prefetch(reinterpret_cast<const char*>(pa + c) + PREFETCH, _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(pb + c) + PREFETCH, _MM_HINT_T0);
        }
        const __m256 wa = w.kind == 0 ? load_bf16(pa + c) : load_fp16(pa + c);
        const __m256 wb = w.kind == 0 ? load_bf16(pb + c) : load_fp16(pb + c);
        for (int m = 0; m < MR; ++m) {
          const __m256 xv = _mm256_loadu_ps(x + m * ldx + c);
          acc[m][0] = _mm256_fmadd_ps(xv, wa, acc[m][0]);
          acc[m][1] = _mm256_fmadd_ps(xv, wb, acc[m][1]);
        }
      }
    }
    for (int m = 0; m < MR; ++m) {
      sums[m * NB + jp] = hsum(acc[m][0]);
      sums[m * NB + jp + 1] = hsum(acc[m][1]);
    }
  }
}

// Sums of MR input rows against the NB decoded weight rows of one block: sums[m * NB + j].
template <int MR>
inline void block_product(const float* x, int64_t ldx, const float* wbuf, int64_t k, float* sums) {
  __m256 acc[MR][NB];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm256_setzero_ps();
  for (int64_t c = 0; c < k; c += 8) {
    __m256 xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = _mm256_loadu_ps(x + m * ldx + c);
    for (int j = 0; j < NB; ++j) {
      const __m256 wv = _mm256_loadu_ps(wbuf + j * k + c);
      for (int m = 0; m < MR; ++m) acc[m][j] = _mm256_fmadd_ps(xv[m], wv, acc[m][j]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NB; ++j) sums[m * NB + j] = hsum(acc[m][j]);
}

Weight make_weight(int64_t kind, const torch::Tensor& w16, const torch::Tensor& q, const torch::Tensor& a,
                   const torch::Tensor& b, int64_t group) {
  Weight w{};
  w.kind = static_cast<int>(kind);
  w.group = group;
  if (kind == 0 || kind == 1) {
    TORCH_CHECK(w16.dim() == 2 && w16.is_contiguous() && w16.element_size() == 2, "16-bit weight [N, K] expected");
    w.n = w16.size(0);
    w.k = w16.size(1);
    w.w16 = reinterpret_cast<const uint16_t*>(w16.data_ptr());
  } else {
    TORCH_CHECK(kind == 2, "unknown weight kind ", kind);
    TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && q.scalar_type() == torch::kInt8, "int8 q [N, K] expected");
    w.n = q.size(0);
    w.k = q.size(1);
    TORCH_CHECK(group % 8 == 0 && w.k % group == 0, "group size must divide K and be a multiple of 8");
    TORCH_CHECK(a.is_contiguous() && a.scalar_type() == torch::kFloat32 && a.numel() == w.n * (w.k / group),
                "fp32 scales [N, K / group] expected");
    w.q = q.data_ptr<int8_t>();
    w.a = a.data_ptr<float>();
    if (b.defined() && b.numel() > 0) {
      TORCH_CHECK(b.is_contiguous() && b.scalar_type() == torch::kFloat32 && b.numel() == a.numel(),
                  "fp32 offsets [N, K / group] expected");
      w.b = b.data_ptr<float>();
    }
  }
  TORCH_CHECK(w.k % 8 == 0, "K must be a multiple of 8, got ", w.k);
  return w;
}

}  // namespace

// Decode the whole weight to a dense fp32 [N, K] tensor (tests, and the prefill path).
torch::Tensor decode(int64_t kind, torch::Tensor w16, torch::Tensor q, torch::Tensor a, torch::Tensor b, int64_t group) {
  const Weight w = make_weight(kind, w16, q, a, b, group);
  auto out = torch::empty({w.n, w.k}, torch::kFloat32);
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, w.n, 64, [&](int64_t lo, int64_t hi) { decode_rows(w, lo, hi - lo, dst + lo * w.k); });
  return out;
}

torch::Tensor linear(torch::Tensor x, int64_t kind, torch::Tensor w16, torch::Tensor q, torch::Tensor a, torch::Tensor b,
                     int64_t group, c10::optional<torch::Tensor> bias) {
  const Weight w = make_weight(kind, w16, q, a, b, group);
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "fp32 input expected");
  TORCH_CHECK(x.size(-1) == w.k, "input has ", x.size(-1), " features, the weight ", w.k);
  auto sizes = x.sizes().vec();
  auto x2 = x.reshape({-1, w.k}).contiguous();
  const int64_t m = x2.size(0);
  sizes.back() = w.n;
  const float* bias_p = nullptr;
  torch::Tensor bias_c;
  if (bias.has_value() && bias->defined()) {
    bias_c = bias->contiguous();
    TORCH_CHECK(bias_c.scalar_type() == torch::kFloat32 && bias_c.numel() == w.n, "fp32 bias [N] expected");
    bias_p = bias_c.data_ptr<float>();
  }
  auto y = torch::empty({m, w.n}, torch::kFloat32);
  const float* xp = x2.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t blocks = (w.n + NB - 1) / NB;
  // Inputs are taken ROW_CHUNK rows at a time so that they stay in cache while every block of the weight
  // passes over them (prefill); the weight is decoded once per chunk.
  for (int64_t r0 = 0; r0 < m; r0 += ROW_CHUNK) {
    const int64_t r1 = std::min(m, r0 + ROW_CHUNK);
    at::parallel_for(0, blocks, 1, [&](int64_t lo, int64_t hi) {
      std::vector<float> buf(m > FUSED_MAX ? NB * w.k : 0);
      float sums[FUSED_MAX * NB];
      for (int64_t blk = lo; blk < hi; ++blk) {
        const int64_t n0 = blk * NB;
        const int64_t valid = std::min<int64_t>(NB, w.n - n0);
        if (m <= FUSED_MAX) {  // one pass over the block's rows: decode them in registers
          switch (m) {
            case 6: fused_product<6>(w, n0, xp, w.k, sums); break;
            case 5: fused_product<5>(w, n0, xp, w.k, sums); break;
            case 4: fused_product<4>(w, n0, xp, w.k, sums); break;
            case 3: fused_product<3>(w, n0, xp, w.k, sums); break;
            case 2: fused_product<2>(w, n0, xp, w.k, sums); break;
            default: fused_product<1>(w, n0, xp, w.k, sums);
          }
          for (int i = 0; i < m; ++i)
            for (int j = 0; j < valid; ++j) yp[i * w.n + n0 + j] = bias_p ? sums[i * NB + j] + bias_p[n0 + j] : sums[i * NB + j];
          continue;
        }
        decode_rows(w, n0, NB, buf.data());
        for (int64_t r = r0; r < r1; r += MR_MAX) {
          const int rows = static_cast<int>(std::min<int64_t>(MR_MAX, r1 - r));
          if (rows == 3) block_product<3>(xp + r * w.k, w.k, buf.data(), w.k, sums);
          else if (rows == 2) block_product<2>(xp + r * w.k, w.k, buf.data(), w.k, sums);
          else block_product<1>(xp + r * w.k, w.k, buf.data(), w.k, sums);
          for (int i = 0; i < rows; ++i)
            for (int j = 0; j < valid; ++j) {
              float v = sums[i * NB + j];
              if (bias_p) v += bias_p[n0 + j];
              yp[(r + i) * w.n + n0 + j] = v;
            }
        }
      }
    });
  }
  return y.view(sizes);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, "y = x @ W^T + b over a compact exact weight");
  m.def("decode", &decode, "the compact weight as dense fp32 [N, K]");
}
