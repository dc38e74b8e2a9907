// Tensors are Kokkos::Views. These aliases fix the layout (row-major, last index fastest, as in
// the reference implementation) so that every layer agrees on it; the memory space is a parameter.
//
//   Tensor3<float, Kokkos::CudaSpace> x;   // (batch, seqlen, channels)
//
// Every tensor parameter of a public op documents its shape in a comment like the one above.
#ifndef KMAMBA_CORE_TENSOR_HPP
#define KMAMBA_CORE_TENSOR_HPP

#include <kmamba/core/Bf16.hpp>
#include <kmamba/core/Error.hpp>
#include <kmamba/core/Shape.hpp>

#include <Kokkos_Core.hpp>

#include <string>
#include <type_traits>

namespace kmamba {

template <class T, class MemorySpace>
using Tensor1 = Kokkos::View<T*, Kokkos::LayoutRight, MemorySpace>;
template <class T, class MemorySpace>
using Tensor2 = Kokkos::View<T**, Kokkos::LayoutRight, MemorySpace>;
template <class T, class MemorySpace>
using Tensor3 = Kokkos::View<T***, Kokkos::LayoutRight, MemorySpace>;
template <class T, class MemorySpace>
using Tensor4 = Kokkos::View<T****, Kokkos::LayoutRight, MemorySpace>;
template <class T, class MemorySpace>
using Tensor5 = Kokkos::View<T*****, Kokkos::LayoutRight, MemorySpace>;

/// Read-only views of the same shapes (what ops take for inputs).
template <class T, class MemorySpace>
using ConstTensor1 = Tensor1<const T, MemorySpace>;
template <class T, class MemorySpace>
using ConstTensor2 = Tensor2<const T, MemorySpace>;
template <class T, class MemorySpace>
using ConstTensor3 = Tensor3<const T, MemorySpace>;
template <class T, class MemorySpace>
using ConstTensor4 = Tensor4<const T, MemorySpace>;
template <class T, class MemorySpace>
using ConstTensor5 = Tensor5<const T, MemorySpace>;

/// Unmanaged row-major view over memory the caller owns (for example an application's buffer).
template <class DataType, class MemorySpace>
using UnmanagedTensor =
    Kokkos::View<DataType, Kokkos::LayoutRight, MemorySpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;

namespace impl {
void check_label(const std::string& label);
}

/// Allocates a zero-filled tensor. `label` names the allocation in Kokkos tools and error
/// messages; kmamba's own labels read "kmamba::<component>::<what>".
///   auto x = kmamba::allocate<Tensor3<float, Mem>>("kmamba::conv1d::x", batch, seqlen, channels);
/// The extents travel as a layout: Kokkos 3's constructors taking extents read the new
/// allocation's label back from the device for their rank check, a synchronous copy per
/// allocation.
template <class ViewType, class... Extents>
ViewType allocate(const std::string& label, Extents... extents) {
  static_assert(sizeof...(Extents) == ViewType::rank, "kmamba::allocate: one extent per dimension");
  impl::check_label(label);
  return ViewType(Kokkos::view_alloc(label), typename ViewType::array_layout(static_cast<std::size_t>(extents)...));
}

/// Allocates a tensor without initialising it (for outputs that an op writes completely).
template <class ViewType, class... Extents>
ViewType allocate_uninitialized(const std::string& label, Extents... extents) {
  static_assert(sizeof...(Extents) == ViewType::rank, "kmamba::allocate_uninitialized: one extent per dimension");
  impl::check_label(label);
  return ViewType(Kokkos::view_alloc(Kokkos::WithoutInitializing, label),
                  typename ViewType::array_layout(static_cast<std::size_t>(extents)...));
}

}  // namespace kmamba

#endif
