// How one rank holds a model that is split across ranks inside a layer (docs/distributed.md §1, §2.1):
// tensor parallelism splits each Mamba-2 or Mamba-3 mixer's heads, with their B/C groups and
// per-head parameters, over the ranks of `tensor` (Mamba2Mixer.hpp, Mamba3Mixer.hpp); sequence
// parallelism gives each rank of `sequence` one contiguous segment of every sequence (segments may
// differ in length) and passes the recurrent states (conv halo, SSM state; Mamba-3's scan states) from rank to rank.
//
//   kmamba::ModelParallel parallel{&mesh.tensor(), &mesh.sequence()};
//   kmamba::LanguageModel<Exec> model(config, parallel);   // this rank's shard of every mixer
//   model.initialize(seed);                                // the slices of the unsplit initialisation
//
// A sharded parameter keeps its Hugging Face name with a smaller shape; ShardedParameter says
// which elements of the unsplit tensor it holds, so checkpoints stay in the unsplit layout
// (scatter_parameters / gather_parameters in Distributed.hpp).
#ifndef KMAMBA_MODELS_MODELPARALLEL_HPP
#define KMAMBA_MODELS_MODELPARALLEL_HPP

#include <kmamba/parallel/Communicator.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace kmamba {

/// The communicators of the in-layer splits; a null one (or one of size 1) means no split.
struct ModelParallel {
  const Communicator* tensor = nullptr;    ///< heads split across its ranks
  const Communicator* sequence = nullptr;  ///< each rank holds one segment of every sequence

  int tensor_rank() const { return tensor != nullptr ? tensor->rank() : 0; }
  int tensor_size() const { return tensor != nullptr ? tensor->size() : 1; }
  int sequence_rank() const { return sequence != nullptr ? sequence->rank() : 0; }
  int sequence_size() const { return sequence != nullptr ? sequence->size() : 1; }
  /// The sequence ranks holding the segments before and after this rank's; no_peer at the ends.
  int previous_segment_rank() const { return sequence_rank() > 0 ? sequence_rank() - 1 : no_peer; }
  int next_segment_rank() const { return sequence_rank() + 1 < sequence_size() ? sequence_rank() + 1 : no_peer; }
};

/// Where this rank's part of one tensor-parallel parameter lies in the unsplit tensor: the
/// flattened element runs [full_offset, full_offset + count) of the unsplit tensor are the runs
/// [local_offset, local_offset + count) of this rank's tensor.
struct ShardedParameter {
  struct Run {
    std::int64_t full_offset = 0, local_offset = 0, count = 0;
    /// The same elements on every tensor rank (e.g. Mamba-3's angle rows of in_proj.weight):
    /// scattered to every rank, gathered from tensor rank 0 and counted once in the gradient norm.
    bool replicated = false;
  };
  std::string name;                      ///< the full (prefixed) Hugging Face name
  std::vector<std::int64_t> full_shape;  ///< the unsplit shape
  std::vector<Run> runs;
};

/// The contiguous segment [begin, begin + length) of a sequence of `seqlen` tokens held by rank
/// `rank` of `size` sequence-parallel ranks: the first seqlen % size ranks hold one token more.
struct SequenceSegment {
  std::int64_t begin = 0, length = 0;
};
SequenceSegment sequence_segment(std::int64_t seqlen, int rank, int size);

}  // namespace kmamba

#endif
