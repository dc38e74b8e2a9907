// Moving tensors between safetensors files and Kokkos Views (any memory space).
#ifndef KMAMBA_MODELS_TENSORIO_HPP
#define KMAMBA_MODELS_TENSORIO_HPP

#include <kmamba/core/Error.hpp>
#include <kmamba/core/Tensor.hpp>
#include <kmamba/models/SafeTensors.hpp>

#include <Kokkos_Core.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace kmamba {

/// Reads tensor `name` of `file` into a new View of type ViewType (float or int64 elements,
/// rank = the tensor's rank, any memory space), converting the stored dtype. Throws
/// kmamba::UserError naming the file and tensor if it is absent or its rank differs.
template <class ViewType>
ViewType read_view(const SafeTensorsReader& file, const std::string& name) {
  using value_type = typename ViewType::non_const_value_type;
  static_assert(std::is_same<value_type, float>::value || std::is_same<value_type, std::int64_t>::value,
                "kmamba::read_view: element type must be float or std::int64_t");
  const TensorInfo& info = file.info(name);
  KMAMBA_REQUIRE(info.shape.size() == ViewType::rank, "kmamba::read_view: tensor '"
                                                          << name << "' of '" << file.path() << "' has rank "
                                                          << info.shape.size() << ", expected " << ViewType::rank);
  typename ViewType::array_layout layout;
  for (std::size_t i = 0; i < info.shape.size(); ++i) layout.dimension[i] = static_cast<std::size_t>(info.shape[i]);
  ViewType view(Kokkos::view_alloc(Kokkos::WithoutInitializing, "kmamba::io::" + name), layout);
  std::vector<value_type> values;
  if constexpr (std::is_same<value_type, float>::value) {
    values = file.read_f32(name);
  } else {
    values = file.read_i64(name);
  }
  Kokkos::View<const value_type*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>> flat(values.data(),
                                                                                                   values.size());
  auto host = Kokkos::create_mirror_view(view);
  KMAMBA_ASSERT(host.span_is_contiguous() && host.span() == values.size(), "read_view: unexpected host layout");
  Kokkos::deep_copy(
      Kokkos::View<value_type*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>>(host.data(), host.span()),
      flat);
  Kokkos::deep_copy(view, host);
  return view;
}

/// Adds `view` (row-major, float elements, any memory space) to `file` as an F32 tensor.
template <class ViewType>
void add_view(SafeTensorsWriter& file, const std::string& name, const ViewType& view) {
  static_assert(std::is_same<typename ViewType::non_const_value_type, float>::value,
                "kmamba::add_view: element type must be float");
  static_assert(std::is_same<typename ViewType::array_layout, Kokkos::LayoutRight>::value,
                "kmamba::add_view: the view must be row-major (LayoutRight)");
  auto host = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), view);
  std::vector<std::int64_t> shape;
  for (unsigned i = 0; i < ViewType::rank; ++i) shape.push_back(static_cast<std::int64_t>(view.extent(i)));
  file.add(name, DType::F32, shape, host.data());
}

}  // namespace kmamba

#endif
