// The 1F1B pipeline over the stages of a LanguageModel.
#include <kmamba/models/Pipeline.hpp>

#include <kmamba/core/Error.hpp>
#include <kmamba/core/ForEachBackend.hpp>
#include <kmamba/parallel/InterleavedSchedule.hpp>

#include <map>
#include <set>
#include <utility>

namespace kmamba {

// The step's micro-batches and what a forward or backward of one of them through one chunk of this
// rank does; the plain and the interleaved schedule's works below share it.
template <class ExecutionSpace>
class Pipeline<ExecutionSpace>::MicroBatches {
 public:
  using Activation = Kokkos::View<float*, memory_space>;
  using Mem = memory_space;

  MicroBatches(const ExecutionSpace& exec, LanguageModel<ExecutionSpace>& model, const std::vector<MicroBatch>& batches)
      : exec_(exec), model_(model), batches_(batches) {}

  /// Elements of the residual stream of micro-batch `mb` (an activation between stages).
  std::size_t elements(int mb) const {
    const MicroBatch& b = batch(mb);
    return b.ids.extent(0) * b.ids.extent(1) * static_cast<std::size_t>(model_.config().d_model);
  }

  /// The training forward of `mb` through chunk `chunk` into `slot`; returns the chunk's output (an
  /// empty View on the last virtual stage, whose loss is added to the sums).
  Activation forward(int chunk, int mb, const Activation& input, std::size_t slot) {
    const MicroBatch& b = batch(mb);
    model_.set_sequence_ids(b.seq_idx);
    const LossResult r = model_.stage_forward(exec_, b.ids, b.targets, as_sequence(b, input), chunk, slot);
    loss_sum += r.loss * static_cast<double>(r.tokens);
    counts.tokens += r.tokens;
    counts.correct += r.correct;
    if (model_.pipeline().last_chunk(chunk)) return Activation();
    const Tensor3<float, Mem>& out = model_.stage_output(chunk);
    return Activation(out.data(), out.span());
  }

  /// The backward of `mb` through chunk `chunk` from its `slot`; returns the gradient of the chunk's
  /// input (empty on virtual stage 0), valid until the chunk's next call.
  Activation backward(int chunk, int mb, const Activation& output_grad, std::size_t slot) {
    const MicroBatch& b = batch(mb);
    model_.set_sequence_ids(b.seq_idx);
    const Tensor3<float, Mem> input_grad =
        model_.stage_backward(exec_, b.ids, as_sequence(b, output_grad), b.weight, chunk, slot);
    return Activation(input_grad.data(), input_grad.span());
  }

  const PipelineParallel& stages() const { return model_.pipeline(); }

  double loss_sum = 0.0;  // Σ loss · tokens over the micro-batches (last stage)
  LossResult counts;

 protected:
  const ExecutionSpace& exec() const { return exec_; }

 private:
  const MicroBatch& batch(int mb) const { return batches_[static_cast<std::size_t>(mb)]; }
  ConstTensor3<float, Mem> as_sequence(const MicroBatch& b, const Activation& a) const {
    if (a.size() == 0) return ConstTensor3<float, Mem>();
    return ConstTensor3<float, Mem>(a.data(), b.ids.extent(0), b.ids.extent(1),
                                    static_cast<std::size_t>(model_.config().d_model));
  }

  ExecutionSpace exec_;
  LanguageModel<ExecutionSpace>& model_;
  const std::vector<MicroBatch>& batches_;
};

// One stage's forward and backward for run_one_f_one_b, over the step's micro-batches.
template <class ExecutionSpace>
class Pipeline<ExecutionSpace>::StageWork : public PipelineStageWork<ExecutionSpace>, public MicroBatches {
 public:
  using Activation = typename PipelineStageWork<ExecutionSpace>::Activation;
  using MicroBatches::MicroBatches;

  std::size_t activation_elements(int mb) const override { return this->elements(mb); }
  Activation forward(int mb, const Activation& input) override { return MicroBatches::forward(0, mb, input, slot(mb)); }
  Activation backward(int mb, const Activation& output_grad) override {
    return MicroBatches::backward(0, mb, output_grad, slot(mb));
  }

 private:
  // The micro-batches in flight on a stage before the last are consecutive and at most p of them,
  // so mb mod p tells their slots apart; the last stage has one in flight.
  std::size_t slot(int mb) const {
    return this->stages().last_stage() ? 0u : static_cast<std::size_t>(mb % this->stages().stages());
  }
};

// The chunks' forwards and backwards for run_interleaved_one_f_one_b. A chunk's micro-batches in
// flight take the lowest free slots of the chunk (keyed by (chunk, micro-batch) until their backward),
// so each chunk holds as many slots as it ever has micro-batches in flight. The last virtual stage
// runs a micro-batch's backward within its forward (the loss's buffers hold one micro-batch) and
// keeps the input gradient for the backward call.
template <class ExecutionSpace>
class Pipeline<ExecutionSpace>::ChunkWork : public VirtualStageWork<ExecutionSpace>, public MicroBatches {
 public:
  using Activation = typename VirtualStageWork<ExecutionSpace>::Activation;
  using Key = std::pair<int, int>;  // (chunk, micro-batch)

  ChunkWork(const ExecutionSpace& exec, LanguageModel<ExecutionSpace>& model, const std::vector<MicroBatch>& batches)
      : MicroBatches(exec, model, batches), pools_(static_cast<std::size_t>(model.pipeline().virtual_stages)) {}

  std::size_t activation_elements(int mb) const override { return this->elements(mb); }

  Activation forward(int chunk, int mb, const Activation& input) override {
    if (!this->stages().last_chunk(chunk)) return MicroBatches::forward(chunk, mb, input, acquire(chunk, mb));
    MicroBatches::forward(chunk, mb, input, 0);
    const Activation input_grad = MicroBatches::backward(chunk, mb, Activation(), 0);
    Activation kept("kmamba::pipeline::last_stage_input_grad", input_grad.size());
    Kokkos::deep_copy(this->exec(), kept, input_grad);
    head_grads_[{chunk, mb}] = kept;
    return Activation();
  }

  Activation backward(int chunk, int mb, const Activation& output_grad) override {
    if (!this->stages().last_chunk(chunk)) return MicroBatches::backward(chunk, mb, output_grad, release(chunk, mb));
    const auto found = head_grads_.find({chunk, mb});
    KMAMBA_ASSERT(found != head_grads_.end(),
                  "backward of chunk " << chunk << ", micro-batch " << mb << " before its forward");
    const Activation input_grad = found->second;
    head_grads_.erase(found);
    return input_grad;
  }

 private:
  struct SlotPool {
    std::set<std::size_t> free;  // slots whose micro-batch's backward has run
    std::size_t count = 0;       // slots handed out so far
  };

  std::size_t acquire(int chunk, int mb) {
    SlotPool& pool = pools_[static_cast<std::size_t>(chunk)];
    std::size_t slot = pool.count;
    if (pool.free.empty()) {
      ++pool.count;
    } else {
      slot = *pool.free.begin();
      pool.free.erase(pool.free.begin());
    }
    slots_[{chunk, mb}] = slot;
    return slot;
  }
  std::size_t release(int chunk, int mb) {
    const auto found = slots_.find({chunk, mb});
    KMAMBA_ASSERT(found != slots_.end(),
                  "backward of chunk " << chunk << ", micro-batch " << mb << " before its forward");
    const std::size_t slot = found->second;
    slots_.erase(found);
    pools_[static_cast<std::size_t>(chunk)].free.insert(slot);
    return slot;
  }

  std::map<Key, std::size_t> slots_;      // the slots of the micro-batches in flight
  std::vector<SlotPool> pools_;           // per chunk
  std::map<Key, Activation> head_grads_;  // the last virtual stage's input gradients, until asked
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
  const int m = static_cast<int>(micro_batches.size()), v = model_->pipeline().virtual_stages;
  if (v > 1) {
    ChunkWork work(exec, *model_, micro_batches);
    timing_ = run_interleaved_one_f_one_b(exec, *pipeline_, v, m, work);
    return finish(exec, work);
  }
  StageWork work(exec, *model_, micro_batches);
  timing_ = run_one_f_one_b(exec, *pipeline_, m, work);
  return finish(exec, work);
}

template <class ExecutionSpace>
LossResult Pipeline<ExecutionSpace>::finish(const ExecutionSpace& exec, const MicroBatches& work) {
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
  const int stage = stages.stage(), p = stages.stages();
  const std::int64_t b = static_cast<std::int64_t>(batch.ids.extent(0)),
                     l = static_cast<std::int64_t>(batch.ids.extent(1));
  // The virtual stages in turn: chunk c of rank r takes its input from rank r − 1's chunk c, or from
  // rank p − 1's chunk c − 1 on rank 0.
  Tensor3<float, Mem> input;
  LossResult r;
  model_->set_sequence_ids(batch.seq_idx);
  for (int chunk = 0; chunk < stages.virtual_stages; ++chunk) {
    if (!stages.first_chunk(chunk)) {
      if (!input.is_allocated())
        input = Tensor3<float, Mem>("kmamba::pipeline::eval_input", b, l, model_->config().d_model);
      pipeline_->recv(exec, Kokkos::View<float*, Mem>(input.data(), input.span()), (stage + p - 1) % p);
    }
    r = model_->stage_forward(exec, batch.ids, batch.targets, ConstTensor3<float, Mem>(input), chunk, 0, false);
    if (!stages.last_chunk(chunk)) {
      const Tensor3<float, Mem>& out = model_->stage_output(chunk);
      pipeline_->send(exec, Kokkos::View<float*, Mem>(out.data(), out.span()), (stage + 1) % p);
    }
  }
  model_->set_sequence_ids({});
  exec.fence();
  return from_last_stage(r.loss * static_cast<double>(r.tokens), r);
}

#define KMAMBA_INSTANTIATE(Exec) template class Pipeline<Exec>;
KMAMBA_FOR_EACH_BACKEND(KMAMBA_INSTANTIATE)
#undef KMAMBA_INSTANTIATE

}  // namespace kmamba
