// kmamba-perf-train: training throughput of a mamba2-130m-shaped language model (random weights:
// d_model 768, 24 layers, headdim 64, d_state 128, ngroups 1, chunk 256, vocab 50277 padded to
// 50288, tied head; --mixer mamba3: the Mamba-3 SISO layers of that shape with chunk 64, --mixer
// mamba1: mamba-130m's Mamba-1 layers, d_state 16) on random tokens: optimizer steps (forward, backward, global-norm
// clipping, AdamW) of batch × seqlen tokens through kmamba::Trainer, with the projection GEMMs in the precision of
// --precision (LanguageModel::set_matmul_precision: fp32 by default; bf16 / tf32 multiply rounded operands on the
// tensor cores on CUDA, and tf32 runs the SSD chunk products in TF32 too; host backends emulate the rounding, no
// faster).
//
//   kmamba-perf-train [--space Cuda|OpenMP|Serial] [--mixer mamba1|mamba2|mamba3] [--preset 130m|370m] [--small]
//   [--batch B] [--seqlen L]
//                     [--vocab V] [--d-state N] [--steps S] [--ngroups G] [--chunk Q] [--activation-checkpointing]
//                     [--json FILE]
//                     [--precision fp32|tf32|bf16] [--kernel-times K] [--offload-optimizer]
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
// in the execution space's memory during a step after the timed ones (parameters, gradients, AdamW moments,
// activations; not the buffers NCCL or cuBLAS keep for themselves). --offload-optimizer keeps the
// AdamW moments in host memory (pinned on CUDA) and runs the optimizer step on host threads
// (Trainer::set_optimizer_placement): the report then gives the step time with the copies and the
// host's update, the peak without the moments, and the optimizer's bytes on the device and host.
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
#include <kmamba/core/Files.hpp>
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

#include "AppRuntime.hpp"
#include "DeviceOption.hpp"
#include "KernelTimes.hpp"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
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
  int d_state = 0;  // 0: the preset's (Mamba-1 16, else 128)
  int chunk = 0;    // the SSD's chunk length; 0: the preset's (256, --small 64)
  int vocab = 50277;
  bool activation_checkpointing = false;
  bool offload_optimizer = false;
  kmamba::MatmulPrecision precision = kmamba::MatmulPrecision::Float32;
};

kmamba::ModelConfig model_config(const Options& o) {
  kmamba::ModelConfig c;
  c.mixer = o.mixer;
  const bool large = o.preset == "370m";
  c.d_model = o.small ? 256 : large ? 1024 : 768;
  c.n_layer = o.small ? 4 : large ? 48 : 24;
  c.vocab_size = o.vocab;
  c.pad_vocab_size_multiple = large ? 8 : 16;
  c.d_state = o.d_state > 0 ? o.d_state : o.mixer == kmamba::MixerKind::Mamba1 ? 16 : 128;
  c.headdim = 64;
  c.ngroups = o.ngroups;
  const int preset_chunk = o.small || o.mixer == kmamba::MixerKind::Mamba3 ? 64 : 256;
  c.chunk_size = o.chunk > 0 ? o.chunk : preset_chunk;
  c.tie_embeddings = true;
  c.validate();
  return c;
}

// The high-water mark of the live Kokkos allocations in one memory space, from the tools callbacks.
// The callbacks are on while the model is built and warmed up (so the lasting allocations count)
// and for one measuring step after the timed ones, but off during the timed steps: with a tool
// loaded, Kokkos reads each device allocation's header back at its release (a synchronous copy),
// which would add a device round trip per allocation to the times.
std::string tracked_space;
std::int64_t live_bytes = 0, peak_bytes = 0, allocations = 0, allocated_bytes = 0;
// Per View label: (allocations, bytes) over the measuring step.
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

void track_allocations(bool on) {
  Kokkos::Tools::Experimental::set_allocate_data_callback(on ? on_allocate : nullptr);
  Kokkos::Tools::Experimental::set_deallocate_data_callback(on ? on_deallocate : nullptr);
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

// One benchmark run on Exec: the model (sharded over the mesh under MPI), its trainer and the
// steps, timed as the slowest rank's.
template <class Exec>
class Bench {
 public:
  explicit Bench(const Options& o)
      : o_(o),
        config_(model_config(o)),
        batch_(o.batch > 0 ? o.batch : (o.small ? 2 : 8)),
        seqlen_(o.seqlen > 0 ? o.seqlen : (o.small ? 256 : 2048)),
        steps_(o.steps > 0 ? o.steps : (o.small ? 3 : 10)) {
    kmamba::LanguageModel<Exec> model(config_);
    model.initialize(1);
    model.set_matmul_precision(o.precision);
    parameters_ = static_cast<double>(model.parameters().size());
    kmamba::TrainConfig train;
    train.batch_size = batch_;
    train.total_steps = steps_ + o.comm_steps + o.kernel_time_steps + 3;  // + warm-up, memory and overlap steps
    train.warmup_steps = 0;
#if KMAMBA_ENABLE_MPI
    if (mpi_running) model = make_mesh(std::move(model));
#endif
    model.set_activation_checkpointing(o.activation_checkpointing);
    trainer_ = std::make_unique<kmamba::Trainer<Exec>>(std::move(model), train, nullptr, exec_);
    if (o.offload_optimizer) trainer_->set_optimizer_placement(kmamba::OptimizerPlacement::Host);
#if KMAMBA_ENABLE_MPI
    if (mesh_) trainer_->enable_data_parallel(*mesh_, kmamba::DataParallelConfig{o.zero_stage, 0});
#endif
  }

  bool root() const { return root_; }
  double flops_per_token() const { return 6.0 * parameters_ + ssd_flops_per_token(config_); }
  double global_tokens() const { return static_cast<double>(data_size_) * batch_ * seqlen_; }
  int steps() const { return steps_; }
  int batch() const { return batch_; }
  int seqlen() const { return seqlen_; }
  double loss() const { return loss_; }
  int world_size() const { return world_size_; }

  // The slowest rank's value, through MPI directly so that the audit does not count it.
  double slowest(double value) const {
#if KMAMBA_ENABLE_MPI
    if (mpi_running) MPI_Allreduce(MPI_IN_PLACE, &value, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
#endif
    return value;
  }

  // Step `s` (its index seeds the data); returns its time.
  double step(int s) {
    // Each data-parallel group trains its own batch; its tensor and sequence ranks share it.
    const std::vector<kmamba::TokenBatch> micro = {
        random_batch(batch_, seqlen_, config_.vocab_size, 7 + static_cast<std::uint64_t>(s) * 1009 + data_rank_)};
    exec_.fence();
    const auto start = std::chrono::steady_clock::now();
    const kmamba::StepResult r = trainer_->step(micro);
    exec_.fence();
    loss_ = r.loss;
    return slowest(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }

  void print_model() const {
    std::printf(
        "model: %s, d_model %d, %d layers, d_state %d, headdim %d, ngroups %d, chunk %d, vocab %d (padded "
        "%d), %.1f M parameters; batch %d x seqlen %d per data-parallel group, %s, %s projections\n",
        kmamba::mixer_name(config_.mixer), config_.d_model, config_.n_layer, config_.d_state, config_.headdim,
        config_.ngroups, config_.chunk_size, config_.vocab_size, config_.padded_vocab_size(), parameters_ * 1e-6,
        batch_, seqlen_, Exec::name(), kmamba::matmul_precision_name(o_.precision));
    std::printf("model FLOPs per token: 6N = %.3g + SSD %.3g = %.3g\n", 6.0 * parameters_, ssd_flops_per_token(config_),
                flops_per_token());
    std::printf("optimizer: AdamW on the %s, %.3f GB of its state in device memory (rank 0)%s\n",
                kmamba::to_string(trainer_->optimizer_placement()),
                static_cast<double>(trainer_->optimizer_device_bytes()) * 1e-9,
                o_.offload_optimizer
                    ? (", the step on " + std::to_string(Kokkos::DefaultHostExecutionSpace().concurrency()) +
                       " host threads (" + Kokkos::DefaultHostExecutionSpace::name() + ")")
                          .c_str()
                    : "");
#if KMAMBA_ENABLE_MPI
    if (mesh_) {
      std::printf("mesh: %d ranks = dp %d x tp %d x sp %d, %s transport, ZeRO stage %d\n", world_size_, data_size_,
                  mesh_->config().tensor_parallel_size, mesh_->config().sequence_parallel_size,
                  mesh_->world().transport(), o_.zero_stage);
    }
#endif
  }

  // The warm-up step and the timed ones; returns the median time.
  double timed_steps() {
    std::vector<double> times;
    for (int s = 0; s <= steps_; ++s) {
      if (s == 1) {
        track_allocations(false);
#if KMAMBA_ENABLE_MPI
        if (log_) log_->clear();
#endif
      }
      const double t = step(s);
      if (root_) std::printf("step %d: %.3f s, loss %.4f%s\n", s, t, loss_, s == 0 ? " (warm-up, not counted)" : "");
      if (s > 0) times.push_back(t);
    }
    std::sort(times.begin(), times.end());
    return times[times.size() / 2];
  }

  // One more step with the allocations tracked: its peak memory and allocations (index: the step's
  // data seed).
  void measure_memory(int index) {
    track_allocations(true);
    peak_bytes = live_bytes;
    allocations = allocated_bytes = 0;
    allocations_by_label.clear();
    step(index);
    track_allocations(false);
  }

  nlohmann::json record(double median, double mfu, double peak_memory) const {
    nlohmann::json r = {{"tool", "kmamba-perf-train"},
                        {"execution_space", Exec::name()},
                        {"precision", kmamba::matmul_precision_name(o_.precision)},
                        {"mixer", kmamba::mixer_name(config_.mixer)},
                        {"d_model", config_.d_model},
                        {"n_layer", config_.n_layer},
                        {"ngroups", config_.ngroups},
                        {"d_state", config_.d_state},
                        {"headdim", config_.headdim},
                        {"expand", config_.expand},
                        {"chunk_size", config_.chunk_size},
                        {"vocab_size", config_.vocab_size},
                        {"pad_vocab_size_multiple", config_.pad_vocab_size_multiple},
                        {"parameters", parameters_},
                        {"batch", batch_},
                        {"seqlen", seqlen_},
                        {"ranks", world_size_},
                        {"dp", data_size_},
                        {"tp", 1},
                        {"sp", 1},
                        {"zero_stage", o_.zero_stage},
                        {"activation_checkpointing", o_.activation_checkpointing},
                        {"optimizer_placement", kmamba::to_string(trainer_->optimizer_placement())},
                        {"optimizer_device_bytes", static_cast<double>(trainer_->optimizer_device_bytes())},
                        {"step_ms", median * 1e3},
                        {"tokens_per_step", global_tokens()},
                        {"tokens_per_s", global_tokens() / median},
                        {"flops_per_token", flops_per_token()},
                        {"mfu_bf16", mfu},
                        {"peak_memory_bytes", peak_memory},
                        {"allocations_per_step", static_cast<double>(allocations)}};
#if KMAMBA_ENABLE_MPI
    if (mesh_) {
      r["tp"] = mesh_->config().tensor_parallel_size;
      r["sp"] = mesh_->config().sequence_parallel_size;
      r["transport"] = mesh_->world().transport();
    }
#endif
    return r;
  }

#if KMAMBA_ENABLE_MPI
  // Bytes and calls per step of the timed steps, then the times of --comm-steps more steps with the
  // audit timing each collective; into `record`.
  void audit_communication(nlohmann::json& record, int& next_step, double median) {
    if (!mesh_) return;
    const double counted_steps = static_cast<double>(steps_);
    const std::map<std::pair<std::string, std::string>, kmamba::CommunicationLog::Tally> counted = log_->tallies();
    log_->clear();
    log_->set_timing(true);
    double fenced_step = 0.0;
    for (int s = 0; s < o_.comm_steps; ++s) fenced_step += step(next_step++);
    log_->set_timing(false);
    fenced_step /= std::max(1, o_.comm_steps);
    const double comm_per_step = slowest(log_->total_seconds() / std::max(1, o_.comm_steps));
    nlohmann::json operations = nlohmann::json::array();
    if (root_) {
      std::printf("communication per step (rank 0; times from %d steps with every collective fenced and timed):\n",
                  o_.comm_steps);
      std::printf("  %-6s %-15s %8s %12s %10s\n", "axis", "operation", "calls", "MB", "ms");
    }
    for (const auto& entry : counted) {
      const auto timed = log_->tally(entry.first.first, entry.first.second);
      const double calls = static_cast<double>(entry.second.calls) / counted_steps;
      const double megabytes = static_cast<double>(entry.second.elements) * 4.0 / counted_steps * 1e-6;
      const double ms = timed.seconds / std::max(1, o_.comm_steps) * 1e3;
      if (root_) {
        std::printf("  %-6s %-15s %8.1f %12.3f %10.3f\n", entry.first.first.c_str(), entry.first.second.c_str(), calls,
                    megabytes, ms);
      }
      operations.push_back({{"axis", entry.first.first},
                            {"operation", entry.first.second},
                            {"calls_per_step", calls},
                            {"megabytes_per_step", megabytes},
                            {"ms_per_step", ms}});
    }
    if (root_) {
      std::printf(
          "communication share: %.1f ms of %.1f ms per step with fenced collectives (%.1f%%); the unfenced "
          "step took %.1f ms\n",
          comm_per_step * 1e3, fenced_step * 1e3, 100.0 * comm_per_step / fenced_step, median * 1e3);
    }
    record["communication"] = operations;
    record["comm_ms_per_step"] = comm_per_step * 1e3;
    record["fenced_step_ms"] = fenced_step * 1e3;
    record["comm_share"] = comm_per_step / fenced_step;
  }

  // One more step with the gradient reductions' timeline recorded (CUDA events on the
  // communication stream; host transports are synchronous and record none): how much of the
  // reductions ran while the backward computed, and how long the step waited for them after it.
  void measure_overlap(nlohmann::json& record, int& next_step) {
    if (!mesh_) return;
    kmamba::DataParallel<Exec>& dp = *trainer_->data_parallel();
    dp.record_communication_timeline(true);
    step(next_step++);
    dp.record_communication_timeline(false);
    const kmamba::CommunicationTimeline t = dp.communication_timeline();
    if (t.collectives.empty() || t.joins.empty()) return;
    const double backward_end = t.joins.back(), busy = t.busy(), before = t.busy_before(backward_end);
    const double exposed = t.exposed_after(backward_end);
    if (root_) {
      std::printf(
          "overlap (rank 0, one step, CUDA events): %zu gradient reductions took %.3f ms, %.3f ms (%.0f%%) of it "
          "before the backward ended, the first starting %.3f ms before its end; exposed after it: %.3f ms\n",
          t.collectives.size(), busy, before, busy > 0.0 ? 100.0 * before / busy : 0.0, backward_end, exposed);
    }
    record["overlap"] = {{"reductions", t.collectives.size()},
                         {"reduction_ms", busy},
                         {"reduction_ms_before_backward_end", before},
                         {"first_reduction_before_backward_end_ms", backward_end},
                         {"exposed_ms", exposed}};
  }
#endif

 private:
#if KMAMBA_ENABLE_MPI
  // The mesh as kmamba-train builds it, its world communicator wrapped by the audit; returns this
  // rank's shards of `model`.
  kmamba::LanguageModel<Exec> make_mesh(kmamba::LanguageModel<Exec> model) {
    MPI_Comm_size(MPI_COMM_WORLD, &world_size_);
    const kmamba::MeshConfig resolved = o_.mesh.resolve(world_size_);
    kmamba::check_mesh_fits_model(resolved, config_);
    // Device memory travels through NCCL (one GPU per rank); host memory through MPI.
    std::unique_ptr<kmamba::Communicator> world;
#if KMAMBA_ENABLE_NCCL
    if (!Kokkos::SpaceAccessibility<Kokkos::HostSpace, typename Exec::memory_space>::accessible) {
      world = std::make_unique<kmamba::NcclCommunicator>(MPI_COMM_WORLD);
    }
#endif
    if (!world) world = std::make_unique<kmamba::MpiCommunicator>(MPI_COMM_WORLD);
    log_ = std::make_shared<kmamba::CommunicationLog>();
    mesh_ = std::make_unique<kmamba::ProcessMesh>(
        std::make_unique<kmamba::CountingCommunicator>(std::move(world), log_), resolved);
    root_ = mesh_->world().rank() == 0;
    data_rank_ = mesh_->coordinates().dp;
    data_size_ = mesh_->config().data_parallel_size;
    if (mesh_->config().tensor_parallel_size == 1 && mesh_->config().sequence_parallel_size == 1) return model;
    kmamba::LanguageModel<Exec> local(config_, {&mesh_->tensor(), &mesh_->sequence()});
    kmamba::scatter_parameters(exec_, model, local);
    return local;
  }
  std::shared_ptr<kmamba::CommunicationLog> log_;
  std::unique_ptr<kmamba::ProcessMesh> mesh_;
#endif
  const Options& o_;
  const Exec exec_{};
  const kmamba::ModelConfig config_;
  const int batch_, seqlen_, steps_;
  double parameters_ = 0.0, loss_ = 0.0;
  int world_size_ = 1, data_rank_ = 0, data_size_ = 1;
  bool root_ = true;
  std::unique_ptr<kmamba::Trainer<Exec>> trainer_;
};

// The allocations of the measuring step, the 20 most frequent labels first. Each device
// allocation writes its header with a synchronous copy, so their count bounds how often the step
// drains the launch queue.
void print_allocations() {
  std::printf("allocations per step: %lld (%.3f GB) in %s\n", static_cast<long long>(allocations),
              static_cast<double>(allocated_bytes) * 1e-9, tracked_space.c_str());
  std::vector<std::pair<std::string, std::pair<std::int64_t, std::int64_t>>> labels(allocations_by_label.begin(),
                                                                                    allocations_by_label.end());
  std::sort(labels.begin(), labels.end(), [](const auto& a, const auto& b) { return a.second.first > b.second.first; });
  std::printf("  %10s %10s  label (the %zu most frequent of %zu)\n", "per step", "GB/step",
              std::min<std::size_t>(labels.size(), 20), labels.size());
  for (std::size_t i = 0; i < labels.size() && i < 20; ++i) {
    std::printf("  %10lld %10.3f  %s\n", static_cast<long long>(labels[i].second.first),
                static_cast<double>(labels[i].second.second) * 1e-9, labels[i].first.c_str());
  }
}

template <class Exec>
void run_space(const Options& o) {
  tracked_space = Exec::memory_space::name();
  track_allocations(true);
  Bench<Exec> bench(o);
  if (bench.root()) bench.print_model();
  const double median = bench.timed_steps();
  int next_step = bench.steps() + 1;  // the index (data seed) of the next untimed step
  bench.measure_memory(next_step++);
  const double rate = bench.flops_per_token() * bench.global_tokens() / median;
  const double peak_memory = bench.slowest(static_cast<double>(peak_bytes));
  const double mfu = rate / (bench.world_size() * bf16_peak_flop_per_s);
  if (bench.root()) {
    std::printf(
        "%-14s %-30s %10.1f ms/step %12.0f tok/s %10.2f TFLOP/s   MFU %.2f%% (bf16 peak), %.1f%% of fp32 peak"
        "   peak memory %.3f GB   last loss %.4f\n",
        "train step",
        (std::to_string(bench.batch()) + "x" + std::to_string(bench.seqlen()) + " (" + Exec::name() + ", " +
         kmamba::matmul_precision_name(o.precision) + ")")
            .c_str(),
        median * 1e3, bench.global_tokens() / median, rate * 1e-12, 100.0 * mfu,
        100.0 * rate / (bench.world_size() * fp32_peak_flop_per_s), peak_memory * 1e-9, bench.loss());
    print_allocations();
  }
  nlohmann::json record = bench.record(median, mfu, peak_memory);
#if KMAMBA_ENABLE_MPI
  bench.audit_communication(record, next_step, median);
  bench.measure_overlap(record, next_step);
#endif
  if (o.kernel_time_steps > 0) {
    // After everything else: the per-kernel breakdown of further steps, each kernel fenced.
    const kmamba_perf::KernelTimes kernel_times;
    double span = 0.0;
    for (int s = 0; s < o.kernel_time_steps; ++s) span += bench.step(next_step++);
    if (bench.root()) kernel_times.report(stdout, span, o.kernel_time_steps);
  }
  if (bench.root() && !o.json.empty()) {
    kmamba::write_output_file(o.json, record.dump(1) + "\n", "kmamba-perf-train: --json");
    std::printf("kmamba-perf-train: wrote %s\n", o.json.c_str());
  }
}

const char* const description =
    "Training throughput (tokens/s, model FLOP/s, MFU) of a mamba2-130m-shaped model (see the head of\n"
    "perf/TrainBench.cpp). Default: mamba2-130m shape, batch 8 x seqlen 2048, 10 timed steps after one warm-up\n"
    "step; under mpirun -np N on a dp x tp x sp mesh.";

void declare(CLI::App& cli, Options& o) {
  using kmamba::app::integer_in;
  using kmamba::app::one_of;
  const auto count = integer_in(1, kmamba::app::int_max);
  kmamba::app::add_space_option(cli, o.space, "the execution space (default: the build's default)");
  cli.add_option_function<std::string>(
         "--mixer",
         [&o](const std::string& m) {
           o.mixer = m == "mamba1"   ? kmamba::MixerKind::Mamba1
                     : m == "mamba2" ? kmamba::MixerKind::Mamba2
                                     : kmamba::MixerKind::Mamba3;
         },
         "the layers (default mamba2; mamba3: SISO, chunk 64; mamba1: d_state 16)")
      ->type_name("NAME")
      ->check(one_of({"mamba1", "mamba2", "mamba3"}));
  cli.add_option("--preset", o.preset, "130m, or 370m: mamba2-370m shape (d_model 1024, 48 layers)")
      ->type_name("NAME")
      ->check(one_of({"130m", "370m"}));
  cli.add_flag("--small", o.small, "d_model 256, 4 layers, chunk 64, batch 2 x 256, 3 steps (a 2-core CPU)");
  cli.add_option("--batch", o.batch, "sequences per data-parallel group")->type_name("B")->check(count);
  cli.add_option("--seqlen", o.seqlen, "tokens per sequence")
      ->type_name("L")
      ->check(integer_in(2, kmamba::app::int_max));
  cli.add_option("--steps", o.steps, "timed steps")->type_name("S")->check(count);
  cli.add_option("--d-state", o.d_state, "state size per channel (default: Mamba-1 16, else 128)")
      ->type_name("N")
      ->check(count);
  cli.add_option("--ngroups", o.ngroups, "B/C groups (default 1; tensor parallelism needs tp to divide it)")
      ->type_name("G")
      ->check(count);
  cli.add_option("--chunk", o.chunk,
                 "the SSD's chunk length (default 256, --small 64); the model computes the same function")
      ->type_name("Q")
      ->check(count);
  cli.add_option("--vocab", o.vocab, "vocabulary size (default 50277, the presets'; padded as the preset pads it)")
      ->type_name("V")
      ->check(integer_in(2, kmamba::app::int_max));
  cli.add_flag("--activation-checkpointing", o.activation_checkpointing,
               "keep each layer's input only and recompute the rest in backward");
  cli.add_option_function<std::string>(
         "--precision", [&o](const std::string& p) { o.precision = kmamba::parse_matmul_precision(p, "--precision"); },
         "the projection GEMMs' arithmetic (default fp32; bf16/tf32 use the tensor cores on CUDA, tf32 also the SSD "
         "chunk products; emulated, no faster, on host backends)")
      ->type_name("P")
      ->check(one_of({"fp32", "tf32", "bf16"}));
  cli.add_flag("--offload-optimizer", o.offload_optimizer,
               "AdamW moments in host memory (pinned on CUDA), the optimizer step on host threads");
  cli.add_option("--json", o.json, "the results as JSON (rank 0)")->type_name("FILE");
  cli.add_option("--kernel-times", o.kernel_time_steps,
                 "K more steps with every Kokkos kernel fenced and timed: a per-kernel table")
      ->type_name("K")
      ->check(count);
  const char* mesh = "process mesh (under mpirun -np N)";
  cli.add_option("--dp", o.mesh.data_parallel_size, "data-parallel ranks (default: N / (tp * sp))")
      ->type_name("D")
      ->check(count)
      ->group(mesh);
  cli.add_option("--tp", o.mesh.tensor_parallel_size, "tensor-parallel ranks (default 1)")
      ->type_name("T")
      ->check(count)
      ->group(mesh);
  cli.add_option("--sp", o.mesh.sequence_parallel_size,
                 "sequence-parallel ranks (default 1); batch x seqlen is per "
                 "data-parallel group (its tensor ranks share it, its sequence ranks split it)")
      ->type_name("C")
      ->check(count)
      ->group(mesh);
  cli.add_option("--zero", o.zero_stage, "1: ZeRO-1 (AdamW moments sharded over dp x sp); default 0")
      ->type_name("Z")
      ->check(integer_in(0, 1))
      ->group(mesh);
  cli.add_option("--comm-steps", o.comm_steps,
                 "steps after the timed ones with every collective fenced and timed (default 2)")
      ->type_name("K")
      ->check(count)
      ->group(mesh);
}

}  // namespace

int main(int argc, char** argv) {
  kmamba::keep_freed_host_memory();  // steps reuse freed host memory (KMAMBA_HOST_MALLOC_KEEP=0: off)
  CLI::App cli{description, "kmamba-perf-train"};
  kmamba::app::configure(cli);
  Options o;
  declare(cli, o);
  return kmamba::app::run_app(
      argc, argv, cli,
      [&] {
        o.mesh_given = cli.count("--dp") + cli.count("--tp") + cli.count("--sp") > 0;
#if !KMAMBA_ENABLE_MPI
        KMAMBA_REQUIRE(!o.mesh_given,
                       "kmamba-perf-train: --dp, --tp and --sp need a build with MPI (KMAMBA_ENABLE_MPI)");
#endif
        // MPI when a launcher started this process or a mesh option asks for ranks, as kmamba-train.
        return kmamba::app::Launch{kmamba::app::launched_by_mpi() || o.mesh_given};
      },
      [&](kmamba::app::Runtime& runtime) {
        mpi_running = runtime.mpi();
        if (mpi_running) runtime.errors_may_be_local();  // a failure on one rank must end all of them
        kmamba::print_configuration(std::cout);
        kmamba::app::on_space(o.space, [&](auto exec) { run_space<decltype(exec)>(o); });
        return kmamba::app::exit_done;
      });
}
