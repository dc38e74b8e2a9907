// The collectives of distributed training over Kokkos Views, behind one interface with two
// transports: MPI (MpiCommunicator.hpp: host memory; device memory only with a CUDA-aware MPI) and
// NCCL (NcclCommunicator.hpp: device memory, work enqueued on the caller's CUDA stream).
//
//   kmamba::MpiCommunicator world(MPI_COMM_WORLD);                 // duplicates the caller's comm
//   auto dp = world.split(color, key, "dp");                        // one communicator per mesh axis
//   dp->all_reduce(exec, grads, kmamba::ReduceOp::Sum);             // in place, (n)
//   dp->reduce_scatter(exec, grads, shard);                          // (size·n) -> (n)
//   dp->all_gather(exec, shard, params);                             // (n) -> (size·n)
//   sp->send_recv(exec, state, sp->rank() + 1, halo, sp->rank() - 1); // a ring step; edges pass no_peer
//
// Every operation is collective over the communicator (send/recv: over the two peers) and must be
// issued by all its ranks in the same order. Views must be contiguous and hold float, double,
// std::int32_t or std::int64_t. Ordering with the caller's work on `exec`: a transport that is not
// stream-ordered (MPI) fences `exec` first and returns when the data are in place; NCCL enqueues on
// the execution space instance's stream and returns at once. Failures throw kmamba::UserError
// (bad arguments) or kmamba::VendorError (the library's status), and every message starts with the
// collective, the mesh axis, the transport and the rank, e.g.
// "kmamba::Communicator::all_reduce on axis 'dp' (MPI, rank 1 of 2): ...".
#ifndef KMAMBA_PARALLEL_COMMUNICATOR_HPP
#define KMAMBA_PARALLEL_COMMUNICATOR_HPP

#include <kmamba/Config.hpp>
#include <kmamba/core/Bf16.hpp>
#include <kmamba/core/Error.hpp>

#include <Kokkos_Core.hpp>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>

namespace kmamba {

/// Element types the transports move. BFloat16 is moved, never reduced (the reductions refuse it at
/// compile time): a reduction in bf16 would round every partial sum (all_reduce_bf16 and
/// reduce_scatter_bf16 sum bf16 values in fp32).
enum class DataType { Float32, Float64, Int32, Int64, BFloat16 };

/// "float32", "float64", "int32", "int64", "bfloat16".
const char* data_type_name(DataType type);
/// Bytes per element.
std::size_t data_type_size(DataType type);

namespace impl {
/// The entry of `table` (one per enumerator, in declaration order) for `value`, an enumerator of an
/// enum class numbered from 0; `fallback` for any other value.
template <class T, class Enum, std::size_t N>
T enum_table(Enum value, const T (&table)[N], T fallback) {
  const auto i = static_cast<std::size_t>(value);
  return i < N ? table[i] : fallback;
}

template <class T>
struct DataTypeOf;
template <>
struct DataTypeOf<float> {
  static constexpr DataType value = DataType::Float32;
};
template <>
struct DataTypeOf<double> {
  static constexpr DataType value = DataType::Float64;
};
template <>
struct DataTypeOf<std::int32_t> {
  static constexpr DataType value = DataType::Int32;
};
template <>
struct DataTypeOf<std::int64_t> {
  static constexpr DataType value = DataType::Int64;
};
template <>
struct DataTypeOf<bf16> {
  static constexpr DataType value = DataType::BFloat16;
};
}  // namespace impl

/// Reductions. Average is the sum divided by the communicator's size (floating types only).
enum class ReduceOp { Sum, Average, Max, Min };

/// "sum", "average", "max", "min".
const char* reduce_op_name(ReduceOp op);

/// A peer argument of send_recv meaning "no message in this direction" (the ends of a chain).
constexpr int no_peer = -1;

/// What a transport needs to know about the caller's execution space instance and buffers.
struct StreamContext {
  /// The instance is a Kokkos::Cuda instance, whose stream (cuda_stream) orders device work. Every
  /// instance counts, the default one included.
  bool cuda_instance = false;
  /// That instance's cudaStream_t (only with cuda_instance). Null is the legacy default stream, the
  /// stream of Kokkos 3's default instance: a stream like any other, not "no stream".
  void* cuda_stream = nullptr;
  bool host_accessible = true;     ///< the buffers can be read and written by the host
  bool device_accessible = false;  ///< the buffers can be read and written by CUDA kernels
  std::function<void()> fence;     ///< waits for the work already submitted to the instance
};

namespace impl {
template <class ExecutionSpace, class MemorySpace>
StreamContext stream_context(const ExecutionSpace& exec) {
  StreamContext context;
  context.host_accessible = Kokkos::SpaceAccessibility<Kokkos::HostSpace, MemorySpace>::accessible;
#if KMAMBA_ENABLE_CUDA
  context.device_accessible = Kokkos::SpaceAccessibility<Kokkos::Cuda, MemorySpace>::accessible;
  if constexpr (std::is_same<ExecutionSpace, Kokkos::Cuda>::value) {
    context.cuda_instance = true;
    context.cuda_stream = exec.cuda_stream();
  }
#endif
  context.fence = [exec] { exec.fence(); };
  return context;
}

template <class ViewType>
struct ScaleBy {
  ViewType x;
  typename ViewType::non_const_value_type factor;
  KOKKOS_INLINE_FUNCTION void operator()(const std::size_t i) const { x.data()[i] *= factor; }
};

// wire(i) ← bf16(x(i)): the one rounding of a value sent in bf16.
struct RoundToWireBf16 {
  const float* x;
  bf16* wire;
  KOKKOS_INLINE_FUNCTION void operator()(const std::size_t i) const { wire[i] = bf16(x[i]); }
};

// out(j) ← Σ_s blocks(s·n + j) over the `ranks` blocks in rank order, summed in fp32 and stored as
// Out (float, or bf16 for the all-gather of all_reduce_bf16).
template <class Out>
struct SumBf16Blocks {
  const bf16* blocks;
  Out* out;
  std::size_t n;
  int ranks;
  KOKKOS_INLINE_FUNCTION void operator()(const std::size_t j) const {
    float sum = 0.0f;
    for (int s = 0; s < ranks; ++s) sum += static_cast<float>(blocks[static_cast<std::size_t>(s) * n + j]);
    out[j] = from_float<Out>(sum);
  }
};

struct WidenWireBf16 {
  const bf16* wire;
  float* x;
  KOKKOS_INLINE_FUNCTION void operator()(const std::size_t i) const { x[i] = static_cast<float>(wire[i]); }
};
}  // namespace impl

/// One group of ranks (the world, or one axis of the process mesh) and the collectives over it.
/// Not copyable; a derived class owns the transport's handle and frees it on destruction.
class Communicator {
 public:
  virtual ~Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  /// This process's rank in the group, in [0, size()).
  int rank() const { return rank_; }
  /// Number of ranks in the group.
  int size() const { return size_; }
  /// The mesh axis the group spans ("world", "dp", "tp", "sp", "dp_sp"), used in error messages.
  const std::string& axis() const { return axis_; }
  /// "MPI" or "NCCL".
  virtual const char* transport() const = 0;

  /// A new communicator of the same transport over the ranks that pass the same `color` (>= 0),
  /// ranked by `key` (ties by the rank here), named `axis`. Collective over this communicator.
  virtual std::unique_ptr<Communicator> split(int color, int key, const std::string& axis) const = 0;

  /// recv ← op over the ranks of send (element-wise); recv may be send itself (in place).
  template <class ExecutionSpace, class SendView, class RecvView>
  void all_reduce(const ExecutionSpace& exec, const SendView& send,  // (n)
                  const RecvView& recv,                              // (n)
                  ReduceOp op = ReduceOp::Sum) const;
  /// In-place all_reduce.
  template <class ExecutionSpace, class View>
  void all_reduce(const ExecutionSpace& exec, const View& data, ReduceOp op = ReduceOp::Sum) const {  // (n)
    all_reduce(exec, data, data, op);
  }

  /// recv ← block rank() of (op over the ranks of send), where send holds size() blocks of
  /// recv.size() elements. In place when recv is send's block rank(); the other blocks of send are
  /// then unspecified.
  template <class ExecutionSpace, class SendView, class RecvView>
  void reduce_scatter(const ExecutionSpace& exec, const SendView& send,  // (size() · n)
                      const RecvView& recv,                              // (n)
                      ReduceOp op = ReduceOp::Sum) const;

  /// reduce_scatter of fp32 sums with bf16 on the wire: every rank rounds its send values to bf16
  /// once, sends block r to rank r (size() − 1 pairwise send_recv exchanges) and sums the size()
  /// bf16 blocks it receives, its own included, in fp32 in rank order: recv = Σ_s bf16(send_s),
  /// |recv − Σ_s send_s| ≤ 2⁻⁸·Σ_s |send_s| + fp32 rounding. Each rank sends (size() − 1)·n bf16
  /// values, half the bytes of a ring reduce_scatter of fp32. In place as reduce_scatter. On one
  /// rank nothing travels: recv ← send, unrounded.
  template <class ExecutionSpace, class SendView, class RecvView>
  void reduce_scatter_bf16(const ExecutionSpace& exec, const SendView& send,  // (size() · n)
                           const RecvView& recv) const;                       // (n)
  /// In-place sum over the ranks with bf16 on the wire: reduce_scatter_bf16 into block rank(),
  /// that sum rounded to bf16 and all-gathered in bf16, so every rank ends with the same
  /// bf16(Σ_s bf16(data_s)) (error ≤ 2⁻⁸·Σ_s |data_s| + 2⁻⁸·|sum| + fp32 rounding). data.size()
  /// must be a multiple of size(). Each rank sends 2(size() − 1)/size() · data.size() bf16 values:
  /// half the bytes of a ring all_reduce of fp32. On one rank nothing travels: data is unchanged.
  template <class ExecutionSpace, class View>
  void all_reduce_bf16(const ExecutionSpace& exec, const View& data) const;  // (size() · n)

  /// Block r of recv ← send of rank r. In place when send is recv's block rank().
  template <class ExecutionSpace, class SendView, class RecvView>
  void all_gather(const ExecutionSpace& exec, const SendView& send,  // (n)
                  const RecvView& recv) const;                       // (size() · n)

  /// data ← data of rank `root`.
  template <class ExecutionSpace, class View>
  void broadcast(const ExecutionSpace& exec, const View& data, int root) const;  // (n)

  /// Sends `send` to rank `dest` and receives `recv` from rank `source` as one operation, so a ring
  /// or chain exchange cannot deadlock; either peer may be no_peer. The received message must have
  /// exactly recv.size() elements.
  template <class ExecutionSpace, class SendView, class RecvView>
  void send_recv(const ExecutionSpace& exec, const SendView& send, int dest,  // (n)
                 const RecvView& recv, int source) const;                     // (m)
  /// Sends `data` to rank `dest` (matched by a recv or send_recv there).
  template <class ExecutionSpace, class View>
  void send(const ExecutionSpace& exec, const View& data, int dest) const {  // (n)
    send_recv(exec, data, dest, Kokkos::View<typename View::non_const_value_type*, typename View::memory_space>(),
              no_peer);
  }
  /// Receives `data` from rank `source` (matched by a send or send_recv there).
  template <class ExecutionSpace, class View>
  void recv(const ExecutionSpace& exec, const View& data, int source) const {  // (n)
    send_recv(exec, View(), no_peer, data, source);
  }

  /// op over the ranks of one host value (token counts, norms, flags). Blocking.
  template <class T>
  T all_reduce_value(T value, ReduceOp op = ReduceOp::Sum) const;

  /// Returns when every rank has called it. Blocking.
  void barrier() const;

 protected:
  Communicator(int rank, int size, std::string axis);
  friend class CountingCommunicator;  // forwards the operations below to the communicator it wraps

  // The transport's operations on raw buffers. The public templates have checked the arguments
  // (sizes, peers, aliasing) and turned Average into Sum unless native_average() says otherwise.
  virtual void do_all_reduce(const void* send, void* recv, std::size_t count, DataType type, ReduceOp op,
                             const StreamContext& stream) const = 0;
  virtual void do_reduce_scatter(const void* send, void* recv, std::size_t recv_count, DataType type, ReduceOp op,
                                 const StreamContext& stream) const = 0;
  virtual void do_all_gather(const void* send, void* recv, std::size_t send_count, DataType type,
                             const StreamContext& stream) const = 0;
  virtual void do_broadcast(void* data, std::size_t count, DataType type, int root,
                            const StreamContext& stream) const = 0;
  virtual void do_send_recv(const void* send, std::size_t send_count, int dest, void* recv, std::size_t recv_count,
                            int source, DataType type, const StreamContext& stream) const = 0;
  virtual void do_barrier() const = 0;
  /// Whether the transport computes ReduceOp::Average itself (else: Sum, then a scaling kernel).
  virtual bool native_average() const { return false; }

  /// Runs `body`; a kmamba::Error it throws is re-thrown with the operation, axis, transport and
  /// rank prepended (transports use it for their own set-up steps, e.g. "split").
  template <class Body>
  void guarded(const char* operation, const Body& body) const {
    try {
      body();
    } catch (...) {
      rethrow_with_context(operation);
    }
  }

 private:
  [[noreturn]] void rethrow_with_context(const char* operation) const;

  void check_peer(const char* what, int peer, bool allow_none) const;
  static void check_op(ReduceOp op, DataType type);

  template <class View>
  static void check_view(const char* name, const View& view);

  template <class ExecutionSpace, class View>
  void finish_average(const ExecutionSpace& exec, const View& recv, ReduceOp op) const;

  // Checks send (size() · n fp32 values) against n, rounds it to bf16 and returns the bf16 blocks
  // rank() receives (block s: rank s's block rank()), after the pairwise exchange.
  template <class ExecutionSpace, class SendView>
  Kokkos::View<bf16*, typename SendView::memory_space> exchange_bf16_blocks(const ExecutionSpace& exec,
                                                                            const SendView& send,  // (size() · n)
                                                                            std::size_t n) const;

  int rank_ = 0;
  int size_ = 1;
  std::string axis_;
};

template <class View>
void Communicator::check_view(const char* name, const View& view) {
  using Value = typename View::non_const_value_type;
  static_assert(std::is_same<Value, float>::value || std::is_same<Value, double>::value ||
                    std::is_same<Value, std::int32_t>::value || std::is_same<Value, std::int64_t>::value ||
                    std::is_same<Value, bf16>::value,
                "kmamba::Communicator: views must hold float, double, std::int32_t, std::int64_t or kmamba::bf16");
  KMAMBA_REQUIRE(view.size() == 0 || view.span_is_contiguous(),
                 "the view '" << name << "' (label '" << view.label() << "') is not contiguous");
}

template <class ExecutionSpace, class View>
void Communicator::finish_average(const ExecutionSpace& exec, const View& recv, ReduceOp op) const {
  using Value = typename View::non_const_value_type;
  if (op != ReduceOp::Average || native_average() || recv.size() == 0) return;
  Kokkos::parallel_for("kmamba::communicator::average",
                       Kokkos::RangePolicy<ExecutionSpace, Kokkos::IndexType<std::size_t>>(exec, 0, recv.size()),
                       impl::ScaleBy<View>{recv, Value(1) / static_cast<Value>(size_)});
}

/// Runs `action` on rank 0 of `comm` and tells every rank whether it succeeded: rank 0 rethrows
/// its exception, every other rank throws kmamba::UserError(`failure`). Collective over `comm`,
/// so that no rank waits forever for one whose action failed.
void run_on_rank0(const Communicator& comm, const std::function<void()>& action, const std::string& failure);

template <class ExecutionSpace, class SendView, class RecvView>
void Communicator::all_reduce(const ExecutionSpace& exec, const SendView& send, const RecvView& recv,
                              ReduceOp op) const {
  guarded("all_reduce", [&] {
    using Value = typename RecvView::non_const_value_type;
    static_assert(std::is_same<typename SendView::non_const_value_type, Value>::value,
                  "kmamba::Communicator::all_reduce: send and recv must hold the same type");
    static_assert(
        !std::is_same<Value, bf16>::value,
        "kmamba::Communicator: bf16 values are moved, never reduced (a reduction in bf16 rounds every partial sum): "
        "all_reduce_bf16 and reduce_scatter_bf16 send fp32 values as bf16 and sum them in fp32");
    static_assert(!std::is_const<typename RecvView::value_type>::value, "recv must be writable");
    check_view("send", send);
    check_view("recv", recv);
    constexpr DataType type = impl::DataTypeOf<Value>::value;
    check_op(op, type);
    KMAMBA_REQUIRE(send.size() == recv.size(),
                   "send has " << send.size() << " elements but recv has " << recv.size() << "; they must be equal");
    const bool in_place = static_cast<const void*>(send.data()) == static_cast<const void*>(recv.data());
    KMAMBA_REQUIRE(in_place || send.data() + send.size() <= recv.data() || recv.data() + recv.size() <= send.data(),
                   "send and recv overlap without being the same buffer");
    const ReduceOp transport_op = op == ReduceOp::Average && !native_average() ? ReduceOp::Sum : op;
    do_all_reduce(send.data(), recv.data(), recv.size(), type, transport_op,
                  impl::stream_context<ExecutionSpace, typename RecvView::memory_space>(exec));
    finish_average(exec, recv, op);
  });
}

template <class ExecutionSpace, class SendView, class RecvView>
void Communicator::reduce_scatter(const ExecutionSpace& exec, const SendView& send, const RecvView& recv,
                                  ReduceOp op) const {
  guarded("reduce_scatter", [&] {
    using Value = typename RecvView::non_const_value_type;
    static_assert(std::is_same<typename SendView::non_const_value_type, Value>::value,
                  "kmamba::Communicator::reduce_scatter: send and recv must hold the same type");
    static_assert(
        !std::is_same<Value, bf16>::value,
        "kmamba::Communicator: bf16 values are moved, never reduced (a reduction in bf16 rounds every partial sum): "
        "all_reduce_bf16 and reduce_scatter_bf16 send fp32 values as bf16 and sum them in fp32");
    static_assert(!std::is_const<typename RecvView::value_type>::value, "recv must be writable");
    check_view("send", send);
    check_view("recv", recv);
    constexpr DataType type = impl::DataTypeOf<Value>::value;
    check_op(op, type);
    const std::size_t n = recv.size();
    KMAMBA_REQUIRE(send.size() == n * static_cast<std::size_t>(size_),
                   "send has " << send.size() << " elements; expected size() · recv.size() = " << size_ << " · " << n);
    const bool in_place = static_cast<const void*>(recv.data()) ==
                          static_cast<const void*>(send.data() + n * static_cast<std::size_t>(rank_));
    KMAMBA_REQUIRE(in_place || send.data() + send.size() <= recv.data() || recv.data() + n <= send.data(),
                   "recv overlaps send without being send's block " << rank_ << " (the in-place form)");
    const ReduceOp transport_op = op == ReduceOp::Average && !native_average() ? ReduceOp::Sum : op;
    do_reduce_scatter(send.data(), recv.data(), n, type, transport_op,
                      impl::stream_context<ExecutionSpace, typename RecvView::memory_space>(exec));
    finish_average(exec, recv, op);
  });
}

template <class ExecutionSpace, class SendView>
Kokkos::View<bf16*, typename SendView::memory_space> Communicator::exchange_bf16_blocks(const ExecutionSpace& exec,
                                                                                        const SendView& send,
                                                                                        std::size_t n) const {
  using Memory = typename SendView::memory_space;
  using Block = Kokkos::View<bf16*, Memory, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
  static_assert(std::is_same<typename SendView::non_const_value_type, float>::value,
                "kmamba::Communicator: bf16 wire reductions take float views");
  check_view("send", send);
  const auto p = static_cast<std::size_t>(size_), r = static_cast<std::size_t>(rank_);
  KMAMBA_REQUIRE(send.size() == p * n,
                 "send has " << send.size() << " elements; expected size() · n = " << size_ << " · " << n);
  Kokkos::View<bf16*, Memory> wire("kmamba::communicator::bf16_send", p * n);
  Kokkos::View<bf16*, Memory> blocks("kmamba::communicator::bf16_blocks", p * n);
  Kokkos::parallel_for("kmamba::communicator::round_to_bf16",
                       Kokkos::RangePolicy<ExecutionSpace, Kokkos::IndexType<std::size_t>>(exec, 0, p * n),
                       impl::RoundToWireBf16{send.data(), wire.data()});
  Kokkos::deep_copy(exec, Block(blocks.data() + r * n, n), Block(wire.data() + r * n, n));
  // Step s: rank r sends its block for rank r + s and receives rank r − s's block for r, so every
  // value crosses the wire once, unsummed (a ring would forward partial sums, rounded again).
  for (std::size_t s = 1; s < p; ++s) {
    const std::size_t dest = (r + s) % p, source = (r + p - s) % p;
    send_recv(exec, Block(wire.data() + dest * n, n), static_cast<int>(dest), Block(blocks.data() + source * n, n),
              static_cast<int>(source));
  }
  return blocks;
}

template <class ExecutionSpace, class SendView, class RecvView>
void Communicator::reduce_scatter_bf16(const ExecutionSpace& exec, const SendView& send, const RecvView& recv) const {
  static_assert(std::is_same<typename RecvView::value_type, float>::value, "recv must hold writable floats");
  Kokkos::View<bf16*, typename SendView::memory_space> blocks;
  guarded("reduce_scatter_bf16", [&] {
    check_view("recv", recv);
    if (size_ > 1) blocks = exchange_bf16_blocks(exec, send, recv.size());
  });
  if (size_ == 1) {  // nothing travels, nothing is rounded
    if (recv.data() != send.data()) Kokkos::deep_copy(exec, recv, send);
    return;
  }
  Kokkos::parallel_for("kmamba::communicator::sum_bf16_blocks",
                       Kokkos::RangePolicy<ExecutionSpace, Kokkos::IndexType<std::size_t>>(exec, 0, recv.size()),
                       impl::SumBf16Blocks<float>{blocks.data(), recv.data(), recv.size(), size_});
}

template <class ExecutionSpace, class View>
void Communicator::all_reduce_bf16(const ExecutionSpace& exec, const View& data) const {
  static_assert(std::is_same<typename View::value_type, float>::value, "data must hold writable floats");
  using Memory = typename View::memory_space;
  using Policy = Kokkos::RangePolicy<ExecutionSpace, Kokkos::IndexType<std::size_t>>;
  const auto p = static_cast<std::size_t>(size_);
  std::size_t n = 0;
  Kokkos::View<bf16*, Memory> blocks;
  guarded("all_reduce_bf16", [&] {
    KMAMBA_REQUIRE(data.size() % p == 0,
                   "data has " << data.size() << " elements, not a multiple of the " << size_ << " ranks");
    n = data.size() / p;
    if (size_ > 1) blocks = exchange_bf16_blocks(exec, data, n);
  });
  if (size_ == 1) return;  // nothing travels, nothing is rounded
  // The own block of `blocks` is no longer needed: it receives this rank's rounded sum, which the
  // all-gather then spreads, so every rank widens the same bf16 values.
  const Kokkos::View<bf16*, Memory, Kokkos::MemoryTraits<Kokkos::Unmanaged>> own(
      blocks.data() + static_cast<std::size_t>(rank_) * n, n);
  Kokkos::View<bf16*, Memory> sums("kmamba::communicator::bf16_sums", n);
  Kokkos::parallel_for("kmamba::communicator::sum_bf16_blocks", Policy(exec, 0, n),
                       impl::SumBf16Blocks<bf16>{blocks.data(), sums.data(), n, size_});
  Kokkos::deep_copy(exec, own, sums);
  all_gather(exec, own, blocks);
  Kokkos::parallel_for("kmamba::communicator::widen_bf16", Policy(exec, 0, data.size()),
                       impl::WidenWireBf16{blocks.data(), data.data()});
}

template <class ExecutionSpace, class SendView, class RecvView>
void Communicator::all_gather(const ExecutionSpace& exec, const SendView& send, const RecvView& recv) const {
  guarded("all_gather", [&] {
    using Value = typename RecvView::non_const_value_type;
    static_assert(std::is_same<typename SendView::non_const_value_type, Value>::value,
                  "kmamba::Communicator::all_gather: send and recv must hold the same type");
    static_assert(!std::is_const<typename RecvView::value_type>::value, "recv must be writable");
    check_view("send", send);
    check_view("recv", recv);
    const std::size_t n = send.size();
    KMAMBA_REQUIRE(recv.size() == n * static_cast<std::size_t>(size_),
                   "recv has " << recv.size() << " elements; expected size() · send.size() = " << size_ << " · " << n);
    const bool in_place = static_cast<const void*>(send.data()) ==
                          static_cast<const void*>(recv.data() + n * static_cast<std::size_t>(rank_));
    KMAMBA_REQUIRE(in_place || send.data() + n <= recv.data() || recv.data() + recv.size() <= send.data(),
                   "send overlaps recv without being recv's block " << rank_ << " (the in-place form)");
    do_all_gather(send.data(), recv.data(), n, impl::DataTypeOf<Value>::value,
                  impl::stream_context<ExecutionSpace, typename RecvView::memory_space>(exec));
  });
}

template <class ExecutionSpace, class View>
void Communicator::broadcast(const ExecutionSpace& exec, const View& data, int root) const {
  guarded("broadcast", [&] {
    static_assert(!std::is_const<typename View::value_type>::value, "data must be writable");
    check_view("data", data);
    check_peer("root", root, false);
    do_broadcast(data.data(), data.size(), impl::DataTypeOf<typename View::non_const_value_type>::value, root,
                 impl::stream_context<ExecutionSpace, typename View::memory_space>(exec));
  });
}

template <class ExecutionSpace, class SendView, class RecvView>
void Communicator::send_recv(const ExecutionSpace& exec, const SendView& send, int dest, const RecvView& recv,
                             int source) const {
  const char* name = dest == no_peer ? "recv" : source == no_peer ? "send" : "send_recv";
  guarded(name, [&] {
    using Value = typename RecvView::non_const_value_type;
    static_assert(std::is_same<typename SendView::non_const_value_type, Value>::value,
                  "kmamba::Communicator::send_recv: send and recv must hold the same type");
    static_assert(!std::is_const<typename RecvView::value_type>::value, "recv must be writable");
    check_view("send", send);
    check_view("recv", recv);
    check_peer("dest", dest, true);
    check_peer("source", source, true);
    do_send_recv(send.data(), dest == no_peer ? 0 : send.size(), dest, recv.data(), source == no_peer ? 0 : recv.size(),
                 source, impl::DataTypeOf<Value>::value,
                 impl::stream_context<ExecutionSpace, typename RecvView::memory_space>(exec));
  });
}

template <class T>
T Communicator::all_reduce_value(T value, ReduceOp op) const {
  static_assert(!std::is_same<T, bf16>::value,
                "kmamba::Communicator: bf16 values are moved, never reduced (a reduction in bf16 rounds every partial "
                "sum): all_reduce_bf16 and reduce_scatter_bf16 send fp32 values as bf16 and sum them in fp32");
  T result{};
  guarded("all_reduce_value", [&] {
    constexpr DataType type = impl::DataTypeOf<T>::value;
    check_op(op, type);
    StreamContext host;
    host.fence = [] {};
    do_all_reduce(&value, &result, 1, type, op == ReduceOp::Average ? ReduceOp::Sum : op, host);
    if (op == ReduceOp::Average) result /= static_cast<T>(size_);
  });
  return result;
}

}  // namespace kmamba

#endif
