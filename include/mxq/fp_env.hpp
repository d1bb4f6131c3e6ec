#pragma once
// mxq's host arithmetic is defined on IEEE binary32 / binary64 with subnormals (docs/numerics.md). A
// thread running with flush-to-zero or denormals-are-zero (x86 MXCSR FTZ / DAZ, AArch64 FPCR.FZ: e.g.
// after torch.set_flush_denormal(True), or code built with -ffast-math start-up files) would compute
// other bytes, and the CPU backends would disagree with the CUDA one. Every public operation holds an
// IeeeSubnormalScope for its duration, on the calling thread and on each worker thread it uses; code
// that does its own host arithmetic beside mxq's (the PyTorch extension) can do the same.
#include <cstdint>

#if defined(__SSE__) || defined(_M_X64) || (defined(_M_IX86_FP) && _M_IX86_FP >= 1)
#define MXQ_FP_ENV_MXCSR 1  // x87 arithmetic (no SSE) ignores MXCSR and has no flush-to-zero
#include <xmmintrin.h>
#endif

namespace mxq {

// While it lives: subnormals on this thread (FTZ and DAZ cleared; FPCR.FZ cleared). The caller's setting
// is restored when it ends. Costs a register read where nothing needs changing.
class IeeeSubnormalScope {
 public:
  IeeeSubnormalScope() noexcept {
#if defined(MXQ_FP_ENV_MXCSR)
    saved_ = _mm_getcsr();
    const std::uint64_t want = saved_ & ~std::uint64_t(0x8040);  // bit 15 FTZ, bit 6 DAZ
    if (want != saved_) {
      _mm_setcsr(static_cast<unsigned>(want));
      changed_ = true;
    }
#elif defined(__aarch64__)
    std::uint64_t fpcr = 0;
    asm volatile("mrs %0, fpcr" : "=r"(fpcr));
    saved_ = fpcr;
    const std::uint64_t want = fpcr & ~(std::uint64_t(1) << 24);  // FZ
    if (want != fpcr) {
      asm volatile("msr fpcr, %0" ::"r"(want));
      changed_ = true;
    }
#endif
  }
  ~IeeeSubnormalScope() {
    if (!changed_) return;
#if defined(MXQ_FP_ENV_MXCSR)
    // FTZ and DAZ back as they were; the exception flags the operation raised stay raised
    _mm_setcsr(static_cast<unsigned>((_mm_getcsr() & ~0x8040u) | (saved_ & 0x8040u)));
#elif defined(__aarch64__)
    asm volatile("msr fpcr, %0" ::"r"(saved_));
#endif
  }
  IeeeSubnormalScope(const IeeeSubnormalScope&) = delete;
  IeeeSubnormalScope& operator=(const IeeeSubnormalScope&) = delete;

 private:
  std::uint64_t saved_ = 0;
  bool changed_ = false;
};

}  // namespace mxq
