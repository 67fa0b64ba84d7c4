// The kernels' golden cases as raw bytes, for comparing machines (tests/stages/test_aarch64.py): the same source
// runs on x86-64 against this machine's library and on aarch64 under user-mode emulation against the generic path's.
//
//   harness <library> <output directory> [stock]
//
// loads <library> (blocked.cpp compiled for a path), installs its kernels on the CPU key (not with `stock`: the
// control, torch's own kernels), and writes each case's output as <output directory>/<case>.bin. The inputs come from an integer hash, not from torch's random fill (whose
// values follow the CPU's vector width), so both machines compute from the same bits.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <dlfcn.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

namespace {

std::string g_directory;

// Values in [-1, 1) on a 2^-22 grid (exact in float32), from xorshift32, times `scale` plus `shift` (in float32).
at::Tensor values(at::IntArrayRef shape, uint32_t seed, at::ScalarType dtype, float scale = 1, float shift = 0) {
  at::Tensor t = at::empty(shape, at::kFloat);
  float* p = t.data_ptr<float>();
  uint32_t s = seed * 2654435761u + 12345u;
  for (int64_t i = 0; i < t.numel(); ++i) {
    s ^= s << 13;
    s ^= s >> 17;
    s ^= s << 5;
    p[i] = static_cast<float>(static_cast<int32_t>(s >> 9) - (1 << 22)) / static_cast<float>(1 << 22) * scale + shift;
  }
  return t.to(dtype);
}

void write(const std::string& name, const at::Tensor& out) {
  const at::Tensor bytes = out.contiguous();
  std::ofstream file(g_directory + "/" + name + ".bin", std::ios::binary);
  file.write(static_cast<const char*>(bytes.data_ptr()), static_cast<std::streamsize>(bytes.nbytes()));
}

std::string dtype_name(at::ScalarType dtype) { return dtype == at::kFloat ? "float32" : "bfloat16"; }

// The fixed-order GEMM: linear (addmm with a bias row), mm and addmm with beta and alpha, at the shapes of
// tests/stages/test_kernels.py's path comparison, and a batch of sequences through linear.
void gemm(at::ScalarType dtype) {
  const std::vector<std::vector<int64_t>> shapes = {
      {1, 64, 16}, {7, 33, 40}, {9, 128, 96}, {300, 257, 48}, {17, 1024, 1000}, {3, 5, 3}, {1, 3072, 3072}};
  uint32_t seed = 1;
  for (const auto& s : shapes) {
    const int64_t m = s[0], k = s[1], n = s[2];
    const at::Tensor x = values({m, k}, seed++, dtype), w = values({n, k}, seed++, dtype), b = values({n}, seed++, dtype);
    const std::string shape = std::to_string(m) + "x" + std::to_string(k) + "x" + std::to_string(n);
    write("gemm-linear-" + dtype_name(dtype) + "-" + shape, at::linear(x, w, b));
    write("gemm-mm-" + dtype_name(dtype) + "-" + shape, at::mm(x, w.t()));
    write("gemm-addmm-" + dtype_name(dtype) + "-" + shape, at::addmm(b, x, w.t(), 0.5, -2));
  }
  const at::Tensor x = values({2, 7, 33}, seed++, dtype), w = values({40, 33}, seed++, dtype);
  write("gemm-linear-" + dtype_name(dtype) + "-2x7x33x40", at::linear(x, w, values({40}, seed++, dtype)));
}

// group_norm in both layouts, with an affine and without, at the tiny models' and a VAE block's widths.
void group_norm(at::ScalarType dtype) {
  const std::vector<std::vector<int64_t>> shapes = {{2, 32, 8, 8, 8}, {1, 64, 16, 16, 32}, {3, 12, 5, 7, 4},
                                                    {2, 320, 4, 4, 32}, {1, 128, 32, 32, 32}};
  uint32_t seed = 100;
  for (const auto& s : shapes) {
    const int64_t n = s[0], c = s[1], h = s[2], w = s[3], groups = s[4];
    const at::Tensor x = values({n, c, h, w}, seed++, dtype, 3, 0.5);
    const at::Tensor weight = values({c}, seed++, dtype), bias = values({c}, seed++, dtype);
    const std::string shape = std::to_string(n) + "x" + std::to_string(c) + "x" + std::to_string(h) + "x" +
                              std::to_string(w) + "g" + std::to_string(groups);
    for (const bool last : {false, true}) {
      const at::Tensor in = last ? x.contiguous(at::MemoryFormat::ChannelsLast) : x;
      const std::string layout = last ? "-channels-last-" : "-channels-first-";
      write("group-norm" + layout + dtype_name(dtype) + "-" + shape, at::group_norm(in, groups, weight, bias, 1e-5));
      write("group-norm-plain" + layout + dtype_name(dtype) + "-" + shape, at::group_norm(in, groups, {}, {}, 1e-6));
    }
  }
}

// Convolution goes to oneDNN, whose kernels differ by instruction set: written so the difference is measured.
void convolution(at::ScalarType dtype) {
  const at::Tensor x = values({2, 8, 16, 16}, 200, dtype), w = values({16, 8, 3, 3}, 201, dtype);
  write("convolution-" + dtype_name(dtype) + "-2x8x16x16-3x3", at::conv2d(x, w, values({16}, 202, dtype), 1, 1));
}

}  // namespace

int main(int argc, char** argv) {
  const bool stock = argc == 4 && std::string(argv[3]) == "stock";
  if (argc != 3 && !stock) {
    std::fprintf(stderr, "usage: %s <kernel library> <output directory> [stock]\n", argv[0]);
    return 2;
  }
  g_directory = argv[2];
  void* library = dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL);
  if (library == nullptr) {
    std::fprintf(stderr, "cannot load %s: %s\n", argv[1], dlerror());
    return 1;
  }
  auto install = reinterpret_cast<int (*)(const char*, const char*)>(dlsym(library, "omniserve_kernels_install"));
  auto isa = reinterpret_cast<const char* (*)()>(dlsym(library, "omniserve_kernels_isa"));
  auto error = reinterpret_cast<const char* (*)()>(dlsym(library, "omniserve_kernels_error"));
  at::set_num_threads(1);
  if (!stock && install("CPU", "mm,addmm,convolution,group_norm") != 0) {
    std::fprintf(stderr, "installing the kernels failed: %s\n", error());
    return 1;
  }
  for (const auto dtype : {at::kFloat, at::kBFloat16}) {
    gemm(dtype);
    group_norm(dtype);
    convolution(dtype);
  }
  std::printf("%s\n", stock ? "stock" : isa());
  return 0;
}
