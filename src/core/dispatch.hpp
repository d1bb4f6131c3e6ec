#pragma once
// Runtime element type / dtype -> compile-time template parameter, shared by the fast CPU path and
// the CUDA backend: f is called with a std::integral_constant of the value.
#include <cstdint>
#include <type_traits>

#include <mxq/types.hpp>

namespace mxq::core {

// The storage word of one element of a floating dtype: the fp32 bits, or the 16-bit pattern.
template <DType DT>
using Storage = std::conditional_t<DT == DType::f32, std::uint32_t, std::uint16_t>;

template <class F>
void dispatch_elem(ElemType t, F&& f) {
  switch (t) {
    case ElemType::e2m1: return f(std::integral_constant<ElemType, ElemType::e2m1>{});
    case ElemType::e2m3: return f(std::integral_constant<ElemType, ElemType::e2m3>{});
    case ElemType::e3m2: return f(std::integral_constant<ElemType, ElemType::e3m2>{});
    case ElemType::e4m3: return f(std::integral_constant<ElemType, ElemType::e4m3>{});
    case ElemType::e5m2: return f(std::integral_constant<ElemType, ElemType::e5m2>{});
    case ElemType::int8: return f(std::integral_constant<ElemType, ElemType::int8>{});
  }
}

// u8, i32, i64 are not floating dtypes: f is not called (the entry points reject it first).
template <class F>
void dispatch_dtype(DType t, F&& f) {
  switch (t) {
    case DType::f32: return f(std::integral_constant<DType, DType::f32>{});
    case DType::f16: return f(std::integral_constant<DType, DType::f16>{});
    case DType::bf16: return f(std::integral_constant<DType, DType::bf16>{});
    case DType::u8:
    case DType::i32:
    case DType::i64: return;
  }
}

}  // namespace mxq::core
