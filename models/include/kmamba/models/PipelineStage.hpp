// How one rank holds a model split into pipeline stages (docs/distributed.md §4): the ranks of the
// `pipeline` communicator hold stages 0 … p − 1, stage s the contiguous blocks stage_layers(n_layer,
// s, p), the first stage also the token embedding, the last the final norm, the LM head and the loss
// (and the embedding again when the head is tied to it; the two copies are kept identical by summing
// their gradients between the first and the last stage).
//
//   kmamba::PipelineParallel stages{&mesh.pipeline()};
//   kmamba::LanguageModel<Exec> model(config, {&mesh.tensor(), &mesh.sequence()}, stages);
//   kmamba::Pipeline<Exec> pipeline(model);   // Pipeline.hpp: the 1F1B schedule over this stage
#ifndef KMAMBA_MODELS_PIPELINESTAGE_HPP
#define KMAMBA_MODELS_PIPELINESTAGE_HPP

#include <kmamba/parallel/Communicator.hpp>

namespace kmamba {

/// The blocks [begin, end) of one pipeline stage, in the unsplit model's layer numbering.
struct StageLayers {
  int begin = 0, end = 0;
};

/// The contiguous blocks of stage `stage` of `stages` over `n_layer` blocks: the first
/// n_layer % stages stages hold one block more. Throws a UserError when there are more stages than
/// blocks (every stage needs at least one) or `stage` is not in [0, stages).
StageLayers stage_layers(int n_layer, int stage, int stages);

/// The communicator of the pipeline stages; a null one (or one of size 1) means one stage.
struct PipelineParallel {
  const Communicator* pipeline = nullptr;  ///< rank s holds stage s

  int stage() const { return pipeline != nullptr ? pipeline->rank() : 0; }
  int stages() const { return pipeline != nullptr ? pipeline->size() : 1; }
  bool first_stage() const { return stage() == 0; }
  bool last_stage() const { return stage() + 1 == stages(); }
};

}  // namespace kmamba

#endif
