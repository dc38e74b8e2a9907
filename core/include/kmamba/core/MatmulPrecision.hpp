// The arithmetic of the matrix products inside the chunked scans (SsdArgs::matmul_precision).
#ifndef KMAMBA_CORE_MATMULPRECISION_HPP
#define KMAMBA_CORE_MATMULPRECISION_HPP

namespace kmamba {

/// How the per-chunk products of a scan multiply their fp32 operands. Sums are fp32 either way.
enum class MatmulPrecision {
  /// Exact fp32 products (CUDA cores on Cuda).
  Float32,
  /// On Cuda, operands rounded to TF32 (10-bit mantissa, round to nearest) and multiplied on the
  /// tensor cores: each product carries a relative error of at most ≈ 2^-10. Elsewhere the same
  /// as Float32.
  TensorFloat32
};

inline const char* matmul_precision_name(MatmulPrecision p) { return p == MatmulPrecision::Float32 ? "fp32" : "tf32"; }

}  // namespace kmamba

#endif
