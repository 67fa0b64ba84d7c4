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

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <numeric>
#include <cstdint>
#include <memory>
#include <string>

namespace {

using at::IntArrayRef;
using at::Tensor;
using c10::MemoryFormat;

// Work per library call (multiply-adds) at which a call's fixed cost stops mattering. Blocks
// hold as many items as make about this much work; more would only pad small batches.
constexpr int64_t kGemmMacs = int64_t{1} << 18;
constexpr int64_t kConvMacs = int64_t{1} << 21;
constexpr int64_t kLineBytes = 64;

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

Tensor blocked_mm(const Tensor& a, const Tensor& b) {
  if (!floating(a) || a.size(0) == 0) {
    Tensor out = at::empty({0}, a.options());
    return at::mm_out(out, a, b);
  }
  return gemm(a, b, nullptr, 1, 1);
}

Tensor blocked_addmm(const Tensor& bias, const Tensor& a, const Tensor& b, const c10::Scalar& beta, const c10::Scalar& alpha) {
  if (!floating(a) || a.size(0) == 0) {
    Tensor out = at::empty({0}, a.options());
    return at::addmm_out(out, bias, a, b, beta, alpha);
  }
  return gemm(a, b, &bias, beta, alpha);
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

// oneDNN directly, always channels-first; fixed blocks of samples for what oneDNN does not take.
//
// ATen's CPU convolution varies with the batch because it picks its backend by batch size
// (im2col for a lone small sample, oneDNN otherwise) and follows the input's layout, which
// itself can follow the batch size. oneDNN computes every output from its own sample in an
// order its kernels fix, whatever the batch: measured over 2400 random layers (channels,
// sizes, kernels, strides, groups, layouts, float32/bfloat16, batch sizes 1-8, every
// position) and pinned in tests/stages/test_kernels.py.
Tensor blocked_convolution(const Tensor& input, const Tensor& weight, const std::optional<Tensor>& bias, IntArrayRef stride,
                   IntArrayRef padding, IntArrayRef dilation, bool transposed, IntArrayRef output_padding,
                   int64_t groups) {
  // One layout whatever the activation's strides (they can depend on the batch: a reshape
  // copies or not), and oneDNN's result depends on the layout. Channels-first: what the stock
  // path gives diffusers models, and what group_norm, which usually follows, needs (below).
  const bool onednn_takes = !transposed && input.device().is_cpu() &&
                            (input.scalar_type() == at::kFloat || input.scalar_type() == at::kBFloat16) &&
                            input.dim() >= 3 && input.dim() <= 5;
  if (onednn_takes && input.size(0) > 0)
    return at::mkldnn_convolution(input.contiguous(), weight, bias, padding, stride, dilation, groups);

  auto stock = [&](const Tensor& x) {
    // Fixed algorithm choice (no benchmarking, deterministic, no TF32), whatever the user set.
    return at::_convolution(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups,
                            /*benchmark=*/false, /*deterministic=*/true, at::globalContext().userEnabledCuDNN(),
                            /*allow_tf32=*/false);
  };
  if (input.dim() < 3 || !floating(input) || input.size(0) == 0) return stock(input);
  const int64_t positions = product(input.sizes().slice(2)) / std::max<int64_t>(product(stride), 1);
  const int64_t work = weight.size(0) * product(weight.sizes().slice(1)) * positions;  // multiply-adds per sample
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

// aten::group_norm in any layout, each (sample, group) reduced the same way whatever the batch.
//
// The stock kernels differ by layout, and the channels-last one splits its reduction by the
// batch size; activations arrive in either layout depending on the batch. The channels-first
// kernel reduces each (sample, group) row on one thread in an order fixed by the row's length
// (measured: 0 of 300 random shapes, batch sizes 2-8, float32/bfloat16, differ), so every input
// goes through it: as it is when channels-first (the convolution above makes it so), copied
// otherwise, and the result is returned in the caller's layout.
Tensor blocked_group_norm(const Tensor& x, int64_t num_groups, const std::optional<Tensor>& weight,
                          const std::optional<Tensor>& bias, double eps, bool /*cudnn_enabled*/) {
  const int64_t n = x.size(0), channels = x.size(1);
  const int64_t positions = product(x.sizes().slice(2));
  Tensor out = std::get<0>(at::native_group_norm(x.contiguous(), weight, bias, n, channels, positions, num_groups, eps));
  return out.contiguous(memory_format(x));
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
// mm,addmm,bmm,baddbmm,convolution,group_norm; returns 0, or -1 with the reason in
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
    slot = std::move(library);
    return 0;
  } catch (const std::exception& err) {
    g_error = err.what();
    return -1;
  }
}

extern "C" void omniserve_kernels_uninstall(const char* dispatch_key) {
  (std::string(dispatch_key) == "CPU" ? g_cpu : g_cuda).reset();
}

extern "C" const char* omniserve_kernels_error() { return g_error.c_str(); }
