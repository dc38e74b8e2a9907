// Parameters, gradients and optimizer moments in contiguous slabs with named sub-views: one
// kernel (or one all-reduce) covers every parameter, and a ZeRO shard is a range of the slab.
//
//   kmamba::ParameterSlab<Mem> slab;
//   slab.add("backbone.norm_f.weight", {64}, kmamba::WeightDecay::No);
//   slab.add("backbone.embeddings.weight", {96, 64}, kmamba::WeightDecay::Yes);
//   slab.finalize("kmamba::model");                       // allocates params and grads
//   auto w = slab.param<2>("backbone.embeddings.weight"); // Tensor2 view into the slab
//
// finalize() orders the entries so that every parameter with weight decay comes first: the
// optimizer applies decay to the range [0, decay_end()) and none after it.
#ifndef KMAMBA_MODELS_PARAMETERSLAB_HPP
#define KMAMBA_MODELS_PARAMETERSLAB_HPP

#include <kmamba/core/Error.hpp>
#include <kmamba/core/Tensor.hpp>

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace kmamba {

enum class WeightDecay { No, Yes };

namespace impl {
// float*, float**, ... : the Kokkos data type of a rank-R float view.
template <int Rank>
struct RankData {
  using type = typename RankData<Rank - 1>::type*;
};
template <>
struct RankData<0> {
  using type = float;
};
}  // namespace impl

template <class MemorySpace>
class ParameterSlab {
 public:
  struct Entry {
    std::string name;
    std::vector<std::int64_t> shape;
    WeightDecay decay;
    std::size_t offset = 0, size = 0;
  };

  /// Declares a parameter; names are unique. Only before finalize().
  void add(const std::string& name, const std::vector<std::int64_t>& shape, WeightDecay decay) {
    KMAMBA_REQUIRE(!finalized_, "kmamba::ParameterSlab::add: '" << name << "' added after finalize()");
    KMAMBA_REQUIRE(index_.count(name) == 0, "kmamba::ParameterSlab::add: parameter '" << name << "' added twice");
    Entry e{name, shape, decay, 0, 1};
    for (const std::int64_t d : shape) {
      KMAMBA_REQUIRE(d > 0, "kmamba::ParameterSlab::add: parameter '" << name << "' has a non-positive extent");
      e.size *= static_cast<std::size_t>(d);
    }
    index_[name] = entries_.size();
    entries_.push_back(e);
  }

  /// Lays the entries out (decayed ones first, each group in declaration order) and allocates the
  /// parameter and gradient slabs, zero-filled.
  void finalize(const std::string& label) {
    KMAMBA_REQUIRE(!finalized_, "kmamba::ParameterSlab::finalize: called twice");
    std::stable_partition(entries_.begin(), entries_.end(), [](const Entry& e) { return e.decay == WeightDecay::Yes; });
    std::size_t offset = 0;
    decay_end_ = 0;
    for (std::size_t i = 0; i < entries_.size(); ++i) {
      entries_[i].offset = offset;
      offset += entries_[i].size;
      if (entries_[i].decay == WeightDecay::Yes) decay_end_ = offset;
      index_[entries_[i].name] = i;
    }
    params_ = Tensor1<float, MemorySpace>(label + "::params", offset);
    grads_ = Tensor1<float, MemorySpace>(label + "::grads", offset);
    finalized_ = true;
  }

  std::size_t size() const { return params_.extent(0); }
  /// Elements [0, decay_end()) receive weight decay.
  std::size_t decay_end() const { return decay_end_; }
  const std::vector<Entry>& entries() const { return entries_; }
  bool contains(const std::string& name) const { return index_.count(name) != 0; }
  const Entry& entry(const std::string& name) const {
    const auto it = index_.find(name);
    KMAMBA_REQUIRE(it != index_.end(), "kmamba::ParameterSlab: no parameter named '" << name << "'");
    return entries_[it->second];
  }

  const Tensor1<float, MemorySpace>& params() const { return params_; }
  const Tensor1<float, MemorySpace>& grads() const { return grads_; }

  /// The parameter `name` as a rank-R row-major view into the parameter slab.
  template <int Rank>
  UnmanagedTensor<typename impl::RankData<Rank>::type, MemorySpace> param(const std::string& name) const {
    return view<Rank>(params_, name);
  }
  /// The gradient of `name` as a rank-R row-major view into the gradient slab.
  template <int Rank>
  UnmanagedTensor<typename impl::RankData<Rank>::type, MemorySpace> grad(const std::string& name) const {
    return view<Rank>(grads_, name);
  }

 private:
  template <int Rank>
  UnmanagedTensor<typename impl::RankData<Rank>::type, MemorySpace> view(const Tensor1<float, MemorySpace>& slab,
                                                                         const std::string& name) const {
    KMAMBA_REQUIRE(finalized_, "kmamba::ParameterSlab: views are available after finalize()");
    const Entry& e = entry(name);
    KMAMBA_REQUIRE(static_cast<int>(e.shape.size()) == Rank, "kmamba::ParameterSlab: parameter '"
                                                                 << name << "' has rank " << e.shape.size()
                                                                 << ", requested as rank " << Rank);
    Kokkos::LayoutRight layout;
    for (int i = 0; i < Rank; ++i) layout.dimension[i] = static_cast<std::size_t>(e.shape[static_cast<std::size_t>(i)]);
    return UnmanagedTensor<typename impl::RankData<Rank>::type, MemorySpace>(slab.data() + e.offset, layout);
  }

  std::vector<Entry> entries_;
  std::map<std::string, std::size_t> index_;
  std::size_t decay_end_ = 0;
  bool finalized_ = false;
  Tensor1<float, MemorySpace> params_, grads_;
};

}  // namespace kmamba

#endif
