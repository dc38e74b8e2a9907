// Everything core/ offers: tensors, shapes, errors, files, bf16 storage and random fills.
#ifndef KMAMBA_CORE_CORE_HPP
#define KMAMBA_CORE_CORE_HPP

#include <kmamba/Config.hpp>
#include <kmamba/core/Activations.hpp>
#include <kmamba/core/Bf16.hpp>
#include <kmamba/core/Conv1d.hpp>
#include <kmamba/core/ConvSsdStep.hpp>
#include <kmamba/core/CrossEntropy.hpp>
#include <kmamba/core/Embedding.hpp>
#include <kmamba/core/Error.hpp>
#include <kmamba/core/Files.hpp>
#include <kmamba/core/HostMemory.hpp>
#include <kmamba/core/Mamba3Scan.hpp>
#include <kmamba/core/Mamba3StateCorrection.hpp>
#include <kmamba/core/Math.hpp>
#include <kmamba/core/MatmulPrecision.hpp>
#include <kmamba/core/Random.hpp>
#include <kmamba/core/RmsNorm.hpp>
#include <kmamba/core/SelectiveScan.hpp>
#include <kmamba/core/SelectiveScanStateCorrection.hpp>
#include <kmamba/core/Shape.hpp>
#include <kmamba/core/Ssd.hpp>
#include <kmamba/core/SsdStateCorrection.hpp>
#include <kmamba/core/Tensor.hpp>

#endif
