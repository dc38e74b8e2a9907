// The Mamba language model: embedding, pre-norm residual blocks, final norm, LM head, loss and the
// backward through all of them; checkpoints in the Hugging Face layout.
#include <kmamba/models/LanguageModel.hpp>

#include "Backbone.hpp"
#include "Elementwise.hpp"
#include "MixerToolkit.hpp"

#include <kmamba/backends/Gemm.hpp>
#include <kmamba/backends/StepGraph.hpp>
#include <kmamba/core/CrossEntropy.hpp>
#include <kmamba/core/Embedding.hpp>
#include <kmamba/core/Error.hpp>
#include <kmamba/core/ForEachBackend.hpp>
#include <kmamba/core/Random.hpp>
#include <kmamba/core/RmsNorm.hpp>
#include <kmamba/core/impl/CheckIds.hpp>
#include <kmamba/core/impl/LightWeightLaunch.hpp>
#include <kmamba/models/SafeTensors.hpp>
#include <kmamba/models/TensorIO.hpp>

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <set>
#include <sys/stat.h>
#include <utility>

namespace kmamba {

namespace impl {

/// logits(r, v) = padded(r, v) for the real vocabulary columns.
template <class MemorySpace>
struct DropPaddedColumns {
  Tensor2<float, MemorySpace> logits;       // (rows, vocab)
  ConstTensor2<float, MemorySpace> padded;  // (rows, padded_vocab)
  KOKKOS_INLINE_FUNCTION void operator()(const int r, const int v) const { logits(r, v) = padded(r, v); }
};

/// out(b, d) = residual(b, last, d) + mixed(b, last, d): the final block's sum at each sequence's
/// last position, the input of the final norm.
template <class MemorySpace>
struct LastPositionSum {
  Tensor2<float, MemorySpace> out;            // (batch, d_model)
  ConstTensor3<float, MemorySpace> residual;  // (batch, seqlen, d_model)
  ConstTensor3<float, MemorySpace> mixed;     // (batch, seqlen, d_model)
  int last;
  KOKKOS_INLINE_FUNCTION void operator()(const int b, const int d) const {
    out(b, d) = mixed(b, last, d) + residual(b, last, d);
  }
};

/// HF names of the LM-level parameters; the mamba_ssm spelling of the embedding is accepted on load.
constexpr const char* embedding_name = embedding_parameter_name;
constexpr const char* mamba_ssm_embedding_name = "backbone.embedding.weight";
constexpr const char* lm_head_name = "lm_head.weight";

}  // namespace impl

template <class ExecutionSpace>
struct LanguageModel<ExecutionSpace>::State {
  using Mem = memory_space;
  using Backbone = impl::Backbone<ExecutionSpace>;
  ModelConfig config;
  ModelParallel parallel;
  PipelineParallel pipeline;
  Slab slab;
  // The blocks this rank holds: one backbone, or one per chunk with virtual pipeline stages.
  std::vector<Backbone> chunks;

  // The head's buffers of the last forward (batch, seqlen fixed by it).
  std::int64_t batch = 0, seqlen = 0;
  Tensor2<float, Mem> padded_logits;  // (batch·seqlen, padded_vocab)
  Tensor1<float, Mem> lse;            // (batch·seqlen)
  // The projections' arithmetic (set_matmul_precision), the head's here and each mixer's own.
  MatmulPrecision precision = MatmulPrecision::Float32;
  // Under BFloat16, the parameters rounded to bf16 for decode steps (step_product), rounded again
  // whenever a decode state is made or prefilled; empty until then.
  mutable Tensor1<bf16, Mem> decode_parameters;  // (slab size)
  // The last stage's targets and predicted tokens of its last training stage_forward, for its backward.
  ConstTensor2<std::int64_t, Mem> stage_targets;
  std::int64_t stage_tokens = 0;

  State(const ModelConfig& c, const ModelParallel& p, const PipelineParallel& stages)
      : config(c), parallel(p), pipeline(stages), chunks(make_chunks(c, p, stages)) {
    config.validate();
    declare_parameters(config, pipeline, chunks, slab);
    slab.finalize("kmamba::lm");
  }

  // The backbone of each chunk of this rank (PipelineStage.hpp), the final norm on the last virtual
  // stage's; chunk 0 keeps the labels of an unchunked model.
  static std::vector<Backbone> make_chunks(const ModelConfig& config, const ModelParallel& parallel,
                                           const PipelineParallel& stages) {
    // Chunks exist for the interleaved schedule, which needs two stages; without them whole-model
    // calls would see chunk 0 only.
    KMAMBA_REQUIRE(stages.virtual_stages == 1 || (stages.virtual_stages > 1 && stages.stages() >= 2),
                   "kmamba::LanguageModel: virtual_pipeline_stages must be 1, or above 1 with "
                   "pipeline_parallel_size >= 2; got virtual_pipeline_stages "
                       << stages.virtual_stages << " with pipeline_parallel_size " << stages.stages());
    std::vector<Backbone> chunks;
    chunks.reserve(static_cast<std::size_t>(stages.virtual_stages));
    for (int c = 0; c < stages.virtual_stages; ++c) {
      chunks.emplace_back(config, parallel,
                          c == 0 ? std::string("kmamba::lm") : "kmamba::lm::chunk" + std::to_string(c),
                          chunk_layers(config.n_layer, stages, c), stages.last_chunk(c));
    }
    return chunks;
  }

  // The parameters' names and shapes, in declaration order; allocates nothing. The first stage
  // holds the embedding, the last the head (the embedding itself when tied), the chunks' blocks
  // between them in chunk order.
  static void declare_parameters(const ModelConfig& config, const PipelineParallel& stages,
                                 const std::vector<Backbone>& chunks, Slab& slab) {
    const std::int64_t dm = config.d_model, vp = config.padded_vocab_size();
    if (stages.first_stage() || (stages.last_stage() && config.tie_embeddings)) {
      slab.add(impl::embedding_name, {vp, dm}, WeightDecay::Yes);
    }
    for (const Backbone& chunk : chunks) chunk.declare_parameters(slab);
    if (stages.last_stage() && !config.tie_embeddings) slab.add(impl::lm_head_name, {vp, dm}, WeightDecay::Yes);
  }

  // The whole backbone of an unchunked model (chunk 0 of a chunked one).
  Backbone& backbone() { return chunks.front(); }
  const Backbone& backbone() const { return chunks.front(); }
  // Chunk `c`'s backbone; `function` names the caller in the error for a chunk not held.
  const Backbone& chunk(const char* function, int c) const {
    KMAMBA_REQUIRE(c >= 0 && c < static_cast<int>(chunks.size()),
                   function << ": chunk " << c << " is not in [0, " << chunks.size()
                            << ") (virtual_pipeline_stages of this model)");
    return chunks[static_cast<std::size_t>(c)];
  }
  Backbone& chunk(const char* function, int c) {
    return const_cast<Backbone&>(std::as_const(*this).chunk(function, c));
  }
  // The chunk ending in the final norm (the whole backbone without virtual stages).
  const Backbone& head_chunk() const { return chunks.back(); }

  // Throws a UserError from `function` on a pipeline stage: it needs the whole model.
  void require_whole_model(const char* function) const {
    KMAMBA_REQUIRE(pipeline.stages() == 1, function << ": this model holds pipeline stage " << pipeline.stage()
                                                    << " of " << pipeline.stages()
                                                    << "; it trains through kmamba::Pipeline (stage_forward, "
                                                       "stage_backward), and whole-model calls need an unsplit "
                                                       "model (kmamba::gather_parameters)");
  }

  ConstTensor2<float, Mem> head_weight() const {
    return slab.template param<2>(config.tie_embeddings ? impl::embedding_name : impl::lm_head_name);
  }
  Tensor2<float, Mem> head_grad() const {
    return slab.template grad<2>(config.tie_embeddings ? impl::embedding_name : impl::lm_head_name);
  }

  void ensure_head_buffers(std::int64_t b, std::int64_t l) {
    if (batch == b && seqlen == l && padded_logits.is_allocated()) return;
    batch = b;
    seqlen = l;
    padded_logits =
        allocate_uninitialized<Tensor2<float, Mem>>("kmamba::lm::logits", b * l, config.padded_vocab_size());
    lse = allocate_uninitialized<Tensor1<float, Mem>>("kmamba::lm::lse", b * l);
  }

  void check_ids(const char* function, const ConstTensor2<std::int64_t, Mem>& ids, const char* name,
                 bool allow_ignore) const {
    KMAMBA_REQUIRE(ids.is_allocated() && ids.extent(0) > 0 && ids.extent(1) > 0,
                   function << ": " << name << " must be a non-empty (batch, seqlen) tensor, got shape "
                            << shape_of(ids).to_string());
    const ConstTensor1<std::int64_t, Mem> flat(ids.data(), ids.span());
    const impl::InvalidIds bad = impl::find_invalid_ids(ExecutionSpace(), flat, allow_ignore, ignore_index,
                                                        static_cast<std::int64_t>(config.vocab_size));
    KMAMBA_REQUIRE(bad.count == 0, function << ": " << bad.count << " " << name << " value(s) are outside [0, "
                                            << config.vocab_size << ")" << (allow_ignore ? " and not -100" : "")
                                            << "; the first is " << bad.first_value << " at flat position "
                                            << bad.first_row << " (batch " << bad.first_row / ids.extent(1)
                                            << ", position " << bad.first_row % ids.extent(1) << ")");
  }

  /// This model's part of the forward over ids through chunk `c`: the blocks from the embedding of
  /// ids (virtual stage 0) or from `input` (the previous virtual stage's output), and on the last
  /// virtual stage the head, which fills padded_logits. Keeps per-layer activations when `training`.
  void run_forward(const ExecutionSpace& exec, const ConstTensor2<std::int64_t, Mem>& ids, bool training,
                   const ConstTensor3<float, Mem>& input = {},  // (batch, seqlen, d_model) or empty
                   int c = 0) {
    const std::int64_t b = ids.extent(0), l = ids.extent(1);
    Backbone& blocks = chunks[static_cast<std::size_t>(c)];
    const Tensor3<float, Mem>& out = blocks.forward(exec, slab, b, l, training, [&](const Tensor2<float, Mem>& h0) {
      if (pipeline.first_chunk(c)) {
        const ConstTensor1<std::int64_t, Mem> flat_ids(ids.data(), ids.span());
        embedding_forward(exec, flat_ids, ConstTensor2<float, Mem>(slab.template param<2>(impl::embedding_name)), h0);
      } else {
        Kokkos::deep_copy(exec, h0, ConstTensor2<float, Mem>(input.data(), h0.extent(0), h0.extent(1)));
      }
    });
    if (!pipeline.last_chunk(c)) return;
    ensure_head_buffers(b, l);
    gemm(exec, Transpose::No, Transpose::Yes, 1.0f, ConstTensor2<float, Mem>(impl::token_rows(out)), head_weight(),
         0.0f, padded_logits, precision);
  }

  /// logits = norm_f(input) · head[:vocab_size]ᵀ for one token per sequence; `normed` receives
  /// the norm's output. Only the real vocabulary's rows of the head are read.
  void decode_head(const ExecutionSpace& exec, const Tensor2<float, Mem>& input,  // (batch, d_model)
                   const Tensor2<float, Mem>& normed,                             // (batch, d_model)
                   const Tensor2<float, Mem>& logits,                             // (batch, vocab_size)
                   const ConstTensor1<bf16, Mem>& bf16_parameters) const {        // (slab size) or empty
    rms_norm(exec, input, slab.template param<1>(Backbone::final_norm_name), static_cast<float>(config.norm_epsilon),
             normed);
    decode_logits(exec, normed, logits, bf16_parameters);
  }

  // logits = normed · headᵀ over the vocabulary's rows of the head (in bf16_parameters' copy where
  // step_product takes it).
  void decode_logits(const ExecutionSpace& exec, const Tensor2<float, Mem>& normed,  // (batch, d_model)
                     const Tensor2<float, Mem>& logits,                              // (batch, vocab_size)
                     const ConstTensor1<bf16, Mem>& bf16_parameters) const {         // (slab size) or empty
    const ConstTensor2<float, Mem> head = head_weight();                             // (padded_vocab, d_model)
    impl::step_product(
        exec, slab, bf16_parameters, ConstTensor2<float, Mem>(normed),
        ConstTensor2<float, Mem>(head.data(), static_cast<std::size_t>(config.vocab_size), head.extent(1)), 0.0f,
        logits, precision);
  }

  /// Under BFloat16, rounds the parameters into decode_parameters (allocated the first time) and
  /// hands the copy to `decode`'s steps; otherwise the steps multiply the slab's weights.
  template <class DecodeImpl>
  void prepare_decode_parameters(const ExecutionSpace& exec, DecodeImpl& decode) const {
    decode.bf16_parameters = {};
    if (precision == MatmulPrecision::BFloat16) {
      if (!decode_parameters.is_allocated()) {
        decode_parameters = allocate_uninitialized<Tensor1<bf16, Mem>>("kmamba::decode::bf16_parameters", slab.size());
      }
      const ConstTensor2<float, Mem> params(slab.params().data(), 1, slab.size());
      round_to_bf16(exec, params, Tensor2<bf16, Mem>(decode_parameters.data(), 1, slab.size()));
      decode.bf16_parameters = decode_parameters;
    }
    for (auto& cache : decode.stream.caches) cache->set_bf16_parameters(decode.bf16_parameters);
  }

  void copy_logits(const ExecutionSpace& exec, const Tensor3<float, Mem>& logits) const {
    const Tensor2<float, Mem> out(logits.data(), logits.extent(0) * logits.extent(1), logits.extent(2));
    Kokkos::parallel_for("kmamba::lm::copy_logits",
                         impl::light_weight(Kokkos::MDRangePolicy<ExecutionSpace, Kokkos::Rank<2>>(
                             exec, {0, 0}, {static_cast<int>(out.extent(0)), static_cast<int>(out.extent(1))})),
                         impl::DropPaddedColumns<Mem>{out, padded_logits});
  }

  LossResult loss_of(const ExecutionSpace& exec, const ConstTensor2<std::int64_t, Mem>& targets) {
    const ConstTensor1<std::int64_t, Mem> flat_targets(targets.data(), targets.span());
    const CrossEntropySum sum =
        cross_entropy_forward(exec, ConstTensor2<float, Mem>(padded_logits), flat_targets, ignore_index, lse);
    LossResult result;
    result.loss = sum.mean();
    result.tokens = sum.count;
    result.correct = sum.correct;
    return result;
  }

  /// Backward from the loss of the last training forward; padded_logits becomes dlogits.
  void run_backward(const ExecutionSpace& exec, const ConstTensor2<std::int64_t, Mem>& ids,
                    const ConstTensor2<std::int64_t, Mem>& targets, float scale) {
    head_backward(exec, targets, scale);
    blocks_backward(exec, ids, 0);
  }

  /// The loss's and the head's backward (the last virtual stage): padded_logits becomes dlogits, and
  /// d(loss)/d(normed_f) goes over head_chunk().output().
  void head_backward(const ExecutionSpace& exec, const ConstTensor2<std::int64_t, Mem>& targets, float scale) {
    const ConstTensor1<std::int64_t, Mem> flat_targets(targets.data(), targets.span());
    // The backward writes dlogits over the logits it reads, row by row (softmax − one-hot).
    cross_entropy_backward(exec, ConstTensor2<float, Mem>(padded_logits), flat_targets, ignore_index,
                           ConstTensor1<float, Mem>(lse), scale, padded_logits);
    // logits = normed_f · Wᵀ: dW += dlogitsᵀ · normed_f, then dnormed_f = dlogits · W over normed_f
    // (dlogits rounded once for both products under BFloat16).
    const Tensor2<float, Mem> normed = impl::token_rows(head_chunk().output());
    const GemmOperand<Mem> dlogits = gemm_operand(exec, ConstTensor2<float, Mem>(padded_logits), precision);
    gemm(exec, Transpose::Yes, Transpose::No, 1.0f, dlogits,
         gemm_operand(exec, ConstTensor2<float, Mem>(normed), precision), 1.0f, head_grad(), precision);
    gemm(exec, Transpose::No, Transpose::No, 1.0f, dlogits,
         gemm_operand(exec, ConstTensor2<float, Mem>(head_weight()), precision), 0.0f, normed, precision);
  }

  /// Chunk `c`'s blocks' backward from d(loss)/d(output) over its output(), and the embedding's on
  /// virtual stage 0. Returns d(loss)/d(h_0), the gradient of the chunk's input.
  const Tensor3<float, Mem>& blocks_backward(const ExecutionSpace& exec, const ConstTensor2<std::int64_t, Mem>& ids,
                                             int c) {
    Backbone& blocks = chunks[static_cast<std::size_t>(c)];
    const Tensor3<float, Mem>& dh0 = blocks.backward(exec, slab);
    if (pipeline.first_chunk(c)) {
      const ConstTensor1<std::int64_t, Mem> flat_ids(ids.data(), ids.span());
      embedding_backward(exec, flat_ids, ConstTensor2<float, Mem>(impl::token_rows(dh0)),
                         Tensor2<float, Mem>(slab.template grad<2>(impl::embedding_name)));
    }
    blocks.finish_backward(exec);
    return dh0;
  }
};

template <class ExecutionSpace>
struct DecodeState<ExecutionSpace>::Impl {
  using Mem = typename ExecutionSpace::memory_space;
  const void* owner = nullptr;  // the LanguageModel::State that made it
  int batch = 0;
  std::int64_t position = 0;
  typename impl::Backbone<ExecutionSpace>::RecurrentState stream;  // the mixers' caches, a step's buffers
  // Where the backend records the decode step as one graph (StepGraph::records): the step reads
  // its ids from and writes its logits to these fixed buffers, copied from and to the caller's.
  StepGraph<ExecutionSpace> graph;
  MatmulPrecision graph_precision = MatmulPrecision::Float32;  // the model's when the graph was recorded
  Tensor1<std::int64_t, Mem> step_ids;                         // (batch)
  Tensor2<float, Mem> step_logits;                             // (batch, vocab_size)
  ConstTensor1<bf16, Mem> bf16_parameters;  // the model's bf16 copy the steps multiply, or empty (fp32 slab)
};

template <class ExecutionSpace>
DecodeState<ExecutionSpace>::DecodeState(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
template <class ExecutionSpace>
DecodeState<ExecutionSpace>::~DecodeState() = default;
template <class ExecutionSpace>
DecodeState<ExecutionSpace>::DecodeState(DecodeState&&) noexcept = default;
template <class ExecutionSpace>
DecodeState<ExecutionSpace>& DecodeState<ExecutionSpace>::operator=(DecodeState&&) noexcept = default;

template <class ExecutionSpace>
int DecodeState<ExecutionSpace>::batch() const {
  return impl_->batch;
}
template <class ExecutionSpace>
std::int64_t DecodeState<ExecutionSpace>::position() const {
  return impl_->position;
}
template <class ExecutionSpace>
void DecodeState<ExecutionSpace>::set_step_graph(bool enabled) {
  impl_->graph = StepGraph<ExecutionSpace>(enabled);
}

template <class ExecutionSpace>
std::string DecodeState<ExecutionSpace>::step_graph_status() const {
  if (impl_->graph.recorded()) return "recorded";
  const std::string& reason = impl_->graph.fallback_reason();
  return reason.empty() ? "warming up" : "not recorded: " + reason;
}

template <class ExecutionSpace>
void DecodeState<ExecutionSpace>::reset(const ExecutionSpace& exec) {
  impl_->stream.reset(exec);
  impl_->position = 0;
}

template <class ExecutionSpace>
LanguageModel<ExecutionSpace>::LanguageModel(const ModelConfig& config)
    : state_(new State(config, ModelParallel(), PipelineParallel())) {}

template <class ExecutionSpace>
LanguageModel<ExecutionSpace>::LanguageModel(const ModelConfig& config, const ModelParallel& parallel)
    : state_(new State(config, parallel, PipelineParallel())) {}

template <class ExecutionSpace>
LanguageModel<ExecutionSpace>::LanguageModel(const ModelConfig& config, const ModelParallel& parallel,
                                             const PipelineParallel& stages)
    : state_(new State(config, parallel, stages)) {}

template <class ExecutionSpace>
void LanguageModel<ExecutionSpace>::set_activation_checkpointing(bool on) {
  for (auto& chunk : state_->chunks) chunk.set_activation_checkpointing(on);
}

template <class ExecutionSpace>
void LanguageModel<ExecutionSpace>::set_gradients_ready_hook(GradientsReadyHook hook) {
  // Chunk 0's backward runs last: it announces its blocks, then everything outside the blocks.
  state_->backbone().set_gradients_ready_hook(std::move(hook), state_->slab);
}

template <class ExecutionSpace>
std::vector<std::vector<std::pair<std::size_t, std::size_t>>> LanguageModel<ExecutionSpace>::gradients_ready_sequence()
    const {
  return state_->backbone().gradients_ready_sequence(state_->slab);
}

template <class ExecutionSpace>
bool LanguageModel<ExecutionSpace>::activation_checkpointing() const {
  return state_->backbone().activation_checkpointing();
}

template <class ExecutionSpace>
void LanguageModel<ExecutionSpace>::set_matmul_precision(MatmulPrecision precision) {
  state_->precision = precision;
  for (auto& chunk : state_->chunks) chunk.set_matmul_precision(precision);
}

template <class ExecutionSpace>
MatmulPrecision LanguageModel<ExecutionSpace>::matmul_precision() const {
  return state_->precision;
}

template <class ExecutionSpace>
void LanguageModel<ExecutionSpace>::set_sequence_ids(const ConstTensor2<std::int64_t, memory_space>& seq_idx) {
  for (auto& chunk : state_->chunks) chunk.set_sequence_ids(seq_idx);
}

template <class ExecutionSpace>
const ModelParallel& LanguageModel<ExecutionSpace>::parallel() const {
  return state_->parallel;
}

template <class ExecutionSpace>
const PipelineParallel& LanguageModel<ExecutionSpace>::pipeline() const {
  return state_->pipeline;
}

template <class ExecutionSpace>
StageLayers LanguageModel<ExecutionSpace>::layers(int chunk) const {
  return state_->chunk("kmamba::LanguageModel::layers", chunk).layers();
}

template <class ExecutionSpace>
std::vector<ShardedParameter> LanguageModel<ExecutionSpace>::sharded_parameters() const {
  std::vector<ShardedParameter> all;
  for (const auto& chunk : state_->chunks) {
    for (ShardedParameter& p : chunk.sharded_parameters()) all.push_back(std::move(p));
  }
  return all;
}

template <class ExecutionSpace>
LanguageModel<ExecutionSpace>::~LanguageModel() = default;
template <class ExecutionSpace>
LanguageModel<ExecutionSpace>::LanguageModel(LanguageModel&&) noexcept = default;
template <class ExecutionSpace>
LanguageModel<ExecutionSpace>& LanguageModel<ExecutionSpace>::operator=(LanguageModel&&) noexcept = default;

template <class ExecutionSpace>
const ModelConfig& LanguageModel<ExecutionSpace>::config() const {
  return state_->config;
}
template <class ExecutionSpace>
typename LanguageModel<ExecutionSpace>::Slab& LanguageModel<ExecutionSpace>::parameters() {
  return state_->slab;
}
template <class ExecutionSpace>
const typename LanguageModel<ExecutionSpace>::Slab& LanguageModel<ExecutionSpace>::parameters() const {
  return state_->slab;
}

template <class ExecutionSpace>
void LanguageModel<ExecutionSpace>::initialize(std::uint64_t seed) {
  const ExecutionSpace exec;
  State& s = *state_;
  Kokkos::deep_copy(exec, s.slab.params(), 0.0f);
  // One independent Philox stream per parameter group: the seed plus a distinct stream offset.
  const std::uint64_t stride = std::uint64_t(1) << 40;
  const float std_dev = static_cast<float>(s.config.initializer_range);
  if (s.slab.contains(impl::embedding_name)) {
    fill_normal(exec, s.slab.template param<2>(impl::embedding_name), seed, 0.0f, std_dev, 0);
  }
  if (s.slab.contains(impl::lm_head_name)) {
    fill_normal(exec, s.slab.template param<2>(impl::lm_head_name), seed, 0.0f, std_dev, stride);
  }
  for (const auto& chunk : s.chunks) chunk.initialize(exec, s.slab, seed);
  exec.fence();
}

template <class ExecutionSpace>
void LanguageModel<ExecutionSpace>::zero_grads(const ExecutionSpace& exec) {
  Kokkos::deep_copy(exec, state_->slab.grads(), 0.0f);
}

template <class ExecutionSpace>
void LanguageModel<ExecutionSpace>::forward(
    const ExecutionSpace& exec, const ConstTensor2<std::int64_t, memory_space>& ids,  // (batch, seqlen)
    const Tensor3<float, memory_space>& logits) {                                     // (batch, seqlen, vocab_size)
  constexpr const char* function = "kmamba::LanguageModel::forward";
  State& s = *state_;
  s.require_whole_model(function);
  s.check_ids(function, ids, "input id", false);
  check_shape(function, "logits", logits,
              {static_cast<std::int64_t>(ids.extent(0)), static_cast<std::int64_t>(ids.extent(1)), s.config.vocab_size},
              "(batch, seqlen, vocab_size) with batch, seqlen from ids");
  s.run_forward(exec, ids, false);
  s.copy_logits(exec, logits);
}

template <class ExecutionSpace>
LossResult LanguageModel<ExecutionSpace>::loss(
    const ExecutionSpace& exec, const ConstTensor2<std::int64_t, memory_space>& ids,  // (batch, seqlen)
    const ConstTensor2<std::int64_t, memory_space>& targets) {                        // (batch, seqlen)
  constexpr const char* function = "kmamba::LanguageModel::loss";
  State& s = *state_;
  s.require_whole_model(function);
  s.check_ids(function, ids, "input id", false);
  check_same_shape(function, "targets", targets, "ids", ids);
  s.check_ids(function, targets, "target", true);
  s.run_forward(exec, ids, false);
  return s.loss_of(exec, targets);
}

template <class ExecutionSpace>
LossResult LanguageModel<ExecutionSpace>::loss_and_backward(
    const ExecutionSpace& exec, const ConstTensor2<std::int64_t, memory_space>& ids,  // (batch, seqlen)
    const ConstTensor2<std::int64_t, memory_space>& targets,                          // (batch, seqlen)
    double weight, const Tensor3<float, memory_space>& logits) {                      // (batch, seqlen, vocab_size)
  constexpr const char* function = "kmamba::LanguageModel::loss_and_backward";
  State& s = *state_;
  s.require_whole_model(function);
  s.check_ids(function, ids, "input id", false);
  check_same_shape(function, "targets", targets, "ids", ids);
  s.check_ids(function, targets, "target", true);
  if (logits.is_allocated()) {
    check_shape(
        function, "logits", logits,
        {static_cast<std::int64_t>(ids.extent(0)), static_cast<std::int64_t>(ids.extent(1)), s.config.vocab_size},
        "(batch, seqlen, vocab_size) with batch, seqlen from ids");
  }
  s.run_forward(exec, ids, true);
  if (logits.is_allocated()) s.copy_logits(exec, logits);
  const LossResult result = s.loss_of(exec, targets);
  const float scale = result.tokens > 0 ? static_cast<float>(weight / static_cast<double>(result.tokens)) : 0.0f;
  s.run_backward(exec, ids, targets, scale);
  exec.fence();
  return result;
}

template <class ExecutionSpace>
LossResult LanguageModel<ExecutionSpace>::stage_forward(
    const ExecutionSpace& exec, const ConstTensor2<std::int64_t, memory_space>& ids,  // (batch, seqlen)
    const ConstTensor2<std::int64_t, memory_space>& targets,                          // (batch, seqlen) or empty
    const ConstTensor3<float, memory_space>& input,  // (batch, seqlen, d_model) or empty
    int chunk, std::size_t slot, bool training) {
  constexpr const char* function = "kmamba::LanguageModel::stage_forward";
  State& s = *state_;
  typename State::Backbone& blocks = s.chunk(function, chunk);
  KMAMBA_REQUIRE(
      ids.is_allocated() && ids.extent(0) > 0 && ids.extent(1) > 0,
      function << ": ids must be a non-empty (batch, seqlen) tensor, got shape " << shape_of(ids).to_string());
  if (s.pipeline.first_chunk(chunk)) s.check_ids(function, ids, "input id", false);
  if (!s.pipeline.first_chunk(chunk)) {
    check_shape(function, "input", input,
                {static_cast<std::int64_t>(ids.extent(0)), static_cast<std::int64_t>(ids.extent(1)), s.config.d_model},
                "(batch, seqlen, d_model) with batch, seqlen from ids: the previous stage's output");
  }
  if (s.pipeline.last_chunk(chunk)) {
    check_same_shape(function, "targets", targets, "ids", ids);
    s.check_ids(function, targets, "target", true);
  }
  if (training) blocks.use_activation_slot(slot);
  s.run_forward(exec, ids, training, input, chunk);
  if (!s.pipeline.last_chunk(chunk)) return LossResult();
  const LossResult result = s.loss_of(exec, targets);
  if (training) {
    s.stage_targets = targets;
    s.stage_tokens = result.tokens;
  }
  return result;
}

template <class ExecutionSpace>
const Tensor3<float, typename ExecutionSpace::memory_space>& LanguageModel<ExecutionSpace>::stage_output(
    int chunk) const {
  return state_->chunk("kmamba::LanguageModel::stage_output", chunk).output();
}

template <class ExecutionSpace>
Tensor3<float, typename ExecutionSpace::memory_space> LanguageModel<ExecutionSpace>::stage_backward(
    const ExecutionSpace& exec, const ConstTensor2<std::int64_t, memory_space>& ids,  // (batch, seqlen)
    const ConstTensor3<float, memory_space>& output_grad,  // (batch, seqlen, d_model) or empty
    double weight, int chunk, std::size_t slot) {
  constexpr const char* function = "kmamba::LanguageModel::stage_backward";
  State& s = *state_;
  typename State::Backbone& blocks = s.chunk(function, chunk);
  blocks.use_activation_slot(slot);
  const Tensor3<float, memory_space>& output = blocks.output();
  KMAMBA_REQUIRE(output.extent(0) == ids.extent(0) && output.extent(1) == ids.extent(1),
                 function << ": ids has shape " << shape_of(ids).to_string() << " but slot " << slot
                          << " holds a micro-batch of shape " << shape_of(output).to_string());
  if (s.pipeline.last_chunk(chunk)) {
    KMAMBA_REQUIRE(s.stage_targets.is_allocated() && s.stage_targets.extent(0) == ids.extent(0) &&
                       s.stage_targets.extent(1) == ids.extent(1),
                   function << ": the last stage runs a micro-batch's backward right after its stage_forward");
    const float scale = s.stage_tokens > 0 ? static_cast<float>(weight / static_cast<double>(s.stage_tokens)) : 0.0f;
    s.head_backward(exec, s.stage_targets, scale);
    s.stage_targets = ConstTensor2<std::int64_t, memory_space>();
  } else {
    check_shape(function, "output_grad", output_grad, shape_of(output), "(batch, seqlen, d_model) of stage_output()");
    Kokkos::deep_copy(exec, output, output_grad);
  }
  const Tensor3<float, memory_space>& input_grad = s.blocks_backward(exec, ids, chunk);
  return s.pipeline.first_chunk(chunk) ? Tensor3<float, memory_space>() : input_grad;
}

template <class ExecutionSpace>
DecodeState<ExecutionSpace> LanguageModel<ExecutionSpace>::make_decode_state(int batch) const {
  using Mem = memory_space;
  KMAMBA_REQUIRE(batch >= 1, "kmamba::LanguageModel::make_decode_state: batch must be at least 1, got " << batch);
  const State& s = *state_;
  std::unique_ptr<typename DecodeState<ExecutionSpace>::Impl> impl(new typename DecodeState<ExecutionSpace>::Impl());
  impl->owner = &s;
  impl->batch = batch;
  impl->graph_precision = s.precision;
  impl->stream = s.backbone().make_state(batch, "kmamba::decode");
  const ExecutionSpace exec;
  s.prepare_decode_parameters(exec, *impl);
  exec.fence();
  if (StepGraph<ExecutionSpace>::records) {
    impl->step_ids = allocate_uninitialized<Tensor1<std::int64_t, Mem>>("kmamba::decode::step_ids", batch);
    impl->step_logits =
        allocate_uninitialized<Tensor2<float, Mem>>("kmamba::decode::step_logits", batch, s.config.vocab_size);
  }
  return DecodeState<ExecutionSpace>(std::move(impl));
}

namespace {

// The state's internals after checking that `model_state` made it.
template <class Impl>
Impl& decode_impl(const char* function, const std::unique_ptr<Impl>& impl, const void* model_state) {
  KMAMBA_REQUIRE(impl != nullptr, function << ": the DecodeState was moved from");
  KMAMBA_REQUIRE(impl->owner == model_state, function << ": the DecodeState was made by another LanguageModel");
  return *impl;
}

}  // namespace

template <class ExecutionSpace>
void LanguageModel<ExecutionSpace>::prefill(const ExecutionSpace& exec,
                                            const ConstTensor2<std::int64_t, memory_space>& ids,  // (batch, seqlen)
                                            DecodeState<ExecutionSpace>& decode,
                                            const Tensor2<float, memory_space>& last_logits) {  // (batch, vocab_size)
  using Mem = memory_space;
  constexpr const char* function = "kmamba::LanguageModel::prefill";
  State& s = *state_;
  s.require_whole_model(function);
  auto& d = decode_impl(function, decode.impl_, &s);
  KMAMBA_REQUIRE(ids.span_is_contiguous(), function << ": ids must be contiguous");
  s.check_ids(function, ids, "input id", false);
  const std::int64_t b = static_cast<std::int64_t>(ids.extent(0)), l = static_cast<std::int64_t>(ids.extent(1));
  KMAMBA_REQUIRE(b == d.batch, function << ": ids has shape " << shape_of(ids).to_string()
                                        << " but the DecodeState holds " << d.batch << " sequences");
  if (last_logits.is_allocated()) {
    check_shape(function, "last_logits", last_logits, {b, static_cast<std::int64_t>(s.config.vocab_size)},
                "(batch, vocab_size)");
  }
  // The steps after a prefill multiply the parameters as they are now (under BFloat16, rounded
  // again here: the parameters may have changed since the state was made).
  s.prepare_decode_parameters(exec, d);
  const ConstTensor1<std::int64_t, Mem> flat_ids(ids.data(), ids.span());
  const ConstTensor2<float, Mem> embedding(s.slab.template param<2>(impl::embedding_name));
  const auto segment = s.backbone().prefill(
      exec, s.slab, b, l, [&](const Tensor2<float, Mem>& h0) { embedding_forward(exec, flat_ids, embedding, h0); },
      d.stream, "kmamba::decode");
  d.position += l;
  if (!last_logits.is_allocated()) return;
  Kokkos::parallel_for(
      "kmamba::decode::prefill_last_position",
      Kokkos::MDRangePolicy<ExecutionSpace, Kokkos::Rank<2>>(exec, {0, 0}, {b, s.config.d_model}),
      impl::LastPositionSum<Mem>{d.stream.residual, segment.residual, segment.mixed, static_cast<int>(l - 1)});
  s.decode_head(exec, d.stream.residual, d.stream.normed, last_logits, d.bf16_parameters);
}

template <class ExecutionSpace>
void LanguageModel<ExecutionSpace>::decode_step(const ExecutionSpace& exec,
                                                const ConstTensor1<std::int64_t, memory_space>& ids,  // (batch)
                                                DecodeState<ExecutionSpace>& decode,
                                                const Tensor2<float, memory_space>& logits,  // (batch, vocab_size)
                                                const bool check_ids) const {
  using Mem = memory_space;
  constexpr const char* function = "kmamba::LanguageModel::decode_step";
  const State& s = *state_;
  s.require_whole_model(function);
  auto& d = decode_impl(function, decode.impl_, &s);
  const std::int64_t batch = d.batch, vocab = s.config.vocab_size;
  check_shape(function, "ids", ids, {batch}, "(batch) of the DecodeState");
  check_shape(function, "logits", logits, {batch, vocab}, "(batch, vocab_size)");
  check_allocated(function, "logits", logits);
  // The ids are checked here, blocking, so that the step itself never waits on the device.
  const ConstTensor2<float, Mem> embedding(s.slab.template param<2>(impl::embedding_name));
  if (check_ids) {
    check_embedding_ids(exec, ids, static_cast<std::int64_t>(embedding.extent(0)), "kmamba::embedding_forward");
  }
  // The step: the same kernels on the same buffers for every token (recorded once where the
  // backend records graphs).
  const auto step = [&](const ExecutionSpace& e, const ConstTensor1<std::int64_t, Mem>& step_ids,
                        const Tensor2<float, Mem>& step_logits) {
    embedding_forward(e, step_ids, embedding, d.stream.residual, false);
    s.backbone().step(e, s.slab, d.stream);
    s.decode_logits(e, d.stream.normed, step_logits, d.bf16_parameters);
  };
  // A tensor-parallel step all-reduces through the communicator, which a recorded graph would
  // not repeat: split models run their steps normally.
  if (StepGraph<ExecutionSpace>::records && s.parallel.tensor_size() == 1) {
    if (d.graph_precision != s.precision) {  // the recorded kernels carry the old precision
      exec.fence();                          // the last replay has finished before the graph goes
      d.graph.invalidate();
      d.graph_precision = s.precision;
    }
    Kokkos::deep_copy(exec, d.step_ids, ids);
    d.graph.run(exec, [&](const ExecutionSpace& e) { step(e, d.step_ids, d.step_logits); });
    Kokkos::deep_copy(exec, logits, d.step_logits);
  } else {
    step(exec, ids, logits);
  }
  d.position += 1;
}

namespace {

bool is_directory(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

void make_directories(const std::string& dir) {
  std::string partial;
  std::size_t pos = 0;
  while (pos != std::string::npos) {
    pos = dir.find('/', pos + 1);
    partial = dir.substr(0, pos);
    if (partial.empty() || is_directory(partial)) continue;
    KMAMBA_REQUIRE(::mkdir(partial.c_str(), 0755) == 0 || errno == EEXIST,
                   "kmamba: cannot create directory '" << partial << "': " << std::strerror(errno));
  }
}

}  // namespace

namespace {

// The tensor of `file` that holds parameter `name`: mamba_ssm spells the embedding its own way.
std::string stored_name(const SafeTensorsReader& file, const std::string& name) {
  if (name == impl::embedding_name && !file.contains(name) && file.contains(impl::mamba_ssm_embedding_name)) {
    return impl::mamba_ssm_embedding_name;
  }
  return name;
}

// The sizes config.json states against the tensors of model.safetensors, before anything sized by
// them is allocated: a num_hidden_layers of 20000 or a vocab_size of 2e9 beside a small checkpoint
// is an error naming the field, not gigabytes of memory.
void check_sizes_against_file(const ModelConfig& c, const SafeTensorsReader& file, const std::string& config_path) {
  const char* function = "kmamba::LanguageModel::load";
  const std::string embedding = stored_name(file, impl::embedding_name);
  KMAMBA_REQUIRE(file.contains(embedding), function << ": '" << file.path() << "' has no tensor '"
                                                    << impl::embedding_name << "' (the embedding)");
  const std::vector<std::int64_t>& shape = file.info(embedding).shape;
  KMAMBA_REQUIRE(shape.size() == 2 && shape[0] == c.padded_vocab_size(),
                 function << ": '" << config_path << "' gives vocab_size " << c.vocab_size << " ("
                          << c.padded_vocab_size() << " embedding rows), but the embedding '" << embedding << "' of '"
                          << file.path() << "' has shape " << Shape(shape).to_string());
  KMAMBA_REQUIRE(shape[1] == c.d_model, function << ": '" << config_path << "' gives hidden_size (d_model) "
                                                 << c.d_model << ", but the embedding '" << embedding << "' of '"
                                                 << file.path() << "' has shape " << Shape(shape).to_string());
  impl::check_layers_against_file(c, file, config_path, function);
}

}  // namespace

template <class ExecutionSpace>
LanguageModel<ExecutionSpace> LanguageModel<ExecutionSpace>::load(const std::string& dir) {
  KMAMBA_REQUIRE(is_directory(dir), "kmamba::LanguageModel::load: '"
                                        << dir
                                        << "' is not a directory (expected a "
                                           "checkpoint directory with config.json and model.safetensors)");
  const std::string config_path = dir + "/config.json";
  const ModelConfig config = ModelConfig::load(config_path);
  const SafeTensorsReader file(dir + "/model.safetensors");
  check_sizes_against_file(config, file, config_path);
  {
    // Every parameter's shape against the file's header, still before any allocation.
    const auto whole = State::make_chunks(config, ModelParallel(), PipelineParallel());
    Slab declared;
    State::declare_parameters(config, PipelineParallel(), whole, declared);
    for (const auto& entry : declared.entries()) {
      KMAMBA_REQUIRE(file.contains(stored_name(file, entry.name)),
                     "kmamba::LanguageModel::load: '" << file.path() << "' has no tensor '" << entry.name << "' (shape "
                                                      << Shape(entry.shape).to_string() << ") required by config.json");
      file.check_shape(stored_name(file, entry.name), entry.shape);
    }
  }
  LanguageModel model(config);
  State& s = *model.state_;
  std::set<std::string> used;
  for (const auto& entry : s.slab.entries()) {
    const std::string stored = stored_name(file, entry.name);
    const std::vector<float> values = file.read_f32(stored);
    const Kokkos::View<const float*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>> host(values.data(),
                                                                                                      values.size());
    Kokkos::deep_copy(Kokkos::subview(s.slab.params(), std::make_pair(entry.offset, entry.offset + entry.size)), host);
    used.insert(stored);
  }
  for (const std::string& name : file.names()) {
    if (used.count(name) != 0) continue;
    // mamba_ssm files carry the tied head although it is the embedding.
    KMAMBA_REQUIRE(name == impl::lm_head_name && s.config.tie_embeddings,
                   "kmamba::LanguageModel::load: '" << file.path() << "' has tensor '" << name
                                                    << "', which this config.json (" << mixer_name(s.config.mixer)
                                                    << ", " << s.config.n_layer << " layers) does not use");
  }
  return model;
}

template <class ExecutionSpace>
void LanguageModel<ExecutionSpace>::save(const std::string& dir) const {
  const State& s = *state_;
  s.require_whole_model("kmamba::LanguageModel::save");
  KMAMBA_REQUIRE(s.parallel.tensor_size() == 1,
                 "kmamba::LanguageModel::save: this model holds one tensor-parallel shard of "
                     << s.parallel.tensor_size()
                     << "; gather it into an unsplit model first (kmamba::gather_parameters)");
  make_directories(dir);
  SafeTensorsWriter file;
  const auto host = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), s.slab.params());
  for (const auto& entry : s.slab.entries()) {
    file.add(entry.name, DType::F32, entry.shape, host.data() + entry.offset);
  }
  file.set_metadata("format", "pt");
  file.write(dir + "/model.safetensors");
  s.config.save(dir + "/config.json");
}

#define KMAMBA_INSTANTIATE(Exec)    \
  template class DecodeState<Exec>; \
  template class LanguageModel<Exec>;
KMAMBA_FOR_EACH_BACKEND(KMAMBA_INSTANTIATE)
#undef KMAMBA_INSTANTIATE

}  // namespace kmamba
