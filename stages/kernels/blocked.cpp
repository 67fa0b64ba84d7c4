// Batch-invariant ops by fixed-shape blocking (built and loaded by stages/kernels/native.py).
//
// Stock CPU kernels pick their algorithm (and so their reduction order) from the whole
// tensor shape: MKL uses other GEMM kernels for M < 4 than for M >= 4, ATen convolves a
// lone small sample differently from a batch, channels-last group_norm splits its reduction
// by the batch size. So a sample's result depends on what else is in the batch.
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
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
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
// Per-sample size up to which group_norm takes the stock channels-first kernel.
constexpr int64_t kSmallNormElements = int64_t{1} << 12;
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

// x zero-padded to whole blocks along dim 0, in layout `fmt`, 64-byte aligned (x itself if it
// already is). The layout never follows x's strides: those can depend on the batch (a reshape
// copies or not), and libraries pick their algorithm by layout. With `lines`, every item (slice
// along dim 0) also starts on a 64-byte line, padding the item stride if need be: MKL's result
// for a GEMM row can follow that row's alignment (measured: K=5 rows at different positions
// of one block differ), so no row may sit differently aligned from another.
Tensor canonical(const Tensor& x, int64_t block, MemoryFormat fmt = MemoryFormat::Contiguous, bool lines = false) {
  const int64_t n = x.size(0);
  const int64_t total = (n + block - 1) / block * block;
  const int64_t item = product(x.sizes().slice(1));
  const int64_t line = kLineBytes / static_cast<int64_t>(x.element_size());
  const int64_t stride = lines ? (item + line - 1) / line * line : item;
  if (total == n && stride == item && x.is_contiguous(fmt) && aligned(x)) return x;
  auto shape = x.sizes().vec();
  shape[0] = total;
  if (fmt == MemoryFormat::Contiguous) {
    // One op: zero rows below, zero columns right of each item (the item-stride padding).
    Tensor padded = at::constant_pad_nd(x.reshape({n, item}), {0, stride - item, 0, total - n});
    return stride != item ? padded.narrow(1, 0, item).view(shape) : padded.view(shape);
  }
  Tensor padded = at::empty(shape, x.options().memory_format(fmt));
  padded.narrow(0, 0, n).copy_(x);
  if (total > n) padded.narrow(0, n, total - n).zero_();
  return padded;
}

// One block of a canonical x: a view, or an aligned copy where the view is not aligned.
Tensor block_of(const Tensor& x, int64_t start, int64_t block) {
  Tensor view = x.narrow(0, start, block);
  return aligned(view) ? view : view.clone(at::MemoryFormat::Preserve);
}

// Whether `t` carries one row per item along dim 0 (rather than broadcasting over items).
bool per_row(const Tensor& t, int64_t n) { return t.dim() >= 2 && t.size(0) == n && n != 1; }

// --- matrix products ---------------------------------------------------------------

// mm / addmm as one batched GEMM over fixed-size row blocks: (blocks, rows, k) @ (k, n).
// ATen's batched GEMM computes each matrix of a batch on its own, the same way whatever the
// batch count (measured: 2400 checks, float32 and bfloat16), so every row block is computed
// alike, wherever it sits, while a single call keeps the cost of a stock GEMM.
Tensor gemm(const Tensor& a, const Tensor& b, const Tensor* bias, const c10::Scalar& beta, const c10::Scalar& alpha) {
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  // Small blocks for wide layers (a decode step's few rows pad to little), larger for narrow ones.
  const int64_t rows = block_size(k * n, kGemmMacs, 16, 256);
  Tensor padded = canonical(a, rows, MemoryFormat::Contiguous, true);
  const int64_t count = padded.size(0) / rows;
  Tensor blocks = padded.view({count, rows, k});
  Tensor weight = b.expand({count, k, n});
  Tensor out = at::empty({count, rows, n}, a.options());
  if (bias == nullptr) {
    at::bmm_out(out, blocks, weight);
  } else {
    Tensor rows_bias = *bias;
    if (per_row(rows_bias, m))  // a full bias matrix is cut into the same row blocks
      rows_bias = canonical(rows_bias.expand({m, n}), rows, MemoryFormat::Contiguous, true).view({count, rows, n});
    at::baddbmm_out(out, rows_bias, blocks, weight, beta, alpha);
  }
  return out.view({count * rows, n}).narrow(0, 0, m);
}

Tensor mm(const Tensor& a, const Tensor& b) {
  if (!floating(a) || a.size(0) == 0) {
    Tensor out = at::empty({0}, a.options());
    return at::mm_out(out, a, b);
  }
  return gemm(a, b, nullptr, 1, 1);
}

Tensor addmm(const Tensor& bias, const Tensor& a, const Tensor& b, const c10::Scalar& beta, const c10::Scalar& alpha) {
  if (!floating(a) || a.size(0) == 0) {
    Tensor out = at::empty({0}, a.options());
    return at::addmm_out(out, bias, a, b, beta, alpha);
  }
  return gemm(a, b, &bias, beta, alpha);
}

// Each matrix on its own (see gemm), in one canonical layout with every matrix line-aligned.
Tensor bmm(const Tensor& a, const Tensor& b) {
  Tensor out = at::empty({a.size(0), a.size(1), b.size(2)}, a.options());
  if (!floating(a) || a.size(0) == 0) return at::bmm_out(out, a, b);
  return at::bmm_out(out, canonical(a, 1, MemoryFormat::Contiguous, true), canonical(b, 1, MemoryFormat::Contiguous, true));
}

Tensor baddbmm(const Tensor& bias, const Tensor& a, const Tensor& b, const c10::Scalar& beta, const c10::Scalar& alpha) {
  Tensor out = at::empty({a.size(0), a.size(1), b.size(2)}, a.options());
  if (!floating(a) || a.size(0) == 0) return at::baddbmm_out(out, bias, a, b, beta, alpha);
  Tensor rows_bias = bias;
  if (bias.dim() == 3 && per_row(bias, a.size(0)))
    rows_bias = canonical(bias.expand(out.sizes()), 1, MemoryFormat::Contiguous, true);
  return at::baddbmm_out(out, rows_bias, canonical(a, 1, MemoryFormat::Contiguous, true),
                         canonical(b, 1, MemoryFormat::Contiguous, true), beta, alpha);
}

// --- convolution -------------------------------------------------------------------

// oneDNN directly, always channels-last; fixed blocks of samples for what oneDNN does not take.
//
// ATen's CPU convolution varies with the batch because it picks its backend by batch size
// (im2col for a lone small sample, oneDNN otherwise) and follows the input's layout, which
// itself can follow the batch size. oneDNN computes every output from its own sample in an
// order its kernels fix, whatever the batch: measured over 2400 random layers (channels,
// sizes, kernels, strides, groups, layouts, float32/bfloat16, batch sizes 1-8, every
// position) and pinned in tests/stages/test_kernels.py.
Tensor convolution(const Tensor& input, const Tensor& weight, const std::optional<Tensor>& bias, IntArrayRef stride,
                   IntArrayRef padding, IntArrayRef dilation, bool transposed, IntArrayRef output_padding,
                   int64_t groups) {
  // One layout whatever the activation's strides (they can depend on the batch: a reshape
  // copies or not), and oneDNN's result depends on the layout. Channels-last: oneDNN's faster one here.
  const MemoryFormat fmt = input.dim() == 4   ? MemoryFormat::ChannelsLast
                           : input.dim() == 5 ? MemoryFormat::ChannelsLast3d
                                              : MemoryFormat::Contiguous;
  const bool onednn_takes = !transposed && input.device().is_cpu() &&
                            (input.scalar_type() == at::kFloat || input.scalar_type() == at::kBFloat16) &&
                            input.dim() >= 3 && input.dim() <= 5;
  if (onednn_takes && input.size(0) > 0)
    return at::mkldnn_convolution(input.contiguous(fmt), weight, bias, padding, stride, dilation, groups);

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
  Tensor padded = canonical(input, samples, fmt);
  std::vector<Tensor> blocks;
  for (int64_t start = 0; start < padded.size(0); start += samples) blocks.push_back(stock(block_of(padded, start, samples)));
  Tensor out = blocks.size() == 1 ? blocks[0] : at::cat(blocks);
  return out.narrow(0, 0, input.size(0));
}

// --- group_norm --------------------------------------------------------------------

// aten::group_norm in any layout, each (sample, group) reduced the same way whatever the batch.
//
// The stock kernels differ by layout, and the channels-last one splits its reduction by the
// batch size; activations arrive in either layout depending on the batch. Here every input is
// read as (sample, position, channel) (a view of channels-last memory, one copy otherwise), and
// each channel sums over positions in one fixed order; a group's mean, then its variance around
// that mean, add up its channels' sums (ATen's Welford reduction would be ~50x slower). Small
// samples take the stock kernel on channels-first memory instead (it reduces each (sample,
// group) row on one thread in a fixed order, whatever the batch); the path depends only on the
// per-sample shape, so a layer always takes the same one.
Tensor group_norm(const Tensor& x, int64_t num_groups, const std::optional<Tensor>& weight,
                  const std::optional<Tensor>& bias, double eps, bool /*cudnn_enabled*/) {
  const int64_t n = x.size(0), channels = x.size(1);
  const int64_t positions = product(x.sizes().slice(2));
  if (channels * positions <= kSmallNormElements) {
    Tensor out = std::get<0>(at::native_group_norm(x.contiguous(), weight, bias, n, channels, positions, num_groups, eps));
    return out.contiguous(memory_format(x));
  }
  const int64_t per_group = channels / num_groups;
  const auto compute = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  // (sample, position, channel) in exactly that memory order: contiguous() is a no-op for
  // channels-last memory and a copy otherwise (reshape alone may return a transposed view).
  Tensor rows = x.movedim(1, -1).contiguous().view({n, -1, channels}).to(compute);
  const int64_t count = rows.size(1) * per_group;
  auto group_sum = [&](const Tensor& t) { return t.view({n, num_groups, per_group}).sum(2, /*keepdim=*/true); };
  auto per_channel = [&](const Tensor& t) { return t.expand({n, num_groups, per_group}).reshape({n, channels}).to(compute); };
  // Exact two passes: the group's mean, then the sum of squared deviations from it (a 2-norm
  // over positions per channel, squared), both summed over the group's channels.
  Tensor mean = group_sum(rows.sum(1)) / count;
  Tensor deviations = at::linalg_vector_norm(rows - per_channel(mean).unsqueeze(1), 2, IntArrayRef{1}).square();
  Tensor var = group_sum(deviations) / count;
  Tensor scale = per_channel(at::rsqrt(var + eps));
  if (weight.has_value() && weight->defined()) scale = scale * weight->to(compute);
  Tensor shift = -per_channel(mean) * scale;
  if (bias.has_value() && bias->defined()) shift = shift + bias->to(compute);
  // Normalised in the (sample, position, channel) layout too: elementwise kernels round
  // differently by layout (fused multiply-add or not), so the layout is fixed here as well.
  Tensor out = at::addcmul(shift.unsqueeze(1), rows, scale.unsqueeze(1)).to(x.scalar_type());
  auto shape = x.sizes().vec();
  shape.erase(shape.begin() + 1);
  shape.push_back(channels);
  return out.view(shape).movedim(-1, 1).contiguous(memory_format(x));
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
    if (has("mm")) library->impl("mm", TORCH_FN(mm));
    if (has("addmm")) library->impl("addmm", TORCH_FN(addmm));
    if (has("bmm")) library->impl("bmm", TORCH_FN(bmm));
    if (has("baddbmm")) library->impl("baddbmm", TORCH_FN(baddbmm));
    if (has("convolution")) library->impl("convolution", TORCH_FN(convolution));
    if (has("group_norm")) library->impl("group_norm", TORCH_FN(group_norm));
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
