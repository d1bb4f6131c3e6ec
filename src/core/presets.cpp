#include <mxq/presets.hpp>

namespace mxq::presets {

QuantOptions vllm_mxfp4_qdq() { return QuantOptions::mx(Format::mxfp4, ScaleRule::even); }
QuantOptions vllm_mxfp8_qdq() { return QuantOptions::mx(Format::mxfp8_e4m3, ScaleRule::floor); }
QuantOptions ocp_mx(Format format) { return QuantOptions::mx(format, ScaleRule::floor); }

QuantOptions torchao_mx(Format format, ScaleRule rule) {
  if (rule != ScaleRule::floor && rule != ScaleRule::ceil && rule != ScaleRule::even && rule != ScaleRule::rceil)
    throw Error(Error::Code::invalid_argument,
                "mxq::presets::torchao_mx: argument 'rule': torchao offers floor, ceil, even and rceil, got '" +
                    std::string(to_string(rule)) + "'");
  return QuantOptions::mx(format, rule);
}

QuantOptions compressed_tensors_mx(Format format) {
  if (format != Format::mxfp4 && format != Format::mxfp8_e4m3)
    throw Error(Error::Code::invalid_argument,
                "mxq::presets::compressed_tensors_mx: argument 'format': compressed-tensors writes mxfp4 and mxfp8_e4m3, got '" +
                    std::string(to_string(format)) + "'");
  return QuantOptions::mx(format, ScaleRule::even_fp4);
}

QuantOptions mxfp8_rceil() { return QuantOptions::mx(Format::mxfp8_e4m3, ScaleRule::rceil); }

QuantOptions qutlass_mx_quest() {
  QuantOptions o = QuantOptions::mx(Format::mxfp4, ScaleRule::quest);
  o.scale_layout = ScaleLayout::swizzled;
  return o;
}

QuantOptions qutlass_mx_absmax() {
  QuantOptions o = QuantOptions::mx(Format::mxfp4, ScaleRule::qutlass_absmax);
  o.scale_layout = ScaleLayout::swizzled;
  return o;
}

QuantOptions qutlass_nv(float global_scale) {
  QuantOptions o = QuantOptions::nvfp4(global_scale);
  o.scale_layout = ScaleLayout::swizzled;
  return o;
}

}  // namespace mxq::presets
