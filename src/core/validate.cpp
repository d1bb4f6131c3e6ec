// The argument checker of the entry points and the validation of options into a Problem.
#include "core/validate.hpp"

#include <string>

namespace mxq::core {

void fail(Error::Code code, const std::string& fn, const std::string& msg) {
  throw Error(code, "mxq::" + fn + ": " + msg);
}

std::string shape_str(std::int64_t r, std::int64_t c) {
  // NOTE: appended piece by piece: GCC 12 warns (-Wrestrict, a false positive) on "[" + string&&.
  std::string s = "[";
  s += std::to_string(r);
  s += ", ";
  s += std::to_string(c);
  s += ']';
  return s;
}

void Checker::geometry(const char* arg, const Tensor& t) const {
  if (t.rows < 0 || t.cols < 0)
    fail(std::string("argument '") + arg + "': negative shape " + shape_str(t.rows, t.cols));
  if (t.row_stride < 0 || (t.row_stride != 0 && t.row_stride < t.cols))
    fail(std::string("argument '") + arg + "': row_stride " + std::to_string(t.row_stride) +
         " must be 0 (dense) or >= cols (" + std::to_string(t.cols) + ")");
  constexpr std::int64_t kMax = std::int64_t(1) << 46;  // keeps every byte offset far from overflow
  if (t.rows > kMax || t.stride() > kMax || (t.rows > 0 && t.stride() > kMax / t.rows))
    fail(std::string("argument '") + arg + "': shape " + shape_str(t.rows, t.cols) + " with row_stride " +
         std::to_string(t.stride()) + " is too large");
  if (t.data == nullptr && t.rows > 0 && t.cols > 0)
    fail(std::string("argument '") + arg + "': data is null for a non-empty " + shape_str(t.rows, t.cols) +
         " view");
}

void Checker::view(const char* arg, const Tensor& t, DType dtype, std::int64_t rows, std::int64_t cols,
                   bool dense_required) {
  if (t.dtype != dtype)
    fail(std::string("argument '") + arg + "': dtype " + std::string(to_string(t.dtype)) + ", expected " +
         std::string(to_string(dtype)));
  if (t.rows != rows || t.cols != cols)
    fail(std::string("argument '") + arg + "': shape " + shape_str(t.rows, t.cols) + ", expected " +
         shape_str(rows, cols));
  geometry(arg, t);
  if (dense_required && t.stride() != t.cols)
    fail(std::string("argument '") + arg + "': must be dense (row_stride 0 or " + std::to_string(t.cols) +
         "), got row_stride " + std::to_string(t.row_stride));
}

void Checker::float_view(const char* arg, const Tensor& t) {
  if (t.dtype != DType::f32 && t.dtype != DType::f16 && t.dtype != DType::bf16)
    fail(std::string("argument '") + arg + "': dtype " + std::string(to_string(t.dtype)) + ", expected f32, f16 or bf16");
  geometry(arg, t);
}

void Checker::same_device(const char* arg, const Tensor& t, Device d) {
  if (t.device != d)
    fail(std::string("argument '") + arg + "' is on " + (t.device == Device::cpu ? "cpu" : "cuda") +
         " but the input is on " + (d == Device::cpu ? "cpu" : "cuda") + "; all views must be on one device");
}

void Checker::record(const char* arg, const Tensor& t, bool writable) {
  if (t.rows == 0 || t.cols == 0 || t.data == nullptr) return;
  const auto b = reinterpret_cast<std::uintptr_t>(t.data);
  const auto bytes = static_cast<std::uintptr_t>(((t.rows - 1) * t.stride() + t.cols) * dtype_size(t.dtype));
  (writable ? outputs_ : inputs_).push_back(Span{arg, b, b + bytes});
}

void Checker::no_overlap() const {
  auto overlap = [](const Span& a, const Span& b) { return a.begin < b.end && b.begin < a.end; };
  for (std::size_t i = 0; i < outputs_.size(); ++i) {
    for (std::size_t j = i + 1; j < outputs_.size(); ++j)
      if (overlap(outputs_[i], outputs_[j]))
        fail(std::string("outputs '") + outputs_[i].name + "' and '" + outputs_[j].name + "' overlap in memory");
    for (const Span& in : inputs_)
      if (overlap(outputs_[i], in))
        fail(std::string("output '") + outputs_[i].name + "' overlaps input '" + in.name + "'");
  }
}

Problem make_problem(const Checker& c, const QuantOptions& opt, std::int64_t rows, std::int64_t K) {
  Problem p;
  p.fn = c.fn();
  p.opt = opt;
  if (static_cast<unsigned>(opt.format) > static_cast<unsigned>(Format::nvfp4_e5m3))
    c.fail("option 'format': invalid value " + std::to_string(int(opt.format)));
  if (static_cast<unsigned>(opt.rule) > static_cast<unsigned>(ScaleRule::nvfp4_e5m3))
    c.fail("option 'rule': invalid value " + std::to_string(int(opt.rule)));
  p.info = format_info(opt.format);
  p.elem = elem_spec(p.info.elem);
  const std::string fmt(to_string(opt.format));
  if (const std::string why = rule_refusal(opt.format, opt.rule); !why.empty()) c.fail("option 'rule': " + why);
  const int g = group_size(opt);
  if (g < 2 || g > 256 || (g & (g - 1)) != 0)
    c.fail("option 'group_size': " + std::to_string(opt.group_size) + ", expected 0 (format default) or a power of two in [2, 256]");
  if (opt.rounding != Rounding::nearest_even && opt.rounding != Rounding::stochastic)
    c.fail("option 'rounding': invalid value " + std::to_string(int(opt.rounding)));
  if (opt.random_bits != 32 && opt.random_bits != 16 && opt.random_bits != 8)
    c.fail("option 'random_bits': " + std::to_string(opt.random_bits) + ", expected 32, 16 or 8 random bits per element");
  if (opt.scale_layout != ScaleLayout::linear && opt.scale_layout != ScaleLayout::swizzled)
    c.fail("option 'scale_layout': invalid value " + std::to_string(int(opt.scale_layout)));
  if (opt.format == Format::nvfp4_e5m3) {
    // The vllm-qdq-plugin's format as it defines it (docs/numerics.md, "NVFP4 with UE5M3 scales"): its two
    // group sizes, round to nearest even; the scale is amax / 6 itself (no tensor scale), and no
    // rotation is defined for it.
    if (opt.group_size != 0 && opt.group_size != 16 && opt.group_size != 32)
      c.fail("option 'group_size': " + std::to_string(opt.group_size) +
             " with format 'nvfp4_e5m3', expected 0 (16), 16 or 32 (the vllm-qdq-plugin's group sizes)");
    if (opt.rounding == Rounding::stochastic)
      c.fail("option 'rounding': 'stochastic' with format 'nvfp4_e5m3', expected rne (the format rounds to nearest even only)");
    if (opt.rotation != Rotation::none)
      c.fail("option 'rotation': '" + std::string(to_string(opt.rotation)) +
             "' with format 'nvfp4_e5m3', expected none (no rotation is defined for this format)");
  }
  if (opt.tensor_scale) {
    if (opt.format != Format::nvfp4)
      c.fail("option 'tensor_scale' is only used by format nvfp4, got format '" + fmt + "'");
    const float s = *opt.tensor_scale;
    if (!(s > 0.0f) || !is_finite_bits(f2u(s)))
      c.fail("option 'tensor_scale': " + std::to_string(s) + ", expected a finite value > 0 (the encode scale 448*6/amax)");
    if (opt.rule == ScaleRule::quest && s != 1.0f)
      c.fail("option 'tensor_scale': " + std::to_string(s) + " with nvfp4 rule 'quest', whose tensor scale is 1 (leave it unset)");
  }
  if (static_cast<unsigned>(opt.rotation) > static_cast<unsigned>(Rotation::matrix))
    c.fail("option 'rotation': invalid value " + std::to_string(int(opt.rotation)));
  if (opt.rotation != Rotation::matrix && (opt.rotation_matrix.data || opt.rotation_inverse.data))
    c.fail(std::string("option '") + (opt.rotation_matrix.data ? "rotation_matrix" : "rotation_inverse") +
           "' given with rotation '" + std::string(to_string(opt.rotation)) + "' (set rotation = Rotation::matrix)");
  if (static_cast<unsigned>(opt.matrix_precision) > static_cast<unsigned>(MatrixPrecision::bf16))
    c.fail("option 'matrix_precision': invalid value " + std::to_string(int(opt.matrix_precision)));
  if (opt.matrix_precision != MatrixPrecision::exact && opt.rotation != Rotation::matrix)
    c.fail("option 'matrix_precision': '" + std::string(to_string(opt.matrix_precision)) + "' with rotation '" +
           std::string(to_string(opt.rotation)) + "' (it chooses how Rotation::matrix sums; leave it exact)");
  if (opt.matrix_precision == MatrixPrecision::bf16 && opt.rotation_size > 128)
    c.fail("option 'matrix_precision': 'bf16' with rotation_size " + std::to_string(opt.rotation_size) +
           ", expected 16, 32, 64 or 128 (the bf16 matrix of RS 256 does not fit the GPU's shared memory; use 'exact')");
  if (opt.rotation == Rotation::none) {
    if (opt.rotation_size != 0)
      c.fail("option 'rotation_size': " + std::to_string(opt.rotation_size) + " without a rotation (set option 'rotation')");
  } else {
    if (opt.rotation_size < 16 || opt.rotation_size > 256 || (opt.rotation_size & (opt.rotation_size - 1)))
      c.fail("option 'rotation_size': " + std::to_string(opt.rotation_size) + ", expected 16, 32, 64, 128 or 256");
    if (K % opt.rotation_size != 0)
      c.fail("option 'rotation_size': " + std::to_string(opt.rotation_size) + " does not divide K = " + std::to_string(K) +
             " (each group of rotation_size elements of a row is rotated)");
    if (opt.rotation == Rotation::matrix) {
      if (!opt.rotation_matrix.data && !opt.rotation_inverse.data)
        c.fail("option 'rotation_matrix': missing (rotation 'matrix' needs the matrix R; dequantize its inverse)");
      for (const auto& [arg, m] : {std::pair<const char*, const Tensor*>{"rotation_matrix", &opt.rotation_matrix},
                                   {"rotation_inverse", &opt.rotation_inverse}}) {
        if (!m->data) continue;
        const std::string shape = std::string("[").append(std::to_string(m->rows)).append(", ").append(std::to_string(m->cols)).append("]");
        if (m->rows != opt.rotation_size || m->cols != opt.rotation_size)
          c.fail(std::string("option '") + arg + "': shape " + shape + ", expected [" + std::to_string(opt.rotation_size) + ", " +
                 std::to_string(opt.rotation_size) + "] (rotation_size squared)");
        if (m->dtype != DType::f32 && m->dtype != DType::bf16)
          c.fail(std::string("option '") + arg + "': dtype " + std::string(to_string(m->dtype)) + ", expected f32 or bf16");
        if (m->stride() != m->cols) c.fail(std::string("option '") + arg + "': rows with a stride, expected a dense matrix");
      }
    }
  }
  p.rows = rows;
  p.K = K;
  p.g = g;
  p.nblocks = (K + g - 1) / g;
  p.scale_rows_padded = (rows + 127) / 128 * 128;
  p.scale_cols_padded = (p.nblocks + 3) / 4 * 4;
  p.stochastic = opt.rounding == Rounding::stochastic;
  p.sr_bits = opt.random_bits;
  p.fp4 = p.info.elem_bits == 4;
  p.S = opt.tensor_scale.value_or(1.0f);
  p.empty = rows == 0 || K == 0;
  return p;
}

}  // namespace mxq::core
