// How one rank holds a model split into pipeline stages (docs/distributed.md §4): the ranks of the
// `pipeline` communicator hold stages 0 … p − 1, stage s the contiguous blocks stage_layers(n_layer,
// s, p), the first stage also the token embedding, the last the final norm, the LM head and the loss
// (and the embedding again when the head is tied to it; the two copies are kept identical by summing
// their gradients between the first and the last stage).
//
// Virtual stages (the interleaved 1F1B schedule, InterleavedSchedule.hpp): with virtual_stages v > 1
// each rank holds v chunks of contiguous blocks instead, chunk c of rank r the blocks of virtual stage
// c·p + r of the v·p (stage_layers(n_layer, c·p + r, v·p)), so a micro-batch passes through the ranks
// v times. The embedding stays with rank 0 (its chunk 0) and the final norm, the head and the loss
// with rank p − 1 (its chunk v − 1), so the tied embedding's two copies are on the same ranks as
// without chunks. v = 1 is the plain split above.
//
//   kmamba::PipelineParallel stages{&mesh.pipeline()};
//   kmamba::LanguageModel<Exec> model(config, {&mesh.tensor(), &mesh.sequence()}, stages);
//   kmamba::Pipeline<Exec> pipeline(model);   // Pipeline.hpp: the 1F1B schedule over this stage
//   kmamba::PipelineParallel interleaved{&mesh.pipeline(), 2};   // two chunks per rank
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
  /// Chunks per rank (virtual pipeline stages, trained by the interleaved 1F1B schedule); 1: one
  /// contiguous stage per rank.
  int virtual_stages = 1;

  int stage() const { return pipeline != nullptr ? pipeline->rank() : 0; }
  int stages() const { return pipeline != nullptr ? pipeline->size() : 1; }
  /// The rank holding the embedding (and chunk 0, virtual stage 0).
  bool first_stage() const { return stage() == 0; }
  /// The rank holding the final norm, the head and the loss (and the last virtual stage).
  bool last_stage() const { return stage() + 1 == stages(); }
  /// Whether this rank's chunk `chunk` is virtual stage 0 (it starts from the embedding).
  bool first_chunk(int chunk) const { return first_stage() && chunk == 0; }
  /// Whether this rank's chunk `chunk` is the last virtual stage (it ends in the head and the loss).
  bool last_chunk(int chunk) const { return last_stage() && chunk + 1 == virtual_stages; }
};

/// The blocks of chunk `chunk` of this rank of `stages`: stage_layers(n_layer, chunk·p + rank,
/// v·p) (with v = 1, the rank's stage). Throws a UserError when virtual_stages < 1, `chunk` is not in
/// [0, virtual_stages) or there are more virtual stages than blocks.
StageLayers chunk_layers(int n_layer, const PipelineParallel& stages, int chunk);

}  // namespace kmamba

#endif
