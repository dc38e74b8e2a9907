#include <kmamba/backends/StepGraph.hpp>
#include <kmamba/backends/VendorChecks.hpp>

#include <cuda_runtime.h>

#include <exception>
#include <string>
#include <vector>

namespace kmamba {

struct StepGraph<Kokkos::Cuda>::Impl {
  bool enabled = true;
  int warm_runs = 0;  // normal runs on the private stream so far
  cudaStream_t stream = nullptr;
  cudaEvent_t caller_ready = nullptr, step_done = nullptr;
  std::unique_ptr<Kokkos::Cuda> instance;  // over `stream`
  cudaGraphExec_t graph = nullptr;
  std::string reason;

  ~Impl() {
    // Destroyed while the CUDA context still exists (before Kokkos::finalize); errors ignored.
    if (graph != nullptr) cudaGraphExecDestroy(graph);
    instance.reset();
    if (caller_ready != nullptr) cudaEventDestroy(caller_ready);
    if (step_done != nullptr) cudaEventDestroy(step_done);
    if (stream != nullptr) cudaStreamDestroy(stream);
  }

  void create() {
    if (stream != nullptr) return;
    KMAMBA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    KMAMBA_CUDA_CHECK(cudaEventCreateWithFlags(&caller_ready, cudaEventDisableTiming));
    KMAMBA_CUDA_CHECK(cudaEventCreateWithFlags(&step_done, cudaEventDisableTiming));
    instance = std::make_unique<Kokkos::Cuda>(stream);
  }

  // Records `work` on the private stream; returns the instantiated graph or nullptr with `reason`.
  cudaGraphExec_t record(const std::function<void(const Kokkos::Cuda&)>& work) {
    KMAMBA_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    try {
      work(*instance);
    } catch (const std::exception& e) {
      // E.g. Kokkos refusing a launch that waits on the host while the stream is capturing: the
      // step is not recordable; it runs normally from now on (a genuine error recurs there).
      cudaGraph_t partial = nullptr;
      cudaStreamEndCapture(stream, &partial);
      if (partial != nullptr) cudaGraphDestroy(partial);
      cudaGetLastError();
      reason = std::string("recording the step failed: ") + e.what();
      return nullptr;
    }
    cudaGraph_t g = nullptr;
    const cudaError_t ended = cudaStreamEndCapture(stream, &g);
    if (ended != cudaSuccess || g == nullptr) {
      cudaGetLastError();  // the capture error is reported through `reason`, not left pending
      reason = "the step could not be recorded (" + impl::describe_cuda_status(ended) +
               "): it waits on the device or uses an operation stream capture does not allow";
      return nullptr;
    }
    std::size_t count = 0;
    KMAMBA_CUDA_CHECK(cudaGraphGetNodes(g, nullptr, &count));
    std::vector<cudaGraphNode_t> nodes(count);
    if (count > 0) KMAMBA_CUDA_CHECK(cudaGraphGetNodes(g, nodes.data(), &count));
    for (const cudaGraphNode_t node : nodes) {
      cudaGraphNodeType type;
      KMAMBA_CUDA_CHECK(cudaGraphNodeGetType(node, &type));
      // Stream-ordered allocations (cuBLAS takes its workspace so) become graph memory nodes,
      // which replay correctly.
      const bool replayable = type == cudaGraphNodeTypeKernel || type == cudaGraphNodeTypeMemset ||
                              type == cudaGraphNodeTypeEmpty || type == cudaGraphNodeTypeMemAlloc ||
                              type == cudaGraphNodeTypeMemFree;
      if (!replayable) {
        cudaGraphDestroy(g);
        reason = "the recorded step holds a node of type " + std::to_string(static_cast<int>(type)) +
                 " (not a kernel, memset or memory node; e.g. a kernel launched through constant memory copies its "
                 "arguments from host memory, which a replay would read stale)";
        return nullptr;
      }
    }
    cudaGraphExec_t exec = nullptr;
    const cudaError_t made = cudaGraphInstantiate(&exec, g, 0);
    cudaGraphDestroy(g);
    if (made != cudaSuccess) {
      cudaGetLastError();
      reason = "the recorded step could not be instantiated (" + impl::describe_cuda_status(made) + ")";
      return nullptr;
    }
    return exec;
  }
};

StepGraph<Kokkos::Cuda>::StepGraph(bool enabled) : impl_(std::make_unique<Impl>()) {
  impl_->enabled = enabled;
  if (!enabled) impl_->reason = "disabled by the caller";
}
StepGraph<Kokkos::Cuda>::~StepGraph() = default;
StepGraph<Kokkos::Cuda>::StepGraph(StepGraph&&) noexcept = default;
StepGraph<Kokkos::Cuda>& StepGraph<Kokkos::Cuda>::operator=(StepGraph&&) noexcept = default;

bool StepGraph<Kokkos::Cuda>::recorded() const { return impl_->graph != nullptr; }
const std::string& StepGraph<Kokkos::Cuda>::fallback_reason() const { return impl_->reason; }

void StepGraph<Kokkos::Cuda>::invalidate() {
  if (impl_->graph != nullptr) {
    KMAMBA_CUDA_CHECK(cudaGraphExecDestroy(impl_->graph));
    impl_->graph = nullptr;
  }
  impl_->warm_runs = 0;
  if (impl_->enabled) impl_->reason.clear();
}

void StepGraph<Kokkos::Cuda>::run(const Kokkos::Cuda& exec, const std::function<void(const Kokkos::Cuda&)>& work) {
  Impl& s = *impl_;
  if (!s.enabled || !s.reason.empty()) {
    work(exec);
    return;
  }
  s.create();
  // The private stream starts after everything queued on the caller's, and the caller's next
  // work after the step.
  KMAMBA_CUDA_CHECK(cudaEventRecord(s.caller_ready, exec.cuda_stream()));
  KMAMBA_CUDA_CHECK(cudaStreamWaitEvent(s.stream, s.caller_ready, 0));
  constexpr int warm_up = 2;
  if (s.graph == nullptr && s.warm_runs < warm_up) {
    work(*s.instance);
    ++s.warm_runs;
  } else {
    if (s.graph == nullptr) {
      // Recording needs the private stream idle: nothing of the warm-up may still run.
      KMAMBA_CUDA_CHECK(cudaStreamSynchronize(s.stream));
      s.graph = s.record(work);
      if (s.graph == nullptr) {
        // The private instance may hold state of the failed recording: the step runs on the
        // caller's instance from now on.
        work(exec);
        return;
      }
    }
    KMAMBA_CUDA_CHECK(cudaGraphLaunch(s.graph, s.stream));
  }
  KMAMBA_CUDA_CHECK(cudaEventRecord(s.step_done, s.stream));
  KMAMBA_CUDA_CHECK(cudaStreamWaitEvent(exec.cuda_stream(), s.step_done, 0));
}

}  // namespace kmamba
