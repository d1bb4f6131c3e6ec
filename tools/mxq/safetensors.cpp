#include "safetensors.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include <nlohmann/json.hpp>

#include "json_limits.hpp"

namespace mxq::st {

namespace {

constexpr DTypeInfo kDTypes[] = {
    {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E4M3", 1}, {"F8_E5M2", 1}, {"I16", 2}, {"U16", 2}, {"F16", 2},
    {"BF16", 2}, {"I32", 4}, {"U32", 4}, {"F32", 4},      {"I64", 8},     {"U64", 8}, {"F64", 8},
};

[[noreturn]] void fail(const std::string& file, const std::string& what) { throw Error(file + ": " + what); }
[[noreturn]] void fail_tensor(const std::string& file, const std::string& tensor, const std::string& what) {
  throw Error(file + ": tensor '" + tensor + "': " + what);
}

// What a file that is not safetensors looks like, for the error message: "" when unrecognised.
std::string not_safetensors_hint(std::span<const std::uint8_t> b) {
  if (b.size() >= 4 && b[0] == 'P' && b[1] == 'K' && b[2] == 3 && b[3] == 4)
    return " (this is a zip archive: a PyTorch .bin/.pt checkpoint? only safetensors files are read)";
  if (b.size() >= 2 && b[0] == 0x80 && b[1] >= 2 && b[1] <= 5)
    return " (this looks like a Python pickle: a PyTorch checkpoint? only safetensors files are read)";
  return "";
}

std::uint64_t read_le64(const std::uint8_t* p) {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

}  // namespace

const DTypeInfo* find_dtype(const std::string& name) {
  for (const DTypeInfo& d : kDTypes)
    if (name == d.name) return &d;
  return nullptr;
}

std::int64_t TensorInfo::numel() const {
  std::int64_t n = 1;
  for (std::int64_t d : shape) n *= d;
  return n;
}

View::View(std::span<const std::uint8_t> bytes, std::string name) : name_(std::move(name)) {
  if (bytes.size() < 8) fail(name_, "truncated: " + std::to_string(bytes.size()) + " bytes, not even the 8-byte header length");
  const std::uint64_t n = read_le64(bytes.data());
  if (n > kMaxHeaderBytes)
    fail(name_, "header length " + std::to_string(n) + " bytes exceeds the limit of " + std::to_string(kMaxHeaderBytes) +
                    not_safetensors_hint(bytes));
  if (n > bytes.size() - 8)
    fail(name_, "truncated: the header claims " + std::to_string(n) + " bytes but only " +
                    std::to_string(bytes.size() - 8) + " follow the length" + not_safetensors_hint(bytes));
  header_bytes_ = n;
  data_ = bytes.subspan(8 + n);

  // The header is UTF-8 JSON and nothing else (as the reference implementation reads it): no
  // byte-order mark, no NUL (a parser could stop there and ignore what follows).
  const auto hb = bytes.subspan(8, n);
  if (n >= 3 && hb[0] == 0xEF && hb[1] == 0xBB && hb[2] == 0xBF) fail(name_, "header starts with a UTF-8 byte-order mark");
  if (std::find(hb.begin(), hb.end(), std::uint8_t(0)) != hb.end())
    fail(name_, "header holds a NUL byte at offset " + std::to_string(8 + (std::find(hb.begin(), hb.end(), std::uint8_t(0)) - hb.begin())));
  // The tensor count first, by a SAX pass that builds nothing and stops at the first entry over the
  // limit: a header of 2 million tiny entries is refused before it is parsed into memory. NOTE: not
  // a parser callback on the DOM parse: nlohmann's callback parser rescans the enclosing object at
  // the end of every entry, which made parsing quadratic (20,000 tensors: 6 s).
  // A header nests 3 levels ({"t": {"shape": [...]}}); deeper is refused before the DOM parse (whose
  // copies recurse once per level).
  struct Counter : cli::DepthSax {
    std::size_t tensors = 0;
    Counter() : DepthSax(kMaxHeaderDepth) {}
    bool key(string_t& k) override { return depth != 1 || k == "__metadata__" || ++tensors <= kMaxTensors; }
  } counter;
  nlohmann::json::sax_parse(bytes.begin() + 8, bytes.begin() + 8 + std::ptrdiff_t(n), &counter);
  if (counter.deepest > kMaxHeaderDepth)
    fail(name_, "header nests JSON more than " + std::to_string(kMaxHeaderDepth) + " levels deep (a header has 3)");
  if (counter.tensors > kMaxTensors)
    fail(name_, "the header declares more than " + std::to_string(kMaxTensors) + " tensors, the limit per file");
  nlohmann::json h;
  try {
    h = nlohmann::json::parse(bytes.begin() + 8, bytes.begin() + 8 + std::ptrdiff_t(n));
  } catch (const nlohmann::json::exception& e) {
    fail(name_, std::string("header is not valid JSON: ") + e.what() + not_safetensors_hint(bytes));
  }
  if (!h.is_object()) fail(name_, "header is not a JSON object");
  tensors_.reserve(h.size());

  for (auto it = h.begin(); it != h.end(); ++it) {
    const std::string& key = it.key();
    const nlohmann::json& v = it.value();
    if (key.size() > kMaxNameBytes)
      fail(name_, "a tensor name of " + std::to_string(key.size()) + " bytes exceeds the limit of " +
                      std::to_string(kMaxNameBytes) + " (it begins '" + key.substr(0, 40) + "')");
    if (key == "__metadata__") {
      if (!v.is_object()) fail(name_, "__metadata__ is not an object");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (m.key().size() > kMaxNameBytes)
          fail(name_, "a __metadata__ key of " + std::to_string(m.key().size()) + " bytes exceeds the limit of " +
                          std::to_string(kMaxNameBytes));
        if (!m.value().is_string()) fail(name_, "__metadata__ entry '" + m.key() + "' is not a string");
        metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    if (!v.is_object()) fail_tensor(name_, key, "entry is not an object");
    TensorInfo t;
    t.name = key;
    const auto dt = v.find("dtype");
    if (dt == v.end() || !dt->is_string()) fail_tensor(name_, key, "missing or non-string 'dtype'");
    t.dtype = dt->get<std::string>();
    const DTypeInfo* info = find_dtype(t.dtype);
    if (!info) fail_tensor(name_, key, "unknown dtype '" + t.dtype + "'");
    const auto sh = v.find("shape");
    if (sh == v.end() || !sh->is_array()) fail_tensor(name_, key, "missing or non-array 'shape'");
    if (sh->size() > kMaxRank)
      fail_tensor(name_, key, "shape has " + std::to_string(sh->size()) + " dimensions, more than the limit of " + std::to_string(kMaxRank));
    // Element count, checked against overflow: every dimension and the product stay below 2^62.
    unsigned __int128 numel = 1;
    for (const nlohmann::json& d : *sh) {
      if (!d.is_number_unsigned() && !(d.is_number_integer() && d.get<std::int64_t>() >= 0))
        fail_tensor(name_, key, "shape has an entry that is not a non-negative integer");
      const std::uint64_t dim = d.get<std::uint64_t>();
      if (dim > (1ull << 62)) fail_tensor(name_, key, "shape dimension " + std::to_string(dim) + " is too large");
      t.shape.push_back(std::int64_t(dim));
      numel *= dim;
      if (numel > (std::uint64_t(1) << 62)) fail_tensor(name_, key, "element count overflows");
    }
    const auto off = v.find("data_offsets");
    if (off == v.end() || !off->is_array() || off->size() != 2 || !(*off)[0].is_number_unsigned() ||
        !(*off)[1].is_number_unsigned())
      fail_tensor(name_, key, "'data_offsets' must be two non-negative integers");
    t.begin = (*off)[0].get<std::uint64_t>();
    t.end = (*off)[1].get<std::uint64_t>();
    if (t.begin > t.end) fail_tensor(name_, key, "data_offsets begin " + std::to_string(t.begin) + " > end " + std::to_string(t.end));
    if (t.end > data_.size())
      fail_tensor(name_, key, "data_offsets end " + std::to_string(t.end) + " is past the end of the data (" +
                                  std::to_string(data_.size()) + " bytes; truncated file?)");
    const unsigned __int128 want = numel * unsigned(info->bytes);
    if (want != t.end - t.begin)
      fail_tensor(name_, key, "holds " + std::to_string(t.end - t.begin) + " bytes but its shape and dtype need " +
                                  std::to_string(std::uint64_t(want)));
    tensors_.push_back(std::move(t));
  }
  // The data buffer must be covered exactly: no overlaps, no holes, nothing after the last tensor.
  std::sort(tensors_.begin(), tensors_.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  std::uint64_t pos = 0;
  for (const TensorInfo& t : tensors_) {
    if (t.begin < pos) fail_tensor(name_, t.name, "overlaps the previous tensor (offset " + std::to_string(t.begin) + ")");
    if (t.begin > pos) fail_tensor(name_, t.name, "leaves a hole of " + std::to_string(t.begin - pos) + " bytes before it");
    pos = t.end;
  }
  if (pos != data_.size())
    fail(name_, std::to_string(data_.size() - pos) + " bytes after the last tensor are not described by the header");
  // NOTE: a linear search here made every per-tensor lookup of the converters (X.weight_scale ->
  // X.weight_packed...) quadratic in the tensor count.
  by_name_.reserve(tensors_.size());
  for (std::size_t i = 0; i < tensors_.size(); ++i) by_name_.emplace(tensors_[i].name, i);
}

const TensorInfo* View::find(const std::string& tensor) const {
  const auto it = by_name_.find(tensor);
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

Mapping::Mapping(const std::string& path) {
  // NOTE: O_NONBLOCK so that a FIFO without a writer is refused below instead of blocking here; it
  // changes nothing for a regular file.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) fail(path, std::string("cannot open: ") + std::strerror(errno));
  struct stat sb {};
  if (::fstat(fd, &sb) != 0) {
    const int e = errno;
    ::close(fd);
    fail(path, std::string("cannot stat: ") + std::strerror(e));
  }
  if (!S_ISREG(sb.st_mode)) {
    ::close(fd);
    fail(path, "not a regular file (a FIFO, socket or device is not read)");
  }
  size_ = std::size_t(sb.st_size);
  if (size_ > 0) {
    ptr_ = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (ptr_ == MAP_FAILED) {
      const int e = errno;
      ptr_ = nullptr;
      ::close(fd);
      fail(path, std::string("cannot map: ") + std::strerror(e));
    }
  }
  ::close(fd);
}

void Mapping::release(std::span<const std::uint8_t> range) const {
  if (range.empty()) return;
  const std::uintptr_t page = std::uintptr_t(::sysconf(_SC_PAGESIZE));
  const std::uintptr_t lo = (reinterpret_cast<std::uintptr_t>(range.data()) + page - 1) / page * page;
  const std::uintptr_t hi = (reinterpret_cast<std::uintptr_t>(range.data()) + range.size()) / page * page;
  if (hi > lo) ::madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED);  // advisory: errors are harmless
}

Mapping::~Mapping() {
  if (ptr_) ::munmap(ptr_, size_);
}

// ---- writer ------------------------------------------------------------------------------------------
Writer::~Writer() {
  if (f_) std::fclose(f_);
  if (!committed_ && !tmp_.empty()) std::remove(tmp_.c_str());
}

void Writer::declare(const std::string& name, const std::string& dtype, std::vector<std::int64_t> shape) {
  if (f_) throw Error(path_ + ": tensor '" + name + "' declared after writing started");
  const DTypeInfo* info = find_dtype(dtype);
  if (!info) throw Error(path_ + ": tensor '" + name + "': unknown dtype '" + dtype + "'");
  if (!declared_.insert(name).second) throw Error(path_ + ": tensor '" + name + "' declared twice");
  TensorInfo t;
  t.name = name;
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.begin = tensors_.empty() ? 0 : tensors_.back().end;
  t.end = t.begin + std::uint64_t(t.numel()) * std::uint64_t(info->bytes);
  tensors_.push_back(std::move(t));
}

void Writer::open_and_write_header() {
  // The header text entry by entry (names are unique: declare checked them). NOTE: building one
  // ordered_json object was quadratic: its operator[] searches the keys linearly.
  std::string text = "{";
  if (!metadata_.empty()) text += "\"__metadata__\":" + nlohmann::json(metadata_).dump();
  for (const TensorInfo& t : tensors_) {
    if (text.size() > 1) text += ',';
    text += nlohmann::json(t.name).dump() + ':' +
            nlohmann::ordered_json{{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {t.begin, t.end}}}.dump();
  }
  text += '}';
  text.resize((text.size() + 7) / 8 * 8, ' ');  // the data starts 8-byte aligned, as the reference writes
  tmp_ = path_ + ".tmp-" + std::to_string(::getpid());
  f_ = std::fopen(tmp_.c_str(), "wb");
  if (!f_) throw Error(tmp_ + ": cannot create: " + std::strerror(errno));
  std::uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = std::uint8_t(std::uint64_t(text.size()) >> (8 * i));
  if (std::fwrite(len, 1, 8, f_) != 8 || std::fwrite(text.data(), 1, text.size(), f_) != text.size())
    throw Error(tmp_ + ": write failed: " + std::strerror(errno));
}

void Writer::write(const std::string& name, std::span<const std::uint8_t> bytes) {
  if (!f_) open_and_write_header();
  if (next_ >= tensors_.size() || tensors_[next_].name != name)
    throw Error(path_ + ": tensor '" + name + "' written out of the declared order");
  const TensorInfo& t = tensors_[next_];
  if (bytes.size() != t.bytes())
    throw Error(path_ + ": tensor '" + name + "': " + std::to_string(bytes.size()) + " bytes given, " +
                std::to_string(t.bytes()) + " declared");
  if (!bytes.empty() && std::fwrite(bytes.data(), 1, bytes.size(), f_) != bytes.size())
    throw Error(tmp_ + ": write failed: " + std::strerror(errno));
  ++next_;
  // Start the writeback of what is written so far (asynchronously: the disk works while the next
  // tensor is converted), so that commit's fsync waits for little more than the last tensor. A
  // failure here is only advice lost: fsync at commit is what reports a failed write.
  if (bytes.size() >= (std::size_t(1) << 20) && std::fflush(f_) == 0) {
#if defined(__linux__)
    ::sync_file_range(::fileno(f_), 0, 0, SYNC_FILE_RANGE_WRITE);
#endif
  }
}

void Writer::commit() {
  if (!f_) open_and_write_header();
  if (next_ != tensors_.size())
    throw Error(path_ + ": " + std::to_string(tensors_.size() - next_) + " declared tensors were not written");
  bool ok = std::fflush(f_) == 0 && ::fsync(::fileno(f_)) == 0;
  const int e = errno;
  ok = std::fclose(f_) == 0 && ok;  // the last chance to hear of a failed write (NFS, quotas)
  f_ = nullptr;
  if (!ok) throw Error(tmp_ + ": write failed: " + std::strerror(e ? e : errno));
  if (std::rename(tmp_.c_str(), path_.c_str()) != 0) throw Error(path_ + ": cannot rename into place: " + std::strerror(errno));
  committed_ = true;
}

}  // namespace mxq::st
