#pragma once
// The whole public C++ API of mxq.
#include <mxq/convert.hpp>
#include <mxq/fp_env.hpp>
#include <mxq/linear.hpp>
#include <mxq/moe.hpp>
#include <mxq/ops.hpp>
#include <mxq/presets.hpp>
#include <mxq/types.hpp>
#include <mxq/version.hpp>
