#pragma once
// Compile-time launch configuration shared by every kernel of the CUDA backend.
#include <cstdint>

namespace mxq::core {}

namespace mxq::cuda {

// The CUDA backend is written against the core's codec and fast-math helpers throughout.
using namespace mxq::core;

using i64 = std::int64_t;
using u32 = std::uint32_t;
using u64 = std::uint64_t;

constexpr unsigned kFull = 0xFFFFFFFFu;  // every lane of a warp

struct LaunchConfig {
  static constexpr int kThreads = 256;  // threads per block, every kernel
  // Chunks a thread of block_kernel keeps in flight through its cp.async ring (kStages - 1 ahead).
  // NOTE: tried on the H200 (2026-12-02): one chunk per thread and plain loads left the kernels
  // latency-bound (~36% achieved occupancy, DRAM ~1/3 busy); holding four chunks per thread in
  // registers instead halved the occupancy and was slower still.
#if defined(MXQ_CUDA_STAGES)  // a tuning experiment: cmake -DCMAKE_CUDA_FLAGS=-DMXQ_CUDA_STAGES=N
  static constexpr int kStages = MXQ_CUDA_STAGES;
#else
  static constexpr int kStages = 4;
#endif
  // A chunk is C contiguous elements of one thread: 16 (2-byte dtypes), 8 or 2; at most 32 bytes.
  static constexpr int kMaxChunkBytes = 32;
  static constexpr int kMaxRingBytes = kStages * kThreads * kMaxChunkBytes;

  static_assert(kThreads % 32 == 0, "a block is whole warps: the group shuffles need every lane");
  static_assert(kThreads >= 128, "one block fills the 128-entry NVFP4 scale tables in one pass");
  static_assert(kStages >= 2, "the ring holds the chunk being computed and at least one in flight");
  static_assert(kMaxRingBytes <= 48 * 1024, "the ring fits the static shared memory of one block");
};

constexpr int kThreads = LaunchConfig::kThreads;
constexpr int kStages = LaunchConfig::kStages;

}  // namespace mxq::cuda
