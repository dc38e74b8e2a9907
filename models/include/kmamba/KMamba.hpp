// kmamba's public header: all an application needs.
//
//   #include <kmamba/KMamba.hpp>
//   int main(int argc, char** argv) {
//     Kokkos::ScopeGuard kokkos(argc, argv);
//     kmamba::print_configuration(std::cout);
//   }
#ifndef KMAMBA_KMAMBA_HPP
#define KMAMBA_KMAMBA_HPP

#include <kmamba/Config.hpp>
#include <kmamba/Embed.hpp>
#include <kmamba/backends/Devices.hpp>
#include <kmamba/core/Core.hpp>
#include <kmamba/models/Config.hpp>
#include <kmamba/models/Data.hpp>
#include <kmamba/models/DeviceSampler.hpp>
#include <kmamba/models/Distributed.hpp>
#include <kmamba/models/Generation.hpp>
#include <kmamba/models/LanguageModel.hpp>
#include <kmamba/models/LoadBalance.hpp>
#include <kmamba/models/Optimizer.hpp>
#include <kmamba/models/ParameterSlab.hpp>
#include <kmamba/models/Pipeline.hpp>
#include <kmamba/models/PipelineStage.hpp>
#include <kmamba/models/SafeTensors.hpp>
#include <kmamba/models/Sampling.hpp>
#include <kmamba/models/SequenceModel.hpp>
#include <kmamba/models/StagedDirectory.hpp>
#include <kmamba/models/TensorIO.hpp>
#include <kmamba/models/TokenFile.hpp>
#include <kmamba/models/Tokenizer.hpp>
#include <kmamba/models/Trainer.hpp>

namespace kmamba {

/// The library's version, "MAJOR.MINOR.PATCH", as compiled (may differ from KMAMBA_VERSION_STRING
/// in the headers an application was built against if the two were mixed).
const char* version();

}  // namespace kmamba

#endif
