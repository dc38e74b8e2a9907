// The alpha-beta communication model of kmamba-perf-model and kmamba-plan
// (docs/distributed.md §8.2): fits time = α + bytes · factor(n) · β per collective and group size
// to kmamba-perf-comm's sweep (the ring factors: all-reduce 2(n−1)/n, reduce-scatter and
// all-gather (n−1)/n, broadcast and send/recv 1, so 1/β is the bus bandwidth), and predicts the
// communication, step time and memory per GPU of data- (fp32, bf16 or PowerSGD gradients),
// tensor-, sequence- and pipeline-parallel training of a Mamba-2 model on N GPUs of
// `gpus_per_node` GPUs per node: collectives inside a node from the fitted table, across nodes
// from an assumed per-GPU link (α_inter, B_inter) with the hierarchical all-reduce
// AR ≈ RS_intra(M) + AR_inter(M/g) + AG_intra(M). The terms each layout is built from
// (gradient_reduction, memory_per_gpu, ...) are shared with kmamba-plan's cost model (Planner.hpp).
#ifndef KMAMBA_PERF_SCALINGMODEL_HPP
#define KMAMBA_PERF_SCALINGMODEL_HPP

#include <kmamba/parallel/GradientBuckets.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace kmamba {
namespace perf {

/// One timed point of the sweep: `collective` ("all_reduce", "reduce_scatter", "all_gather",
/// "broadcast", "send_recv") on `ranks` ranks moving a logical buffer of `bytes` in `seconds`.
struct Sample {
  std::string collective;
  int ranks = 0;
  double bytes = 0.0;
  double seconds = 0.0;
};

/// The samples of a kmamba-perf-comm --json sweep; a file that is not one (not JSON, a missing key,
/// a value of another type) is a UserError of `tool` naming the file and what it must hold.
std::vector<Sample> read_sweep(const std::string& path, const std::string& tool);

/// Bus bytes per logical byte of the ring algorithms: 2(n−1)/n, (n−1)/n, or 1.
double ring_factor(const std::string& collective, int ranks);

/// α (s) and β (s per bus byte) of one collective on one group size, and how well they fit.
struct AlphaBeta {
  std::string collective;
  int ranks = 0;
  double alpha = 0.0;                  ///< latency, s
  double beta = 0.0;                   ///< s per bus byte (1/β: bus bandwidth)
  bool alpha_clamped = false;          ///< the free fit gave α < 0; refitted with α = 0
  std::vector<double> bytes;           ///< the points fitted
  std::vector<double> relative_error;  ///< (model − measured) / measured, per point
  /// α + bytes · ring_factor(collective, ranks) · β.
  double time(double logical_bytes) const;
};

/// Fits α, β to `samples` (one collective, one group size, at least two sizes) minimising the sum of
/// squared relative errors, so that small messages (latency) and large ones (bandwidth) weigh alike.
AlphaBeta fit_alpha_beta(const std::vector<Sample>& samples);
/// One fit per (collective, ranks) present in `samples`, ordered by collective then ranks.
std::vector<AlphaBeta> fit_all(const std::vector<Sample>& samples);
/// A table of every collective kmamba's layouts use (all-reduce, reduce-scatter, all-gather,
/// send/recv) on `ranks` GPUs of one node with one assumed latency `alpha` (s) and bus bandwidth
/// (B/s): the model without a measured sweep.
std::vector<AlphaBeta> assumed_fits(int ranks, double alpha, double bandwidth);

/// The fitted intra-node table and the assumed inter-node link.
class CommModel {
 public:
  /// `intra`: fits of the GPUs of one node; `inter_alpha` (s) and `inter_bandwidth` (bytes/s per
  /// GPU) for the links between nodes; `gpus_per_node` GPUs per node.
  CommModel(std::vector<AlphaBeta> intra, double inter_alpha, double inter_bandwidth, int gpus_per_node);

  int gpus_per_node() const { return gpus_per_node_; }
  double inter_alpha() const { return inter_alpha_; }
  double inter_bandwidth() const { return inter_bandwidth_; }

  /// `collective` on n ranks of one node: the fit of that size, else α and β of the fitted size
  /// nearest to n with n's ring factor. n = 1: 0.
  double intra(const std::string& collective, int n, double bytes) const;
  /// Ring `collective` over k nodes, one GPU per node per ring: all-reduce 2(k−1)·α + 2(k−1)/k·M/B,
  /// reduce-scatter and all-gather (k−1)·α + (k−1)/k·M/B, send/recv α + M/B. k = 1: 0.
  double inter(const std::string& collective, int k, double bytes) const;
  /// All-reduce of `bytes` over a group of `group` ranks holding `per_node` of them on each node
  /// (the group spans group / per_node nodes): within a node the fitted all-reduce; across nodes
  /// RS_intra(M) + AR_inter(M / per_node) + AG_intra(M).
  double all_reduce(int group, int per_node, double bytes) const;

 private:
  const AlphaBeta* nearest(const std::string& collective, int n) const;
  std::vector<AlphaBeta> intra_;
  double inter_alpha_, inter_bandwidth_;
  int gpus_per_node_;
};

/// A Mamba-2 language model's shape (defaults: mamba2-370m).
struct Shape {
  int d_model = 1024, n_layer = 48, vocab_size = 50277, pad_vocab_size_multiple = 8;
  int d_state = 128, headdim = 64, expand = 2, ngroups = 1, d_conv = 4, chunk_size = 256;
  int d_inner() const { return expand * d_model; }
  int nheads() const { return d_inner() / headdim; }
  std::int64_t padded_vocab() const;
};

/// Parameters of kmamba's Mamba-2 LanguageModel of `shape` (tied embedding, no in/out_proj bias,
/// conv bias, RMS norms): per layer in_proj d·(2·di + 2·G·N + H), conv (di + 2GN)·(K + 1),
/// dt_bias, A_log, D (H each), the gated norm di, out_proj di·d, the block norm d; the embedding
/// V·d and the final norm d.
double parameter_count(const Shape& shape);
/// Of which the embedding (tied LM head) and final norm: replicated on every tensor rank.
double replicated_parameter_count(const Shape& shape);
/// Training FLOPs per token: 6 · parameters + 3 · layers · (2QNG + 2QPH + 4NPH) (the SSD's chunked
/// products), as kmamba-perf-train counts them.
double flops_per_token(const Shape& shape);

/// How a run is laid out and what one GPU measured.
struct Workload {
  Shape shape;
  double compute_s = 0.0;        ///< measured step time of one GPU (no parallelism) on tokens_per_gpu tokens
  double tokens_per_gpu = 0.0;   ///< tokens of that measured step
  double peak_flops = 989e12;    ///< per GPU, for MFU (H200 dense bf16, docs/performance.md §2)
  double bytes_per_value = 4;    ///< activation element bytes (fp32 in this build); gradients: fp32, bf16 on the wire
                                 ///< with compression Bf16
  double serial_fraction = 0.1;  ///< share of the compute in the conv and SSD scans (which sp's correction adds to)
  double backward_fraction = 2.0 / 3.0;  ///< share of the compute that DP bucket reductions can hide behind
  GradientCompression compression = GradientCompression::None;  ///< how the dp gradients travel
  int powersgd_rank = 4;                                        ///< with compression PowerSgd
  double memory_bandwidth = 2.9e12;  ///< B/s of PowerSGD's passes over the gradients (H100 HBM3, assumed)
};

/// The prediction of one layout on n_gpus GPUs (times in s per optimizer step).
struct Prediction {
  std::string layout;  ///< "dp", "tp2", "sp8@65536", "pp4m16", "dp+bf16", ...
  int gpus = 0, dp = 1, tp = 1, sp = 1, pp = 1;
  int micro_batches = 1;  ///< of the pipeline schedule
  double bubble = 0.0;    ///< pipeline_bubble(pp, micro_batches)
  double pp_comm = 0.0;   ///< the activation sends between stages on the schedule's path
  double memory = 0.0;    ///< bytes per GPU (the fullest stage): memory_per_gpu
  double seqlen = 0.0, tokens_per_step = 0.0;
  double compute = 0.0, dp_comm = 0.0, tp_comm = 0.0;
  double sp_comm = 0.0;                  ///< the sequence-parallel state exchanges and conv halos
  double dp_fixed = 0.0;                 ///< the part of dp_comm no backward hides (PowerSGD, ZeRO-1's all-gather)
  double step = 0.0;                     ///< compute + every communication exposed
  double step_overlap = 0.0;             ///< DP reduction hidden behind the backward (backward_fraction · compute)
  double tokens_per_s = 0.0, mfu = 0.0;  ///< of step
  double tokens_per_s_overlap = 0.0, mfu_overlap = 0.0;  ///< of step_overlap
  double comm_share() const { return (dp_comm + tp_comm + sp_comm + pp_comm) / step; }
};

/// Data parallel (weak scaling): every GPU trains tokens_per_gpu tokens per step; one DDP all-reduce
/// of the fp32 gradients per step over all GPUs, in buckets of default_bucket_elements(N).
Prediction predict_dp(const CommModel& comm, const Workload& work, int gpus);
/// Tensor parallel t inside a node (strong scaling of the one-GPU batch across the t ranks) times data
/// parallel N/t: compute (replicated head + the rest / t), per layer one activation all-reduce of
/// tokens · d_model values forward and one backward over tp, the gradient all-reduce over dp.
Prediction predict_tp(const CommModel& comm, const Workload& work, int gpus, int tp);
/// Sequence parallel c (as kmamba's Mamba-2 mixer does it, docs/distributed.md §2.1: the scans
/// parallel in time, the states combined in ⌈log₂ c⌉ exchanges, the conv halo passed along the
/// chain) on sequences of `seqlen` tokens, one per sp group, times data parallel N/c: each rank
/// computes seqlen / c tokens plus the state correction (ModelCosts::sp_scan_overhead of the scan
/// share serial_fraction), per layer sequence_parallel_seconds; the gradient all-reduce over dp × sp.
Prediction predict_sp(const CommModel& comm, const Workload& work, int gpus, int sp, double seqlen);
/// Pipeline parallel p (contiguous layer ranges; the last stage also holds the tied head) times
/// data parallel N/p, weak scaling: each pipeline trains p · tokens_per_gpu tokens per step in
/// `micro_batches` micro-batches on the 1F1B schedule: (m + p − 1) slots of the slowest stage's
/// micro-batch (its layers' share of the compute, plus the head on the last stage) and of the
/// activation send and gradient receive at its boundary; the gradient all-reduce over dp.
Prediction predict_pp(const CommModel& comm, const Workload& work, int gpus, int pp, int micro_batches);

// ---- The terms shared with kmamba-plan (Planner.hpp): docs/distributed.md §8.3 ----

/// The 1F1B schedule's bubble, the share of a step a stage idles: (p − 1)/(m + p − 1) for p
/// stages and m micro-batches (0 for one stage).
double pipeline_bubble(int stages, int micro_batches);

/// One parameter tensor as the parallel layouts see it: PowerSGD's matrix (first extent, product
/// of the others; `matrix` false for vectors, which are never compressed) and how tensor
/// parallelism splits it (the axis divided by t, or -1: every tp rank holds all of it).
struct ParameterBlock {
  double rows = 0.0, cols = 1.0;
  bool matrix = false;
  int split_axis = 0;
  double elements() const { return rows * cols; }
  /// This tp rank's block of t.
  ParameterBlock on_tensor_rank(int t) const;
};

/// What a training step costs per token and layer, the input of every layout (from a Shape here,
/// from any kmamba ModelConfig in Planner.hpp).
struct ModelCosts {
  int n_layer = 0, d_model = 0;
  std::vector<ParameterBlock> layer;  ///< one residual block's parameters
  std::vector<ParameterBlock> outer;  ///< the embedding (tied LM head) and the final norm, replicated over tp
  double padded_vocab = 0.0;
  double scan_units = 0.0;  ///< a token's scan work per layer: inner channels × state size
  /// fp32 bytes a layer keeps per token for its backward (block input, norm, in_proj output, conv
  /// output, scan and gated-norm outputs, the scan's chunk states).
  double activation_bytes = 0.0;
  double state_bytes = 0.0;  ///< per sequence and layer: one message of the sp state scan (decay + state)
  double halo_bytes = 0.0;   ///< per sequence and layer: the conv halo one sp rank sends the next
  /// The extra scan work of sequence parallelism (the state correction and its gradient) as a
  /// share of the layer's scan time.
  double sp_scan_overhead = 0.25;
  double layer_parameters() const;
  double outer_parameters() const;
};

/// The costs of a Mamba-2 `shape` (fp32 activations; sp overhead of the SSD's correction).
ModelCosts model_costs(const Shape& shape);

/// fp32 bytes a layer of `costs.layer` keeps per token: the block input and its norm, the outputs
/// of every projection but the row-parallel out_proj (split_axis 1) and of the conv, the scan's
/// and the gated norm's outputs (d_inner each), and `chunk_state_bytes` per token.
double kept_activation_bytes(const ModelCosts& costs, double d_inner, double chunk_state_bytes);

/// How one rank's gradients are reduced over the data-parallel group.
struct GradientWire {
  GradientCompression compression = GradientCompression::None;
  int powersgd_rank = 4;
  int zero_stage = 0;  ///< 1: reduce-scatter, then the updated parameters all-gathered after the step
};

/// One step's data-parallel reduction: the part that may run during the last backward (bucket
/// reductions) and the part that cannot (ZeRO-1's parameter all-gather, PowerSGD: all of it,
/// with its passes over the gradients).
struct ReductionTime {
  double hideable = 0.0, exposed = 0.0;
};

/// The reduction of `blocks` (this rank's fp32 gradients; already its tp shards) over `group`
/// ranks, `per_node` of them on a node (docs/distributed.md §3, §3.3, §3.4): none: buckets of
/// default_bucket_elements(group) all-reduced (ZeRO-1: reduce-scattered + all-gathered, the same
/// bytes); bf16: the same buckets at 2 bytes a value; powersgd rank r: one all-reduce of
/// Σ r·rows over the compressed matrices + every other element, one of Σ r·cols, and 9 fp32 passes
/// over the compressed gradients at `memory_bandwidth` (error feedback add and update, M·Q, Mᵀ·P,
/// P·Qᵀ).
ReductionTime gradient_reduction(const CommModel& comm, const std::vector<ParameterBlock>& blocks, int group,
                                 int per_node, const GradientWire& wire, double memory_bandwidth);

/// The fp32 values PowerSGD rank r all-reduces per step for `blocks`: Σ r·(rows + cols) over the
/// matrices it compresses (powersgd_compresses) + every other element.
double powersgd_values(const std::vector<ParameterBlock>& blocks, int rank);

/// Bytes per GPU, by term.
struct MemoryTerms {
  double weights = 0.0, gradients = 0.0, optimizer = 0.0, compression = 0.0, activations = 0.0, logits = 0.0;
  double total() const { return weights + gradients + optimizer + compression + activations + logits; }
};

/// What one pipeline stage of a layout holds.
struct StageLoad {
  int layers = 0;       ///< residual blocks on the stage
  bool first = true;    ///< holds the embedding
  bool last = true;     ///< holds the final norm and the tied head (its own copy of the embedding)
  int in_flight = 1;    ///< micro-batches whose activations it keeps (1F1B: min(m, p − stage))
  double tokens = 0.0;  ///< tokens of one micro-batch on one rank (micro-batch · seqlen / sp)
  int tp = 1;           ///< tensor-parallel ranks splitting the layers
  int zero_group = 1;   ///< ranks sharding the AdamW moments under ZeRO-1 (dp · sp)
  bool checkpointing = false;
};

/// A GPU's memory on stage `stage`: fp32 weights and gradients, AdamW's two moments (divided by
/// the ZeRO-1 group), PowerSGD's error feedback (one fp32 copy of the gradients) and its factors,
/// the activations of `in_flight` micro-batches (with checkpointing: each block's input and norm
/// scale, and one block's whole activations for its recompute), and on the last stage the fp32
/// logits of one micro-batch (their gradient overwrites them).
MemoryTerms memory_per_gpu(const ModelCosts& costs, const StageLoad& stage, const GradientWire& wire);

/// The stages of a pipeline of `stages` over `n_layer` blocks: contiguous ranges, the first
/// n_layer mod p stages one block more.
std::vector<int> stage_layers(int n_layer, int stages);

/// Per layer and micro-batch, the tensor-parallel activation all-reduces of `tokens` × d_model
/// fp32 values over t ranks of one node: forward and backward, and the forward's again when the
/// block is recomputed.
double tensor_parallel_seconds(const CommModel& comm, double tokens, int d_model, int t, bool checkpointing);
/// Per layer and micro-batch of `sequences`, sequence parallelism over c ranks
/// (docs/distributed.md §2): per direction ⌈log₂ c⌉ state messages of the parallel-in-time scan and the conv halo's
/// chain of c − 1 hops (recomputed blocks repeat the forward's); `across_nodes`: the hops use the
/// inter-node link.
double sequence_parallel_seconds(const CommModel& comm, const ModelCosts& costs, double sequences, int c,
                                 bool checkpointing, bool across_nodes);
/// One micro-batch's activation (forward) and its gradient (backward) across one stage boundary:
/// `tokens` × d_model fp32 values each way.
double pipeline_send_seconds(const CommModel& comm, double tokens, int d_model, bool across_nodes);

}  // namespace perf
}  // namespace kmamba

#endif
