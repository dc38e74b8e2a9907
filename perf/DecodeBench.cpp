// kmamba-perf-decode: recurrent inference of a mamba2-130m-shaped language model (random weights:
// d_model 768, 24 layers, headdim 64, d_state 128, ngroups 1, vocab 50277 padded to 50288, tied
// head), fp32 weights and states; with --precision bf16 the projections and head multiply bf16
// operands, decode steps reading the model's bf16 copy of the weights.
//
//   kmamba-perf-decode [--space Cuda|OpenMP|Serial] [--small] [--repeats R] [--mixer mamba2|mamba1]
//                      [--precision fp32|tf32|bf16] [--profile-steps N [--profile-batch B] [--kernel-times]]
//
// Cases:
//   decode step b1 / b64   one LanguageModel::decode_step for the whole batch, fenced, median over R
//                          steps after a prefill: the latency per token (b1) and the throughput (b64)
//   generate b1 / b64      kmamba::generate (prefill of the prompt, then decode steps): the prefill
//                          and decode tokens/s of its GenerationStats, with a greedy host sampler (the
//                          logits copied to the host every step), and sampling on the device, greedy
//                          and with temperature 1, top-k 50, top-p 0.9 (the whole loop on the device)
//   prefill                LanguageModel::prefill over (batch, seqlen) tokens: tokens/s
// The floor of a decode step is its bytes over the H200's measured bandwidth (docs/algorithms.md §6.5,
// docs/performance.md §3.4): every weight read once per step (the LM head's real rows included) plus,
// per sequence, the SSM and conv states read and written, all fp32 (the weights 2 bytes each under
// --precision bf16, as the anchors' table counts them). The prefill floor is its FLOPs (projections, SSD, head of the
// last position) over the fp32 FMA rate. On a host the ratio is printed against the same H200 floor, as a reference
// only.
// --small keeps the model and shrinks the batch, prompt and step counts to what a 2-core CPU runs in
// about a minute. --profile-steps N runs only N plain (not recorded) decode steps at batch B (default
// 1) after the prefill and warm-ups, between cudaProfilerStart and cudaProfilerStop on CUDA: under
// `ncu --profile-from-start off` that profiles exactly the kernels of a decode step. With
// --kernel-times those steps also print a per-kernel table (perf/KernelTimes.hpp: every Kokkos
// kernel fenced and timed, the rest of the step as one row).
#include <kmamba/KMamba.hpp>
#include <kmamba/backends/StepGraph.hpp>

#if KMAMBA_ENABLE_CUDA
#include <cuda_profiler_api.h>
#endif

#include "AppRuntime.hpp"
#include "DeviceOption.hpp"
#include "KernelTimes.hpp"
#include "Timing.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

namespace {

// H200 ceilings: measured device copy bandwidth; fp32 FMA rate from docs/performance.md §2.
constexpr double hbm_bytes_per_s = 4.3e12;
constexpr double fp32_flop_per_s = 60e12;

struct Options {
  std::string space, mixer = "mamba2";
  bool small = false;
  int repeats = 20;
  int profile_steps = 0, profile_batch = 1;
  bool kernel_times = false;
  kmamba::MatmulPrecision precision = kmamba::MatmulPrecision::Float32;
};

struct Shapes {
  int batch_large, prompt, new_tokens, prefill_batch, prefill_seqlen;
};

Shapes shapes_for(const Options& o) { return o.small ? Shapes{8, 32, 8, 1, 256} : Shapes{64, 128, 64, 8, 512}; }

kmamba::ModelConfig model_config(const std::string& mixer) {
  kmamba::ModelConfig c;
  KMAMBA_REQUIRE(mixer == "mamba2" || mixer == "mamba1",
                 "kmamba-perf-decode: --mixer must be mamba2 or mamba1, got '" << mixer << "'");
  c.mixer = mixer == "mamba2" ? kmamba::MixerKind::Mamba2 : kmamba::MixerKind::Mamba1;
  c.d_model = 768;
  c.n_layer = 24;
  c.vocab_size = 50277;
  c.pad_vocab_size_multiple = 16;
  c.d_state = mixer == "mamba2" ? 128 : 16;
  c.headdim = 64;
  c.ngroups = 1;
  c.expand = 2;
  c.d_conv = 4;
  c.chunk_size = 256;
  c.tie_embeddings = true;
  c.validate();
  return c;
}

// Bytes a decode step must move and FLOPs it must do (docs/algorithms.md §6.5), fp32 everywhere.
struct StepCost {
  double weight_bytes = 0, state_bytes_per_sequence = 0, flops_per_sequence = 0;
  double bytes(int batch) const { return weight_bytes + batch * state_bytes_per_sequence; }
};

StepCost step_cost(const kmamba::ModelConfig& c, std::size_t parameters, kmamba::MatmulPrecision precision) {
  const double dm = c.d_model, E = c.d_inner(), N = c.d_state, W = c.d_conv, V = c.vocab_size;
  const double padded = c.padded_vocab_size();
  const double GN = c.mixer == kmamba::MixerKind::Mamba2 ? c.ngroups * N : 0;
  const double conv_channels = E + 2 * GN;  // Mamba-2 convolves x, B and C; Mamba-1 x only
  StepCost cost;
  // Every parameter except the embedding's padding rows (the tied head reads its real rows).
  const double read = static_cast<double>(parameters) - (padded - V) * dm;
  // Under bf16 the steps read the model's bf16 copy of the weights (the norms' and conv's weights
  // there too are fp32 and few: counted at 2 bytes with the rest).
  cost.weight_bytes = (precision == kmamba::MatmulPrecision::BFloat16 ? 2.0 : 4.0) * read;
  // The SSM state is E·N per layer for both (Mamba-2: nheads·headdim·N), read and written.
  cost.state_bytes_per_sequence = c.n_layer * 2.0 * 4.0 * (E * N + conv_channels * (W - 1));
  const double matmul = read - V * dm;  // the layers' weights; the head below
  cost.flops_per_sequence =
      2.0 * matmul + 2.0 * V * dm + c.n_layer * (5.0 * E * N + 2.0 * W * conv_channels + 10.0 * E);
  return cost;
}

// FLOPs of a prefill over `tokens` tokens (docs/algorithms.md §6.1, chunk Q): projections and SSD per
// token, the head for the last position of each of `batch` sequences.
double prefill_flops(const kmamba::ModelConfig& c, std::size_t parameters, double tokens, int batch) {
  const double dm = c.d_model, E = c.d_inner(), N = c.d_state, Q = c.chunk_size, G = c.ngroups;
  const double layer_weights = static_cast<double>(parameters) - c.padded_vocab_size() * dm;
  const double scan = c.mixer == kmamba::MixerKind::Mamba2 ? 4 * E * N + Q * E + 2 * Q * G * N : 9 * E * N;
  return tokens * (2.0 * layer_weights + c.n_layer * scan) + batch * 2.0 * c.vocab_size * dm;
}

void report(const char* name, const std::string& shape, double seconds, double tokens, double bytes, double flops) {
  const double floor_s = std::max(bytes / hbm_bytes_per_s, flops / fp32_flop_per_s);
  std::printf("%-22s %-30s %10.3f ms %12.1f tok/s %8.1f GB/s %8.1f GFLOP/s   floor %8.3f ms  x%.1f\n", name,
              shape.c_str(), seconds * 1e3, tokens / seconds, bytes / seconds * 1e-9, flops / seconds * 1e-9,
              floor_s * 1e3, seconds / floor_s);
}

std::vector<std::vector<std::int64_t>> random_prompts(int batch, int length, int vocab) {
  std::vector<std::vector<std::int64_t>> prompts(static_cast<std::size_t>(batch));
  std::uint64_t x = 0x9E3779B97F4A7C15ull;
  for (auto& p : prompts) {
    for (int t = 0; t < length; ++t) {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      p.push_back(static_cast<std::int64_t>(x % static_cast<std::uint64_t>(vocab)));
    }
  }
  return prompts;
}

// The token ids of `prompts` (each `length` long) as a (batch, length) device tensor.
template <class Mem>
kmamba::Tensor2<std::int64_t, Mem> upload_prompts(const char* label,
                                                  const std::vector<std::vector<std::int64_t>>& prompts, int length) {
  const int batch = static_cast<int>(prompts.size());
  auto ids = kmamba::allocate_uninitialized<kmamba::Tensor2<std::int64_t, Mem>>(label, batch, length);
  auto host_ids = Kokkos::create_mirror_view(ids);
  for (int b = 0; b < batch; ++b) {
    for (int t = 0; t < length; ++t) host_ids(b, t) = prompts[b][t];
  }
  Kokkos::deep_copy(ids, host_ids);
  return ids;
}

// A decode state for `prompts`, prefilled, after three warm-up steps (which record the step graph
// when `graph`), with the logits and the next tokens its steps use.
template <class Exec>
struct Prefilled {
  using Mem = typename Exec::memory_space;
  kmamba::DecodeState<Exec> state;
  kmamba::Tensor2<float, Mem> logits;
  kmamba::Tensor1<std::int64_t, Mem> next;

  Prefilled(const Exec& exec, kmamba::LanguageModel<Exec>& model, const std::vector<std::vector<std::int64_t>>& prompts,
            int length, bool graph)
      : state(model.make_decode_state(static_cast<int>(prompts.size()))) {
    const int batch = static_cast<int>(prompts.size());
    state.set_step_graph(graph);
    const auto ids = upload_prompts<Mem>("kmamba::perf::prompt", prompts, length);
    logits = kmamba::allocate_uninitialized<kmamba::Tensor2<float, Mem>>("kmamba::perf::logits", batch,
                                                                         model.config().vocab_size);
    model.prefill(exec, ids, state, logits);
    next = kmamba::allocate<kmamba::Tensor1<std::int64_t, Mem>>("kmamba::perf::next", batch);
    Kokkos::deep_copy(next, 11);
    for (int warm = 0; warm < 3; ++warm) model.decode_step(exec, next, state, logits);
  }
};

// --profile-steps: decode steps at --profile-batch between cudaProfilerStart and Stop.
template <class Exec>
void profile_decode(const Exec& exec, kmamba::LanguageModel<Exec>& model, const Options& o, const Shapes& s) {
  Prefilled<Exec> p(exec, model, random_prompts(o.profile_batch, s.prompt, model.config().vocab_size), s.prompt, false);
  exec.fence();
#if KMAMBA_ENABLE_CUDA
  cudaProfilerStart();
#endif
  {
    std::unique_ptr<kmamba_perf::KernelTimes> kernel_times;
    if (o.kernel_times) kernel_times = std::make_unique<kmamba_perf::KernelTimes>();
    const auto start = std::chrono::steady_clock::now();
    for (int step = 0; step < o.profile_steps; ++step) model.decode_step(exec, p.next, p.state, p.logits);
    exec.fence();
    const double span = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (kernel_times) kernel_times->report(stdout, span, o.profile_steps);
  }
#if KMAMBA_ENABLE_CUDA
  cudaProfilerStop();
#endif
  std::printf("profiled %d decode steps at batch %d\n", o.profile_steps, o.profile_batch);
}

// One generate call per way of sampling: a greedy host sampler, then greedy and top-k/top-p sampling
// on the device.
template <class Exec>
void bench_generate(const Exec& exec, kmamba::LanguageModel<Exec>& model, const Shapes& s,
                    const std::vector<std::vector<std::int64_t>>& prompts) {
  const kmamba::TokenSampler greedy = [](const float* logits, int v, int, const std::vector<std::int64_t>&) {
    return static_cast<std::int64_t>(std::max_element(logits, logits + v) - logits);
  };
  kmamba::SamplingConfig device_greedy;
  device_greedy.temperature = 0.0f;
  kmamba::SamplingConfig device_sampled;
  device_sampled.top_k = 50;
  device_sampled.top_p = 0.9f;
  const int batch = static_cast<int>(prompts.size());
  kmamba::GenerationOptions options;
  options.max_new_tokens = s.new_tokens;
  for (int way = 0; way < 3; ++way) {
    const kmamba::GenerationResult r =
        way == 0 ? kmamba::generate(exec, model, prompts, greedy, options)
                 : kmamba::generate(exec, model, prompts, way == 1 ? device_greedy : device_sampled, options);
    const kmamba::GenerationStats& g = r.stats;
    char shape[96];
    std::snprintf(shape, sizeof shape, "b%d L%d +%d (%s)", batch, static_cast<int>(prompts[0].size()), s.new_tokens,
                  Exec::name());
    const char* how = way == 0 ? "host greedy" : way == 1 ? "device greedy" : "device k50 p0.9";
    std::printf("%-22s %-30s %-16s prefill %.1f tok/s (%.3f s), decode %.1f tok/s (%lld steps, %.3f ms/step)\n",
                batch == 1 ? "generate b1" : "generate batch", shape, how, g.prefill_tokens_per_second(),
                g.prefill_seconds, g.decode_tokens_per_second(), static_cast<long long>(g.decode_steps),
                g.decode_steps > 0 ? g.decode_seconds / static_cast<double>(g.decode_steps) * 1e3 : 0.0);
  }
}

// One decode step at batch 1 and at the large batch, after a prefill of the prompt: recorded as one
// graph (the default; CUDA only) and launched kernel by kernel; then the generation loop.
template <class Exec>
void bench_decode(const Exec& exec, kmamba::LanguageModel<Exec>& model, const Options& o, const Shapes& s,
                  const StepCost& cost) {
  for (const int batch : {1, s.batch_large}) {
    const auto prompts = random_prompts(batch, s.prompt, model.config().vocab_size);
    char shape[96];
    for (const bool graph : {true, false}) {
      if (!graph && !kmamba::StepGraph<Exec>::records) continue;
      Prefilled<Exec> p(exec, model, prompts, s.prompt, graph);
      const double t =
          kmamba_perf::median_seconds(exec, o.repeats, [&] { model.decode_step(exec, p.next, p.state, p.logits); });
      std::snprintf(shape, sizeof shape, "b%d after %d tokens (%s)", batch, s.prompt, Exec::name());
      const std::string name = std::string(batch == 1 ? "decode step b1" : "decode step batch") +
                               (kmamba::StepGraph<Exec>::records ? (graph ? " graph" : " kernels") : "");
      report(name.c_str(), shape, t, batch, cost.bytes(batch), batch * cost.flops_per_sequence);
      if (graph && kmamba::StepGraph<Exec>::records)
        std::printf("  step graph: %s\n", p.state.step_graph_status().c_str());
    }
    bench_generate(exec, model, s, prompts);
  }
}

// Prefill throughput.
template <class Exec>
void bench_prefill(const Exec& exec, kmamba::LanguageModel<Exec>& model, const Options& o, const Shapes& s) {
  using Mem = typename Exec::memory_space;
  const kmamba::ModelConfig& config = model.config();
  const std::size_t parameters = model.parameters().size();
  auto state = model.make_decode_state(s.prefill_batch);
  const auto ids =
      upload_prompts<Mem>("kmamba::perf::prefill_ids",
                          random_prompts(s.prefill_batch, s.prefill_seqlen, config.vocab_size), s.prefill_seqlen);
  auto logits = kmamba::allocate_uninitialized<kmamba::Tensor2<float, Mem>>("kmamba::perf::prefill_logits",
                                                                            s.prefill_batch, config.vocab_size);
  const int repeats = std::max(1, std::min(o.repeats, 5));
  const double t = kmamba_perf::median_seconds(exec, repeats, [&] {
    state.reset(exec);
    model.prefill(exec, ids, state, logits);
  });
  const double tokens = static_cast<double>(s.prefill_batch) * s.prefill_seqlen;
  char shape[96];
  std::snprintf(shape, sizeof shape, "b%d L%d (%s)", s.prefill_batch, s.prefill_seqlen, Exec::name());
  report("prefill", shape, t, tokens, 4.0 * static_cast<double>(parameters),
         prefill_flops(config, parameters, tokens, s.prefill_batch));
}

template <class Exec>
void run_space(const Options& o) {
  const Exec exec;
  const Shapes s = shapes_for(o);
  const kmamba::ModelConfig config = model_config(o.mixer);
  kmamba::LanguageModel<Exec> model(config);
  model.initialize(1);
  model.set_matmul_precision(o.precision);
  const std::size_t parameters = model.parameters().size();
  const StepCost cost = step_cost(config, parameters, o.precision);
  std::printf(
      "model: %s, d_model %d, %d layers, d_state %d, vocab %d (padded %d), %.1f M parameters (fp32 %.0f MB), "
      "state %.1f MB per sequence (fp32, conv included), projections in %s\n",
      kmamba::mixer_name(config.mixer), config.d_model, config.n_layer, config.d_state, config.vocab_size,
      config.padded_vocab_size(), parameters * 1e-6, parameters * 4e-6, cost.state_bytes_per_sequence / 2 * 1e-6,
      kmamba::matmul_precision_name(o.precision));
  std::printf("%-22s %-30s %13s %18s %13s %16s   %s\n", "case", "shape", "median", "throughput", "bandwidth",
              "arithmetic", "H200 floor and ratio");
  if (o.profile_steps > 0) {
    profile_decode(exec, model, o, s);
    return;
  }
  bench_decode(exec, model, o, s, cost);
  bench_prefill(exec, model, o, s);
}

const char* const description =
    "Recurrent inference of a mamba2-130m-shaped language model: decode latency (batch 1), throughput\n"
    "(batch 64), prefill tokens/s (see the head of perf/DecodeBench.cpp).";

void declare(CLI::App& cli, Options& o) {
  kmamba::app::add_space_option(cli, o.space, "the execution space (default: the build's default)");
  cli.add_flag("--small", o.small,
               "batch 8 instead of 64, prompt 32, 8 new tokens, prefill 1x256 (a 2-core CPU); default: batch 1 and "
               "64, prompt 128, 64 new tokens, prefill 8x512");
  kmamba::app::add_integer(cli, "--repeats", o.repeats, 1, 1000000,
                           "timed decode steps; the median is reported (default 20)", "R");
  cli.add_option("--mixer", o.mixer, "mamba2 or mamba1 (default mamba2)")
      ->type_name("NAME")
      ->check(kmamba::app::one_of({"mamba2", "mamba1"}));
  kmamba::app::add_integer(
      cli, "--profile-steps", o.profile_steps, 1, 1000000,
      "only N plain decode steps at --profile-batch, inside cudaProfilerStart/Stop on CUDA (for ncu "
      "--profile-from-start off)");
  kmamba::app::add_integer(cli, "--profile-batch", o.profile_batch, 1, 1000000,
                           "the batch of --profile-steps (default 1)", "B");
  cli.add_flag("--kernel-times", o.kernel_times,
               "with --profile-steps: every Kokkos kernel of those steps fenced and timed, a table");
  cli.add_option_function<std::string>(
         "--precision", [&o](const std::string& p) { o.precision = kmamba::parse_matmul_precision(p, "--precision"); },
         "the projections' and head's arithmetic (default fp32; bf16 decodes from a bf16 copy of the weights, half "
         "the bytes)")
      ->type_name("P")
      ->check(kmamba::app::one_of({"fp32", "tf32", "bf16"}));
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  const auto body = [&](kmamba::app::Runtime&) {
    kmamba::print_configuration(std::cout);
    kmamba::app::on_space(o.space, [&](auto exec) { run_space<decltype(exec)>(o); });
    return kmamba::app::exit_done;
  };
  return kmamba::app::run_tool(argc, argv,
                               {"kmamba-perf-decode", description, [&](CLI::App& cli) { declare(cli, o); }, {}, body});
}
