// The largest width of the causal conv1d, in a header without Kokkos so that configuration code
// (kmamba::ModelConfig, which the file readers' fuzz targets compile without Kokkos) can check it.
#ifndef KMAMBA_CORE_CONV1DWIDTH_HPP
#define KMAMBA_CORE_CONV1DWIDTH_HPP

namespace kmamba {

/// The largest conv width (taps) causal_conv1d and its backward take: the backward keeps a window
/// of the last inputs in registers, sized at compile time.
constexpr int conv1d_max_width = 16;

}  // namespace kmamba

#endif
