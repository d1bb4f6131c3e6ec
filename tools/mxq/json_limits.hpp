#pragma once
// JSON read from a checkpoint or a part directory is untrusted: its nesting depth is bounded before
// anything recursive (the DOM's copy, comparison and serialisation recurse once per level: 60,000
// levels overflowed the stack), and it is written back indented to a bounded depth only (indenting
// every level makes 2 * depth^2 bytes from 2 * depth).
#include <algorithm>
#include <cstddef>
#include <string>

#include <nlohmann/json.hpp>

namespace mxq::cli {

// Deepest nesting of objects and arrays accepted in any JSON file (real configs and indexes nest
// fewer than 10 levels; a part's manifest holds the index one level down).
constexpr std::size_t kMaxJsonDepth = 64;

// Levels written indented by dump_json; deeper values are written compact, on one line.
constexpr std::size_t kIndentedJsonDepth = 10;

// The deepest nesting of text, by an iterative SAX pass that builds nothing and stops as soon as it
// goes past `limit` (then returns limit + 1). Invalid JSON returns what was seen up to the error: the
// parse that follows reports it. NOTE: not a callback on the DOM parse: nlohmann's callback parser
// rescans the enclosing object at the end of every entry (quadratic; safetensors.cpp says more).
// A SAX handler that builds nothing and tracks the nesting depth, refusing (stopping the parse) past
// `limit`; derived handlers override key() to look at names too (safetensors.cpp counts tensors).
struct DepthSax : nlohmann::json_sax<nlohmann::json> {
  std::size_t limit, depth = 0, deepest = 0;
  explicit DepthSax(std::size_t l) : limit(l) {}
  bool open() {
    deepest = std::max(deepest, ++depth);
    return depth <= limit;
  }
  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override { return open(); }
  bool end_object() override { return --depth, true; }
  bool start_array(std::size_t) override { return open(); }
  bool end_array() override { return --depth, true; }
  bool key(string_t&) override { return true; }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override { return false; }
};

template <class It>
std::size_t json_depth(It first, It last, std::size_t limit = kMaxJsonDepth) {
  DepthSax d(limit);
  nlohmann::json::sax_parse(first, last, &d);
  return d.deepest;
}

namespace detail {
inline void dump_json_to(std::string& s, const nlohmann::json& j, std::size_t depth) {
  if (!j.is_structured() || j.empty() || depth >= kIndentedJsonDepth) {
    s += j.dump();
    return;
  }
  const std::string in(2 * (depth + 1), ' ');
  s += j.is_object() ? "{\n" : "[\n";
  bool first = true;
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (!first) s += ",\n";
    first = false;
    s += in;
    if (j.is_object()) s += nlohmann::json(it.key()).dump() + ": ";
    dump_json_to(s, it.value(), depth + 1);
  }
  s += '\n';
  s.append(2 * depth, ' ');
  s += j.is_object() ? '}' : ']';
}
}  // namespace detail

// j as nlohmann's dump(2) writes it for the first kIndentedJsonDepth levels (every real config and
// index: the same bytes), deeper values compact: the output is at most about 2 * kIndentedJsonDepth
// times the compact size, never quadratic in the depth.
inline std::string dump_json(const nlohmann::json& j) {
  std::string s;
  detail::dump_json_to(s, j, 0);
  return s;
}

}  // namespace mxq::cli
