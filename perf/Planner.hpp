// kmamba-plan's cost model (docs/distributed.md §8.3): the step time and per-GPU memory of a
// parallel plan — pipeline × data × tensor × sequence parallel sizes, micro-batch size, ZeRO stage,
// activation checkpointing and gradient compression — for any kmamba model on N GPUs, and the
// enumeration of every plan. The compute terms come from measured times (kmamba-perf-train's step,
// kmamba-perf's scans; built-in defaults measured on an H100), the communication terms from the
// α–β model of ScalingModel.hpp, which kmamba-perf-model shares.
#ifndef KMAMBA_PERF_PLANNER_HPP
#define KMAMBA_PERF_PLANNER_HPP

#include "ScalingModel.hpp"

#include <kmamba/KMamba.hpp>

#include <map>
#include <string>
#include <vector>

namespace kmamba {
namespace perf {

/// The costs of a kmamba model of `config` (any mixer): its parameters as the mixer declares
/// them (make_mixer), tp splitting each along the axis kmamba's tensor parallelism shards
/// (docs/distributed.md §1; the block norm, embedding and final norm replicated), and its scan,
/// activation and sequence-parallel message sizes.
ModelCosts model_costs(const ModelConfig& config);

/// What the compute terms are calibrated from.
struct Measurements {
  /// The measured training step: its model, tokens and seconds (one GPU, no parallelism).
  ModelConfig step_model;
  double step_tokens = 0.0, step_seconds = 0.0;
  /// Per mixer (by mixer_name): the scan's forward + backward seconds per scan unit
  /// (token × inner channel × state size).
  std::map<std::string, double> scan_seconds_per_unit;
  std::string source;  ///< where the numbers come from, for the report
};

/// The built-in measurements, taken on an H100 80GB HBM3 and recorded in perf/RESULTS.md: the
/// mamba2-130m step (bf16 projections, 8 × 2048 tokens) 137.3 ms; per scan, forward + backward
/// at b8 L4096: the SSD (bf16, H32 P64 N128) 5.008 ms, Mamba-3 SISO (H32 P64 N128) 12.65 ms, the
/// selective scan (D1536 N16) 1.689 + 6.855 ms.
Measurements default_measurements();
/// Replaces the step by the one in a kmamba-perf-train --json file (`path`); a UserError naming
/// the file and the key when it is not one.
void read_step_json(const std::string& path, Measurements& m);
/// Replaces the scan rates of the mixers whose forward + backward rows a kmamba-perf --json file
/// holds in `precision` ("fp32", "tf32", "bf16"; fp32 rows where the precision has none).
void read_kernel_json(const std::string& path, const std::string& precision, Measurements& m);

/// Seconds per unit of a step's work: dense (6 · parameters per token: the projections, the
/// head, AdamW) and the mixer's scans.
struct ComputeRates {
  double seconds_per_flop = 0.0;
  double scan_seconds_per_unit = 0.0;
};
/// The rates for `mixer`: its scan's measured rate, and the step's time less its own scans per
/// dense FLOP. A UserError when the scans take the whole measured step.
ComputeRates compute_rates(const Measurements& m, MixerKind mixer);

/// What kmamba-plan is asked.
struct PlanRequest {
  ModelConfig model;
  /// A Hugging Face checkpoint directory the plan fine-tunes ("model" key), else a new model
  /// (its architecture keys).
  std::string model_dir;
  std::string precision = "bf16";  ///< kmamba-train's --precision of the measured step
  int gpus = 1, gpus_per_node = 8;
  double memory_bytes = 80e9;  ///< per GPU
  int seqlen = 2048;
  int global_batch = 8;  ///< sequences per optimizer step
  /// Allowed values (empty: every feasible one).
  std::vector<int> pp, tp, sp, zero_stages, grad_accum;
  std::vector<bool> checkpointing = {false, true};
  std::vector<GradientCompression> compression = {GradientCompression::None, GradientCompression::Bf16,
                                                  GradientCompression::PowerSgd};
  int powersgd_rank = 4;
  double backward_fraction = 2.0 / 3.0;  ///< of a micro-batch's compute, what bucket reductions hide behind
  double memory_bandwidth = 2.9e12;      ///< PowerSGD's passes (Workload::memory_bandwidth)
};

/// One plan and its prediction (seconds per optimizer step; bytes per GPU of the fullest stage).
struct Plan {
  int pp = 1, dp = 1, tp = 1, sp = 1, micro_batch = 1, grad_accum = 1, zero_stage = 0;
  bool checkpointing = false;
  GradientCompression compression = GradientCompression::None;
  int powersgd_rank = 4;
  double compute = 0.0;  ///< the slowest stage's compute over the schedule's slots
  double tp_comm = 0.0, sp_comm = 0.0, pp_comm = 0.0, dp_comm = 0.0;  ///< on the step's path
  double bubble = 0.0;
  double step = 0.0, tokens_per_s = 0.0;
  MemoryTerms memory;
  /// "pp2 dp4 tp1 sp1 mb2 acc4 zero1 ckpt bf16".
  std::string describe() const;
};

/// The prediction of `layout` (its sizes and options; the rest is filled in). Per micro-batch of
/// micro_batch · seqlen / sp tokens on a rank, the slowest stage computes its layers / tp
/// (dense at rates.seconds_per_flop, scans at rates.scan_seconds_per_unit, sp adding the
/// correction's share of the scans), the last stage also the head, replicated over tp; plus per
/// layer the tp all-reduces and the sp exchanges; the 1F1B schedule runs grad_accum + pp − 1 such
/// slots, each with a stage boundary's send and receive; the data-parallel reduction over dp · sp
/// adds what the last micro-batch's backward does not hide. Ranks: tp fastest, then sp, dp, pp.
Plan evaluate_plan(const PlanRequest& request, const CommModel& comm, const ComputeRates& rates, const Plan& layout);

/// Every plan of the request that fits its memory, fastest first (then the least memory). A
/// UserError saying why when none does (no mesh fits the model, or the smallest plan's memory).
std::vector<Plan> enumerate_plans(const PlanRequest& request, const CommModel& comm, const ComputeRates& rates);

/// The kmamba-train --config options of `plan` for `request` (architecture keys of a new model,
/// the batch, the mesh, the parallel options).
std::string train_config_json(const PlanRequest& request, const Plan& plan);

}  // namespace perf
}  // namespace kmamba

#endif
