// kmamba-perf-train: training throughput of a mamba2-130m-shaped language model (random weights:
// d_model 768, 24 layers, headdim 64, d_state 128, ngroups 1, chunk 256, vocab 50277 padded to
// 50288, tied head) on random tokens: optimizer steps (forward, backward, global-norm clipping,
// AdamW) of batch × seqlen tokens through kmamba::Trainer, with the projection GEMMs in the
// precision of --precision (LanguageModel::set_matmul_precision: fp32 by default; bf16 / tf32
// multiply rounded operands on the tensor cores on CUDA, and tf32 runs the SSD chunk products in
// TF32 too; host backends emulate the rounding, no faster).
//
//   kmamba-perf-train [--space Cuda|OpenMP|Serial] [--small] [--batch B] [--seqlen L] [--steps S]
//                     [--precision fp32|tf32|bf16]
//
// Reports the median step time, tokens/s and the model FLOP rate: 6·N per token (N parameters, the
// tied head counted once) plus the SSD's chunked products (per token and layer, forward:
// 2·Q·N·G for C·Bᵀ, 2·Q·P·H for the intra-chunk outputs, 4·N·P·H for the chunk states and their
// contribution to the outputs; ×3 for forward + backward), as a fraction of the H200's dense bf16
// tensor-core peak (989 TFLOP/s: the MFU convention of perf-anchors.md §2) and of its fp32 FMA
// peak (67 TFLOP/s, the ceiling of fp32 GEMMs). --small shrinks the model (4 layers,
// d_model 256) and the batch for a 2-core CPU.
#include <kmamba/KMamba.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <iostream>
#include <string>
#include <vector>

namespace {

constexpr double bf16_peak_flop_per_s = 989e12;
constexpr double fp32_peak_flop_per_s = 67e12;

struct Options {
  std::string space;
  bool small = false;
  int batch = 0, seqlen = 0, steps = 0;
  kmamba::MatmulPrecision precision = kmamba::MatmulPrecision::Float32;
};

kmamba::ModelConfig model_config(bool small) {
  kmamba::ModelConfig c;
  c.mixer = kmamba::MixerKind::Mamba2;
  c.d_model = small ? 256 : 768;
  c.n_layer = small ? 4 : 24;
  c.vocab_size = 50277;
  c.pad_vocab_size_multiple = 16;
  c.d_state = 128;
  c.headdim = 64;
  c.ngroups = 1;
  c.chunk_size = small ? 64 : 256;
  c.tie_embeddings = true;
  c.validate();
  return c;
}

double ssd_flops_per_token(const kmamba::ModelConfig& c) {
  const double Q = c.chunk_size, N = c.d_state, G = c.ngroups, P = c.headdim, H = c.num_heads();
  return 3.0 * c.n_layer * (2 * Q * N * G + 2 * Q * P * H + 4 * N * P * H);
}

kmamba::TokenBatch random_batch(int batch, int seqlen, int vocab, std::uint64_t seed) {
  kmamba::TokenBatch b;
  b.ids = kmamba::Tensor2<std::int64_t, Kokkos::HostSpace>("kmamba::perf::ids", batch, seqlen);
  b.targets = kmamba::Tensor2<std::int64_t, Kokkos::HostSpace>("kmamba::perf::targets", batch, seqlen);
  std::uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  std::vector<std::int64_t> row(static_cast<std::size_t>(seqlen) + 1);
  for (int i = 0; i < batch; ++i) {
    for (auto& t : row) {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      t = static_cast<std::int64_t>(x % static_cast<std::uint64_t>(vocab));
    }
    for (int t = 0; t < seqlen; ++t) {
      b.ids(i, t) = row[static_cast<std::size_t>(t)];
      b.targets(i, t) = row[static_cast<std::size_t>(t) + 1];
    }
  }
  return b;
}

template <class Exec>
void run_space(const Options& o) {
  const Exec exec;
  const kmamba::ModelConfig config = model_config(o.small);
  const int batch = o.batch > 0 ? o.batch : (o.small ? 2 : 8);
  const int seqlen = o.seqlen > 0 ? o.seqlen : (o.small ? 256 : 2048);
  const int steps = o.steps > 0 ? o.steps : (o.small ? 3 : 10);
  kmamba::LanguageModel<Exec> model(config);
  model.initialize(1);
  model.set_matmul_precision(o.precision);
  const double parameters = static_cast<double>(model.parameters().size());
  kmamba::TrainConfig train;
  train.batch_size = batch;
  train.total_steps = steps + 1;
  train.warmup_steps = 0;
  kmamba::Trainer<Exec> trainer(std::move(model), train, nullptr, exec);
  const double tokens = static_cast<double>(batch) * seqlen;
  const double flops_per_token = 6.0 * parameters + ssd_flops_per_token(config);
  std::printf("model: Mamba2, d_model %d, %d layers, d_state %d, headdim %d, chunk %d, vocab %d, %.1f M parameters; "
              "batch %d x seqlen %d, %s, %s projections\n",
              config.d_model, config.n_layer, config.d_state, config.headdim, config.chunk_size, config.vocab_size,
              parameters * 1e-6, batch, seqlen, Exec::name(), kmamba::matmul_precision_name(o.precision));
  std::printf("model FLOPs per token: 6N = %.3g + SSD %.3g = %.3g\n", 6.0 * parameters, ssd_flops_per_token(config),
              flops_per_token);
  std::vector<double> times;
  double loss = 0.0;
  for (int s = 0; s <= steps; ++s) {
    const std::vector<kmamba::TokenBatch> micro = {random_batch(batch, seqlen, config.vocab_size, 7 + s)};
    exec.fence();
    const auto start = std::chrono::steady_clock::now();
    const kmamba::StepResult r = trainer.step(micro);
    exec.fence();
    const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    loss = r.loss;
    std::printf("step %d: %.3f s, loss %.4f%s\n", s, t, r.loss, s == 0 ? " (warm-up, not counted)" : "");
    if (s > 0) times.push_back(t);
  }
  std::sort(times.begin(), times.end());
  const double median = times[times.size() / 2];
  const double rate = flops_per_token * tokens / median;
  std::printf("%-14s %-30s %10.1f ms/step %12.0f tok/s %10.2f TFLOP/s   MFU %.2f%% (bf16 peak), %.1f%% of fp32 peak"
              "   last loss %.4f\n",
              "train step",
              (std::to_string(batch) + "x" + std::to_string(seqlen) + " (" + Exec::name() + ", " +
               kmamba::matmul_precision_name(o.precision) + ")")
                  .c_str(),
              median * 1e3, tokens / median, rate * 1e-12, 100.0 * rate / bf16_peak_flop_per_s,
              100.0 * rate / fp32_peak_flop_per_s, loss);
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      std::printf(
          "usage: kmamba-perf-train [--space Cuda|OpenMP|Serial] [--small] [--batch B] [--seqlen L] [--steps S]\n"
          "                         [--precision fp32|tf32|bf16]\n"
          "  default: mamba2-130m shape, batch 8 x seqlen 2048, 10 timed steps after one warm-up step\n"
          "  --small: d_model 256, 4 layers, chunk 64, batch 2 x 256, 3 steps (a 2-core CPU)\n"
          "  --precision: the projection GEMMs' arithmetic (default fp32; bf16/tf32 use the tensor cores on CUDA,\n"
          "    tf32 also the SSD chunk products; emulated, no faster, on host backends)\n");
      return 0;
    }
  }
  Kokkos::ScopeGuard kokkos(argc, argv);
  try {
    Options o;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      auto value = [&]() -> std::string {
        KMAMBA_REQUIRE(i + 1 < argc, "kmamba-perf-train: " << a << " needs a value");
        return argv[++i];
      };
      if (a == "--space") o.space = value();
      else if (a == "--small") o.small = true;
      else if (a == "--batch") o.batch = std::max(1, std::atoi(value().c_str()));
      else if (a == "--seqlen") o.seqlen = std::max(2, std::atoi(value().c_str()));
      else if (a == "--steps") o.steps = std::max(1, std::atoi(value().c_str()));
      else if (a == "--precision") o.precision = kmamba::parse_matmul_precision(value(), "kmamba-perf-train: --precision");
      else if (a.rfind("--kokkos-", 0) != 0) KMAMBA_USER_ERROR("kmamba-perf-train: unknown argument '" << a << "'");
    }
    kmamba::print_configuration(std::cout);
    const std::string space = o.space.empty() ? Kokkos::DefaultExecutionSpace::name() : o.space;
    bool ran = false;
#if KMAMBA_ENABLE_CUDA
    if (space == "Cuda") run_space<Kokkos::Cuda>(o), ran = true;
#endif
#if KMAMBA_HAS_OPENMP
    if (space == "OpenMP") run_space<Kokkos::OpenMP>(o), ran = true;
#endif
#if KMAMBA_HAS_SERIAL
    if (space == "Serial") run_space<Kokkos::Serial>(o), ran = true;
#endif
    KMAMBA_REQUIRE(ran, "kmamba-perf-train: --space " << space << " is not in this build");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}
