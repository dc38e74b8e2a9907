// The 1F1B pipeline over the stages of a LanguageModel.
#include <kmamba/models/Pipeline.hpp>

#include <kmamba/core/Error.hpp>
#include <kmamba/core/ForEachBackend.hpp>

namespace kmamba {

// One stage's forward and backward for run_one_f_one_b, over the step's micro-batches.
template <class ExecutionSpace>
class Pipeline<ExecutionSpace>::StageWork : public PipelineStageWork<ExecutionSpace> {
 public:
  using Activation = typename PipelineStageWork<ExecutionSpace>::Activation;
  using Mem = memory_space;

  StageWork(const ExecutionSpace& exec, LanguageModel<ExecutionSpace>& model, const std::vector<MicroBatch>& batches)
      : exec_(exec), model_(model), batches_(batches) {}

  std::size_t activation_elements(int mb) const override {
    const MicroBatch& b = batch(mb);
    return b.ids.extent(0) * b.ids.extent(1) * static_cast<std::size_t>(model_.config().d_model);
  }

  Activation forward(int mb, const Activation& input) override {
    const MicroBatch& b = batch(mb);
    model_.set_sequence_ids(b.seq_idx);
    const LossResult r = model_.stage_forward(exec_, b.ids, b.targets, as_sequence(b, input), slot(mb));
    loss_sum += r.loss * static_cast<double>(r.tokens);
    counts.tokens += r.tokens;
    counts.correct += r.correct;
    if (model_.pipeline().last_stage()) return Activation();
    const Tensor3<float, Mem>& out = model_.stage_output();
    return Activation(out.data(), out.span());
  }

  Activation backward(int mb, const Activation& output_grad) override {
    const MicroBatch& b = batch(mb);
    model_.set_sequence_ids(b.seq_idx);
    const Tensor3<float, Mem> input_grad =
        model_.stage_backward(exec_, b.ids, as_sequence(b, output_grad), b.weight, slot(mb));
    return Activation(input_grad.data(), input_grad.span());
  }

  double loss_sum = 0.0;  // Σ loss · tokens over the micro-batches (last stage)
  LossResult counts;

 private:
  const MicroBatch& batch(int mb) const { return batches_[static_cast<std::size_t>(mb)]; }
  // The micro-batches in flight on a stage before the last are consecutive and at most p of them,
  // so mb mod p tells their slots apart; the last stage has one in flight.
  std::size_t slot(int mb) const {
    return model_.pipeline().last_stage() ? 0u : static_cast<std::size_t>(mb % model_.pipeline().stages());
  }
  ConstTensor3<float, Mem> as_sequence(const MicroBatch& b, const Activation& a) const {
    if (a.size() == 0) return ConstTensor3<float, Mem>();
    return ConstTensor3<float, Mem>(a.data(), b.ids.extent(0), b.ids.extent(1),
                                    static_cast<std::size_t>(model_.config().d_model));
  }

  ExecutionSpace exec_;
  LanguageModel<ExecutionSpace>& model_;
  const std::vector<MicroBatch>& batches_;
};

template <class ExecutionSpace>
Pipeline<ExecutionSpace>::Pipeline(LanguageModel<ExecutionSpace>& model)
    : model_(&model), pipeline_(model.pipeline().pipeline) {
  KMAMBA_REQUIRE(pipeline_ != nullptr,
                 "kmamba::Pipeline: the model is not split into pipeline stages "
                 "(make it with a PipelineParallel communicator)");
  const int stage = pipeline_->rank(), last = pipeline_->size() - 1;
  if (last > 0) ends_ = pipeline_->split(stage == 0 || stage == last ? 0 : 1, stage, "pp_ends");
}

template <class ExecutionSpace>
Pipeline<ExecutionSpace>::~Pipeline() = default;

template <class ExecutionSpace>
LossResult Pipeline<ExecutionSpace>::from_last_stage(double loss_sum, const LossResult& counts) const {
  LossResult total;
  total.tokens = pipeline_->all_reduce_value(counts.tokens);
  total.correct = pipeline_->all_reduce_value(counts.correct);
  const double sum = pipeline_->all_reduce_value(loss_sum);
  total.loss = total.tokens > 0 ? sum / static_cast<double>(total.tokens) : 0.0;
  return total;
}

template <class ExecutionSpace>
LossResult Pipeline<ExecutionSpace>::loss_and_backward(const ExecutionSpace& exec,
                                                       const std::vector<MicroBatch>& micro_batches) {
  KMAMBA_REQUIRE(!micro_batches.empty(), "kmamba::Pipeline::loss_and_backward: no micro-batches");
  StageWork work(exec, *model_, micro_batches);
  timing_ = run_one_f_one_b(exec, *pipeline_, static_cast<int>(micro_batches.size()), work);
  model_->set_sequence_ids({});
  const PipelineParallel& stages = model_->pipeline();
  const bool holds_tied_copy = model_->config().tie_embeddings && (stages.first_stage() || stages.last_stage());
  if (ends_ && holds_tied_copy) {
    ends_->all_reduce(exec, model_->parameters().template grad<2>(embedding_parameter_name));
  }
  exec.fence();
  return from_last_stage(work.loss_sum, work.counts);
}

template <class ExecutionSpace>
LossResult Pipeline<ExecutionSpace>::loss(const ExecutionSpace& exec, const MicroBatch& batch) {
  using Mem = memory_space;
  const PipelineParallel& stages = model_->pipeline();
  const int stage = stages.stage();
  const std::int64_t b = static_cast<std::int64_t>(batch.ids.extent(0)),
                     l = static_cast<std::int64_t>(batch.ids.extent(1));
  Tensor3<float, Mem> input;
  if (!stages.first_stage()) {
    input = Tensor3<float, Mem>("kmamba::pipeline::eval_input", b, l, model_->config().d_model);
    pipeline_->recv(exec, Kokkos::View<float*, Mem>(input.data(), input.span()), stage - 1);
  }
  model_->set_sequence_ids(batch.seq_idx);
  const LossResult r = model_->stage_forward(exec, batch.ids, batch.targets, ConstTensor3<float, Mem>(input), 0, false);
  model_->set_sequence_ids({});
  if (!stages.last_stage()) {
    const Tensor3<float, Mem>& out = model_->stage_output();
    pipeline_->send(exec, Kokkos::View<float*, Mem>(out.data(), out.span()), stage + 1);
  }
  exec.fence();
  return from_last_stage(r.loss * static_cast<double>(r.tokens), r);
}

#define KMAMBA_INSTANTIATE(Exec) template class Pipeline<Exec>;
KMAMBA_FOR_EACH_BACKEND(KMAMBA_INSTANTIATE)
#undef KMAMBA_INSTANTIATE

}  // namespace kmamba
