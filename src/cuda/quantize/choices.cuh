#pragma once
// The structural choices of a quantize / QDQ kernel as template parameters. The launcher (one dispatch,
// quantize_launch.cu / qdq_launch.cu) resolves the options into them; inside a kernel each is a
// constant, so the hot loop carries only the code of its own choice.
//
// The `runtime` choice reads the option from the parameters instead: the launcher uses it only for
// the launches whose speed matters least (rows with partial chunks or strides, group sizes 2..8), to
// bound the number of kernels compiled.
#include <cstdint>

#include "cuda/common/params.cuh"

namespace mxq::cuda {

// How an MX block's scale exponent is chosen: from the block amax by one of floor / ceil / even /
// rceil (as constants: core::AmaxRule), by the quest rule (the block's standard deviation), or by
// QuTLASS's abs_max rule (which also multiplies the elements by 3).
enum class ScaleChoice : std::uint8_t { amax, quest, absmax, runtime };
enum class RoundChoice : std::uint8_t { rne, stochastic, runtime };

template <ScaleChoice SC, RoundChoice RC>
struct Choices {
  static constexpr ScaleChoice scale = SC;
  static constexpr RoundChoice round = RC;
  __device__ __forceinline__ static bool quest(const Params& p) {
    if constexpr (SC == ScaleChoice::runtime) return p.rule == ScaleRule::quest;
    else return SC == ScaleChoice::quest;
  }
  __device__ __forceinline__ static bool absmax(const Params& p) {
    if constexpr (SC == ScaleChoice::runtime) return p.rule == ScaleRule::qutlass_absmax;
    else return SC == ScaleChoice::absmax;
  }
  __device__ __forceinline__ static bool stochastic(const Params& p) {
    if constexpr (RC == RoundChoice::runtime) return p.stochastic;
    else return RC == RoundChoice::stochastic;
  }
};

inline ScaleChoice scale_choice(ScaleRule r) {
  return r == ScaleRule::quest ? ScaleChoice::quest : r == ScaleRule::qutlass_absmax ? ScaleChoice::absmax : ScaleChoice::amax;
}

}  // namespace mxq::cuda
