// Pipeline-parallel training of a LanguageModel split into stages (PipelineStage.hpp;
// docs/distributed.md §4): the micro-batches of one optimizer step run through the stages in the 1F1B
// order (PipelineSchedule.hpp), each stage's output — the (batch, seqlen, d_model) residual stream —
// sent to the next stage and its gradient sent back with the communicator's point-to-point calls.
//
//   kmamba::LanguageModel<Exec> model(config, {&mesh.tensor(), &mesh.sequence()}, {&mesh.pipeline()});
//   model.initialize(seed);
//   kmamba::Pipeline<Exec> pipeline(model);
//   model.zero_grads(exec);
//   kmamba::LossResult r = pipeline.loss_and_backward(exec, micro_batches);   // on every stage
//   ... DataParallel::reduce_gradients, grad_norm (over the whole mesh), step ...
//
// Every stage of a pipeline sees the same micro-batches (the first reads the ids, the last the
// targets). A stage before the last keeps the block inputs of each micro-batch in flight (at most p − s
// on stage s) and recomputes its blocks in backward; the last stage runs each micro-batch's backward
// right after its forward, with or without activation checkpointing.
//
// A model with virtual stages (PipelineParallel::virtual_stages v > 1: v chunks per rank) runs the
// interleaved 1F1B schedule instead (InterleavedSchedule.hpp; m a multiple of p), its bubble
// (p − 1)/(v·m + p − 1) instead of (p − 1)/(m + p − 1). Each chunk keeps the block inputs of its
// micro-batches in flight in slots keyed by (chunk, micro-batch), reused once their backward has run;
// the last virtual stage runs each micro-batch's backward within its forward and keeps only the
// input gradient until the schedule asks for it.
#ifndef KMAMBA_MODELS_PIPELINE_HPP
#define KMAMBA_MODELS_PIPELINE_HPP

#include <kmamba/core/Tensor.hpp>
#include <kmamba/models/LanguageModel.hpp>
#include <kmamba/parallel/PipelineSchedule.hpp>

#include <cstdint>
#include <memory>
#include <vector>

namespace kmamba {

/// One micro-batch of a pipeline step, in the model's memory space.
template <class MemorySpace>
struct PipelineMicroBatch {
  ConstTensor2<std::int64_t, MemorySpace> ids;      ///< (batch, seqlen)
  ConstTensor2<std::int64_t, MemorySpace> targets;  ///< (batch, seqlen); read by the last stage
  ConstTensor2<std::int64_t, MemorySpace> seq_idx;  ///< (batch, seqlen) packed sequence ids, or empty
  /// Its weight in the step's gradient (its predicted tokens over the step's, as loss_and_backward).
  double weight = 1.0;
};

template <class ExecutionSpace>
class Pipeline {
 public:
  using memory_space = typename ExecutionSpace::memory_space;
  using MicroBatch = PipelineMicroBatch<memory_space>;

  /// Drives `model` (a stage of model.pipeline(); kept by reference: it must outlive this object).
  /// Collective over the pipeline (it splits off the group of the first and the last stage, which
  /// sums the tied embedding's gradient).
  explicit Pipeline(LanguageModel<ExecutionSpace>& model);
  ~Pipeline();

  /// Forward and backward of every micro-batch through the stages in the 1F1B order (interleaved
  /// with virtual stages; a UserError unless the micro-batches are a multiple of p then): ADDS
  /// Σ_i weight_i · ∇loss_i into this stage's gradients, then, with a tied head, sums the
  /// embedding's gradient over the first and the last stage (so both copies take the same step).
  /// Returns the mean loss over the micro-batches' predicted tokens, their tokens and correct
  /// predictions — the same on every stage. Collective over the pipeline. Blocking.
  LossResult loss_and_backward(const ExecutionSpace& exec, const std::vector<MicroBatch>& micro_batches);
  /// The loss of one batch (forward only, the virtual stages in turn), on every stage. Collective
  /// over the pipeline. Blocking.
  LossResult loss(const ExecutionSpace& exec, const MicroBatch& batch);
  /// This stage's timing of the last loss_and_backward (its idle share is the bubble it saw).
  const PipelineTiming& timing() const { return timing_; }

 private:
  class MicroBatches;
  class StageWork;
  class ChunkWork;
  // After the schedule: sums the tied embedding's gradient over the ends and returns the loss of
  // `work`'s micro-batches from the last stage.
  LossResult finish(const ExecutionSpace& exec, const MicroBatches& work);
  // The stages' results summed over the pipeline (only the last stage's are not zero).
  LossResult from_last_stage(double loss_sum, const LossResult& counts) const;

  LanguageModel<ExecutionSpace>* model_;
  const Communicator* pipeline_;
  std::unique_ptr<Communicator> ends_;  // stages 0 and p − 1 (p > 1)
  PipelineTiming timing_;
};

}  // namespace kmamba

#endif
