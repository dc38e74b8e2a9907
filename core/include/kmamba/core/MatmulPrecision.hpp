// The arithmetic of matrix products: the projection GEMMs (kmamba::gemm, the models'
// set_matmul_precision) and the products inside the chunked scans (SsdArgs::matmul_precision).
#ifndef KMAMBA_CORE_MATMULPRECISION_HPP
#define KMAMBA_CORE_MATMULPRECISION_HPP

#include <kmamba/core/Bf16.hpp>
#include <kmamba/core/Error.hpp>

#include <Kokkos_Core.hpp>

#include <cstdint>
#include <string>

namespace kmamba {

/// How a matrix product multiplies its fp32 operands; sums are fp32 in every mode. TensorFloat32 and
/// BFloat16 round each operand first, and the product of two rounded operands (at most 22 significant
/// bits) is exact in fp32: they differ from Float32 (products rounded to fp32) by that rounding only.
enum class MatmulPrecision {
  /// Exact fp32 products (CUDA cores on Cuda).
  Float32,
  /// Operands rounded to TF32 (10-bit mantissa, round to nearest) and, on Cuda, multiplied on the
  /// tensor cores: each product carries a relative error of at most ≈ 2^-10. The chunk products
  /// of the scans compute as Float32 on host backends; kmamba::gemm emulates the rounding there.
  TensorFloat32,
  /// Operands rounded to bf16 (7 stored mantissa bits, round to nearest even) and, on Cuda,
  /// multiplied on the tensor cores: each product carries a relative error of at most ≈ 2^-7.
  /// For kmamba::gemm (host backends emulate the rounding), the SSD's fused kernels
  /// (SsdArgs::matmul_precision) and the Mamba-3 SISO scan, which runs on the SSD; the MIMO scan
  /// rejects it (check_scan_matmul_precision).
  BFloat16
};

/// `value` rounded to the operand precision of `p`, in fp32 storage: Float32 leaves it as is;
/// TensorFloat32 keeps 10 mantissa bits, rounding to nearest with ties away from zero (as the
/// tensor cores' cvt.rna conversion does); BFloat16 keeps 7, rounding to nearest even (as
/// float_to_bf16_bits). NaN and infinities stay what they are.
KOKKOS_INLINE_FUNCTION float round_operand(MatmulPrecision p, float value) {
  if (p == MatmulPrecision::BFloat16) return bf16_bits_to_float(float_to_bf16_bits(value));
  if (p == MatmulPrecision::TensorFloat32) {
    const std::uint32_t bits = impl::float_bits(value);
    if ((bits & 0x7f800000u) == 0x7f800000u) return value;
    return impl::float_from_bits((bits + 0x1000u) & 0xffffe000u);
  }
  return value;
}

/// "fp32", "tf32" or "bf16".
inline const char* matmul_precision_name(MatmulPrecision p) {
  switch (p) {
    case MatmulPrecision::Float32:
      return "fp32";
    case MatmulPrecision::TensorFloat32:
      return "tf32";
    case MatmulPrecision::BFloat16:
      return "bf16";
  }
  return "unknown";
}

/// The precision named "fp32", "tf32" or "bf16" (matmul_precision_name's spellings). Anything else
/// is a kmamba::UserError that names `what` (e.g. "--precision") and the accepted values.
inline MatmulPrecision parse_matmul_precision(const std::string& name, const std::string& what = "matmul precision") {
  if (name == "fp32") return MatmulPrecision::Float32;
  if (name == "tf32") return MatmulPrecision::TensorFloat32;
  if (name == "bf16") return MatmulPrecision::BFloat16;
  KMAMBA_USER_ERROR(what << " must be fp32, tf32 or bf16, got '" << name << "'");
}

/// The chunk products of the Mamba-3 scans (Mamba3SisoArgs / Mamba3MimoArgs::matmul_precision)
/// run in Float32 or TensorFloat32; BFloat16 there is a kmamba::UserError naming `function`.
inline void check_scan_matmul_precision(const char* function, MatmulPrecision p) {
  KMAMBA_REQUIRE(p == MatmulPrecision::Float32 || p == MatmulPrecision::TensorFloat32,
                 function << ": matmul_precision " << matmul_precision_name(p)
                          << " is not available for the chunk products of the scans (fp32 or tf32)");
}

}  // namespace kmamba

#endif
