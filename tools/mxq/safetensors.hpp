#pragma once
// safetensors files: a strict reader (memory-mapped, every header field checked before any byte of
// data is touched) and a streaming writer (header first, then tensor by tensor, into a temporary
// name that is renamed into place only when everything was written).
//
// Format: an 8-byte little-endian header length N, N bytes of JSON
//   {"name": {"dtype": "BF16", "shape": [r, c], "data_offsets": [begin, end]}, ...,
//    "__metadata__": {"key": "value", ...}}
// then the data buffer; offsets are relative to its start. As the reference implementation, the
// reader refuses overlapping tensors, holes and trailing bytes.
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace mxq::st {

// Thrown for anything wrong with a file; what() is one line naming the file (and tensor).
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The dtypes safetensors defines, with their element sizes in bytes.
struct DTypeInfo {
  const char* name;
  int bytes;
};
const DTypeInfo* find_dtype(const std::string& name);  // nullptr when unknown

// A tensor shape as "[a, b, c]", the form every message and listing of the tool uses.
inline std::string shape_text(const std::vector<std::int64_t>& shape) {
  std::string r = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) r += (i ? ", " : "") + std::to_string(shape[i]);
  return r + "]";
}

struct TensorInfo {
  std::string name;
  std::string dtype;
  std::vector<std::int64_t> shape;
  std::uint64_t begin = 0, end = 0;  // byte range inside the data buffer
  std::uint64_t bytes() const { return end - begin; }
  std::int64_t numel() const;
};

// Largest header accepted (the reference implementation's limit is 100 MB).
constexpr std::uint64_t kMaxHeaderBytes = 100ull << 20;

// Longest tensor name or metadata key accepted, in bytes. Real checkpoints' names are under 200
// bytes; a longer one is refused before any name is matched against a pattern (names are data from
// the file, and std::regex recurses once per character).
constexpr std::size_t kMaxNameBytes = 1024;

// Most tensors one file may declare (the largest real checkpoints have a few thousand per shard),
// and most dimensions one tensor may have. The count is checked while the header is parsed, so that a
// header's cost is bounded: parsing is linear in the header (at most kMaxHeaderBytes), and nothing done per
// tensor afterwards (lookups by name, writing, listing) grows faster than the tensor count.
constexpr std::size_t kMaxTensors = 200000;
constexpr std::size_t kMaxRank = 32;
// Deepest JSON nesting of a header accepted (a valid one has 3 levels).
constexpr std::size_t kMaxHeaderDepth = 8;

// A parsed header over some bytes (a mapped file, or memory for tests and the fuzzer).
class View {
 public:
  // Validates everything; `name` is used in error messages.
  View(std::span<const std::uint8_t> bytes, std::string name);
  View(const View&) = delete;  // the name index holds views of tensors_' names
  View& operator=(const View&) = delete;
  View(View&&) = default;
  const std::string& name() const { return name_; }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }  // in data order
  const TensorInfo* find(const std::string& tensor) const;  // by name, in constant time
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  std::span<const std::uint8_t> data(const TensorInfo& t) const { return data_.subspan(t.begin, t.bytes()); }
  std::uint64_t header_bytes() const { return header_bytes_; }

 private:
  std::string name_;
  std::span<const std::uint8_t> data_;
  std::vector<TensorInfo> tensors_;
  std::unordered_map<std::string_view, std::size_t> by_name_;  // views of tensors_[i].name
  std::map<std::string, std::string> metadata_;
  std::uint64_t header_bytes_ = 0;
};

// A read-only memory map of a whole file, closed on destruction.
class Mapping {
 public:
  explicit Mapping(const std::string& path);
  ~Mapping();
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  std::span<const std::uint8_t> bytes() const { return {static_cast<const std::uint8_t*>(ptr_), size_}; }
  // Lets the kernel drop the pages wholly inside `range` (a later read maps them in again): keeps
  // the resident set of a streaming pass near one tensor.
  void release(std::span<const std::uint8_t> range) const;

 private:
  void* ptr_ = nullptr;
  std::size_t size_ = 0;
};

// A mapped, validated file.
class File {
 public:
  explicit File(const std::string& path) : map_(std::make_unique<Mapping>(path)), view_(map_->bytes(), path) {}
  const View& view() const { return view_; }
  void release(const TensorInfo& t) const { map_->release(view_.data(t)); }

 private:
  std::unique_ptr<Mapping> map_;
  View view_;
};

// Writes a file tensor by tensor: declare every tensor first, then write their bytes in the order
// declared. Output goes to `path.tmp-<pid>`; commit() renames it into place. A writer destroyed
// without commit() removes the temporary file, so a failure never leaves a partial output.
class Writer {
 public:
  explicit Writer(std::string path) : path_(std::move(path)) {}
  ~Writer();
  Writer(const Writer&) = delete;
  Writer& operator=(const Writer&) = delete;
  void metadata(const std::string& key, const std::string& value) { metadata_[key] = value; }
  void declare(const std::string& name, const std::string& dtype, std::vector<std::int64_t> shape);
  void write(const std::string& name, std::span<const std::uint8_t> bytes);  // next declared tensor
  void commit();

 private:
  void open_and_write_header();
  std::string path_, tmp_;
  std::map<std::string, std::string> metadata_;
  std::vector<TensorInfo> tensors_;
  std::unordered_set<std::string> declared_;
  std::size_t next_ = 0;
  std::FILE* f_ = nullptr;
  bool committed_ = false;
};

}  // namespace mxq::st
