// kmamba-perf-train: training throughput of a mamba2-130m-shaped language model (random weights:
// d_model 768, 24 layers, headdim 64, d_state 128, ngroups 1, chunk 256, vocab 50277 padded to
// 50288, tied head; --mixer mamba3: the Mamba-3 SISO layers of that shape with chunk 64, --mixer
// mamba1: mamba-130m's Mamba-1 layers, d_state 16) on random tokens: optimizer steps (forward, backward, global-norm clipping,
// AdamW) of batch × seqlen tokens through kmamba::Trainer, with the projection GEMMs in the
// precision of --precision (LanguageModel::set_matmul_precision: fp32 by default; bf16 / tf32
// multiply rounded operands on the tensor cores on CUDA, and tf32 runs the SSD chunk products in
// TF32 too; host backends emulate the rounding, no faster).
//
//   kmamba-perf-train [--space Cuda|OpenMP|Serial] [--mixer mamba1|mamba2|mamba3] [--preset 130m|370m] [--small] [--batch B] [--seqlen L]
//                     [--steps S] [--ngroups G] [--chunk Q] [--activation-checkpointing] [--json FILE]
//                     [--precision fp32|tf32|bf16] [--kernel-times K]
//   mpirun -np N kmamba-perf-train ... [--dp D] [--tp T] [--sp C] [--zero 0|1] [--comm-steps K]
//
// Reports the median step time, tokens/s and the model FLOP rate: 6·N per token (N parameters, the
// tied head counted once) plus the SSD's chunked products (per token and layer, forward:
// 2·Q·N·G for C·Bᵀ, 2·Q·P·H for the intra-chunk outputs, 4·N·P·H for the chunk states and their
// contribution to the outputs; ×3 for forward + backward), as a fraction of the H200's dense bf16
// tensor-core peak (989 TFLOP/s: the MFU convention of docs/performance.md §2) and of its fp32 FMA
// peak (67 TFLOP/s, the ceiling of fp32 GEMMs). --small shrinks the model (4 layers,
// d_model 256) and the batch for a 2-core CPU; --preset 370m is mamba2-370m's shape (d_model 1024,
// 48 layers, vocab padded to 50280). Peak memory: the high-water mark of the live Kokkos allocations
// in the execution space's memory during the timed steps (parameters, gradients, AdamW moments,
// activations; not the buffers NCCL or cuBLAS keep for themselves).
//
// Under mpirun (or with a mesh option) the model trains on a dp × tp × sp process mesh built as
// kmamba-train builds it (NCCL for device memory, MPI for host memory; one GPU per rank, the
// rank's node-local one), through the communication audit (CountingCommunicator): each rank
// trains `batch` sequences of `seqlen` tokens per data-parallel group (tensor ranks share them,
// sequence ranks split them), so the global batch is dp · batch · seqlen tokens. After the timed
// steps, --comm-steps more steps run with the audit timing every collective (fenced before and
// after, which serialises communication with compute): the report gives per axis and operation the
// calls, bytes and time per step, and the communication share of those steps' time. tokens/s and MFU
// count the whole mesh (MFU over world-size GPUs).
#include <kmamba/KMamba.hpp>
#include <kmamba/parallel/ProcessMesh.hpp>

#if KMAMBA_ENABLE_MPI
#include <kmamba/parallel/CountingCommunicator.hpp>
#include <kmamba/parallel/Mpi.hpp>
#include <kmamba/parallel/MpiCommunicator.hpp>
#if KMAMBA_ENABLE_NCCL
#include <kmamba/parallel/NcclCommunicator.hpp>
#endif
#include <mpi.h>
#endif

#include <nlohmann/json.hpp>

#include "KernelTimes.hpp"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace {

constexpr double bf16_peak_flop_per_s = 989e12;
constexpr double fp32_peak_flop_per_s = 67e12;

struct Options {
  std::string space, preset = "130m", json;
  kmamba::MixerKind mixer = kmamba::MixerKind::Mamba2;
  bool small = false;
  int batch = 0, seqlen = 0, steps = 0;
  kmamba::MeshConfig mesh;
  bool mesh_given = false;
  int zero_stage = 0, comm_steps = 2, kernel_time_steps = 0;
  int ngroups = 1;
  int chunk = 0;  // the SSD's chunk length; 0: the preset's (256, --small 64)
  bool activation_checkpointing = false;
  kmamba::MatmulPrecision precision = kmamba::MatmulPrecision::Float32;
};

kmamba::ModelConfig model_config(const Options& o) {
  kmamba::ModelConfig c;
  c.mixer = o.mixer;
  const bool large = o.preset == "370m";
  c.d_model = o.small ? 256 : large ? 1024 : 768;
  c.n_layer = o.small ? 4 : large ? 48 : 24;
  c.vocab_size = 50277;
  c.pad_vocab_size_multiple = large ? 8 : 16;
  c.d_state = o.mixer == kmamba::MixerKind::Mamba1 ? 16 : 128;
  c.headdim = 64;
  c.ngroups = o.ngroups;
  const int preset_chunk = o.small || o.mixer == kmamba::MixerKind::Mamba3 ? 64 : 256;
  c.chunk_size = o.chunk > 0 ? o.chunk : preset_chunk;
  c.tie_embeddings = true;
  c.validate();
  return c;
}

// The high-water mark of the live Kokkos allocations in one memory space, from the tools callbacks.
std::string tracked_space;
std::int64_t live_bytes = 0, peak_bytes = 0, allocations = 0, allocated_bytes = 0;
// Per View label: (allocations, bytes) over the timed steps.
std::map<std::string, std::pair<std::int64_t, std::int64_t>> allocations_by_label;

extern "C" void on_allocate(Kokkos_Profiling_SpaceHandle space, const char* label, const void*, std::uint64_t size) {
  if (tracked_space != space.name) return;
  live_bytes += static_cast<std::int64_t>(size);
  ++allocations;
  allocated_bytes += static_cast<std::int64_t>(size);
  auto& tally = allocations_by_label[label];
  ++tally.first;
  tally.second += static_cast<std::int64_t>(size);
  peak_bytes = std::max(peak_bytes, live_bytes);
}
extern "C" void on_deallocate(Kokkos_Profiling_SpaceHandle space, const char*, const void*, std::uint64_t size) {
  if (tracked_space == space.name) live_bytes -= static_cast<std::int64_t>(size);
}

bool mpi_running = false;

// The scans' FLOPs per token, forward + backward (×3 of the forward): the chunked products for
// Mamba-2 and Mamba-3 (C·Bᵀ, the intra-chunk outputs, the chunk states and their outputs), and for
// Mamba-1's recurrence a state update and an output term per state and channel (≈ 9·N·E).
double ssd_flops_per_token(const kmamba::ModelConfig& c) {
  if (c.mixer == kmamba::MixerKind::Mamba1) return 3.0 * c.n_layer * 9.0 * c.d_state * c.d_inner();
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
  tracked_space = Exec::memory_space::name();
  Kokkos::Tools::Experimental::set_allocate_data_callback(on_allocate);
  Kokkos::Tools::Experimental::set_deallocate_data_callback(on_deallocate);
  const kmamba::ModelConfig config = model_config(o);
  const int batch = o.batch > 0 ? o.batch : (o.small ? 2 : 8);
  const int seqlen = o.seqlen > 0 ? o.seqlen : (o.small ? 256 : 2048);
  const int steps = o.steps > 0 ? o.steps : (o.small ? 3 : 10);
  kmamba::LanguageModel<Exec> model(config);
  model.initialize(1);
  model.set_matmul_precision(o.precision);
  const double parameters = static_cast<double>(model.parameters().size());
  kmamba::TrainConfig train;
  train.batch_size = batch;
  train.total_steps = steps + o.comm_steps + o.kernel_time_steps + 1;
  train.warmup_steps = 0;
  int world_size = 1, data_rank = 0, data_size = 1;
  bool root = true;
#if KMAMBA_ENABLE_MPI
  // The mesh as kmamba-train builds it, its world communicator wrapped by the audit.
  std::shared_ptr<kmamba::CommunicationLog> log;
  std::unique_ptr<kmamba::ProcessMesh> mesh;
  if (mpi_running) {
    MPI_Comm_size(MPI_COMM_WORLD, &world_size);
    const kmamba::MeshConfig resolved = o.mesh.resolve(world_size);
    kmamba::check_mesh_fits_model(resolved, config);
    // Device memory travels through NCCL (one GPU per rank); host memory through MPI.
    std::unique_ptr<kmamba::Communicator> world;
#if KMAMBA_ENABLE_NCCL
    if (!Kokkos::SpaceAccessibility<Kokkos::HostSpace, typename Exec::memory_space>::accessible) {
      world = std::make_unique<kmamba::NcclCommunicator>(MPI_COMM_WORLD);
    }
#endif
    if (!world) world = std::make_unique<kmamba::MpiCommunicator>(MPI_COMM_WORLD);
    log = std::make_shared<kmamba::CommunicationLog>();
    mesh = std::make_unique<kmamba::ProcessMesh>(std::make_unique<kmamba::CountingCommunicator>(std::move(world), log),
                                                 resolved);
    root = mesh->world().rank() == 0;
    data_rank = mesh->coordinates().dp;
    data_size = mesh->config().data_parallel_size;
    if (mesh->config().tensor_parallel_size > 1 || mesh->config().sequence_parallel_size > 1) {
      kmamba::LanguageModel<Exec> local(config, {&mesh->tensor(), &mesh->sequence()});
      kmamba::scatter_parameters(exec, model, local);
      model = std::move(local);
    }
  }
#endif
  model.set_activation_checkpointing(o.activation_checkpointing);
  kmamba::Trainer<Exec> trainer(std::move(model), train, nullptr, exec);
#if KMAMBA_ENABLE_MPI
  if (mesh) trainer.enable_data_parallel(*mesh, kmamba::DataParallelConfig{o.zero_stage, 0});
#endif
  // The slowest rank's value, through MPI directly so that the audit does not count it.
  auto slowest = [&](double value) {
#if KMAMBA_ENABLE_MPI
    if (mpi_running) MPI_Allreduce(MPI_IN_PLACE, &value, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
#endif
    return value;
  };
  const double global_tokens = static_cast<double>(data_size) * batch * seqlen;
  const double flops_per_token = 6.0 * parameters + ssd_flops_per_token(config);
  if (root) {
    std::printf("model: %s, d_model %d, %d layers, d_state %d, headdim %d, ngroups %d, chunk %d, vocab %d (padded "
                "%d), %.1f M parameters; batch %d x seqlen %d per data-parallel group, %s, %s projections\n",
                kmamba::mixer_name(config.mixer), config.d_model, config.n_layer, config.d_state, config.headdim, config.ngroups, config.chunk_size,
                config.vocab_size,
                config.padded_vocab_size(), parameters * 1e-6, batch, seqlen, Exec::name(),
                kmamba::matmul_precision_name(o.precision));
    std::printf("model FLOPs per token: 6N = %.3g + SSD %.3g = %.3g\n", 6.0 * parameters,
                ssd_flops_per_token(config), flops_per_token);
#if KMAMBA_ENABLE_MPI
    if (mesh) {
      std::printf("mesh: %d ranks = dp %d x tp %d x sp %d, %s transport, ZeRO stage %d\n", world_size, data_size,
                  mesh->config().tensor_parallel_size, mesh->config().sequence_parallel_size,
                  mesh->world().transport(), o.zero_stage);
    }
#endif
  }
  std::vector<double> times;
  double loss = 0.0;
  auto run_step = [&](int s) {
    // Each data-parallel group trains its own batch; its tensor and sequence ranks share it.
    const std::vector<kmamba::TokenBatch> micro = {
        random_batch(batch, seqlen, config.vocab_size, 7 + static_cast<std::uint64_t>(s) * 1009 + data_rank)};
    exec.fence();
    const auto start = std::chrono::steady_clock::now();
    const kmamba::StepResult r = trainer.step(micro);
    exec.fence();
    loss = r.loss;
    return slowest(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  };
  for (int s = 0; s <= steps; ++s) {
    if (s == 1) {
      peak_bytes = live_bytes;  // the high-water mark of the timed steps
      allocations = allocated_bytes = 0;
      allocations_by_label.clear();
    }
#if KMAMBA_ENABLE_MPI
    if (log && s == 1) log->clear();
#endif
    const double t = run_step(s);
    if (root) std::printf("step %d: %.3f s, loss %.4f%s\n", s, t, loss, s == 0 ? " (warm-up, not counted)" : "");
    if (s > 0) times.push_back(t);
  }
  std::sort(times.begin(), times.end());
  const double median = times[times.size() / 2];
  const double rate = flops_per_token * global_tokens / median;
  const double peak_memory = static_cast<double>(slowest(static_cast<double>(peak_bytes)));
  const double mfu = rate / (world_size * bf16_peak_flop_per_s);
  if (root) {
    std::printf("%-14s %-30s %10.1f ms/step %12.0f tok/s %10.2f TFLOP/s   MFU %.2f%% (bf16 peak), %.1f%% of fp32 peak"
                "   peak memory %.3f GB   last loss %.4f\n",
                "train step",
                (std::to_string(batch) + "x" + std::to_string(seqlen) + " (" + Exec::name() + ", " +
                 kmamba::matmul_precision_name(o.precision) + ")")
                    .c_str(),
                median * 1e3, global_tokens / median, rate * 1e-12, 100.0 * mfu,
                100.0 * rate / (world_size * fp32_peak_flop_per_s), peak_memory * 1e-9, loss);
  }
  if (root) {
    // Device allocations are synchronous (a release waits for the device), so their count per step
    // bounds how often the step drains the launch queue.
    std::printf("allocations per step: %.1f (%.3f GB) in %s\n", static_cast<double>(allocations) / steps,
                static_cast<double>(allocated_bytes) / steps * 1e-9, tracked_space.c_str());
    std::vector<std::pair<std::string, std::pair<std::int64_t, std::int64_t>>> labels(allocations_by_label.begin(),
                                                                                     allocations_by_label.end());
    std::sort(labels.begin(), labels.end(), [](const auto& a, const auto& b) { return a.second.first > b.second.first; });
    std::printf("  %10s %10s  label (the %zu most frequent of %zu)\n", "per step", "GB/step",
                std::min<std::size_t>(labels.size(), 20), labels.size());
    for (std::size_t i = 0; i < labels.size() && i < 20; ++i) {
      std::printf("  %10.1f %10.3f  %s\n", static_cast<double>(labels[i].second.first) / steps,
                  static_cast<double>(labels[i].second.second) / steps * 1e-9, labels[i].first.c_str());
    }
  }
  nlohmann::json record = {{"tool", "kmamba-perf-train"},
                           {"execution_space", Exec::name()},
                           {"precision", kmamba::matmul_precision_name(o.precision)},
                           {"mixer", kmamba::mixer_name(config.mixer)},
                           {"d_model", config.d_model},
                           {"n_layer", config.n_layer},
                           {"ngroups", config.ngroups},
                           {"parameters", parameters},
                           {"batch", batch},
                           {"seqlen", seqlen},
                           {"ranks", world_size},
                           {"dp", data_size},
                           {"tp", 1},
                           {"sp", 1},
                           {"zero_stage", o.zero_stage},
                           {"activation_checkpointing", o.activation_checkpointing},
                           {"step_ms", median * 1e3},
                           {"tokens_per_step", global_tokens},
                           {"tokens_per_s", global_tokens / median},
                           {"flops_per_token", flops_per_token},
                           {"mfu_bf16", mfu},
                           {"peak_memory_bytes", peak_memory},
                           {"allocations_per_step", static_cast<double>(allocations) / steps}};
  int next_step = steps + 1;  // the index (data seed) of the next untimed step
#if KMAMBA_ENABLE_MPI
  if (mesh) {
    record["tp"] = mesh->config().tensor_parallel_size;
    record["sp"] = mesh->config().sequence_parallel_size;
    record["transport"] = mesh->world().transport();
    // Bytes and calls per step of the timed steps, then the times with the audit timing each collective.
    const double counted_steps = static_cast<double>(steps);
    const std::map<std::pair<std::string, std::string>, kmamba::CommunicationLog::Tally> counted = log->tallies();
    log->clear();
    log->set_timing(true);
    std::vector<double> fenced;
    for (int s = 0; s < o.comm_steps; ++s) fenced.push_back(run_step(next_step++));
    log->set_timing(false);
    double fenced_step = 0.0;
    for (double t : fenced) fenced_step += t;
    fenced_step /= std::max(1, o.comm_steps);
    const double comm_per_step = slowest(log->total_seconds() / std::max(1, o.comm_steps));
    nlohmann::json operations = nlohmann::json::array();
    if (root) {
      std::printf("communication per step (rank 0; times from %d steps with every collective fenced and timed):\n",
                  o.comm_steps);
      std::printf("  %-6s %-15s %8s %12s %10s\n", "axis", "operation", "calls", "MB", "ms");
    }
    for (const auto& entry : counted) {
      const auto timed = log->tally(entry.first.first, entry.first.second);
      const double calls = static_cast<double>(entry.second.calls) / counted_steps;
      const double megabytes = static_cast<double>(entry.second.elements) * 4.0 / counted_steps * 1e-6;
      const double ms = timed.seconds / std::max(1, o.comm_steps) * 1e3;
      if (root) {
        std::printf("  %-6s %-15s %8.1f %12.3f %10.3f\n", entry.first.first.c_str(), entry.first.second.c_str(), calls,
                    megabytes, ms);
      }
      operations.push_back({{"axis", entry.first.first},
                            {"operation", entry.first.second},
                            {"calls_per_step", calls},
                            {"megabytes_per_step", megabytes},
                            {"ms_per_step", ms}});
    }
    if (root) {
      std::printf("communication share: %.1f ms of %.1f ms per step with fenced collectives (%.1f%%); the unfenced "
                  "step took %.1f ms\n",
                  comm_per_step * 1e3, fenced_step * 1e3, 100.0 * comm_per_step / fenced_step, median * 1e3);
    }
    record["communication"] = operations;
    record["comm_ms_per_step"] = comm_per_step * 1e3;
    record["fenced_step_ms"] = fenced_step * 1e3;
    record["comm_share"] = comm_per_step / fenced_step;
  }
#endif
  if (o.kernel_time_steps > 0) {
    // After everything else: the per-kernel breakdown of further steps, each kernel fenced.
    double span = 0.0;
    {
      const kmamba_perf::KernelTimes kernel_times;
      for (int s = 0; s < o.kernel_time_steps; ++s) span += run_step(next_step++);
      if (root) kernel_times.report(stdout, span, o.kernel_time_steps);
    }
  }
  Kokkos::Tools::Experimental::set_allocate_data_callback(nullptr);
  Kokkos::Tools::Experimental::set_deallocate_data_callback(nullptr);
  if (root && !o.json.empty()) {
    std::ofstream file(o.json);
    KMAMBA_REQUIRE(file.good(), "kmamba-perf-train: cannot write '" << o.json << "'");
    file << record.dump(1) << "\n";
    std::printf("kmamba-perf-train: wrote %s\n", o.json.c_str());
  }
}

}  // namespace

int main(int argc, char** argv) {
  kmamba::keep_freed_host_memory();  // steps reuse freed host memory (KMAMBA_HOST_MALLOC_KEEP=0: off)
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      std::printf(
          "usage: kmamba-perf-train [--space Cuda|OpenMP|Serial] [--mixer mamba1|mamba2|mamba3] [--preset 130m|370m]\n"
          "                         [--small] [--batch B]\n"
          "                         [--seqlen L] [--steps S] [--ngroups G] [--chunk Q] [--activation-checkpointing]\n"
          "                         [--json FILE] [--precision fp32|tf32|bf16] [--kernel-times K]\n"
          "       mpirun -np N kmamba-perf-train ... [--dp D] [--tp T] [--sp C] [--zero 0|1] [--comm-steps K]\n"
          "  default: mamba2-130m shape, batch 8 x seqlen 2048, 10 timed steps after one warm-up step\n"
          "  --mixer: the layers (default mamba2; mamba3: SISO, chunk 64; mamba1: d_state 16)\n"
          "  --preset 370m: mamba2-370m shape (d_model 1024, 48 layers)\n"
          "  --small: d_model 256, 4 layers, chunk 64, batch 2 x 256, 3 steps (a 2-core CPU)\n"
          "  --ngroups G: B/C groups (default 1; tensor parallelism needs tp to divide it)\n"
          "  --chunk Q: the SSD's chunk length (default 256, --small 64); the model computes the same function\n"
          "  --activation-checkpointing: keep each layer's input only and recompute the rest in backward\n"
          "  --dp, --tp, --sp: the process mesh under mpirun (dp default: N / (tp * sp)); batch x seqlen is\n"
          "    per data-parallel group (its tensor ranks share it, its sequence ranks split it)\n"
          "  --zero 1: ZeRO-1 (AdamW moments sharded over dp x sp); default 0\n"
          "  --comm-steps K: steps after the timed ones with every collective fenced and timed (default 2)\n"
          "  --json FILE: the results as JSON (rank 0)\n"
          "  --kernel-times K: K more steps with every Kokkos kernel fenced and timed: a per-kernel table\n"
          "  --precision: the projection GEMMs' arithmetic (default fp32; bf16/tf32 use the tensor cores on CUDA,\n"
          "    tf32 also the SSD chunk products; emulated, no faster, on host backends)\n");
      return 0;
    }
  }
  int status = 0;
  try {
    Options o;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      auto value = [&]() -> std::string {
        KMAMBA_REQUIRE(i + 1 < argc, "kmamba-perf-train: " << a << " needs a value");
        return argv[++i];
      };
      auto positive = [&]() {
        const std::string text = value();
        const int v = std::atoi(text.c_str());
        KMAMBA_REQUIRE(v >= 1, "kmamba-perf-train: " << a << " needs a positive integer, got '" << text << "'");
        return v;
      };
      if (a == "--space") o.space = value();
      else if (a == "--preset") o.preset = value();
      else if (a == "--mixer") {
        const std::string m = value();
        KMAMBA_REQUIRE(m == "mamba1" || m == "mamba2" || m == "mamba3",
                       "kmamba-perf-train: --mixer must be mamba1, mamba2 or mamba3, got '" << m << "'");
        o.mixer = m == "mamba1" ? kmamba::MixerKind::Mamba1 : m == "mamba2" ? kmamba::MixerKind::Mamba2 : kmamba::MixerKind::Mamba3;
      }
      else if (a == "--small") o.small = true;
      else if (a == "--batch") o.batch = std::max(1, std::atoi(value().c_str()));
      else if (a == "--seqlen") o.seqlen = std::max(2, std::atoi(value().c_str()));
      else if (a == "--steps") o.steps = std::max(1, std::atoi(value().c_str()));
      else if (a == "--json") o.json = value();
      else if (a == "--precision") o.precision = kmamba::parse_matmul_precision(value(), "kmamba-perf-train: --precision");
      else if (a == "--dp") o.mesh.data_parallel_size = positive(), o.mesh_given = true;
      else if (a == "--tp") o.mesh.tensor_parallel_size = positive(), o.mesh_given = true;
      else if (a == "--sp") o.mesh.sequence_parallel_size = positive(), o.mesh_given = true;
      else if (a == "--ngroups") o.ngroups = positive();
      else if (a == "--chunk") o.chunk = positive();
      else if (a == "--activation-checkpointing") o.activation_checkpointing = true;
      else if (a == "--zero") o.zero_stage = std::atoi(value().c_str());
      else if (a == "--comm-steps") o.comm_steps = positive();
      else if (a == "--kernel-times") o.kernel_time_steps = positive();
      else if (a.rfind("--kokkos-", 0) != 0) KMAMBA_USER_ERROR("kmamba-perf-train: unknown argument '" << a << "'");
    }
    KMAMBA_REQUIRE(o.preset == "130m" || o.preset == "370m",
                   "kmamba-perf-train: --preset must be 130m or 370m, got '" << o.preset << "'");
    KMAMBA_REQUIRE(o.zero_stage == 0 || o.zero_stage == 1,
                   "kmamba-perf-train: --zero must be 0 or 1, got " << o.zero_stage);
    // MPI when a launcher started this process or a mesh option asks for ranks, as kmamba-train.
    const bool launched = std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMI_SIZE") != nullptr ||
                          std::getenv("PMIX_RANK") != nullptr;
    std::vector<std::string> kokkos_args = {argv[0]};
    for (int i = 1; i < argc; ++i) {
      if (std::string(argv[i]).rfind("--kokkos-", 0) == 0) kokkos_args.push_back(argv[i]);
    }
    if (launched || o.mesh_given) {
#if KMAMBA_ENABLE_MPI
      MPI_Init(&argc, &argv);
      mpi_running = true;
      int rank = 0;
      MPI_Comm_rank(MPI_COMM_WORLD, &rank);
      if (rank != 0) {
        KMAMBA_REQUIRE(std::freopen("/dev/null", "w", stdout) != nullptr,
                       "kmamba-perf-train: cannot silence rank " << rank);
      }
#if KMAMBA_ENABLE_CUDA
      // One GPU per rank: the node-local rank's, unless --kokkos-device-id says otherwise.
      const bool device_given = std::any_of(kokkos_args.begin(), kokkos_args.end(), [](const std::string& a) {
        return a.rfind("--kokkos-device-id", 0) == 0;
      });
      const int devices = Kokkos::Cuda::detect_device_count();
      if (!device_given && devices > 0) {
        kokkos_args.push_back("--kokkos-device-id=" +
                              std::to_string(kmamba::node_local_rank(MPI_COMM_WORLD) % devices));
      }
#endif
#else
      KMAMBA_REQUIRE(!o.mesh_given, "kmamba-perf-train: --dp, --tp and --sp need a build with MPI (KMAMBA_ENABLE_MPI)");
#endif
    }
    std::vector<char*> kokkos_argv;
    for (std::string& a : kokkos_args) kokkos_argv.push_back(&a[0]);
    int kokkos_argc = static_cast<int>(kokkos_argv.size());
    kokkos_argv.push_back(nullptr);
    Kokkos::ScopeGuard kokkos(kokkos_argc, kokkos_argv.data());
    auto body = [&]() {
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
      return 0;
    };
#if KMAMBA_ENABLE_MPI
    // A failure on one rank ends all of them (the others may wait in a collective).
    if (mpi_running) status = kmamba::run_or_abort(MPI_COMM_WORLD, body);
    else status = body();
#else
    status = body();
#endif
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    status = 1;
  }
#if KMAMBA_ENABLE_MPI
  if (mpi_running) MPI_Finalize();
#endif
  return status;
}
