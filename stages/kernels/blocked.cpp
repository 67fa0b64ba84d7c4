// Batch-invariant ops by fixed-shape blocking (built and loaded by stages/kernels/native.py).
//
// Stock CPU kernels pick their algorithm (and so their reduction order) from the whole
// tensor shape: MKL uses other GEMM kernels for M < 4 than for M >= 4 and threads a small
// batch of matrices differently from a large one, ATen convolves a lone small sample
// differently from a batch, channels-last group_norm splits its reduction by the batch size.
// So a sample's result depends on what else is in the batch.
//
// The cure here: never let the batch size reach the library. Every call that a sample's
// result depends on is cut along its batch dimension into blocks of a fixed size (zero
// padded), laid out in one canonical, 64-byte-aligned layout, and computed one block per
// library call (or as one batched call whose matrices the library computes independently).
// For a given op and per-sample shape every call the library sees has the same shape,
// strides and alignment, so it takes the same path; a sample's rows land in some block at
// some position, and the library computes each row of a block the same way wherever it sits
// (pinned by tests/stages/test_kernels.py). Blocks hold as many items as make about
// GEMM_MACS / CONV_MACS of work, so small layers still run one library call for many samples.
//
// C++ rather than Python: the tiny pipelines make ~1300 of these calls per image, and a
// Python kernel costs 10-20 us of boxing and interpreter time per call, as much as the
// work itself at 64x64 (measured: on/off 0.76x at batch 1 in Python).
//
// Each kernel calls the stock kernel through an overload it never overrides (`bmm.out`
// for mm and bmm, `mkldnn_convolution`/`_convolution` for convolution, ...).
//
// mm and addmm in float32 and bfloat16 take another road where the CPU has AVX-512 with bf16
// (native.py compiles for it then): a GEMM of our own whose every output element is summed in
// one fixed order (see "fixed-order GEMM on packed weights"). Fixed-shape blocks cost a decode
// step dearly (one row padded to a block of 16: 0.15x of stock at M=1), and a kernel whose order
// never depends on M needs no padding at all; it runs at the speed of the stock GEMMs
// (docs/performance.md, `omniserve bench --stage kernels`).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <omp.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <numeric>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <cmath>
#include <vector>

namespace {

using at::IntArrayRef;
using at::Tensor;
using c10::MemoryFormat;

// Work per library call (multiply-adds) at which a call's fixed cost stops mattering. Blocks
// hold as many items as make about this much work; more would only pad small batches.
constexpr int64_t kGemmMacs = int64_t{1} << 18;
constexpr int64_t kConvMacs = int64_t{1} << 21;
constexpr int64_t kLineBytes = 64;
// Work per sample from which oneDNN convolves one sample per call (see blocked_convolution).
constexpr int64_t kOneDnnSampleMacs = int64_t{1} << 25;

bool floating(const Tensor& t) {
  auto d = t.scalar_type();
  return d == at::kFloat || d == at::kBFloat16 || d == at::kHalf || d == at::kDouble;
}

int64_t product(IntArrayRef sizes) {
  int64_t p = 1;
  for (auto s : sizes) p *= s;
  return p;
}

// Items per library call: the power of two at or below target / work_per_item, clamped. It
// depends only on the per-item work (never on the batch): what makes blocked ops invariant.
int64_t block_size(int64_t work_per_item, int64_t target, int64_t minimum, int64_t maximum) {
  int64_t items = target / std::max<int64_t>(work_per_item, 1);
  int64_t power = 1;
  while (power * 2 <= items) power *= 2;
  return std::max(minimum, std::min(maximum, power));
}

bool aligned(const Tensor& x) {
  // Libraries may take other code paths for unaligned data; fresh allocations are 64-byte aligned.
  return reinterpret_cast<uintptr_t>(x.data_ptr()) % kLineBytes == 0;
}

MemoryFormat memory_format(const Tensor& x) {
  if (x.dim() == 4 && !x.is_contiguous() && x.is_contiguous(MemoryFormat::ChannelsLast)) return MemoryFormat::ChannelsLast;
  if (x.dim() == 5 && !x.is_contiguous() && x.is_contiguous(MemoryFormat::ChannelsLast3d)) return MemoryFormat::ChannelsLast3d;
  return MemoryFormat::Contiguous;
}

// x zero-padded to whole blocks along dim 0, contiguous, 64-byte aligned (x itself if it
// already is). The layout never follows x's strides: those can depend on the batch (a reshape
// copies or not), and libraries pick their algorithm by layout. With `lines`, every item (slice
// along dim 0) also starts on a 64-byte line, padding the item stride if need be: MKL's result
// for a GEMM row can follow that row's alignment (measured: K=5 rows at different positions
// of one block differ), so no row may sit differently aligned from another.
Tensor canonical(const Tensor& x, int64_t block, bool lines = false) {
  const int64_t n = x.size(0);
  const int64_t total = (n + block - 1) / block * block;
  const int64_t item = product(x.sizes().slice(1));
  const int64_t line = kLineBytes / static_cast<int64_t>(x.element_size());
  const int64_t stride = lines ? (item + line - 1) / line * line : item;
  if (total == n && stride == item && x.is_contiguous() && aligned(x)) return x;
  auto shape = x.sizes().vec();
  shape[0] = total;
  // One op: zero rows below, zero columns right of each item (the item-stride padding).
  Tensor padded = at::constant_pad_nd(x.reshape({n, item}), {0, stride - item, 0, total - n});
  return stride != item ? padded.narrow(1, 0, item).view(shape) : padded.view(shape);
}

// One block of a canonical x: a view, or an aligned copy where the view is not aligned.
Tensor block_of(const Tensor& x, int64_t start, int64_t block) {
  Tensor view = x.narrow(0, start, block);
  return aligned(view) ? view : view.clone(at::MemoryFormat::Preserve);
}

// Whether `t` carries one row per item along dim 0 (rather than broadcasting over items).
bool per_row(const Tensor& t, int64_t n) { return t.dim() >= 2 && t.size(0) == n && n != 1; }

// --- matrix products ---------------------------------------------------------------

// MKL's thread-local thread count (the C interface; the lowercase names are Fortran's, taking a
// pointer); absent (null) where torch is built without MKL.
extern "C" int MKL_Set_Num_Threads_Local(int) __attribute__((weak));

// While alive, GEMM libraries called from this thread use one thread (MKL through its local
// setting, oneDNN and OpenMP-threaded code through this thread's OpenMP team size).
class OneLibraryThread {
 public:
  OneLibraryThread() : omp_before_(omp_get_max_threads()) {
    if (MKL_Set_Num_Threads_Local != nullptr) mkl_before_ = MKL_Set_Num_Threads_Local(1);
    omp_set_num_threads(1);
  }
  ~OneLibraryThread() {
    omp_set_num_threads(omp_before_);
    if (MKL_Set_Num_Threads_Local != nullptr) MKL_Set_Num_Threads_Local(mkl_before_);
  }

 private:
  int omp_before_, mkl_before_ = 0;
};

// out[i] = beta * bias[i] + alpha * a[i] @ b[i] (bias == nullptr: a[i] @ b[i]), every matrix
// computed on one thread. A library left to thread a batched GEMM itself threads within a
// matrix when the batch has fewer matrices than threads and across matrices otherwise, and the
// two round differently (measured: MKL, 2 threads, one matrix alone vs among several: up to
// 1-ulp differences when it has few rows). So a batch of at least as many matrices as threads
// goes to the library in one call (it then computes each matrix as a single-threaded call does),
// and a smaller one is cut into slices, each computed by a single-threaded library call
// (measured: 0 of 4500 random linear/bmm/baddbmm checks differ, 1 and 2 threads).
void batched_product(Tensor out, const Tensor* bias, const Tensor& a, const Tensor& b, const c10::Scalar& beta,
                     const c10::Scalar& alpha) {
  const int64_t count = a.size(0);
  if (count >= at::get_num_threads()) {
    if (bias == nullptr)
      at::bmm_out(out, a, b);
    else
      at::baddbmm_out(out, *bias, a, b, beta, alpha);
    return;
  }
  auto slice = [&](const Tensor& t, int64_t begin, int64_t end) {
    return t.dim() == 3 && t.size(0) == count ? t.narrow(0, begin, end - begin) : t;  // else it broadcasts
  };
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    OneLibraryThread one;
    Tensor part = out.narrow(0, begin, end - begin);
    if (bias == nullptr)
      at::bmm_out(part, slice(a, begin, end), slice(b, begin, end));
    else
      at::baddbmm_out(part, slice(*bias, begin, end), slice(a, begin, end), slice(b, begin, end), beta, alpha);
  });
}

// The columns a product is computed with, for matrices of `rows` rows:
// - whole 64-byte lines per output matrix, so that every output matrix of a batch starts on a
//   line: MKL's result for a matrix follows its output's alignment (measured: a 3x250 float32
//   output at a 16-byte offset differs in 6 elements from the same product on a line), and a
//   matrix's offset in a contiguous batch is its position times its size;
// - at least two: ATen's batched GEMM computes a one-column product differently for one matrix
//   than for several (measured: 1-ulp differences in most rows, float32, K from 8 to 1408).
// Extra columns are zero columns of the right-hand side, sliced off the result again.
int64_t padded_columns(int64_t rows, int64_t n, int64_t line) {
  const int64_t step = line / std::gcd(std::max<int64_t>(rows, 1), line);
  return std::max<int64_t>(2, (n + step - 1) / step * step);
}

// `t` (last dimension n, or 1 to broadcast) widened with zero columns to `columns`.
Tensor pad_columns(const Tensor& t, int64_t n, int64_t columns) {
  if (t.dim() == 0 || columns == n || t.size(-1) != n) return t;
  return at::constant_pad_nd(t, {0, columns - n});
}

Tensor first_columns(const Tensor& product, int64_t n) {
  return product.size(-1) == n ? product : product.narrow(-1, 0, n).contiguous();
}

int64_t line_elements(const Tensor& t) { return kLineBytes / static_cast<int64_t>(t.element_size()); }

// --- fixed-order GEMM on packed weights (every CPU path) ----------------------------
//
// out = beta * bias + alpha * (a @ b) for float32 and bfloat16, computed so that an output
// element's arithmetic never depends on the number of rows, where its row sits, the threads, or
// the CPU path: each element is one float32 accumulator that takes a[i][k] * b[k][j] for
// k = 0, 1, ..., K-1 in that order, one fused multiply-add per k (float32); for bfloat16, per pair
// (2p, 2p+1) of k, the odd product then the even one, each a fused multiply-add (what AVX-512's
// vdpbf16ps does, in the order Intel's manual gives; the products of two bfloat16 are exact in
// float32). Rows are computed in tiles that share loads, never arithmetic; threads split the columns,
// never k; the k range is cut into chunks whose partial sums are stored to and reloaded from a
// float32 buffer (exact). So no row needs padding: one row streams the weight once, like a GEMV, and
// many rows run at the speed of a blocked GEMM (the loop nest of BLIS/oneDNN).
//
// The arithmetic is defined on 16 logical lanes (one per column of a panel's vector), and every path
// (`Lanes` below: AVX-512, AVX2 + FMA, plain C++ with std::fma) does exactly it, so the three paths
// give the same bits (pinned in tests/stages/test_kernels.py by running each path on one machine).
// Not emulated: vdpbf16ps flushes denormal inputs and results to zero; the other paths keep them.
//
// The weight (b) is packed once into column panels of 16, 32 or 48 columns (by its width: a narrow
// weight wastes no columns), k-major (for bfloat16, k pairs interleaved, as vdpbf16ps takes them),
// and the packed copy is cached for as long as the weight tensor lives unchanged (PackedWeights).
#if defined(OMNISERVE_ISA_AVX512) || defined(OMNISERVE_ISA_AVX2)
#include <immintrin.h>
#endif

#include <atomic>
#include <list>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <vector>

inline float bf16_bits_to_float(uint32_t bits) {  // the bfloat16 in the top half of a float32: exact
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

#if defined(OMNISERVE_ISA_AVX512)
constexpr const char* kIsa = "avx512";
constexpr bool kOneDnnBf16 = true;  // oneDNN convolves bfloat16 on this path's CPUs
// 16 lanes in one register.
struct Lanes {
  __m512 v;
  static Lanes zero() { return {_mm512_setzero_ps()}; }
  static Lanes load(const float* p) { return {_mm512_loadu_ps(p)}; }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
};
struct F32Weights { __m512 w; };  // one k, 16 columns
inline F32Weights f32_weights(const float* p) { return {_mm512_loadu_ps(p)}; }
inline Lanes f32_step(Lanes acc, const float* a, int64_t k, const F32Weights& w) {
  return {_mm512_fmadd_ps(_mm512_set1_ps(a[k]), w.w, acc.v)};
}
struct Bf16Weights { __m512 w; };  // one k pair, 16 columns (32 bfloat16, pairs adjacent)
inline Bf16Weights bf16_weights(const c10::BFloat16* p) { return {_mm512_castsi512_ps(_mm512_loadu_si512(p))}; }
inline Lanes bf16_step(Lanes acc, uint32_t pair, const Bf16Weights& w) {
  const __m512 a = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(pair)));
  return {_mm512_dpbf16_ps(acc.v, (__m512bh)_mm512_castps_si512(a), (__m512bh)_mm512_castps_si512(w.w))};
}
// (T)(beta * bias + alpha * acc) for the first `left` lanes.
template <typename T>
inline void finish_lanes(Lanes acc, const T* bias, T* out, int left, float alpha, float beta) {
  const __mmask16 mask = static_cast<__mmask16>((1u << left) - 1);
  __m512 value = _mm512_mul_ps(_mm512_set1_ps(alpha), acc.v);
  if constexpr (std::is_same_v<T, float>) {
    if (bias != nullptr) value = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(beta), _mm512_maskz_loadu_ps(mask, bias)), value);
    _mm512_mask_storeu_ps(out, mask, value);
  } else {
    if (bias != nullptr) {
      const __m512i raw = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias));
      const __m512 b = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));  // bfloat16 -> float32: exact
      value = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(beta), b), value);
    }
    _mm256_mask_storeu_epi16(out, mask, (__m256i)_mm512_cvtneps_pbh(value));
  }
}
// Rows per tile for panels of V vectors: accumulators, weights and a broadcast fit 32 registers.
template <int V> constexpr int kTileRowsFor = 8;

#elif defined(OMNISERVE_ISA_AVX2)
constexpr const char* kIsa = "avx2";
constexpr bool kOneDnnBf16 = false;
// 16 lanes in two registers.
struct Lanes {
  __m256 lo, hi;
  static Lanes zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static Lanes load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  void store(float* p) const { _mm256_storeu_ps(p, lo); _mm256_storeu_ps(p + 8, hi); }
};
struct F32Weights { __m256 lo, hi; };
inline F32Weights f32_weights(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline Lanes f32_step(Lanes acc, const float* a, int64_t k, const F32Weights& w) {
  const __m256 x = _mm256_broadcast_ss(a + k);
  return {_mm256_fmadd_ps(x, w.lo, acc.lo), _mm256_fmadd_ps(x, w.hi, acc.hi)};
}
// A k pair's weights as float32: the even k (low halves) and the odd k (high halves) of 16 columns.
struct Bf16Weights { __m256 even_lo, odd_lo, even_hi, odd_hi; };
inline Bf16Weights bf16_weights(const c10::BFloat16* p) {
  const __m256i mask = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)), _mm256_castsi256_ps(_mm256_and_si256(lo, mask)),
          _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16)), _mm256_castsi256_ps(_mm256_and_si256(hi, mask))};
}
inline Lanes bf16_step(Lanes acc, uint32_t pair, const Bf16Weights& w) {
  const __m256 even = _mm256_set1_ps(bf16_bits_to_float(pair << 16));
  const __m256 odd = _mm256_set1_ps(bf16_bits_to_float(pair & 0xffff0000u));
  return {_mm256_fmadd_ps(even, w.even_lo, _mm256_fmadd_ps(odd, w.odd_lo, acc.lo)),
          _mm256_fmadd_ps(even, w.even_hi, _mm256_fmadd_ps(odd, w.odd_hi, acc.hi))};
}
template <typename T>
inline void finish_lanes(Lanes acc, const T* bias, T* out, int left, float alpha, float beta) {
  float value[16];
  const __m256 a = _mm256_set1_ps(alpha);
  _mm256_storeu_ps(value, _mm256_mul_ps(a, acc.lo));
  _mm256_storeu_ps(value + 8, _mm256_mul_ps(a, acc.hi));
  for (int l = 0; l < left; ++l) {  // -ffp-contract=off: a multiply, then an add, as AVX-512's path does
    const float b = bias != nullptr ? beta * static_cast<float>(bias[l]) : 0.f;
    out[l] = static_cast<T>(bias != nullptr ? b + value[l] : value[l]);  // c10's rounding: to nearest even
  }
}
// 16 ymm registers: two per accumulator of 16 lanes.
template <int V> constexpr int kTileRowsFor = V == 1 ? 4 : 2;

#else
constexpr const char* kIsa = "generic";
constexpr bool kOneDnnBf16 = false;
// 16 lanes as plain floats; std::fma is the one rounding an FMA instruction makes.
struct Lanes {
  float v[16];
  static Lanes zero() { return {}; }
  static Lanes load(const float* p) { Lanes l; std::memcpy(l.v, p, sizeof l.v); return l; }
  void store(float* p) const { std::memcpy(p, v, sizeof v); }
};
struct F32Weights { const float* w; };
inline F32Weights f32_weights(const float* p) { return {p}; }
inline Lanes f32_step(Lanes acc, const float* a, int64_t k, const F32Weights& w) {
  const float x = a[k];
  for (int l = 0; l < 16; ++l) acc.v[l] = std::fma(x, w.w[l], acc.v[l]);
  return acc;
}
struct Bf16Weights { const uint32_t* w; };
inline Bf16Weights bf16_weights(const c10::BFloat16* p) { return {reinterpret_cast<const uint32_t*>(p)}; }
inline Lanes bf16_step(Lanes acc, uint32_t pair, const Bf16Weights& w) {
  const float even = bf16_bits_to_float(pair << 16), odd = bf16_bits_to_float(pair & 0xffff0000u);
  for (int l = 0; l < 16; ++l) {
    const uint32_t weights = w.w[l];
    acc.v[l] = std::fma(even, bf16_bits_to_float(weights << 16),
                        std::fma(odd, bf16_bits_to_float(weights & 0xffff0000u), acc.v[l]));
  }
  return acc;
}
template <typename T>
inline void finish_lanes(Lanes acc, const T* bias, T* out, int left, float alpha, float beta) {
  for (int l = 0; l < left; ++l) {
    const float value = alpha * acc.v[l];
    out[l] = static_cast<T>(bias != nullptr ? beta * static_cast<float>(bias[l]) + value : value);
  }
}
template <int V> constexpr int kTileRowsFor = 4;
#endif

// The most rows a tile takes on any path (packed_tile_rows dispatches 1 to 8).
constexpr int kTileRows = 8;

// Vectors of 16 columns per panel for a weight of n columns: its shape alone decides.
inline int panel_vectors(int64_t n) { return n <= 16 ? 1 : n <= 32 ? 2 : 3; }
// k per chunk: a panel's chunk (128 x 48 columns of float32, 24 KB) stays in L1 while every row tile of a block
// passes; at 512 it spilled to L2, which AVX2's tiles of 2-4 rows read too often (measured on a Xeon, one thread,
// float32: 1024 x 3072 x 3072 at 21 GMAC/s with 512, 34 with 128; 64 was no faster).
constexpr int64_t kDepthChunk = 128;

// Element type traits: float32 takes one k per step, bfloat16 a pair.
template <typename T> struct Packing;
template <> struct Packing<float> {
  static constexpr int64_t kPerStep = 1;
  using Weights = F32Weights;
  static Weights weights(const float* p) { return f32_weights(p); }
  static Lanes step(Lanes acc, const float* a, int64_t k, const Weights& w) { return f32_step(acc, a, k, w); }
  static Lanes step_last(Lanes acc, const float* a, int64_t k, const Weights& w) { return f32_step(acc, a, k, w); }
};
template <> struct Packing<c10::BFloat16> {
  static constexpr int64_t kPerStep = 2;
  using Weights = Bf16Weights;
  static Weights weights(const c10::BFloat16* p) { return bf16_weights(p); }
  static Lanes step(Lanes acc, const c10::BFloat16* a, int64_t k, const Weights& w) {
    uint32_t pair;
    std::memcpy(&pair, a + k, sizeof pair);
    return bf16_step(acc, pair, w);
  }
  // Odd depth: the last k pairs with a zero (the packed weight holds a zero there too).
  static Lanes step_last(Lanes acc, const c10::BFloat16* a, int64_t k, const Weights& w) {
    uint16_t low;
    std::memcpy(&low, a + k, sizeof low);
    return bf16_step(acc, low, w);
  }
};

// Packed layout: panel p (columns p*width ...), step s (k = s*kPerStep ...): width * kPerStep
// elements, column-major within the step (each column's kPerStep k values adjacent); zero padded.
template <typename T>
Tensor pack_weight(const Tensor& b) {  // b: k x n
  constexpr int64_t per = Packing<T>::kPerStep;
  const int64_t k = b.size(0), n = b.size(1), width = 16 * panel_vectors(n);
  const int64_t panels = (n + width - 1) / width, steps = (k + per - 1) / per;
  Tensor packed = at::zeros({panels, steps, width * per}, b.options());
  Tensor src = b.contiguous();
  const T* s = src.data_ptr<T>();
  T* d = packed.data_ptr<T>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t kk = 0; kk < k; ++kk)
        for (int64_t c = 0; c < width && p * width + c < n; ++c)
          d[(p * steps + kk / per) * width * per + c * per + kk % per] = s[kk * n + p * width + c];
  });
  return packed;
}

struct PackedProblem {
  const void* a; int64_t lda;  // rows x depth
  const void* w;               // packed weight
  int64_t depth, steps;        // k, and k steps of the packed weight
  void* out; int64_t n;        // rows x n, contiguous
  const void* bias; int64_t bias_row;  // rows x n with unit column stride (bias_row 0: one row for all); or null
  float alpha, beta;
};

// Stores 16 results: (T)(beta * bias + alpha * acc), the same operations for every element.
template <typename T>
__attribute__((noinline)) void finish(const PackedProblem& p, Lanes acc, int64_t i, int64_t j) {
  const int64_t left = std::min<int64_t>(16, p.n - j);
  if (left <= 0) return;  // a panel's zero columns past n
  const T* bias = p.bias != nullptr ? static_cast<const T*>(p.bias) + i * p.bias_row + j : nullptr;
  finish_lanes<T>(acc, bias, static_cast<T*>(p.out) + i * p.n + j, static_cast<int>(left), p.alpha, p.beta);
}

constexpr int64_t kPrefetchSteps = 16;

// R rows x one panel over steps [s0, s1): partial sums from `partial` (none at s0 == 0), the k
// steps, then either back to `partial` or, after the last step, finished into the output.
template <typename T, int R, int kVectors, bool Stream>
void packed_tile(const PackedProblem& p, int64_t i0, int64_t panel, int64_t s0, int64_t s1, float* partial) {
  constexpr int64_t kPanel = 16 * kVectors;
  using P = Packing<T>;
  constexpr int64_t per = P::kPerStep;
  const T* a = static_cast<const T*>(p.a) + i0 * p.lda;
  const T* w = static_cast<const T*>(p.w) + (panel * p.steps + s0) * kPanel * per;
  Lanes acc[R][kVectors];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVectors; ++v)
      acc[r][v] = s0 == 0 ? Lanes::zero() : Lanes::load(partial + (r * kVectors + v) * 16);
  // Whole steps; then, for odd bfloat16 depth, the last k alone (never reading past the row).
  const int64_t whole = std::min(s1, p.depth / per);
  int64_t s = s0;
  for (; s < whole; ++s, w += kPanel * per) {
    // Rows that make one tile stream each panel once: ask for its lines kPrefetchSteps ahead (faster than the
    // hardware prefetcher alone; measured: 4096 x 4096 float32, one row, 0.71x of stock -> 1.00x). No effect on any sum.
    if constexpr (Stream)
      for (int64_t line = 0; line < kPanel * per * static_cast<int64_t>(sizeof(T)); line += kLineBytes)
        __builtin_prefetch(reinterpret_cast<const char*>(w + kPrefetchSteps * kPanel * per) + line);
    typename P::Weights wv[kVectors];
    for (int v = 0; v < kVectors; ++v) wv[v] = P::weights(w + v * 16 * per);
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kVectors; ++v) acc[r][v] = P::step(acc[r][v], a + r * p.lda, s * per, wv[v]);
  }
  if (s < s1) {
    typename P::Weights wv[kVectors];
    for (int v = 0; v < kVectors; ++v) wv[v] = P::weights(w + v * 16 * per);
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kVectors; ++v) acc[r][v] = P::step_last(acc[r][v], a + r * p.lda, s * per, wv[v]);
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVectors; ++v) acc[r][v].store(partial + (r * kVectors + v) * 16);
  if (s1 >= p.steps)  // after the last step: from the (L1-resident) partial sums into the output
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kVectors; ++v)
        finish<T>(p, Lanes::load(partial + (r * kVectors + v) * 16), i0 + r, panel * kPanel + v * 16);
}

template <typename T, int V, bool Stream>
void packed_tile_rows(const PackedProblem& p, int64_t i, int rows, int64_t panel, int64_t s0, int64_t s1, float* partial) {
  switch (rows) {
    case 8: packed_tile<T, 8, V, Stream>(p, i, panel, s0, s1, partial); break;
    case 7: packed_tile<T, 7, V, Stream>(p, i, panel, s0, s1, partial); break;
    case 6: packed_tile<T, 6, V, Stream>(p, i, panel, s0, s1, partial); break;
    case 5: packed_tile<T, 5, V, Stream>(p, i, panel, s0, s1, partial); break;
    case 4: packed_tile<T, 4, V, Stream>(p, i, panel, s0, s1, partial); break;
    case 3: packed_tile<T, 3, V, Stream>(p, i, panel, s0, s1, partial); break;
    case 2: packed_tile<T, 2, V, Stream>(p, i, panel, s0, s1, partial); break;
    case 1: packed_tile<T, 1, V, Stream>(p, i, panel, s0, s1, partial); break;
    default: break;
  }
}
static_assert(kTileRows == 8, "packed_tile_rows dispatches 1 to 8 rows");

// The loop nest of BLIS: panels in groups, rows in blocks, k in chunks. A group's partial sums for
// a block of rows stay in L2 while the block's slice of `a` for one k chunk (L2) is reused by every
// panel of the group, and each panel's chunk (L1) by every row of the block. The blocking decides
// what is in cache, never the order of any element's sum.
template <typename T, int V, bool Stream>
void packed_panels(const PackedProblem& p, int64_t r0, int64_t r1, int64_t begin, int64_t end) {
  constexpr int64_t kBlockRows = 256, kPartialBytes = int64_t{1} << 19, kPanel = 16 * V;
  // k in chunks so that a chunk of `a` and of a panel are reused from cache by the block's rows and the group's
  // panels; rows that make one tile (Stream) reuse nothing: each panel then streams whole, one after another.
  const int64_t chunk = Stream ? std::max<int64_t>(p.steps, 1) : std::max<int64_t>(1, kDepthChunk / Packing<T>::kPerStep);
  const int64_t block = std::min<int64_t>(kBlockRows, (r1 - r0 + kTileRows - 1) / kTileRows * kTileRows);
  const int64_t group = std::clamp<int64_t>(kPartialBytes / (block * kPanel * static_cast<int64_t>(sizeof(float))), 1,
                                            std::max<int64_t>(end - begin, 1));
  // Never read before written (the first chunk starts from zero), so not cleared: clearing it cost more
  // than a small product itself (measured: 90 us instead of 40 for 666x128 @ 128x32).
  std::unique_ptr<float[]> partial(new float[static_cast<size_t>(block * group * kPanel)]);
  for (int64_t g0 = begin; g0 < end; g0 += group) {
    const int64_t g1 = std::min(end, g0 + group);
    for (int64_t i0 = r0; i0 < r1; i0 += block) {
      const int64_t i1 = std::min(r1, i0 + block);
      for (int64_t s0 = 0; s0 < std::max<int64_t>(p.steps, 1); s0 += chunk)
        for (int64_t panel = g0; panel < g1; ++panel)
          for (int64_t i = i0; i < i1; i += kTileRowsFor<V>)
            packed_tile_rows<T, V, Stream>(p, i, static_cast<int>(std::min<int64_t>(kTileRowsFor<V>, i1 - i)), panel,
                                           s0, std::min(p.steps, s0 + chunk),
                                           partial.get() + ((panel - g0) * block + (i - i0)) * kPanel);
    }
  }
}

// Threads split the columns (panels) or, where there are fewer panels than threads, the rows; never
// k. Either way every element is computed alike whichever thread computes it.
//
// A thread takes at least kThreadMacs multiply-adds (about 20 us here): waking a second thread for less
// costs more than it saves, and on a busy box (another process on the other core) a barrier can wait
// for a whole time slice (measured: a 32x32x128 product at 0.5 ms instead of a few us).
constexpr int64_t kThreadMacs = int64_t{1} << 21;
constexpr int64_t kStreamRows = 16;

template <typename T, int V>
void packed_parallel(const PackedProblem& p, int64_t m, int64_t panels) {
  // A panel's cost in multiply-adds at the compute-bound rate: a product of few rows streams its weights from
  // memory at about a sixteenth of that rate per multiply-add, so it counts as kStreamRows rows (one row of 2048 x
  // 5632 otherwise never woke a second thread; measured 2 threads, 1 row: 512 x 1408 at 0.33x of stock before).
  const int64_t work = std::max<int64_t>(std::max<int64_t>(m, kStreamRows) * p.depth * 16 * V, 1);
  const int threads = at::get_num_threads();
  if (panels >= threads || m < 2 * kTileRows) {
    const int64_t grain = std::max<int64_t>(1, kThreadMacs / work);
    at::parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {
      if (m <= kTileRowsFor<V>) packed_panels<T, V, true>(p, 0, m, begin, end);
      else packed_panels<T, V, false>(p, 0, m, begin, end);
    });
    return;
  }
  const int64_t tiles = (m + kTileRows - 1) / kTileRows;
  const int64_t grain = std::max<int64_t>(1, kThreadMacs / std::max<int64_t>(work * panels / tiles, 1));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    packed_panels<T, V, false>(p, begin * kTileRows, std::min(m, end * kTileRows), 0, panels);
  });
}

// Packed copies of weights, kept while the weight lives unchanged: the cache holds a reference to
// the weight (so its memory cannot be reused by another tensor at the same address) and its
// version counter (an in-place change bumps it, and the copy is packed again). Bounded by bytes,
// least recently used first out. Inference tensors carry no version counter: packed per call.
class PackedWeights {
 public:
  void set_limit(int64_t bytes) {
    std::lock_guard<std::mutex> guard(mutex_);
    limit_ = bytes;
    evict();
  }

  template <typename T>
  Tensor get(const Tensor& b) {
    if (b.is_inference() || limit_ <= 0) {
      ++uncached_;
      return pack_weight<T>(b);
    }
    const Key key{reinterpret_cast<uintptr_t>(b.data_ptr()), b.size(0), b.size(1), b.stride(0), b.stride(1),
                  static_cast<int>(b.scalar_type())};
    const int64_t version = b._version();
    {
      std::lock_guard<std::mutex> guard(mutex_);
      auto found = entries_.find(key);
      if (found != entries_.end() && found->second.version == version) {
        order_.splice(order_.end(), order_, found->second.position);
        ++hits_;
        return found->second.packed;
      }
    }
    ++packs_;
    Tensor packed = pack_weight<T>(b);
    std::lock_guard<std::mutex> guard(mutex_);
    auto found = entries_.find(key);
    if (found != entries_.end()) {
      bytes_ -= found->second.packed.nbytes();
      order_.erase(found->second.position);
      entries_.erase(found);
    }
    order_.push_back(key);
    entries_.emplace(key, Entry{b, version, packed, std::prev(order_.end())});
    bytes_ += packed.nbytes();
    evict();
    return packed;
  }

  void clear() {
    std::lock_guard<std::mutex> guard(mutex_);
    entries_.clear();
    order_.clear();
    bytes_ = 0;
  }

  // hits, packs (cached), uncached packs (inference tensors or a zero limit), entries, bytes, limit.
  void stats(int64_t* out) {
    std::lock_guard<std::mutex> guard(mutex_);
    const int64_t values[] = {hits_, packs_, uncached_, static_cast<int64_t>(entries_.size()), bytes_, limit_};
    std::copy(std::begin(values), std::end(values), out);
  }

 private:
  using Key = std::tuple<uintptr_t, int64_t, int64_t, int64_t, int64_t, int>;
  struct Entry {
    Tensor source;
    int64_t version;
    Tensor packed;
    std::list<Key>::iterator position;
  };

  void evict() {
    while (bytes_ > limit_ && !order_.empty()) {
      auto found = entries_.find(order_.front());
      bytes_ -= found->second.packed.nbytes();
      entries_.erase(found);
      order_.pop_front();
    }
  }

  std::mutex mutex_;
  std::map<Key, Entry> entries_;
  std::list<Key> order_;
  int64_t bytes_ = 0, limit_ = int64_t{1} << 31;
  std::atomic<int64_t> hits_{0}, packs_{0}, uncached_{0};
};

PackedWeights g_packed;

template <typename T>
Tensor packed_gemm(const Tensor& a, const Tensor& b, const Tensor* bias, float alpha, float beta) {
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  Tensor rows = a.stride(1) == 1 && (m == 1 || a.stride(0) >= k) ? a : a.contiguous();
  Tensor packed = g_packed.get<T>(b);
  Tensor out = at::empty({m, n}, a.options());
  PackedProblem p{rows.data_ptr(), rows.stride(0), packed.data_ptr(), k, packed.size(1), out.data_ptr(), n,
                  nullptr, 0, alpha, beta};
  Tensor bias_rows;
  if (bias != nullptr && beta != 0.0f) {  // beta 0 ignores the bias, as stock does
    bias_rows = bias->to(a.scalar_type());
    if (bias_rows.dim() < 2 || bias_rows.size(0) == 1) {  // one row for every output row
      bias_rows = bias_rows.reshape({-1}).expand({n}).contiguous();
    } else {
      bias_rows = bias_rows.expand({m, n}).contiguous();
      p.bias_row = n;
    }
    p.bias = bias_rows.data_ptr();
  }
  const int64_t panels = packed.size(0);
  switch (panel_vectors(n)) {
    case 1: packed_parallel<T, 1>(p, m, panels); break;
    case 2: packed_parallel<T, 2>(p, m, panels); break;
    default: packed_parallel<T, 3>(p, m, panels); break;
  }
  return out;
}

// mm / addmm as one batched GEMM over fixed-size row blocks: (blocks, rows, k) @ (k, n).
// ATen's batched GEMM computes each matrix of a batch on its own, the same way whatever the
// batch count (measured: 2400 checks, float32 and bfloat16), so every row block is computed
// alike, wherever it sits, while a single call keeps the cost of a stock GEMM.
Tensor gemm(const Tensor& a, const Tensor& b, const Tensor* bias, const c10::Scalar& beta, const c10::Scalar& alpha) {
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  // Small blocks for wide layers (a decode step's few rows pad to little), larger for narrow ones.
  const int64_t rows = block_size(k * n, kGemmMacs, 16, 256);
  Tensor padded = canonical(a, rows, true);
  const int64_t count = padded.size(0) / rows;
  const int64_t columns = padded_columns(rows, n, line_elements(a));
  Tensor blocks = padded.view({count, rows, k});
  Tensor weight = pad_columns(b, n, columns).expand({count, k, columns});
  Tensor out = at::empty({count, rows, columns}, a.options());
  if (bias == nullptr) {
    batched_product(out, nullptr, blocks, weight, 1, 1);
  } else {
    Tensor rows_bias = pad_columns(*bias, n, columns);
    if (per_row(*bias, m))  // a full bias matrix is cut into the same row blocks
      rows_bias = canonical(pad_columns(bias->expand({m, n}), n, columns), rows, true)
                      .view({count, rows, columns});
    batched_product(out, &rows_bias, blocks, weight, beta, alpha);
  }
  return first_columns(out.view({count * rows, columns}).narrow(0, 0, m), n);
}

// a @ b (+ bias) by packed_gemm for float32 and bfloat16; undefined where it does not apply.
Tensor fixed_order_product(const Tensor& a, const Tensor& b, const Tensor* bias, const c10::Scalar& beta,
                           const c10::Scalar& alpha) {
  const auto dtype = a.scalar_type();
  if (b.scalar_type() != dtype) return Tensor();
  if (dtype == at::kFloat) return packed_gemm<float>(a, b, bias, alpha.toFloat(), beta.toFloat());
  if (dtype == at::kBFloat16) return packed_gemm<c10::BFloat16>(a, b, bias, alpha.toFloat(), beta.toFloat());
  return Tensor();
}

Tensor blocked_mm(const Tensor& a, const Tensor& b) {
  if (!floating(a) || a.size(0) == 0) {
    Tensor out = at::empty({0}, a.options());
    return at::mm_out(out, a, b);
  }
  Tensor out = fixed_order_product(a, b, nullptr, 0, 1);
  return out.defined() ? out : gemm(a, b, nullptr, 1, 1);
}

Tensor blocked_addmm(const Tensor& bias, const Tensor& a, const Tensor& b, const c10::Scalar& beta, const c10::Scalar& alpha) {
  if (!floating(a) || a.size(0) == 0) {
    Tensor out = at::empty({0}, a.options());
    return at::addmm_out(out, bias, a, b, beta, alpha);
  }
  Tensor out = fixed_order_product(a, b, &bias, beta, alpha);
  return out.defined() ? out : gemm(a, b, &bias, beta, alpha);
}

// Each matrix on its own (see gemm), in one canonical layout: every input matrix line-aligned,
// every output matrix line-aligned (padded_columns).
Tensor blocked_bmm(const Tensor& a, const Tensor& b) {
  const int64_t count = a.size(0), m = a.size(1), n = b.size(2);
  if (!floating(a) || count == 0) {
    Tensor out = at::empty({count, m, n}, a.options());
    return at::bmm_out(out, a, b);
  }
  const int64_t columns = padded_columns(m, n, line_elements(a));
  Tensor out = at::empty({count, m, columns}, a.options());
  batched_product(out, nullptr, canonical(a, 1, true),
                  canonical(pad_columns(b, n, columns), 1, true), 1, 1);
  return first_columns(out, n);
}

Tensor blocked_baddbmm(const Tensor& bias, const Tensor& a, const Tensor& b, const c10::Scalar& beta, const c10::Scalar& alpha) {
  const int64_t count = a.size(0), m = a.size(1), n = b.size(2);
  if (!floating(a) || count == 0) {
    Tensor out = at::empty({count, m, n}, a.options());
    return at::baddbmm_out(out, bias, a, b, beta, alpha);
  }
  const int64_t columns = padded_columns(m, n, line_elements(a));
  Tensor rows_bias = bias;
  if (columns != n || (bias.dim() == 3 && per_row(bias, count)))  // one bias matrix per output matrix, laid out alike
    rows_bias = canonical(pad_columns(bias.expand({count, m, n}), n, columns), 1, true);
  Tensor out = at::empty({count, m, columns}, a.options());
  batched_product(out, &rows_bias, canonical(a, 1, true),
                  canonical(pad_columns(b, n, columns), 1, true), beta, alpha);
  return first_columns(out, n);
}

// --- convolution -------------------------------------------------------------------

// `x` with exactly `layout`'s strides. `contiguous(layout)` keeps a tensor whose size-1 dimensions have other
// strides, and mkldnn_convolution picks its own layout from all the strides (suggest_memory_format): a lone sample
// reshaped out of a permute (the Wan VAE's attention, batch stride 16 instead of C*H*W) ran channels-first while the
// same sample in a batch ran channels-last, and the two round differently (measured: 432 of 576 outputs).
Tensor in_layout(const Tensor& x, MemoryFormat layout) {
  std::vector<int64_t> strides(x.dim(), 1);
  if (layout == MemoryFormat::ChannelsLast) strides = c10::get_channels_last_strides_2d(x.sizes());
  else
    for (int64_t d = x.dim() - 2; d >= 0; --d) strides[d] = strides[d + 1] * std::max<int64_t>(x.size(d + 1), 1);
  if (x.strides() == IntArrayRef(strides)) return x;
  return at::empty_strided(x.sizes(), strides, x.options()).copy_(x);
}

// Multiply-adds per sample of a convolution (about: positions counted at the input's size over the stride).
int64_t conv_work(const Tensor& input, const Tensor& weight, IntArrayRef stride) {
  const int64_t positions = product(input.sizes().slice(2)) / std::max<int64_t>(product(stride), 1);
  return weight.size(0) * product(weight.sizes().slice(1)) * positions;
}

// oneDNN directly, in one layout whatever the caller's; fixed blocks of samples for what oneDNN
// does not take.
//
// ATen's CPU convolution varies with the batch because it picks its backend by batch size
// (im2col for a lone small sample, oneDNN otherwise) and follows the input's layout, which
// itself can follow the batch size. oneDNN computes every output from its own sample in the
// order of the kernel it picked, and picks one kernel for every batch of a small layer
// (measured over 2400 random layers: channels, sizes, kernels, strides, groups, layouts,
// float32/bfloat16, batch sizes 1-8, every position; pinned in tests/stages/test_kernels.py),
// but not of every large one: those run one sample per call.
Tensor blocked_convolution(const Tensor& input, const Tensor& weight, const std::optional<Tensor>& bias, IntArrayRef stride,
                   IntArrayRef padding, IntArrayRef dilation, bool transposed, IntArrayRef output_padding,
                   int64_t groups) {
  // One layout whatever the activation's strides (they can depend on the batch: a reshape
  // copies or not), and oneDNN's result depends on the layout. 2-d convolutions run
  // channels-last: oneDNN's channels-first kernels cost about 1.5x its channels-last ones at
  // diffusion shapes (measured: 73.5 vs 59.6 ms of convolution per batch-8 render at 64x64),
  // and group_norm below reads either layout in one order. The result stays channels-last.
  const bool onednn_takes = !transposed && input.device().is_cpu() &&
                            (input.scalar_type() == at::kFloat || input.scalar_type() == at::kBFloat16) &&
                            input.dim() >= 3 && input.dim() <= 5;
  if (onednn_takes && input.size(0) > 0) {
    const auto layout = input.dim() == 4 ? MemoryFormat::ChannelsLast : MemoryFormat::Contiguous;
    auto onednn = [&](const Tensor& x) {
      if (input.scalar_type() == at::kBFloat16 && !kOneDnnBf16) {
        // oneDNN convolves bfloat16 only with AVX-512 (bw/vl/dq) or AVX-NE-CONVERT and refuses elsewhere. In
        // float32 it convolves on every CPU, and every bfloat16 converts to float32 exactly: the float32
        // result, rounded once to bfloat16, is as invariant as oneDNN's float32 one and at least as accurate
        // as a bfloat16 kernel's (which accumulates in float32 too).
        auto wide = [](const Tensor& t) { return t.to(at::kFloat); };
        const std::optional<Tensor> wide_bias = bias && bias->defined() ? std::optional<Tensor>(wide(*bias)) : bias;
        return at::mkldnn_convolution(in_layout(wide(x), layout), wide(weight), wide_bias, padding, stride,
                                      dilation, groups).to(at::kBFloat16);
      }
      return at::mkldnn_convolution(in_layout(x, layout), weight, bias, padding, stride, dilation, groups);
    };
    if (input.size(0) == 1 || conv_work(input, weight, stride) < kOneDnnSampleMacs) return onednn(input);
    // oneDNN picks its kernel's blocking from the whole problem, the batch included. On the avx2 path the SD1.5
    // UNet's 3x3 1920->640 convolution at 32x32 (up_blocks.2 of a 512x512 render) blocks its weights by 24
    // output channels for a lone sample and by 16 for two, and the two round differently (measured: 98% of
    // that layer's outputs, 16,225 of 16,384 of the UNet's). A convolution this large therefore runs one
    // sample per oneDNN call: every sample gets the lone sample's kernel, whatever the batch. Smaller ones run
    // the batch in one call, where a call per sample would cost more than the convolution (measured on avx2,
    // one thread, batch 8 against 8 calls: 2.7-4.9x at 8x8 with 4-32 channels, 1.27x at 9.4M multiply-adds
    // per sample, 1.04x at 38M; 0.87x at 11G); there oneDNN kept one kernel for every batch over 2400 random
    // layers (tests/stages/test_kernels.py).
    const Tensor x = in_layout(input, layout);
    // Each sample where a lone sample would sit: a fresh, 64-byte aligned allocation unless whole lines apart.
    const bool lines = product(x.sizes().slice(1)) * static_cast<int64_t>(x.element_size()) % kLineBytes == 0;
    std::vector<Tensor> samples;
    for (int64_t i = 0; i < x.size(0); ++i)
      samples.push_back(onednn(lines ? x.narrow(0, i, 1) : in_layout(x.narrow(0, i, 1).clone(), layout)));
    return in_layout(at::cat(samples), layout);
  }

  auto stock = [&](const Tensor& x) {
    // Fixed algorithm choice (no benchmarking, deterministic, no TF32), whatever the user set.
    return at::_convolution(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups,
                            /*benchmark=*/false, /*deterministic=*/true, at::globalContext().userEnabledCuDNN(),
                            /*allow_tf32=*/false);
  };
  if (input.dim() < 3 || !floating(input) || input.size(0) == 0) return stock(input);
  const int64_t work = conv_work(input, weight, stride);
  // Samples of a block sit at offsets of whole samples: only whole 64-byte lines keep them equally aligned.
  const int64_t line = kLineBytes / static_cast<int64_t>(input.element_size());
  const int64_t samples = product(input.sizes().slice(1)) % line == 0 ? block_size(work, kConvMacs, 1, 64) : 1;
  Tensor padded = canonical(input, samples);
  std::vector<Tensor> blocks;
  for (int64_t start = 0; start < padded.size(0); start += samples) blocks.push_back(stock(block_of(padded, start, samples)));
  Tensor out = blocks.size() == 1 ? blocks[0] : at::cat(blocks);
  return out.narrow(0, 0, input.size(0));
}

// --- group_norm --------------------------------------------------------------------

// aten::group_norm in either layout, each (sample, group) reduced in one order whatever the
// batch and whatever the layout.
//
// The stock kernels differ by layout, and the channels-last one splits its reduction by the
// batch size; activations arrive in either layout depending on the batch (and our convolution
// returns channels-last). So the order is ours and defined on logical indices: channel c's
// values at positions p go to lane p % 16 in increasing p; the 16 lanes are summed in one tree
// (`lanes_sum`); a group's channels are added in channel order (in double). Mean first, then
// the centred squares (a second pass: exact enough without Welford). Channels-first rows are
// read 16 positions at a time, channels-last positions a run of channels at a time; each lane
// sees the same values in the same order, so both layouts give the same bits (pinned in the tests).
// The output is x * scale + shift per channel, in the caller's layout.
constexpr int kLanes = 16;

// Lanes l and l + half, half = 8, 4, 2, 1: the one order both layouts use.
float lanes_sum(float* lanes) {
  for (int half = kLanes / 2; half > 0; half /= 2)
    for (int l = 0; l < half; ++l) lanes[l] += lanes[l + half];
  return lanes[0];
}

// One lane's step: x added, or (x - centre)^2 added. Compiled with -ffp-contract=off (native.py), so
// a multiply and an add stay two roundings in every loop, vectorized or not.
template <bool Centred>
inline float accumulate(float lane, float x, float centre) {
  if constexpr (Centred) {
    const float d = x - centre;
    return lane + d * d;
  } else {
    return lane + x;
  }
}

// One row's sum over positions of x, or of (x - centre)^2 (channels-first: a row is one channel of
// one sample). Full blocks of 16 have compile-time trip counts (so they vectorize); the last,
// partial one the same steps, fewer lanes.
template <typename T, bool Centred>
float row_sum(const T* v, int64_t positions, float centre) {
  float lanes[kLanes] = {};
  int64_t p = 0;
  for (; p + kLanes <= positions; p += kLanes)
    for (int l = 0; l < kLanes; ++l) lanes[l] = accumulate<Centred>(lanes[l], static_cast<float>(v[p + l]), centre);
  for (int l = 0; p + l < positions; ++l) lanes[l] = accumulate<Centred>(lanes[l], static_cast<float>(v[p + l]), centre);
  return lanes_sum(lanes);
}

// A group's mean (or variance) from its channels' sums: added in channel order, in double, over the group's size.
double group_mean(const float* sums, int64_t per_group, int64_t positions) {
  double total = 0;
  for (int64_t c = 0; c < per_group; ++c) total += sums[c];
  return total / static_cast<double>(per_group * positions);
}

// The normalization as x * scale + shift for one channel: its group's mean (as float) and variance, its affine.
struct ScaleShift {
  float scale, shift;
};
inline ScaleShift scale_shift(float mean, double variance, double eps, const float* gamma, const float* beta, int64_t c) {
  const float rstd = static_cast<float>(1.0 / std::sqrt(variance + eps));
  const float scale = gamma ? rstd * gamma[c] : rstd;
  return {scale, (beta ? beta[c] : 0.f) - mean * scale};
}

// Channels-first: a group's channels are adjacent rows, so one task takes its (sample, group) through
// both sums and the normalization while the group's rows are still in cache (the order of each sum is
// the one above; only which rows run when differs).
template <typename T>
void group_norm_first(const T* x, T* out, int64_t n, int64_t channels, int64_t groups, int64_t positions, double eps,
                      const float* gamma, const float* beta) {
  const int64_t per_group = channels / groups;
  at::parallel_for(0, n * groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sums(per_group);
    for (int64_t g = begin; g < end; ++g) {
      const T* v = x + g * per_group * positions;
      for (int64_t c = 0; c < per_group; ++c) sums[c] = row_sum<T, false>(v + c * positions, positions, 0.f);
      const float mean = static_cast<float>(group_mean(sums.data(), per_group, positions));
      for (int64_t c = 0; c < per_group; ++c) sums[c] = row_sum<T, true>(v + c * positions, positions, mean);
      const double variance = group_mean(sums.data(), per_group, positions);
      for (int64_t c = 0; c < per_group; ++c) {
        const auto [a, b] = scale_shift(mean, variance, eps, gamma, beta, g % groups * per_group + c);
        const T* row = v + c * positions;
        T* o = out + (g * per_group + c) * positions;
        for (int64_t p = 0; p < positions; ++p) o[p] = static_cast<T>(static_cast<float>(row[p]) * a + b);
      }
    }
  });
}

// Channels-last sums, one task per (sample, run of kLastChannels channels): position by position,
// each position's run read whole (contiguous: the memory is read in order, each line by one task),
// value at position p to lane p % 16 of its channel, in increasing p; the lanes then summed by
// `lanes_sum`. Each channel sees exactly the channels-first order, so both layouts give the same bits.
constexpr int64_t kLastChannels = 128;

template <typename T, bool Centred>
void channel_sums_last(const T* x, int64_t n, int64_t channels, int64_t positions, const float* centre, float* sums) {
  const int64_t runs = (channels + kLastChannels - 1) / kLastChannels;
  at::parallel_for(0, n * runs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t sample = task / runs, c0 = task % runs * kLastChannels;
      const int64_t width = std::min(kLastChannels, channels - c0);
      const float* __restrict m = centre ? centre + sample * channels + c0 : nullptr;
      std::vector<float> lanes(kLanes * width, 0.f);  // [lane][channel]
      const T* v = x + sample * positions * channels + c0;
      for (int64_t p = 0; p < positions; ++p) {
        const T* __restrict at_p = v + p * channels;
        float* __restrict lane = lanes.data() + p % kLanes * width;
        for (int64_t j = 0; j < width; ++j)
          lane[j] = accumulate<Centred>(lane[j], static_cast<float>(at_p[j]), Centred ? m[j] : 0.f);
      }
      for (int64_t j = 0; j < width; ++j) {
        float column[kLanes];
        for (int l = 0; l < kLanes; ++l) column[l] = lanes[l * width + j];
        sums[sample * channels + c0 + j] = lanes_sum(column);
      }
    }
  });
}

template <typename T>
void group_norm_last(const T* x, T* out, int64_t n, int64_t channels, int64_t groups, int64_t positions, double eps,
                     const float* gamma, const float* beta) {
  const int64_t per_group = channels / groups;
  std::vector<float> sums(n * channels), mean(n * channels), scale(n * channels), shift(n * channels);
  channel_sums_last<T, false>(x, n, channels, positions, nullptr, sums.data());
  for (int64_t g = 0; g < n * groups; ++g)
    std::fill_n(mean.begin() + g * per_group, per_group, static_cast<float>(group_mean(&sums[g * per_group], per_group, positions)));
  channel_sums_last<T, true>(x, n, channels, positions, mean.data(), sums.data());
  for (int64_t g = 0; g < n * groups; ++g) {
    const double variance = group_mean(&sums[g * per_group], per_group, positions);
    for (int64_t i = g * per_group; i < (g + 1) * per_group; ++i) {
      const ScaleShift channel = scale_shift(mean[i], variance, eps, gamma, beta, i % channels);
      scale[i] = channel.scale;
      shift[i] = channel.shift;
    }
  }
  at::parallel_for(0, n * positions, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* v = x + row * channels;
      T* o = out + row * channels;
      const float* a = scale.data() + row / positions * channels;
      const float* b = shift.data() + row / positions * channels;
      for (int64_t c = 0; c < channels; ++c) o[c] = static_cast<T>(static_cast<float>(v[c]) * a[c] + b[c]);
    }
  });
}

template <typename T>
Tensor group_norm_fixed(const Tensor& x, bool last, int64_t groups, const std::optional<Tensor>& weight,
                        const std::optional<Tensor>& bias, double eps) {
  const int64_t n = x.size(0), channels = x.size(1), positions = product(x.sizes().slice(2));
  Tensor gamma = weight && weight->defined() ? weight->to(at::kFloat).contiguous() : Tensor();
  Tensor beta = bias && bias->defined() ? bias->to(at::kFloat).contiguous() : Tensor();
  Tensor out = at::empty_like(x);  // same strides: the caller's layout
  (last ? group_norm_last<T> : group_norm_first<T>)(x.const_data_ptr<T>(), out.mutable_data_ptr<T>(), n, channels, groups,
                                                    positions, eps, gamma.defined() ? gamma.const_data_ptr<float>() : nullptr,
                                                    beta.defined() ? beta.const_data_ptr<float>() : nullptr);
  return out;
}

Tensor blocked_group_norm(const Tensor& x, int64_t num_groups, const std::optional<Tensor>& weight,
                          const std::optional<Tensor>& bias, double eps, bool /*cudnn_enabled*/) {
  const int64_t n = x.size(0), channels = x.size(1);
  const int64_t positions = product(x.sizes().slice(2));
  TORCH_CHECK(num_groups > 0 && channels % num_groups == 0, "group_norm: ", channels,
              " channels do not split into ", num_groups, " groups");
  const bool ours = x.device().is_cpu() && x.numel() > 0 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16);
  if (!ours) {  // other dtypes: the stock channels-first kernel, whose row order does not follow the batch
    Tensor out = std::get<0>(at::native_group_norm(x.contiguous(), weight, bias, n, channels, positions, num_groups, eps));
    return out.contiguous(memory_format(x));
  }
  const bool last = memory_format(x) == MemoryFormat::ChannelsLast;
  const Tensor in = last ? x : x.contiguous();
  Tensor out = x.scalar_type() == at::kFloat ? group_norm_fixed<float>(in, last, num_groups, weight, bias, eps)
                                             : group_norm_fixed<at::BFloat16>(in, last, num_groups, weight, bias, eps);
  return out.contiguous(memory_format(x));  // 3-d channels-last inputs were read channels-first
}

// --- nearest upsampling ------------------------------------------------------------

// Not for invariance (it moves values and sums nothing) but for the price of the layout the
// convolution above fixes: in this torch build, 2x nearest upsampling of a channels-first tensor
// runs 10-25x slower than of a channels-last one (measured: 6.5 ms vs 0.2 ms at 8x64x32x32), and
// diffusers' VAE decoder upsamples what our channels-first convolution returns (stock kernels
// leave it channels-last there). Exactly 2x of a channels-first float tensor is done here: ATen
// maps output index o to input index o >> 1 whenever an output side is twice the input's (its
// `nearest_idx`), so this is the stock result element for element; everything else is stock's.
template <typename T>
void upsample_twice(const T* in, T* out, int64_t planes, int64_t h, int64_t w) {
  at::parallel_for(0, planes, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t i = 0; i < h; ++i) {
        const T* row = in + (p * h + i) * w;
        T* even = out + (p * 2 * h + 2 * i) * 2 * w;
        for (int64_t j = 0; j < w; ++j) even[2 * j] = even[2 * j + 1] = row[j];
        std::memcpy(even + 2 * w, even, sizeof(T) * 2 * w);
      }
  });
}

Tensor blocked_upsample_nearest2d(const Tensor& self, IntArrayRef output_size, std::optional<double> scales_h,
                                  std::optional<double> scales_w) {
  const bool twice = self.dim() == 4 && self.is_contiguous() && output_size.size() == 2 &&
                     output_size[0] == 2 * self.size(2) && output_size[1] == 2 * self.size(3) &&
                     (self.element_size() == 4 || self.element_size() == 2) && self.numel() > 0;
  if (!twice) {
    Tensor out = at::empty({0}, self.options());
    return at::upsample_nearest2d_out(out, self, output_size, scales_h, scales_w);
  }
  const int64_t planes = self.size(0) * self.size(1), h = self.size(2), w = self.size(3);
  Tensor out = at::empty({self.size(0), self.size(1), 2 * h, 2 * w}, self.options());
  if (self.element_size() == 4)
    upsample_twice(static_cast<const uint32_t*>(self.data_ptr()), static_cast<uint32_t*>(out.data_ptr()), planes, h, w);
  else
    upsample_twice(static_cast<const uint16_t*>(self.data_ptr()), static_cast<uint16_t*>(out.data_ptr()), planes, h, w);
  return out;
}

// --- pointwise transcendental ops: every element by the vector code -----------------------
//
// ATen computes an elementwise op's body with its vector code and the last (numel mod twice the vector width)
// elements with its scalar code (ATen/native/cpu/Loops.h, vectorized_loop); for exp, tanh, sin, erf... the two round
// differently (Sleef against libm), and with several threads the split points move as well. So where an element
// falls in the flattened tensor, which the batch size decides, chose its bits (measured: SiLU in the Qwen2.5-VL text
// encoder, the last of three co-batched prompts, avx512 path). Here the stock kernel runs on blocks of
// kPointwiseBlock elements (a multiple of every vector width, under ATen's grain so one thread runs each; the last
// block zero padded), so every element takes the vector code wherever it sits.
constexpr int64_t kPointwiseBlock = 16384;

bool pointwise_dtype(const Tensor& x) {
  return x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf;
}

// `op(out, in)` (a stock out= overload) over `src` into `dst`, both dense with the same strides: in memory order.
template <typename Op>
void by_blocks(const Tensor& src, const Tensor& dst, const Op& op) {
  const int64_t n = src.numel(), full = n / kPointwiseBlock, rest = n - full * kPointwiseBlock;
  Tensor a = src.as_strided({n}, {1}), b = dst.as_strided({n}, {1});
  // The caller's dispatch state in every worker (its InferenceMode above all: an inference tensor written from a
  // worker outside it is refused, measured in vLLM's CPU worker).
  const at::ThreadLocalState caller;
  at::parallel_for(0, full, 1, [&](int64_t begin, int64_t end) {
    at::ThreadLocalStateGuard same(caller);
    for (int64_t i = begin; i < end; ++i) {
      Tensor out = b.narrow(0, i * kPointwiseBlock, kPointwiseBlock);
      op(out, a.narrow(0, i * kPointwiseBlock, kPointwiseBlock));
    }
  });
  if (rest) {
    Tensor padded = at::zeros({kPointwiseBlock}, src.options()), out = at::empty({kPointwiseBlock}, src.options());
    padded.narrow(0, 0, rest).copy_(a.narrow(0, full * kPointwiseBlock, rest));
    op(out, padded);
    b.narrow(0, full * kPointwiseBlock, rest).copy_(out.narrow(0, 0, rest));
  }
}

template <typename Op>
Tensor pointwise(const Tensor& x, const Op& op) {
  if (!pointwise_dtype(x) || x.numel() == 0) {
    // Stock kernel, whole; integers give the default float dtype as the stock functional does.
    const bool floating = x.is_floating_point() || x.is_complex();
    Tensor out = at::empty({0}, x.options().dtype(floating ? x.scalar_type() : at::get_default_dtype_as_scalartype()));
    return op(out, x);
  }
  const Tensor src = x.is_non_overlapping_and_dense() ? x : x.contiguous();
  Tensor out = at::empty_like(src);  // a dense input's strides kept (channels-last stays channels-last)
  by_blocks(src, out, op);
  return out;
}

template <typename Op>
Tensor& pointwise_(Tensor& x, const Op& op) {
  if (!pointwise_dtype(x) || x.numel() == 0) return op(x, x), x;
  if (x.is_non_overlapping_and_dense()) {
    by_blocks(x, x, op);
  } else {
    x.copy_(pointwise(x, op));
  }
  return x;
}

// The stock out= kernels (never overridden here).
auto silu_into = [](Tensor& out, const Tensor& x) -> Tensor& { return at::silu_out(out, x); };
auto sigmoid_into = [](Tensor& out, const Tensor& x) -> Tensor& { return at::sigmoid_out(out, x); };
auto tanh_into = [](Tensor& out, const Tensor& x) -> Tensor& { return at::tanh_out(out, x); };
auto exp_into = [](Tensor& out, const Tensor& x) -> Tensor& { return at::exp_out(out, x); };
auto log_into = [](Tensor& out, const Tensor& x) -> Tensor& { return at::log_out(out, x); };
auto sin_into = [](Tensor& out, const Tensor& x) -> Tensor& { return at::sin_out(out, x); };
auto cos_into = [](Tensor& out, const Tensor& x) -> Tensor& { return at::cos_out(out, x); };
auto erf_into = [](Tensor& out, const Tensor& x) -> Tensor& { return at::erf_out(out, x); };

Tensor blocked_silu(const Tensor& x) { return pointwise(x, silu_into); }
Tensor& blocked_silu_(Tensor& x) { return pointwise_(x, silu_into); }
Tensor blocked_sigmoid(const Tensor& x) { return pointwise(x, sigmoid_into); }
Tensor& blocked_sigmoid_(Tensor& x) { return pointwise_(x, sigmoid_into); }
Tensor blocked_tanh(const Tensor& x) { return pointwise(x, tanh_into); }
Tensor& blocked_tanh_(Tensor& x) { return pointwise_(x, tanh_into); }
Tensor blocked_exp(const Tensor& x) { return pointwise(x, exp_into); }
Tensor& blocked_exp_(Tensor& x) { return pointwise_(x, exp_into); }
Tensor blocked_log(const Tensor& x) { return pointwise(x, log_into); }
Tensor blocked_sin(const Tensor& x) { return pointwise(x, sin_into); }
Tensor blocked_cos(const Tensor& x) { return pointwise(x, cos_into); }
Tensor blocked_erf(const Tensor& x) { return pointwise(x, erf_into); }

Tensor blocked_gelu(const Tensor& x, c10::string_view approximate) {
  return pointwise(x, [&](Tensor& out, const Tensor& in) -> Tensor& { return at::gelu_out(out, in, approximate); });
}

Tensor& blocked_gelu_(Tensor& x, c10::string_view approximate) {
  return pointwise_(x, [&](Tensor& out, const Tensor& in) -> Tensor& { return at::gelu_out(out, in, approximate); });
}

// --- installation ------------------------------------------------------------------

// One library per dispatch key; destroying it removes its kernels and the stock ones answer again.
std::unique_ptr<torch::Library> g_cpu, g_cuda;

// Replacing stock kernels is the point; the dispatcher warns about exactly that, so that one
// warning is dropped while registering and every other is passed on.
class QuietOverrides : public c10::WarningHandler {
 public:
  explicit QuietOverrides(c10::WarningHandler* next) : next_(next) {}
  void process(const c10::Warning& warning) override {
    if (warning.msg().find("Overriding a previously registered kernel") == std::string::npos) next_->process(warning);
  }

 private:
  c10::WarningHandler* next_;
};

std::string g_error;

}  // namespace

// The C interface native.py loads through ctypes. `ops` is a comma-separated subset of
// mm,addmm,bmm,baddbmm,convolution,group_norm,upsample_nearest2d and the pointwise ops (POINTWISE_OPS in
// native.py); returns 0, or -1 with the reason in
// omniserve_kernels_error().
extern "C" int omniserve_kernels_install(const char* dispatch_key, const char* ops) {
  try {
    const std::string key(dispatch_key), wanted = std::string(",") + ops + ",";
    TORCH_CHECK(key == "CPU" || key == "CUDA", "unsupported dispatch key ", key);
    auto& slot = key == "CPU" ? g_cpu : g_cuda;
    slot.reset();
    auto library = std::make_unique<torch::Library>(torch::Library::IMPL, "aten",
                                                    key == "CPU" ? c10::DispatchKey::CPU : c10::DispatchKey::CUDA,
                                                    __FILE__, __LINE__);
    QuietOverrides quiet(c10::WarningUtils::get_warning_handler());
    c10::WarningUtils::WarningHandlerGuard guard(&quiet);
    auto has = [&](const char* name) { return wanted.find(std::string(",") + name + ",") != std::string::npos; };
    if (has("mm")) library->impl("mm", TORCH_FN(blocked_mm));
    if (has("addmm")) library->impl("addmm", TORCH_FN(blocked_addmm));
    if (has("bmm")) library->impl("bmm", TORCH_FN(blocked_bmm));
    if (has("baddbmm")) library->impl("baddbmm", TORCH_FN(blocked_baddbmm));
    if (has("convolution")) library->impl("convolution", TORCH_FN(blocked_convolution));
    if (has("group_norm")) library->impl("group_norm", TORCH_FN(blocked_group_norm));
    if (has("upsample_nearest2d")) library->impl("upsample_nearest2d", TORCH_FN(blocked_upsample_nearest2d));
#define OMNISERVE_POINTWISE(name)                                              \
  if (has(#name)) library->impl(#name, TORCH_FN(blocked_##name));              \
  if (has(#name "_")) library->impl(#name "_", TORCH_FN(blocked_##name##_));
    OMNISERVE_POINTWISE(silu)
    OMNISERVE_POINTWISE(sigmoid)
    OMNISERVE_POINTWISE(tanh)
    OMNISERVE_POINTWISE(exp)
    OMNISERVE_POINTWISE(gelu)
#undef OMNISERVE_POINTWISE
    if (has("log")) library->impl("log", TORCH_FN(blocked_log));
    if (has("sin")) library->impl("sin", TORCH_FN(blocked_sin));
    if (has("cos")) library->impl("cos", TORCH_FN(blocked_cos));
    if (has("erf")) library->impl("erf", TORCH_FN(blocked_erf));
    slot = std::move(library);
    return 0;
  } catch (const std::exception& err) {
    g_error = err.what();
    return -1;
  }
}

extern "C" void omniserve_kernels_uninstall(const char* dispatch_key) {
  (std::string(dispatch_key) == "CPU" ? g_cpu : g_cuda).reset();
  if (std::string(dispatch_key) == "CPU") g_packed.clear();  // nothing of ours outlives the kernels
}

// The packed-weight cache: `stats` gets hits, packs, uncached packs, entries, bytes, limit. A limit >= 0
// sets it. Returns 1 (every build has the fixed-order GEMM).
extern "C" int omniserve_kernels_packed_weights(int64_t limit, int64_t* stats) {
  if (limit >= 0) g_packed.set_limit(limit);
  g_packed.stats(stats);
  return 1;
}

// The CPU path this library was compiled for: "avx512", "avx2" or "generic".
extern "C" const char* omniserve_kernels_isa() { return kIsa; }

extern "C" const char* omniserve_kernels_error() { return g_error.c_str(); }
