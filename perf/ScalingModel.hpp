// The alpha-beta communication model of kmamba-perf-model (docs/distributed.md §8.2 S1, S3, S6): fits
// time = α + bytes · factor(n) · β per collective and group size to kmamba-perf-comm's sweep (the
// ring factors: all-reduce 2(n−1)/n, reduce-scatter and all-gather (n−1)/n, broadcast and send/recv
// 1, so 1/β is the bus bandwidth), and predicts the communication and step time of data-, tensor-
// and sequence-parallel training of a Mamba-2 model on N GPUs of `gpus_per_node` GPUs per node:
// collectives inside a node from the fitted table, across nodes from an assumed per-GPU link
// (α_inter, B_inter) with the hierarchical all-reduce AR ≈ RS_intra(M) + AR_inter(M/g) + AG_intra(M).
#ifndef KMAMBA_PERF_SCALINGMODEL_HPP
#define KMAMBA_PERF_SCALINGMODEL_HPP

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
  double compute_s = 0.0;       ///< measured step time of one GPU (no parallelism) on tokens_per_gpu tokens
  double tokens_per_gpu = 0.0;  ///< tokens of that measured step
  double peak_flops = 989e12;   ///< per GPU, for MFU (H200 dense bf16, docs/performance.md §2)
  double bytes_per_value = 4;   ///< gradient and activation element bytes (fp32 in this build)
  double serial_fraction =
      0.1;  ///< share of the compute in the conv + SSD scan that a sequence-parallel chain serialises
  double backward_fraction = 2.0 / 3.0;  ///< share of the compute that DP bucket reductions can hide behind
};

/// The prediction of one layout on n_gpus GPUs (times in s per optimizer step).
struct Prediction {
  std::string layout;  ///< "dp", "tp2", "sp8@65536", ...
  int gpus = 0, dp = 1, tp = 1, sp = 1;
  double seqlen = 0.0, tokens_per_step = 0.0;
  double compute = 0.0, dp_comm = 0.0, tp_comm = 0.0;
  double sp_comm = 0.0;                  ///< the sequence chain: its hops plus the serialised scans waited for
  double step = 0.0;                     ///< compute + every communication exposed
  double step_overlap = 0.0;             ///< DP reduction hidden behind the backward (backward_fraction · compute)
  double tokens_per_s = 0.0, mfu = 0.0;  ///< of step
  double tokens_per_s_overlap = 0.0, mfu_overlap = 0.0;  ///< of step_overlap
  double comm_share() const { return (dp_comm + tp_comm + sp_comm) / step; }
};

/// Data parallel (weak scaling): every GPU trains tokens_per_gpu tokens per step; one DDP all-reduce
/// of the fp32 gradients per step over all GPUs, in buckets of default_bucket_elements(N).
Prediction predict_dp(const CommModel& comm, const Workload& work, int gpus);
/// Tensor parallel t inside a node (strong scaling of the one-GPU batch across the t ranks) times data
/// parallel N/t: compute (replicated head + the rest / t), per layer one activation all-reduce of
/// tokens · d_model values forward and one backward over tp, the gradient all-reduce over dp.
Prediction predict_tp(const CommModel& comm, const Workload& work, int gpus, int tp);
/// Sequence parallel c (state passing as kmamba's Mamba-2 mixer does it: a chain over the c ranks,
/// per layer and direction three conv halos and one SSM state per hop) on sequences of `seqlen`
/// tokens, one per sp group, times data parallel N/c; the chain adds (c − 1) · (the serial part of a
/// layer + hop) per direction; the gradient all-reduce over dp × sp.
Prediction predict_sp(const CommModel& comm, const Workload& work, int gpus, int sp, double seqlen);

}  // namespace perf
}  // namespace kmamba

#endif
