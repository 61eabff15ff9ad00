#include "train/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <thread>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

// xxHash from Debian's libxxhash-dev, inlined: no link-time dependency.
#define XXH_INLINE_ALL
#include <xxhash.h>

namespace epx::detail {
namespace {

namespace fs = std::filesystem;
static_assert(std::endian::native == std::endian::little, "checkpoint files are little-endian");

constexpr char kMagic[8] = {'E', 'P', 'X', '-', 'C', 'K', 'P', 'T'};
constexpr std::size_t kHeaderBytes = 72;
constexpr uint32_t kMaxNameBytes = 4096;
constexpr uint64_t kMaxMetaBytes = uint64_t{64} << 20;
constexpr uint64_t kMaxRankFileBytes = uint64_t{1} << 40;

uint64_t xxh3(std::span<const uint8_t> bytes) { return XXH3_64bits(bytes.data(), bytes.size()); }
std::string hex(uint64_t v) { return fmt::format("{:016x}", v); }
std::string rank_file_name(int rank) { return fmt::format("rank-{}.bin", rank); }
std::string errno_text() { return std::strerror(errno); }

// Appends little-endian values to a byte vector.
class ByteWriter {
 public:
  template <typename T>
  void pod(const T& v) {
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    out_.insert(out_.end(), p, p + sizeof(T));
  }
  void floats(const std::vector<float>& v) {
    pod(static_cast<uint64_t>(v.size()));
    const auto* p = reinterpret_cast<const uint8_t*>(v.data());
    out_.insert(out_.end(), p, p + v.size() * sizeof(float));
  }
  void text(const std::string& s) {
    pod(static_cast<uint32_t>(s.size()));
    out_.insert(out_.end(), s.begin(), s.end());
  }
  std::vector<uint8_t>& bytes() { return out_; }

 private:
  std::vector<uint8_t> out_;
};

// Reads values from a byte span; every length is checked against what is left.
class ByteReader {
 public:
  ByteReader(std::span<const uint8_t> bytes, const std::string& name) : bytes_(bytes), name_(name) {}
  template <typename T>
  Status pod(T* v, std::string_view what) {
    EPX_RETURN_IF_ERROR(need(sizeof(T), what));
    std::memcpy(v, bytes_.data() + at_, sizeof(T));
    at_ += sizeof(T);
    return Status::ok();
  }
  Status floats(std::vector<float>* v, std::string_view what) {
    uint64_t n = 0;
    EPX_RETURN_IF_ERROR(pod(&n, what));
    if (n > left() / sizeof(float))
      return invalid_argument("{}: {} claims {} values but only {} bytes are left", name_, what, n, left());
    v->resize(n);
    if (n > 0) std::memcpy(v->data(), bytes_.data() + at_, n * sizeof(float));  // no null pointer to memcpy
    at_ += n * sizeof(float);
    return Status::ok();
  }
  Status text(std::string* s, std::string_view what) {
    uint32_t n = 0;
    EPX_RETURN_IF_ERROR(pod(&n, what));
    if (n > kMaxNameBytes) return invalid_argument("{}: {} of {} bytes (limit {})", name_, what, n, kMaxNameBytes);
    EPX_RETURN_IF_ERROR(need(n, what));
    s->assign(reinterpret_cast<const char*>(bytes_.data() + at_), n);
    at_ += n;
    return Status::ok();
  }
  [[nodiscard]] std::size_t left() const { return bytes_.size() - at_; }

 private:
  Status need(std::size_t n, std::string_view what) const {
    if (n > left()) return invalid_argument("{} ends early: {} needs {} bytes, {} are left", name_, what, n, left());
    return Status::ok();
  }
  std::span<const uint8_t> bytes_;
  const std::string& name_;
  std::size_t at_ = 0;
};

// ---- files ----------------------------------------------------------------

Status read_file(const fs::path& path, uint64_t max_bytes, std::vector<uint8_t>* out) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return not_found("{} does not exist", path.string());
    return invalid_argument("cannot open {}: {}", path.string(), errno_text());
  }
  struct stat st {};
  Status s = Status::ok();
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    s = invalid_argument("{} is not a regular file", path.string());
  } else if (static_cast<uint64_t>(st.st_size) > max_bytes) {
    s = invalid_argument("{} is {} bytes, above the limit of {}", path.string(), st.st_size, max_bytes);
  } else {
    out->resize(static_cast<std::size_t>(st.st_size));
    std::size_t done = 0;
    while (s.is_ok() && done < out->size()) {
      const ssize_t n = ::read(fd, out->data() + done, out->size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) s = invalid_argument("cannot read {}: {}", path.string(), errno_text());
      if (n == 0) s = invalid_argument("{} shrank while it was read", path.string());
      if (n > 0) done += static_cast<std::size_t>(n);
    }
  }
  ::close(fd);
  return s;
}

// Writes, fsyncs and closes `path`; on any failure removes it.
Status write_file_durably(const fs::path& path, std::span<const uint8_t> bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return internal_error("cannot create {}: {}", path.string(), errno_text());
  std::size_t done = 0;
  std::string error;
  while (error.empty() && done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) error = errno_text();
    if (n > 0) done += static_cast<std::size_t>(n);
  }
  if (error.empty() && ::fsync(fd) != 0) error = errno_text();
  if (::close(fd) != 0 && error.empty()) error = errno_text();
  if (error.empty()) return Status::ok();
  ::unlink(path.c_str());
  return internal_error("cannot write {} ({} bytes): {}", path.string(), bytes.size(), error);
}

Status fsync_dir(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return internal_error("cannot open folder {}: {}", dir.string(), errno_text());
  const bool ok = ::fsync(fd) == 0;
  const std::string error = ok ? "" : errno_text();
  ::close(fd);
  if (!ok) return internal_error("cannot fsync folder {}: {}", dir.string(), error);
  return Status::ok();
}

std::span<const uint8_t> as_bytes(std::string_view s) {
  return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
}

// The nearest existing ancestor of `dir` (itself when it exists).
fs::path existing_ancestor(const fs::path& dir) {
  fs::path p = fs::absolute(dir).lexically_normal();
  std::error_code ec;
  while (!fs::exists(p, ec) && p.has_parent_path() && p.parent_path() != p) p = p.parent_path();
  return p;
}

// "step-000120" -> 120; -1 for any other name.
int64_t parse_step_folder(const std::string& name) {
  if (name.size() < 6 || name.rfind("step-", 0) != 0) return -1;
  int64_t step = -1;
  const char* end = name.data() + name.size();
  auto [p, ec] = std::from_chars(name.data() + 5, end, step);
  return ec == std::errc() && p == end && step >= 0 ? step : -1;
}

}  // namespace

uint64_t model_hash(std::string_view fingerprint) { return xxh3(as_bytes(fingerprint)); }
std::string step_folder_name(int64_t step) { return fmt::format("step-{:06}", step); }

// ---- rank file format ------------------------------------------------------

std::vector<uint8_t> serialize_rank_file(const RankFileHeader& header, const RankState& state) {
  ByteWriter payload;
  payload.pod(state.adam_steps);
  payload.pod(static_cast<uint32_t>(state.params.size()));
  for (const RankState::Param& p : state.params) {
    payload.text(p.name);
    payload.floats(p.value);
    payload.floats(p.m);
    payload.floats(p.v);
  }
  payload.pod(static_cast<uint32_t>(state.biases.size()));
  for (const std::vector<float>& b : state.biases) payload.floats(b);

  ByteWriter out;
  out.pod(kMagic);
  out.pod(kCheckpointFormatVersion);
  out.pod(static_cast<uint32_t>(kHeaderBytes));
  out.pod(header.rank);
  out.pod(header.num_ranks);
  out.pod(header.num_nodes);
  out.pod(uint32_t{0});
  out.pod(header.step);
  out.pod(header.model_hash);
  out.pod(static_cast<uint64_t>(payload.bytes().size()));
  out.pod(xxh3(payload.bytes()));
  out.pod(xxh3(out.bytes()));
  out.bytes().insert(out.bytes().end(), payload.bytes().begin(), payload.bytes().end());
  return std::move(out.bytes());
}

namespace {

Status parse_header(ByteReader& r, std::span<const uint8_t> bytes, const std::string& name, RankFileHeader* h) {
  char magic[8];
  uint32_t version = 0, header_bytes = 0, reserved = 0;
  uint64_t header_xxh3 = 0;
  EPX_RETURN_IF_ERROR(r.pod(&magic, "the magic"));
  if (std::memcmp(magic, kMagic, sizeof(kMagic)) != 0) {
    if (std::memcmp(magic, "EPXCKPT1", 8) == 0)
      return invalid_argument("{} is an epx checkpoint of format 1; this epx reads format {}", name, kCheckpointFormatVersion);
    return invalid_argument("{} is not an epx checkpoint file (no EPX-CKPT magic)", name);
  }
  EPX_RETURN_IF_ERROR(r.pod(&version, "the format version"));
  if (version != kCheckpointFormatVersion)
    return invalid_argument("{} is of checkpoint format {}; this epx reads format {}", name, version, kCheckpointFormatVersion);
  EPX_RETURN_IF_ERROR(r.pod(&header_bytes, "the header size"));
  if (header_bytes != kHeaderBytes) return invalid_argument("{}: header of {} bytes, want {}", name, header_bytes, kHeaderBytes);
  EPX_RETURN_IF_ERROR(r.pod(&h->rank, "the rank"));
  EPX_RETURN_IF_ERROR(r.pod(&h->num_ranks, "the rank count"));
  EPX_RETURN_IF_ERROR(r.pod(&h->num_nodes, "the node count"));
  EPX_RETURN_IF_ERROR(r.pod(&reserved, "the header"));
  if (reserved != 0)  // zero in format 2; any other value is another format or damage
    return invalid_argument("{}: the header's reserved word is {}, not 0: not a file of format {}", name, reserved,
                            kCheckpointFormatVersion);
  EPX_RETURN_IF_ERROR(r.pod(&h->step, "the step"));
  EPX_RETURN_IF_ERROR(r.pod(&h->model_hash, "the model hash"));
  EPX_RETURN_IF_ERROR(r.pod(&h->payload_bytes, "the payload size"));
  EPX_RETURN_IF_ERROR(r.pod(&h->payload_xxh3, "the payload checksum"));
  EPX_RETURN_IF_ERROR(r.pod(&header_xxh3, "the header checksum"));
  const uint64_t actual = xxh3(bytes.first(kHeaderBytes - sizeof(uint64_t)));
  if (actual != header_xxh3)
    return invalid_argument("{}: the header's checksum is {}, its bytes hash to {}: the header is damaged", name,
                            hex(header_xxh3), hex(actual));
  if (h->payload_bytes != r.left())
    return invalid_argument("{}: the header promises {} payload bytes, the file holds {} (bytes appended or cut)", name,
                            h->payload_bytes, r.left());
  const uint64_t payload = xxh3(bytes.subspan(kHeaderBytes));
  if (payload != h->payload_xxh3)
    return invalid_argument("{}: the payload's checksum is {}, the header says {}: the file is damaged", name,
                            hex(payload), hex(h->payload_xxh3));
  return Status::ok();
}

Status parse_payload(ByteReader& r, const std::string& name, RankState* state) {
  uint32_t num_params = 0, num_layers = 0;
  EPX_RETURN_IF_ERROR(r.pod(&state->adam_steps, "the AdamW step count"));
  EPX_RETURN_IF_ERROR(r.pod(&num_params, "the parameter count"));
  // Each parameter takes at least 28 bytes (a name length and three value counts).
  if (num_params > r.left() / 28)
    return invalid_argument("{}: {} parameters cannot fit in the {} bytes left", name, num_params, r.left());
  state->params.assign(num_params, {});
  for (uint32_t i = 0; i < num_params; ++i) {
    RankState::Param& p = state->params[i];
    EPX_RETURN_IF_ERROR(r.text(&p.name, fmt::format("parameter {}'s name", i)));
    EPX_RETURN_IF_ERROR(r.floats(&p.value, p.name));
    EPX_RETURN_IF_ERROR(r.floats(&p.m, p.name + " (first moment)"));
    EPX_RETURN_IF_ERROR(r.floats(&p.v, p.name + " (second moment)"));
  }
  EPX_RETURN_IF_ERROR(r.pod(&num_layers, "the layer count"));
  if (num_layers > r.left() / 8)
    return invalid_argument("{}: {} layers' biases cannot fit in the {} bytes left", name, num_layers, r.left());
  state->biases.assign(num_layers, {});
  for (uint32_t l = 0; l < num_layers; ++l)
    EPX_RETURN_IF_ERROR(r.floats(&state->biases[l], fmt::format("layer {}'s expert bias", l)));
  if (r.left() != 0) return invalid_argument("{}: {} bytes follow the payload", name, r.left());
  return Status::ok();
}

}  // namespace

Status parse_rank_file(std::span<const uint8_t> bytes, const std::string& name, RankFileHeader* header,
                       RankState* state) {
  ByteReader r(bytes, name);
  EPX_RETURN_IF_ERROR(parse_header(r, bytes, name, header));
  return parse_payload(r, name, state);
}

// ---- meta.json -------------------------------------------------------------

std::string format_checkpoint_meta(const CheckpointMeta& meta) {
  nlohmann::json files = nlohmann::json::array();
  for (const CheckpointFile& f : meta.files) files.push_back({{"name", f.name}, {"bytes", f.bytes}, {"xxh3", hex(f.xxh3)}});
  nlohmann::json j = {{"format", "epx-checkpoint"}, {"version", kCheckpointFormatVersion}, {"step", meta.step},
                      {"num_ranks", meta.num_ranks}, {"num_nodes", meta.num_nodes}, {"model", meta.fingerprint},
                      {"model_xxh3", hex(model_hash(meta.fingerprint))}, {"files", files}};
  if (!meta.layer_slots.empty()) {
    j["layer_slots"] = meta.layer_slots;
    j["eplb_window"] = meta.eplb_window;
  }
  j["meta_xxh3"] = hex(xxh3(as_bytes(j.dump())));  // of everything above, compact, keys sorted
  return j.dump(2) + "\n";
}

namespace {

using Json = nlohmann::json;

bool get_hex(const Json& j, const char* key, uint64_t* out) {
  const auto it = j.find(key);
  if (it == j.end() || !it->is_string()) return false;
  const std::string& s = it->get_ref<const std::string&>();
  if (s.size() != 16 || s.find_first_not_of("0123456789abcdef") != std::string::npos) return false;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), *out, 16);
  return ec == std::errc() && p == s.data() + s.size();
}

// An integer JSON value in [lo, hi].
bool to_int(const Json& v, int64_t lo, int64_t hi, int64_t* out) {
  if (!v.is_number_integer()) return false;
  if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(hi)) return false;
  *out = v.get<int64_t>();
  return *out >= lo && *out <= hi;
}

template <typename T>
bool get_int(const Json& j, const char* key, int64_t lo, int64_t hi, T* out) {
  const auto it = j.find(key);
  int64_t v = 0;
  if (it == j.end() || !to_int(*it, lo, hi, &v)) return false;
  *out = static_cast<T>(v);
  return true;
}

template <typename T>
bool get_int_lists(const Json& j, const char* key, int64_t lo, int64_t hi, std::vector<std::vector<T>>* out) {
  const auto it = j.find(key);
  if (it == j.end() || !it->is_array()) return false;
  for (const Json& list : *it) {
    if (!list.is_array()) return false;
    std::vector<T>& row = out->emplace_back();
    for (const Json& v : list) {
      int64_t x = 0;
      if (!to_int(v, lo, hi, &x)) return false;
      row.push_back(static_cast<T>(x));
    }
  }
  return true;
}

Status parse_meta_files(const Json& j, const std::string& name, CheckpointMeta* meta) {
  if (!j.contains("files") || !j["files"].is_array())
    return invalid_argument("{}: 'files' must list the rank files", name);
  for (const Json& f : j["files"]) {
    CheckpointFile file;
    if (!f.is_object() || !f.contains("name") || !f["name"].is_string() ||
        !get_int(f, "bytes", 0, static_cast<int64_t>(kMaxRankFileBytes), &file.bytes) || !get_hex(f, "xxh3", &file.xxh3))
      return invalid_argument("{}: files[{}] must hold a name, bytes and an xxh3 of 16 lowercase hex digits", name,
                              meta->files.size());
    file.name = f["name"].get<std::string>();
    meta->files.push_back(std::move(file));
  }
  return Status::ok();
}

}  // namespace

Status parse_checkpoint_meta(std::string_view text, const std::string& name, CheckpointMeta* meta) {
  // Values nested deeper than meta.json's own are dropped while parsing (the
  // checksum then fails), so that nothing below recurses deeply.
  const Json::parser_callback_t shallow = [](int depth, Json::parse_event_t, Json&) { return depth <= 8; };
  Json j = Json::parse(text.begin(), text.end(), shallow, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object())
    return invalid_argument("{} is not JSON: not an epx checkpoint meta file", name);
  if (j.contains("format") && j["format"] == "epx-checkpoint-1")
    return invalid_argument("{} is of checkpoint format 1 (epx before verified checkpoints); this epx reads format {}",
                            name, kCheckpointFormatVersion);
  uint64_t stored = 0;
  if (!j.contains("format") || j["format"] != "epx-checkpoint" || !get_hex(j, "meta_xxh3", &stored))
    return invalid_argument("{} is not an epx checkpoint meta file (format epx-checkpoint with a meta_xxh3)", name);
  uint32_t version = 0;
  if (!get_int(j, "version", 0, 1000, &version) || version != kCheckpointFormatVersion)
    return invalid_argument("{}: checkpoint format version {}; this epx reads {}", name,
                            j.contains("version") ? j["version"].dump() : "(none)", kCheckpointFormatVersion);
  j.erase("meta_xxh3");
  const uint64_t actual = xxh3(as_bytes(j.dump()));
  if (actual != stored)
    return invalid_argument("{}: its content hashes to {} but its meta_xxh3 says {}: the file was edited or damaged", name,
                            hex(actual), hex(stored));
  *meta = {};
  if (!get_int(j, "step", 0, int64_t{1} << 62, &meta->step) ||
      !get_int(j, "num_ranks", 1, 1 << 20, &meta->num_ranks) || !get_int(j, "num_nodes", 1, 1 << 20, &meta->num_nodes) ||
      !j.contains("model") || !j["model"].is_string())
    return invalid_argument("{}: step, num_ranks, num_nodes and model must be set", name);
  meta->fingerprint = j["model"].get<std::string>();
  uint64_t mh = 0;
  if (!get_hex(j, "model_xxh3", &mh) || mh != model_hash(meta->fingerprint))
    return invalid_argument("{}: model_xxh3 does not match its model '{}'", name, meta->fingerprint);
  EPX_RETURN_IF_ERROR(parse_meta_files(j, name, meta));
  if (j.contains("layer_slots")) {
    const bool ok = get_int_lists(j, "layer_slots", -1, 1 << 30, &meta->layer_slots) &&
                    get_int_lists(j, "eplb_window", 0, int64_t{1} << 62, &meta->eplb_window) &&
                    meta->layer_slots.size() == meta->eplb_window.size();
    if (!ok) return invalid_argument("{}: layer_slots and eplb_window must be lists of integer lists, one per layer", name);
  }
  return Status::ok();
}

// ---- the checkpoint directory ----------------------------------------------

Status check_save_dir(const std::string& dir) {
  std::error_code ec;
  const fs::path path(dir);
  const fs::file_status st = fs::status(path, ec);
  if (!fs::exists(st)) {
    const fs::path base = existing_ancestor(path);
    if (!fs::is_directory(base, ec))
      return invalid_argument("--save {}: {} exists and is not a folder", dir, base.string());
    return Status::ok();
  }
  if (!fs::is_directory(st))
    return invalid_argument("--save {} is an existing file; epx writes checkpoints only into a folder it owns "
                            "(a new or empty folder, or one holding {})", dir, kCheckpointMarker);
  if (fs::exists(path / kCheckpointMarker, ec)) return Status::ok();
  fs::directory_iterator it(path, ec);
  if (ec) return invalid_argument("--save {}: cannot list the folder: {}", dir, ec.message());
  // Another process's probe file (every MPI process probes) does not count.
  while (it != fs::directory_iterator() && it->path().filename().string().rfind(".epx-probe-", 0) == 0) it.increment(ec);
  if (ec || it == fs::directory_iterator()) return Status::ok();
  return invalid_argument("--save {} is a folder that holds other files (e.g. '{}') and no {} marker; epx writes "
                          "checkpoints only into a new or empty folder, or one it created",
                          dir, it->path().filename().string(), kCheckpointMarker);
}

Result<SaveSpace> probe_save_dir(const std::string& dir) {
  EPX_RETURN_IF_ERROR(check_save_dir(dir));
  SaveSpace space;
  const fs::path base = existing_ancestor(dir);
  space.probed = base.string();
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  const fs::path probe = base / fmt::format(".epx-probe-{}-{}", host, ::getpid());
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return invalid_argument("--save {}: cannot create a file in {}: {}", dir, space.probed, errno_text());
  ::close(fd);
  ::unlink(probe.c_str());
  struct statvfs vfs {};
  if (::statvfs(base.c_str(), &vfs) != 0)
    return invalid_argument("--save {}: cannot read the free space of {}: {}", dir, space.probed, errno_text());
  space.free_bytes = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
  return space;
}

Result<std::string> resolve_checkpoint(const std::string& path) {
  const fs::path p(path);
  std::error_code ec;
  if (!fs::exists(p, ec)) return not_found("no checkpoint at {}: it does not exist", path);
  if (fs::exists(p / "meta.json", ec)) return path;
  if (!fs::exists(p / "latest", ec))
    return not_found("no checkpoint at {}: it holds neither a 'latest' file nor meta.json", path);
  std::vector<uint8_t> bytes;
  EPX_RETURN_IF_ERROR(read_file(p / "latest", 256, &bytes));
  std::string name(bytes.begin(), bytes.end());
  while (!name.empty() && (name.back() == '\n' || name.back() == '\r')) name.pop_back();
  if (parse_step_folder(name) < 0)
    return invalid_argument("{}/latest names '{}', not a step folder (step-NNNNNN)", path, name);
  if (!fs::exists(p / name / "meta.json", ec))
    return not_found("{}/latest names {}, which holds no meta.json", path, name);
  return (p / name).string();
}

namespace {

// "experts=8" where `saved` and `mine` differ first; both whole otherwise.
std::string model_difference(const std::string& saved, const std::string& mine) {
  std::vector<std::string> a, b;
  for (const std::string* s : {&saved, &mine}) {
    std::vector<std::string>& out = s == &saved ? a : b;
    for (std::size_t start = 0; start <= s->size();) {
      const std::size_t end = std::min(s->find(' ', start), s->size());
      out.push_back(s->substr(start, end - start));
      start = end + 1;
    }
  }
  for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    if (a[i] != b[i]) return fmt::format("{} in the checkpoint, {} in this run", a[i], b[i]);
  return fmt::format("'{}' in the checkpoint, '{}' in this run", saved, mine);
}

Status check_layout(const std::string& where, const CheckpointMeta& saved, const CheckpointMeta& expected) {
  if (saved.num_ranks != expected.num_ranks || saved.num_nodes != expected.num_nodes)
    return invalid_argument("checkpoint {} was written by {} ranks on {} nodes; this run has {} ranks on {} nodes "
                            "(resuming on another layout needs resharding, which epx does not do yet)",
                            where, saved.num_ranks, saved.num_nodes, expected.num_ranks, expected.num_nodes);
  if (saved.fingerprint != expected.fingerprint)
    return invalid_argument("checkpoint {} is of another model: {}", where,
                            model_difference(saved.fingerprint, expected.fingerprint));
  if (saved.files.size() != static_cast<std::size_t>(saved.num_ranks))
    return invalid_argument("{}/meta.json lists {} files for {} ranks", where, saved.files.size(), saved.num_ranks);
  for (int r = 0; r < saved.num_ranks; ++r)
    if (saved.files[r].name != rank_file_name(r))
      return invalid_argument("{}/meta.json lists '{}' as rank {}'s file, want {}", where, saved.files[r].name, r,
                              rank_file_name(r));
  const int64_t named = parse_step_folder(fs::path(where).lexically_normal().filename().string());
  if (named >= 0 && named != saved.step)
    return invalid_argument("{}/meta.json says step {}, its folder's name step {}", where, saved.step, named);
  return Status::ok();
}

// Reads rank `rank`'s file and checks it against meta.json; fills `state`.
Status read_rank_file(const std::string& where, const CheckpointMeta& meta, int rank, RankState* state) {
  const CheckpointFile& listed = meta.files[rank];
  const fs::path path = fs::path(where) / listed.name;
  const std::string name = path.string();
  std::error_code ec;
  const auto size = fs::file_size(path, ec);
  if (ec) return not_found("checkpoint {} has no {} (meta.json lists {} rank files)", where, listed.name, meta.num_ranks);
  if (size != listed.bytes)
    return invalid_argument("{} is {} bytes; meta.json lists {} (bytes appended or cut)", name, size, listed.bytes);
  std::vector<uint8_t> bytes;
  EPX_RETURN_IF_ERROR(read_file(path, listed.bytes, &bytes));
  RankFileHeader h;
  EPX_RETURN_IF_ERROR(parse_rank_file(bytes, name, &h, state));
  if (h.rank != rank)
    return invalid_argument("{} holds rank {}'s part, not rank {}'s (files swapped or renamed)", name, h.rank, rank);
  if (h.num_ranks != meta.num_ranks || h.num_nodes != meta.num_nodes)
    return invalid_argument("{} was written by {} ranks on {} nodes; meta.json says {} on {}", name, h.num_ranks,
                            h.num_nodes, meta.num_ranks, meta.num_nodes);
  if (h.step != meta.step) return invalid_argument("{} is of step {}; meta.json says step {}", name, h.step, meta.step);
  if (h.model_hash != model_hash(meta.fingerprint))
    return invalid_argument("{} is of another model (hash {}) than meta.json's ({})", name, hex(h.model_hash),
                            hex(model_hash(meta.fingerprint)));
  const uint64_t actual = xxh3(bytes);
  if (actual != listed.xxh3)
    return invalid_argument("{} hashes to {}; meta.json lists {} (a file of another checkpoint?)", name, hex(actual),
                            hex(listed.xxh3));
  return Status::ok();
}

}  // namespace

namespace {

// read_checkpoint_meta of the step folder `where`.
Status read_meta_at(const std::string& where, CheckpointMeta* expected) {
  const fs::path meta_path = fs::path(where) / "meta.json";
  std::vector<uint8_t> bytes;
  EPX_RETURN_IF_ERROR(read_file(meta_path, kMaxMetaBytes, &bytes));
  CheckpointMeta saved;
  EPX_RETURN_IF_ERROR(parse_checkpoint_meta(
      std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()), meta_path.string(), &saved));
  EPX_RETURN_IF_ERROR(check_layout(where, saved, *expected));
  *expected = std::move(saved);
  return Status::ok();
}

}  // namespace

Status read_checkpoint_meta(const std::string& path, CheckpointMeta* expected) {
  EPX_ASSIGN_OR_RETURN(std::string where, resolve_checkpoint(path));
  return read_meta_at(where, expected);
}

Status verify_checkpoint(const std::string& path, CheckpointMeta* expected) {
  EPX_ASSIGN_OR_RETURN(std::string where, resolve_checkpoint(path));
  EPX_RETURN_IF_ERROR(read_meta_at(where, expected));
  for (int r = 0; r < expected->num_ranks; ++r) {
    RankState state;
    EPX_RETURN_IF_ERROR(read_rank_file(where, *expected, r, &state));
  }
  return Status::ok();
}

// ---- save ------------------------------------------------------------------

namespace {

// Every rank learns whether any rank failed, and the first failure's message
// (cut to 255 bytes); this rank's own error wins.
Status agree(Transport& transport, const Status& mine, const Deadline& deadline) {
  constexpr std::size_t kText = 256;
  std::vector<char> text(kText, '\0'), all(kText * static_cast<std::size_t>(transport.num_ranks()));
  if (!mine.is_ok()) {
    const std::string m = mine.message().empty() ? "failed" : mine.message();
    std::memcpy(text.data(), m.data(), std::min(m.size(), kText - 1));
  }
  EPX_RETURN_IF_ERROR(transport.all_gather(std::span<const char>(text), std::span<char>(all), deadline));
  if (!mine.is_ok()) return mine;
  for (int r = 0; r < transport.num_ranks(); ++r) {
    const char* other = all.data() + static_cast<std::size_t>(r) * kText;
    if (other[0] != '\0') return aborted("rank {}: {}", r, std::string(other, strnlen(other, kText)));
  }
  return Status::ok();
}

// A save stopped by a crash leaves `.step-N.tmp` (never published: removed)
// or, rewriting step N, `.step-N.old` (put back when step-N is missing).
void tidy_leftover(const fs::path& dir, const std::string& name) {
  if (name.rfind(".step-", 0) != 0) return;
  std::error_code ec;
  if (name.ends_with(".tmp")) fs::remove_all(dir / name, ec);
  if (!name.ends_with(".old")) return;
  const fs::path original = dir / name.substr(1, name.size() - 5);
  if (fs::exists(original, ec))
    fs::remove_all(dir / name, ec);
  else
    fs::rename(dir / name, original, ec);
}

// Rank 0: DIR exists, is ours (marker), holds no stale temporary folder, and
// has a fresh empty `tmp`.
Status prepare_save(const fs::path& dir, const fs::path& tmp) {
  EPX_RETURN_IF_ERROR(check_save_dir(dir.string()));
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return internal_error("cannot create checkpoint folder {}: {}", dir.string(), ec.message());
  if (!fs::exists(dir / kCheckpointMarker, ec)) {
    EPX_RETURN_IF_ERROR(write_file_durably(dir / kCheckpointMarker, as_bytes("epx checkpoint folder\n")));
    EPX_RETURN_IF_ERROR(fsync_dir(dir));
  }
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) tidy_leftover(dir, e.path().filename().string());
  fs::create_directory(tmp, ec);
  if (ec) return internal_error("cannot create {}: {}", tmp.string(), ec.message());
  return Status::ok();
}

RankState collect_state(std::span<Parameter* const> params, AdamW& adam, std::span<MoELayer* const> layers) {
  RankState state;
  state.adam_steps = adam.num_steps();
  for (const Parameter* p : params) {
    const AdamW::Moments& m = adam.moments()[p->name];
    const std::vector<float> zeros(m.m.empty() || m.v.empty() ? p->value.size() : 0, 0.0f);
    state.params.push_back({p->name, p->value, m.m.empty() ? zeros : m.m, m.v.empty() ? zeros : m.v});
  }
  for (MoELayer* layer : layers) state.biases.push_back(layer->bias().values());
  return state;
}

// Rank 0, after every file is in `tmp`: meta.json, the rename, `latest`.
Status publish(const fs::path& dir, const fs::path& tmp, const CheckpointMeta& meta) {
  const std::string text = format_checkpoint_meta(meta);
  EPX_RETURN_IF_ERROR(write_file_durably(tmp / "meta.json", as_bytes(text)));
  EPX_RETURN_IF_ERROR(fsync_dir(tmp));
  if (const char* delay = std::getenv("EPX_TEST_CHECKPOINT_DELAY_MS"))  // test hook: a window for kill -9
    std::this_thread::sleep_for(std::chrono::milliseconds(std::atoi(delay)));
  const std::string name = step_folder_name(meta.step);
  const fs::path final_path = dir / name, old = dir / ("." + name + ".old");
  std::error_code ec;
  if (fs::exists(final_path, ec)) {  // the same step again (a resume that runs no step)
    fs::rename(final_path, old, ec);
    if (ec) return internal_error("cannot move {} aside: {}", final_path.string(), ec.message());
  }
  fs::rename(tmp, final_path, ec);
  if (ec) {
    const Status s = internal_error("cannot rename {} to {}: {}", tmp.string(), final_path.string(), ec.message());
    if (fs::exists(old, ec)) fs::rename(old, final_path, ec);  // `latest` names it: put it back
    return s;
  }
  EPX_RETURN_IF_ERROR(fsync_dir(dir));
  EPX_RETURN_IF_ERROR(write_file_durably(dir / "latest.tmp", as_bytes(name + "\n")));
  fs::rename(dir / "latest.tmp", dir / "latest", ec);
  if (ec) return internal_error("cannot rename {}/latest.tmp to latest: {}", dir.string(), ec.message());
  EPX_RETURN_IF_ERROR(fsync_dir(dir));
  fs::remove_all(old, ec);
  return Status::ok();
}

// Rank 0: removes all but the newest `keep` step folders; `current` stays.
Status prune(const fs::path& dir, int64_t current, int keep) {
  std::vector<int64_t> others;
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    const int64_t step = parse_step_folder(e.path().filename().string());
    if (step >= 0 && step != current && e.is_directory(ec)) others.push_back(step);
  }
  std::sort(others.rbegin(), others.rend());
  for (std::size_t i = static_cast<std::size_t>(std::max(keep - 1, 0)); i < others.size(); ++i) {
    fs::remove_all(dir / step_folder_name(others[i]), ec);
    if (ec)
      return internal_error("checkpoint {} is complete, but removing the old {} failed: {}", step_folder_name(current),
                            step_folder_name(others[i]), ec.message());
  }
  return Status::ok();
}

}  // namespace

Status save_checkpoint(const std::string& dir_name, int keep, const CheckpointMeta& meta_in, Transport& transport,
                       std::span<Parameter* const> params, AdamW& adam, std::span<MoELayer* const> layers,
                       const Deadline& deadline) {
  const fs::path dir(dir_name);
  const fs::path tmp = dir / ("." + step_folder_name(meta_in.step) + ".tmp");
  const int rank = transport.rank(), R = transport.num_ranks();
  const std::string what = fmt::format("writing checkpoint {} in {}", step_folder_name(meta_in.step), dir_name);
  auto fail = [&](const Status& s) -> Status {
    if (rank == 0) {
      std::error_code ec;
      fs::remove_all(tmp, ec);
    }
    return Status(s.code(), fmt::format("{}: {} (the previous checkpoints are kept)", what, s.message()));
  };
  Status s = rank == 0 ? prepare_save(dir, tmp) : Status::ok();
  if (s = agree(transport, s, deadline); !s.is_ok()) return fail(s);

  const RankFileHeader header{.rank = rank, .num_ranks = meta_in.num_ranks, .num_nodes = meta_in.num_nodes,
                              .step = meta_in.step, .model_hash = model_hash(meta_in.fingerprint)};
  const std::vector<uint8_t> bytes = serialize_rank_file(header, collect_state(params, adam, layers));
  s = write_file_durably(tmp / rank_file_name(rank), bytes);
  if (s = agree(transport, s, deadline); !s.is_ok()) return fail(s);

  const uint64_t mine[2] = {bytes.size(), xxh3(bytes)};
  std::vector<uint64_t> all(2 * static_cast<std::size_t>(R));
  s = transport.all_gather(std::span<const uint64_t>(mine, 2), std::span<uint64_t>(all), deadline);
  if (!s.is_ok()) return fail(s);
  if (rank == 0) {
    CheckpointMeta meta = meta_in;
    meta.files.clear();
    for (int r = 0; r < R; ++r) meta.files.push_back({rank_file_name(r), all[2 * r], all[2 * r + 1]});
    s = publish(dir, tmp, meta);
    if (s.is_ok()) s = prune(dir, meta.step, keep);
  }
  if (s = agree(transport, s, deadline); !s.is_ok()) return fail(s);
  return Status::ok();
}

// ---- load ------------------------------------------------------------------

namespace {

// The state read fits this rank's model: names, sizes, layers.
Status check_fit(const std::string& name, const RankState& state, std::span<Parameter* const> params,
                 std::span<MoELayer* const> layers) {
  if (state.params.size() != params.size())
    return invalid_argument("{} holds {} parameters, the model has {}", name, state.params.size(), params.size());
  for (std::size_t i = 0; i < params.size(); ++i) {
    const RankState::Param& p = state.params[i];
    if (p.name != params[i]->name)
      return invalid_argument("{} holds parameter '{}' where the model has '{}'", name, p.name, params[i]->name);
    const std::size_t n = params[i]->value.size();
    if (p.value.size() != n || p.m.size() != n || p.v.size() != n)
      return invalid_argument("{}: {} holds {} values, the model {}", name, p.name, p.value.size(), n);
  }
  if (state.biases.size() != layers.size())
    return invalid_argument("{} holds {} layers' biases, the model has {} layers", name, state.biases.size(), layers.size());
  for (std::size_t l = 0; l < layers.size(); ++l)
    if (state.biases[l].size() != layers[l]->bias().values().size())
      return invalid_argument("{}: layer {}'s bias holds {} values, the model {}", name, l, state.biases[l].size(),
                              layers[l]->bias().values().size());
  return Status::ok();
}

// meta.json, this rank's file and its fit to the model; nothing is loaded.
Status verify_rank_part(const std::string& path, CheckpointMeta* expected, int rank, std::span<Parameter* const> params,
                        std::span<MoELayer* const> layers, RankState* state) {
  EPX_ASSIGN_OR_RETURN(std::string where, resolve_checkpoint(path));
  EPX_RETURN_IF_ERROR(read_meta_at(where, expected));
  EPX_RETURN_IF_ERROR(read_rank_file(where, *expected, rank, state));
  return check_fit((fs::path(where) / rank_file_name(rank)).string(), *state, params, layers);
}

}  // namespace

Status load_checkpoint(const std::string& path, CheckpointMeta* expected, Transport& transport,
                       std::span<Parameter* const> params, AdamW& adam, std::span<MoELayer* const> layers,
                       const Deadline& deadline) {
  const int rank = transport.rank();
  RankState state;
  Status s = verify_rank_part(path, expected, rank, params, layers, &state);
  EPX_RETURN_IF_ERROR(agree(transport, s, deadline));
  int64_t steps[2] = {expected->step, -expected->step};  // every rank found the same step
  EPX_RETURN_IF_ERROR(transport.all_reduce(std::span<int64_t>(steps, 2), ReduceOp::kMax, deadline));
  if (steps[0] != -steps[1])
    return aborted("the ranks found checkpoint {} at steps {} to {}: was its 'latest' replaced meanwhile?", path,
                   -steps[1], steps[0]);
  for (std::size_t i = 0; i < params.size(); ++i) {
    AdamW::Moments& m = adam.moments()[params[i]->name];
    params[i]->value = std::move(state.params[i].value);
    m.m = std::move(state.params[i].m);
    m.v = std::move(state.params[i].v);
  }
  for (std::size_t l = 0; l < layers.size(); ++l) layers[l]->bias().set_values(state.biases[l]);
  adam.set_num_steps(state.adam_steps);
  return Status::ok();
}

}  // namespace epx::detail
