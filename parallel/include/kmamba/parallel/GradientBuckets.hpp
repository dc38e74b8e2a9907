// Data-parallel reduction of one flat buffer (a ParameterSlab's gradients or parameters) in
// buckets: contiguous ranges, each a multiple of the group size so that a bucket splits into equal
// per-rank shards (docs/distributed.md §3).
//
//   BucketLayout layout(n, ranks, bucket_elements):
//     [ bucket 0 | bucket 1 | ... | bucket k-1 | tail ]     tail: n mod ranks elements
//     bucket b = [ shard of rank 0 | shard of rank 1 | ... ]  each bucket.size / ranks elements
//
// DDP all-reduces every bucket. ZeRO-1 reduce-scatters every bucket (rank r ends with the summed
// gradient of its shards), updates its shards, then all-gathers the parameters; the tail (fewer
// elements than ranks) is all-reduced and updated by every rank alike.
//
// Overlap with backward (docs/distributed.md §3): begin() arms a reduction for the current backward,
// ready() announces the elements whose gradients are final (e.g. one layer's, right after its
// backward), and each bucket is reduced as soon as all its elements are announced — on CUDA on a
// communication stream that waits for the compute stream (CommunicationStream.hpp), so that the
// reduction of layer l runs while layer l−1's backward computes; on host transports synchronously.
// finish() reduces what is left and orders the compute stream after the reductions. With
// GradientCompression::Bf16 the buckets travel as bf16 and are summed in fp32
// (Communicator::all_reduce_bf16, reduce_scatter_bf16: half the bytes); the tail stays fp32. Buckets are
// reduced in one order fixed by set_ready_sequence() on every rank (collectives must match), so a
// rank that armed late or never gives the same schedule:
//
//   reducer.set_ready_sequence(model_announcements);        // once
//   reducer.begin(grads, Reduction::AllReduce);             // before the last micro-batch's backward
//   reducer.ready(exec, begin, end);                        // from the backward, per layer
//   reducer.finish(exec, grads, Reduction::AllReduce);      // after it
#ifndef KMAMBA_PARALLEL_GRADIENTBUCKETS_HPP
#define KMAMBA_PARALLEL_GRADIENTBUCKETS_HPP

#include <kmamba/core/Tensor.hpp>
#include <kmamba/parallel/CommunicationStream.hpp>
#include <kmamba/parallel/Communicator.hpp>

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cstddef>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace kmamba {

/// Bytes of fp32 gradients a reduction bucket holds by default (PyTorch DDP's 25 MB, in MiB): small
/// enough that a model of ~100M parameters has ~20 buckets, so that reductions start early in the
/// backward and the last one, which the step waits for, is short; large enough that each
/// collective moves megabytes, not a latency-bound trickle.
constexpr std::size_t default_bucket_bytes = std::size_t{25} << 20;

/// default_bucket_bytes of fp32 elements (at least one per rank).
std::size_t default_bucket_elements(int ranks);

/// How the data-parallel gradients travel: fp32; rounded to bf16 once per rank and summed in fp32;
/// or as PowerSGD's low-rank factors with error feedback (PowerSgd.hpp; GradientReducer treats it
/// as fp32: DataParallel reduces with PowerSgd instead).
enum class GradientCompression { None, Bf16, PowerSgd };

/// "none", "bf16", "powersgd".
const char* gradient_compression_name(GradientCompression compression);
/// The compression named `name` ("none", "bf16" or "powersgd"); anything else is a UserError naming `what`.
GradientCompression parse_gradient_compression(const std::string& name, const std::string& what);

class BucketLayout {
 public:
  struct Bucket {
    std::size_t begin = 0;         ///< first element of the bucket in the flat buffer
    std::size_t size = 0;          ///< elements, a multiple of ranks()
    std::size_t shard_offset = 0;  ///< where each rank's shard of this bucket sits in its shard storage
  };

  /// Cuts `elements` into buckets of at most `bucket_elements` (rounded down to a multiple of
  /// `ranks`, at least `ranks`; 0: default_bucket_elements(ranks)) and the tail.
  BucketLayout(std::size_t elements, int ranks, std::size_t bucket_elements = 0);

  std::size_t elements() const { return elements_; }
  int ranks() const { return ranks_; }
  const std::vector<Bucket>& buckets() const { return buckets_; }
  /// Elements of one rank's shard of `bucket`.
  std::size_t shard_size(const Bucket& bucket) const { return bucket.size / static_cast<std::size_t>(ranks_); }
  /// First element of `rank`'s shard of `bucket` in the flat buffer.
  std::size_t shard_begin(const Bucket& bucket, int rank) const {
    return bucket.begin + static_cast<std::size_t>(rank) * shard_size(bucket);
  }
  /// [tail_begin(), elements()): the fewer than ranks() elements that are not sharded.
  std::size_t tail_begin() const { return tail_begin_; }
  /// One rank's shard storage: its shard of every bucket, then the tail.
  std::size_t shard_elements() const { return shard_elements_; }

 private:
  std::size_t elements_;
  int ranks_;
  std::vector<Bucket> buckets_;
  std::size_t tail_begin_ = 0, shard_elements_ = 0;
};

namespace impl {
template <class MemorySpace>
struct SquaredSum {
  ConstTensor1<float, MemorySpace> x;
  KOKKOS_INLINE_FUNCTION void operator()(const std::size_t i, double& acc) const {
    acc += static_cast<double>(x(i)) * static_cast<double>(x(i));
  }
};
}  // namespace impl

/// The bucketed collectives of data parallelism over one communicator (the data-parallel axis).
/// Keeps a reference to the communicator, which must outlive it. Ordering as in Communicator.hpp.
template <class ExecutionSpace>
class GradientReducer {
 public:
  using memory_space = typename ExecutionSpace::memory_space;
  using Range = std::pair<std::size_t, std::size_t>;  ///< elements [first, second)

  /// How buckets are reduced: summed on every rank (DDP) or into each rank's shard (ZeRO-1).
  enum class Reduction { AllReduce, ReduceScatter };

  GradientReducer(const Communicator& comm, std::size_t elements, std::size_t bucket_elements = 0,
                  GradientCompression compression = GradientCompression::None)
      : comm_(&comm),
        layout_(elements, comm.size(), bucket_elements),
        compression_(compression),
        stream_(std::make_shared<CommunicationStream<ExecutionSpace>>()) {
    set_ready_sequence({});
  }

  /// The announcements a backward makes, in order (announcement i: the ranges ready() receives at
  /// that point). Buckets are reduced in the order they become complete under it, the rest after
  /// them in index order (the default: index order). Every rank must give the same sequence.
  void set_ready_sequence(const std::vector<std::vector<Range>>& announcements) {
    std::vector<std::size_t> pending = bucket_sizes();
    std::vector<bool> placed(pending.size(), false);
    order_.clear();
    for (const auto& announcement : announcements) {
      for (const Range& r : announcement) subtract(pending, r);
      for (std::size_t b = 0; b < pending.size(); ++b) {
        if (pending[b] == 0 && !placed[b]) {
          order_.push_back(b);
          placed[b] = true;
        }
      }
    }
    for (std::size_t b = 0; b < pending.size(); ++b) {
      if (!placed[b]) order_.push_back(b);
    }
  }

  /// Arms an overlapped reduction of `data` (the gradients of the coming backward): ready() then
  /// reduces each bucket once all its elements are announced. `data` must stay alive until finish().
  void begin(const Tensor1<float, memory_space>& data, Reduction how) {  // (elements)
    check(data, "begin");
    armed_ = true;
    how_ = how;
    data_ = data;
    pending_ = bucket_sizes();
    next_ = 0;
  }
  bool armed() const { return armed_; }

  /// Announces that the gradients of elements [begin, end) are final for this backward (their
  /// work enqueued on `exec`); reduces every bucket that is next in order and complete. Nothing
  /// unless armed.
  void ready(const ExecutionSpace& exec, std::size_t begin, std::size_t end) {
    if (!armed_) return;
    subtract(pending_, {begin, end});
    while (next_ < order_.size() && pending_[order_[next_]] == 0) launch(exec, order_[next_++]);
  }

  /// Reduces every bucket not reduced yet (all of them when not armed) and the tail, and orders
  /// `exec`'s later work after the reductions. Disarms.
  void finish(const ExecutionSpace& exec, const Tensor1<float, memory_space>& data, Reduction how) {  // (elements)
    check(data, "finish");
    KMAMBA_REQUIRE(!armed_ || (data.data() == data_.data() && how == how_),
                   "kmamba::GradientReducer::finish: not the buffer or the reduction begin() armed");
    if (!armed_) begin(data, how);
    while (next_ < order_.size()) launch(exec, order_[next_++]);
    stream_->wait_for(exec);
    all_reduce_tail(stream_->instance(exec), data);
    stream_->join(exec);
    armed_ = false;
    data_ = Tensor1<float, memory_space>();
  }

  const BucketLayout& layout() const { return layout_; }
  const Communicator& communicator() const { return *comm_; }
  GradientCompression compression() const { return compression_; }

  /// Starts or stops recording when each reduction ran against the compute stream (CUDA events;
  /// nothing on host backends), for measuring overlap; timeline() returns the recording.
  void record_timeline(bool on) { stream_->record_timeline(on); }
  CommunicationTimeline timeline() const { return stream_->timeline(); }

  /// data ← Σ over the ranks of data, bucket by bucket (DDP); finish() without begin().
  void all_reduce(const ExecutionSpace& exec, const Tensor1<float, memory_space>& data) {  // (elements)
    finish(exec, data, Reduction::AllReduce);
  }

  /// This rank's shard of every bucket ← the sum over the ranks of that shard, and the tail ← its
  /// sum; the other elements of data are left unspecified (ZeRO-1); finish() without begin().
  void reduce_scatter(const ExecutionSpace& exec, const Tensor1<float, memory_space>& data) {  // (elements)
    finish(exec, data, Reduction::ReduceScatter);
  }

  /// Every rank's shard of every bucket ← that rank's values (after each rank updated its shards).
  /// The tail is left as it is (identical on every rank).
  void all_gather(const ExecutionSpace& exec, const Tensor1<float, memory_space>& data) const {  // (elements)
    check(data, "all_gather");
    const int rank = comm_->rank();
    for (const auto& bucket : layout_.buckets()) {
      comm_->all_gather(exec, range(data, layout_.shard_begin(bucket, rank), layout_.shard_size(bucket)),
                        range(data, bucket.begin, bucket.size));
    }
  }

  /// Σ data² over the elements this rank owns: its shard of every bucket, and the tail on rank 0;
  /// summed over the ranks this counts every element exactly once. Blocking (a host value).
  double owned_sum_of_squares(const ExecutionSpace& exec,
                              const ConstTensor1<float, memory_space>& data) const {  // (elements)
    KMAMBA_REQUIRE(data.extent(0) == layout_.elements(),
                   "kmamba::GradientReducer::owned_sum_of_squares: the buffer has "
                       << data.extent(0) << " elements, the layout " << layout_.elements());
    double total = 0.0;
    const int rank = comm_->rank();
    for (const auto& bucket : layout_.buckets()) {
      total += sum_of_squares(exec, data, layout_.shard_begin(bucket, rank), layout_.shard_size(bucket));
    }
    if (rank == 0) total += sum_of_squares(exec, data, layout_.tail_begin(), layout_.elements() - layout_.tail_begin());
    return total;
  }

  /// Σ data² over elements [begin, begin + size). Blocking (a host value).
  static double sum_of_squares(const ExecutionSpace& exec, const ConstTensor1<float, memory_space>& data,
                               std::size_t begin, std::size_t size) {
    if (size == 0) return 0.0;
    double sum = 0.0;
    Kokkos::parallel_reduce(
        "kmamba::gradient_reducer::sum_of_squares",
        Kokkos::RangePolicy<ExecutionSpace, Kokkos::IndexType<std::size_t>>(exec, 0, size),
        impl::SquaredSum<memory_space>{ConstTensor1<float, memory_space>(data.data() + begin, size)}, sum);
    return sum;
  }

  /// The same over the owned elements that also lie in one of `counted`, half-open [begin, end)
  /// ranges that do not overlap (e.g. leaving out parameters another group of ranks counts).
  double owned_sum_of_squares(const ExecutionSpace& exec, const ConstTensor1<float, memory_space>& data,  // (elements)
                              const std::vector<std::pair<std::size_t, std::size_t>>& counted) const {
    KMAMBA_REQUIRE(data.extent(0) == layout_.elements(),
                   "kmamba::GradientReducer::owned_sum_of_squares: the buffer has "
                       << data.extent(0) << " elements, the layout " << layout_.elements());
    const int rank = comm_->rank();
    std::vector<std::pair<std::size_t, std::size_t>> owned;
    for (const auto& bucket : layout_.buckets()) {
      const std::size_t begin = layout_.shard_begin(bucket, rank);
      owned.emplace_back(begin, begin + layout_.shard_size(bucket));
    }
    if (rank == 0) owned.emplace_back(layout_.tail_begin(), layout_.elements());
    double total = 0.0;
    for (const auto& o : owned) {
      for (const auto& c : counted) {
        const std::size_t begin = std::max(o.first, c.first), end = std::min(o.second, c.second);
        if (begin < end) total += sum_of_squares(exec, data, begin, end - begin);
      }
    }
    return total;
  }

 private:
  static Tensor1<float, memory_space> range(const Tensor1<float, memory_space>& data, std::size_t begin,
                                            std::size_t size) {
    return Tensor1<float, memory_space>(data.data() + begin, size);
  }

  void check(const Tensor1<float, memory_space>& data, const char* function) const {
    KMAMBA_REQUIRE(data.extent(0) == layout_.elements(),
                   "kmamba::GradientReducer::" << function << ": the buffer has " << data.extent(0)
                                               << " elements, the layout " << layout_.elements());
  }

  void all_reduce_tail(const ExecutionSpace& exec, const Tensor1<float, memory_space>& data) const {
    const std::size_t tail = layout_.elements() - layout_.tail_begin();
    if (tail > 0) comm_->all_reduce(exec, range(data, layout_.tail_begin(), tail));
  }

  std::vector<std::size_t> bucket_sizes() const {
    std::vector<std::size_t> sizes;
    for (const auto& bucket : layout_.buckets()) sizes.push_back(bucket.size);
    return sizes;
  }

  // pending[b] −= the elements of bucket b in r.
  void subtract(std::vector<std::size_t>& pending, const Range& r) const {
    const auto& buckets = layout_.buckets();
    for (std::size_t b = 0; b < buckets.size(); ++b) {
      const std::size_t begin = std::max(r.first, buckets[b].begin);
      const std::size_t end = std::min(r.second, buckets[b].begin + buckets[b].size);
      if (begin < end) pending[b] -= std::min(pending[b], end - begin);
    }
  }

  // Reduces bucket b of the armed buffer on the communication stream, after exec's work so far.
  void launch(const ExecutionSpace& exec, std::size_t b) const {
    const auto& bucket = layout_.buckets()[b];
    stream_->wait_for(exec);
    const ExecutionSpace on = stream_->instance(exec);
    const Tensor1<float, memory_space> whole = range(data_, bucket.begin, bucket.size);
    const Tensor1<float, memory_space> shard =
        range(data_, layout_.shard_begin(bucket, comm_->rank()), layout_.shard_size(bucket));
    const bool bf16 = compression_ == GradientCompression::Bf16;
    if (how_ == Reduction::AllReduce && bf16) {
      comm_->all_reduce_bf16(on, whole);
    } else if (how_ == Reduction::AllReduce) {
      comm_->all_reduce(on, whole);
    } else if (bf16) {
      comm_->reduce_scatter_bf16(on, whole, shard);
    } else {
      comm_->reduce_scatter(on, whole, shard);
    }
  }

  const Communicator* comm_;
  BucketLayout layout_;
  GradientCompression compression_;
  std::shared_ptr<CommunicationStream<ExecutionSpace>> stream_;
  std::vector<std::size_t> order_;  // bucket indices in the order they are reduced
  // The armed reduction (begin() … finish()).
  bool armed_ = false;
  Reduction how_ = Reduction::AllReduce;
  Tensor1<float, memory_space> data_;  // (elements)
  std::vector<std::size_t> pending_;   // per bucket: elements not announced yet
  std::size_t next_ = 0;               // position in order_ of the next bucket to reduce
};

}  // namespace kmamba

#endif
