// The scalar math functions that kernels call (exp, log, sqrt, ...), usable on host and device, from
// one name on every Kokkos kmamba builds against. Kokkos 3.4 to 3.6 define them in
// Kokkos::Experimental; Kokkos 3.7 moved them to Kokkos:: (keeping deprecated Experimental names) and
// Kokkos 4.0 removed the Experimental names. kmamba::math::exp(x) is Kokkos' exp(x) on both lines:
// the using-declarations below bring in every overload (float, double, long double, integers), so
// overload resolution and the precision of each call are those of the Kokkos function itself.
//
// Kernels call kmamba::math::<f>, never Kokkos::<f> or Kokkos::Experimental::<f>; scripts/kokkos-math.sh
// rewrites the Experimental spellings mechanically and, with --check, finds any that come back.
#ifndef KMAMBA_CORE_MATH_HPP
#define KMAMBA_CORE_MATH_HPP

#include <Kokkos_Core.hpp>

#if !defined(KOKKOS_VERSION)
#error "kmamba/core/Math.hpp: KOKKOS_VERSION is not defined (Kokkos_Core.hpp did not define it)"
#endif

namespace kmamba {
namespace math {

#if KOKKOS_VERSION >= 30700
#define KMAMBA_KOKKOS_MATH_NAMESPACE Kokkos
#else
#define KMAMBA_KOKKOS_MATH_NAMESPACE Kokkos::Experimental
#endif

using KMAMBA_KOKKOS_MATH_NAMESPACE::cos;
using KMAMBA_KOKKOS_MATH_NAMESPACE::exp;
using KMAMBA_KOKKOS_MATH_NAMESPACE::exp2;
using KMAMBA_KOKKOS_MATH_NAMESPACE::expm1;
using KMAMBA_KOKKOS_MATH_NAMESPACE::floor;
using KMAMBA_KOKKOS_MATH_NAMESPACE::log;
using KMAMBA_KOKKOS_MATH_NAMESPACE::log1p;
using KMAMBA_KOKKOS_MATH_NAMESPACE::sin;
using KMAMBA_KOKKOS_MATH_NAMESPACE::sqrt;
using KMAMBA_KOKKOS_MATH_NAMESPACE::tanh;

#undef KMAMBA_KOKKOS_MATH_NAMESPACE

}  // namespace math
}  // namespace kmamba

#endif
