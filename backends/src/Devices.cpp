#include <kmamba/backends/Devices.hpp>
#include <kmamba/backends/VendorChecks.hpp>

#include <Kokkos_Core.hpp>

#include <iomanip>
#include <ostream>
#include <sstream>
#include <type_traits>

namespace kmamba {
namespace {

template <class ExecSpace>
ExecutionSpaceInfo host_space_info() {
  ExecutionSpaceInfo info;
  info.name = ExecSpace::name();
  info.concurrency = ExecSpace().concurrency();
  info.device = "host CPU, " + std::to_string(info.concurrency) + (info.concurrency == 1 ? " thread" : " threads");
  info.is_default = std::is_same<ExecSpace, Kokkos::DefaultExecutionSpace>::value;
  return info;
}

}  // namespace

#if KMAMBA_ENABLE_CUDA
namespace impl {
std::string describe_cublas_status(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS:
      return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED:
      return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED:
      return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE:
      return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH:
      return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR:
      return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED:
      return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR:
      return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_LICENSE_ERROR:
      return "CUBLAS_STATUS_LICENSE_ERROR";
  }
  return "unknown cuBLAS status";
}
}  // namespace impl
#endif

std::vector<ExecutionSpaceInfo> execution_spaces() {
  std::vector<ExecutionSpaceInfo> spaces;
#if KMAMBA_ENABLE_CUDA
  {
    int device = 0;
    KMAMBA_CUDA_CHECK(cudaGetDevice(&device));
    cudaDeviceProp prop;
    KMAMBA_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
    std::ostringstream os;
    os << prop.name << " (sm_" << prop.major << prop.minor << ", " << prop.multiProcessorCount << " SMs, " << std::fixed
       << std::setprecision(1) << static_cast<double>(prop.totalGlobalMem) / (1024.0 * 1024.0 * 1024.0)
       << " GiB, device " << device << ")";
    ExecutionSpaceInfo info;
    info.name = Kokkos::Cuda::name();
    info.device = os.str();
    info.concurrency = Kokkos::Cuda().concurrency();
    info.is_default = std::is_same<Kokkos::Cuda, Kokkos::DefaultExecutionSpace>::value;
    spaces.push_back(info);
  }
#endif
#if KMAMBA_HAS_OPENMP
  spaces.push_back(host_space_info<Kokkos::OpenMP>());
#endif
#if KMAMBA_HAS_SERIAL
  spaces.push_back(host_space_info<Kokkos::Serial>());
#endif
  return spaces;
}

void print_configuration(std::ostream& os) {
  os << "kmamba " << KMAMBA_VERSION_STRING << " (Kokkos " << KMAMBA_KOKKOS_VERSION_STRING << ")\n"
     << "  options: CUDA=" << (KMAMBA_ENABLE_CUDA ? "on" : "off") << " MPI=" << (KMAMBA_ENABLE_MPI ? "on" : "off")
     << " NCCL=" << (KMAMBA_ENABLE_NCCL ? "on" : "off") << "\n";
  for (const ExecutionSpaceInfo& s : execution_spaces()) {
    os << "  execution space " << s.name << (s.is_default ? " (default)" : "") << ": " << s.device << "\n";
  }
}

}  // namespace kmamba
