#include "epx/observe/run_log.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>

#include <fmt/format.h>
#include <simdjson.h>

#include "observe/run_log_parse.h"

namespace epx {

namespace {

namespace od = simdjson::ondemand;
using simdjson::error_code;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// Where a line failed: the field being read (a path like "layers[3].cv").
struct FieldPath {
  std::string_view outer;  // "" or "layers", "ranks", "wait_matrix", "eplb"
  int64_t index = -1;      // the entry of `outer` when it is an array
  std::string_view field;
  [[nodiscard]] std::string to_string() const {
    std::string s(outer);
    if (index >= 0) s += fmt::format("[{}]", index);
    if (!outer.empty() && !field.empty()) s += '.';
    s += field;
    return s;
  }
};

// A number, or NaN for the null the trainer writes for a non-finite one.
error_code read_double(od::value value, double& out) {
  const error_code err = value.get_double().get(out);
  if (err != simdjson::INCORRECT_TYPE) return err;
  bool is_null = false;
  if (value.is_null().get(is_null) == simdjson::SUCCESS && is_null) {
    out = kNaN;
    return simdjson::SUCCESS;
  }
  return err;
}

error_code read_int(od::value value, int64_t& out) { return value.get_int64().get(out); }

error_code read_int(od::value value, int& out) {
  int64_t wide = 0;
  SIMDJSON_TRY(value.get_int64().get(wide));
  if (wide < std::numeric_limits<int>::min() || wide > std::numeric_limits<int>::max())
    return simdjson::NUMBER_OUT_OF_RANGE;
  out = static_cast<int>(wide);
  return simdjson::SUCCESS;
}

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

// How many of the 8 bytes at `p` are leading digits, and their value: the
// digits and their count found without a branch per byte (SWAR, as simdjson's
// own parse_eight_digits_unrolled).
int leading_digits(const char* p, uint64_t& value) {
  uint64_t chunk = 0;
  std::memcpy(&chunk, p, 8);
  const uint64_t digits = chunk ^ 0x3030303030303030ULL;  // '0'..'9' -> 0..9
  const uint64_t not_digit =
      (((digits & 0x7F7F7F7F7F7F7F7FULL) + 0x7676767676767676ULL) | digits) & 0x8080808080808080ULL;
  const int n = not_digit == 0 ? 8 : __builtin_ctzll(not_digit) / 8;
  if (n == 0) return 0;
  uint64_t v = digits << (8 * (8 - n));  // the n digits as the last of eight, after zeros
  v = (v * 10) + (v >> 8);
  v = (((v & 0x000000FF000000FFULL) * 0x000F424000000064ULL) +
       (((v >> 16) & 0x000000FF000000FFULL) * 0x0000271000000001ULL)) >> 32;
  value = v;
  return n;
}

// One JSON integer at `p` (-?(0|[1-9][0-9]*)), for the arrays below; the
// buffer is padded, so the 8 bytes at any p before `end` are readable.
error_code parse_int(const char*& p, const char* end, int64_t& out) {
  const bool negative = p < end && *p == '-';
  if (negative) ++p;
  const char* digits = p;
  uint64_t x = 0;
  const int n8 = leading_digits(p, x);
  p += std::min<std::ptrdiff_t>(n8, end - p);
  if (n8 == 8 || p == end)  // a long number (or one cut by `end`): the rest digit by digit
    for (p = digits, x = 0; p < end && *p >= '0' && *p <= '9';) x = x * 10 + static_cast<uint64_t>(*p++ - '0');
  const std::ptrdiff_t n = p - digits;
  if (n == 0 || (n > 1 && *digits == '0')) return simdjson::INCORRECT_TYPE;
  if (p < end && (*p == '.' || *p == 'e' || *p == 'E')) return simdjson::INCORRECT_TYPE;  // not an integer
  if (n > 19 || (n == 19 && x > static_cast<uint64_t>(INT64_MAX) + (negative ? 1 : 0)))
    return simdjson::NUMBER_OUT_OF_RANGE;
  out = negative ? static_cast<int64_t>(0 - x) : static_cast<int64_t>(x);
  return simdjson::SUCCESS;
}

// An array of integers, the bulk of a metrics line (tokens per expert): its
// text taken whole from simdjson and parsed in one tight loop, about twice
// as fast as an On Demand iteration per element.
error_code read_ints(od::value value, std::vector<int64_t>& out) {
  out.clear();
  od::array array;
  SIMDJSON_TRY(value.get_array().get(array));
  std::string_view text;
  SIMDJSON_TRY(array.raw_json().get(text));
  const char* p = text.data() + 1;  // after '['
  const char* end = text.data() + text.size();
  while (end > p && is_space(end[-1])) --end;
  --end;  // at ']'
  while (p < end && is_space(*p)) ++p;
  while (p < end) {
    int64_t x = 0;
    SIMDJSON_TRY(parse_int(p, end, x));
    out.push_back(x);
    while (p < end && is_space(*p)) ++p;
    if (p == end) break;
    if (*p != ',') return simdjson::INCORRECT_TYPE;
    ++p;
    while (p < end && is_space(*p)) ++p;
    if (p == end) return simdjson::TAPE_ERROR;  // a comma before ']'
  }
  return simdjson::SUCCESS;
}

error_code read_doubles(od::value value, std::vector<double>& out) {
  out.clear();
  od::array array;
  SIMDJSON_TRY(value.get_array().get(array));
  for (auto element : array) {
    od::value v;
    SIMDJSON_TRY(std::move(element).get(v));
    double x = 0;
    SIMDJSON_TRY(read_double(v, x));
    out.push_back(x);
  }
  return simdjson::SUCCESS;
}

// Calls read_field(key, value) for every field of the object; unknown keys
// are the callee's to skip (by not reading the value).
template <typename ReadField>
error_code for_each_field(od::value value, FieldPath& where, ReadField&& read_field) {
  od::object object;
  SIMDJSON_TRY(value.get_object().get(object));
  for (auto field : object) {
    std::string_view key;
    SIMDJSON_TRY(field.unescaped_key().get(key));
    where.field = key;
    od::value v;
    SIMDJSON_TRY(field.value().get(v));
    SIMDJSON_TRY(read_field(key, v));
  }
  where.field = {};
  return simdjson::SUCCESS;
}

error_code read_layer(od::value value, LayerRecord& layer, FieldPath& where) {
  return for_each_field(value, where, [&](std::string_view key, od::value v) -> error_code {
    if (key == "layer") return read_int(v, layer.layer);
    if (key == "max_vio") return read_double(v, layer.max_vio);
    if (key == "cv") return read_double(v, layer.cv);
    if (key == "dropped") return read_int(v, layer.dropped);
    if (key == "worst_rank") return read_int(v, layer.worst_rank);
    if (key == "worst_rank_share") return read_double(v, layer.worst_rank_share);
    if (key == "idle_fraction") return read_double(v, layer.idle_fraction);
    if (key == "tokens_per_expert") return read_ints(v, layer.tokens_per_expert);
    if (key == "tokens_per_rank") return read_ints(v, layer.tokens_per_rank);
    return simdjson::SUCCESS;
  });
}

double* rank_double_field(RankRecord& r, std::string_view key) {
  if (key == "router") return &r.router;
  if (key == "dispatch") return &r.dispatch;
  if (key == "experts") return &r.experts;
  if (key == "combine") return &r.combine;
  if (key == "dense") return &r.dense;
  if (key == "wait") return &r.wait;
  if (key == "sync") return &r.sync;
  if (key == "total") return &r.total;
  if (key == "grad_reduce") return &r.grad_reduce;
  if (key == "grad_wait") return &r.grad_wait;
  if (key == "grad_bytes") return &r.grad_bytes;
  if (key == "exchange_wait") return &r.exchange_wait;
  if (key == "late") return &r.late;
  if (key == "slow_data") return &r.slow_data;
  return nullptr;
}

error_code read_rank(od::value value, RankRecord& rank, FieldPath& where) {
  return for_each_field(value, where, [&](std::string_view key, od::value v) -> error_code {
    if (key == "rank") return read_int(v, rank.rank);
    if (key == "waited_for") return read_int(v, rank.waited_for);
    if (double* field = rank_double_field(rank, key)) return read_double(v, *field);
    return simdjson::SUCCESS;
  });
}

// A record of an earlier line made new again, its vectors' memory kept.
void reset(LayerRecord& layer) {
  std::vector<int64_t> experts = std::move(layer.tokens_per_expert), ranks = std::move(layer.tokens_per_rank);
  experts.clear();
  ranks.clear();
  layer = LayerRecord{};
  layer.tokens_per_expert = std::move(experts);
  layer.tokens_per_rank = std::move(ranks);
}
void reset(RankRecord& rank) { rank = RankRecord{}; }

// Reads an array of objects, each with read_one, numbering them in `where`.
// The entries `out` already holds are reused (reset) and the rest dropped.
template <typename Record, typename ReadOne>
error_code read_records(od::value value, std::string_view name, std::vector<Record>& out, FieldPath& where,
                        ReadOne read_one) {
  od::array array;
  SIMDJSON_TRY(value.get_array().get(array));
  where.outer = name;
  where.index = 0;
  std::size_t count = 0;
  for (auto element : array) {
    od::value v;
    SIMDJSON_TRY(std::move(element).get(v));
    if (count < out.size()) {
      reset(out[count]);
    } else {
      out.emplace_back();
    }
    SIMDJSON_TRY(read_one(v, out[count], where));
    ++count;
    ++where.index;
  }
  out.resize(count);
  where = FieldPath{};
  return simdjson::SUCCESS;
}

error_code read_wait_matrix(od::value value, WaitMatrix& matrix, FieldPath& where) {
  where.outer = "wait_matrix";
  SIMDJSON_TRY(for_each_field(value, where, [&](std::string_view key, od::value v) -> error_code {
    if (key == "num_ranks") return read_int(v, matrix.num_ranks);
    if (key == "arrival") return read_doubles(v, matrix.arrival);
    if (key == "data") return read_doubles(v, matrix.data);
    return simdjson::SUCCESS;
  }));
  const std::size_t cells = static_cast<std::size_t>(std::max(matrix.num_ranks, 0)) * std::max(matrix.num_ranks, 0);
  if (matrix.num_ranks < 0 || matrix.arrival.size() != cells || matrix.data.size() != cells) {
    where.field = "num_ranks";
    return simdjson::INDEX_OUT_OF_BOUNDS;  // reworded by failure_message
  }
  where = FieldPath{};
  return simdjson::SUCCESS;
}

error_code read_eplb(od::value value, EplbRecord& eplb, FieldPath& where) {
  where.outer = "eplb";
  SIMDJSON_TRY(for_each_field(value, where, [&](std::string_view key, od::value v) -> error_code {
    if (key == "balance_before") return read_doubles(v, eplb.balance_before);
    if (key == "balance_after") return read_doubles(v, eplb.balance_after);
    if (key == "moved_slots") return read_int(v, eplb.moved_slots);
    if (key == "moved_bytes") return read_int(v, eplb.moved_bytes);
    return simdjson::SUCCESS;
  }));
  where = FieldPath{};
  return simdjson::SUCCESS;
}

// The step made new again for another line; its layers and ranks are kept
// for read_records to reuse (dropped by the caller when the line has none).
void reset_keeping_memory(StepRecord& step) {
  std::vector<LayerRecord> layers = std::move(step.layers);
  std::vector<RankRecord> ranks = std::move(step.ranks);
  step = StepRecord{};
  step.layers = std::move(layers);
  step.ranks = std::move(ranks);
}

error_code read_step_field(std::string_view key, od::value v, StepRecord& step, FieldPath& where) {
  if (key == "step") return read_int(v, step.step);
  if (key == "loss") return read_double(v, step.loss);
  if (key == "main_loss") return read_double(v, step.main_loss);
  if (key == "val_loss") return read_double(v, step.val_loss.emplace());
  if (key == "lr") return read_double(v, step.lr);
  if (key == "grad_norm") return read_double(v, step.grad_norm);
  if (key == "seconds") return read_double(v, step.seconds);
  if (key == "tokens_per_s") return read_double(v, step.tokens_per_s);
  if (key == "num_nodes") return read_int(v, step.num_nodes);
  if (key == "resumed_from") return read_int(v, step.resumed_from);
  if (key == "layers") return read_records(v, "layers", step.layers, where, read_layer);
  if (key == "ranks") return read_records(v, "ranks", step.ranks, where, read_rank);
  if (key == "wait_matrix") return read_wait_matrix(v, step.wait_matrix.emplace(), where);
  if (key == "eplb") return read_eplb(v, step.eplb.emplace(), where);
  return simdjson::SUCCESS;
}

// What went wrong, for a person: the field and simdjson's reason.
std::string failure_message(error_code err, const FieldPath& where, const StepRecord& step) {
  const std::string field = where.to_string();
  if (err == simdjson::INDEX_OUT_OF_BOUNDS && where.outer == "wait_matrix" && step.wait_matrix)
    return fmt::format("field \"wait_matrix\": arrival has {} and data {} numbers, num_ranks = {} needs {}",
                       step.wait_matrix->arrival.size(), step.wait_matrix->data.size(), step.wait_matrix->num_ranks,
                       static_cast<int64_t>(step.wait_matrix->num_ranks) * step.wait_matrix->num_ranks);
  if (field.empty()) return fmt::format("not a JSON object of the metrics format ({})", simdjson::error_message(err));
  return fmt::format("field \"{}\": {}", field, simdjson::error_message(err));
}

std::string line_start(std::string_view line) {
  constexpr std::size_t kShown = 60;
  if (line.size() <= kShown) return std::string(line);
  return std::string(line.substr(0, kShown)) + "...";
}

}  // namespace

namespace observe_detail {

// One line whose buffer holds at least SIMDJSON_PADDING readable bytes after it.
Status parse_padded_line(LineParser& parser, std::string_view line, std::size_t capacity, StepRecord& step) {
  reset_keeping_memory(step);
  bool has_layers = false, has_ranks = false;
  od::document doc;
  FieldPath where;
  error_code err = parser.parser.iterate(simdjson::padded_string_view(line.data(), line.size(), capacity)).get(doc);
  if (!err) {
    od::object object;
    err = doc.get_object().get(object);
    if (!err) {
      for (auto field : object) {
        std::string_view key;
        od::value v;
        if ((err = field.unescaped_key().get(key)) != simdjson::SUCCESS) break;
        where.field = key;
        if ((err = field.value().get(v)) != simdjson::SUCCESS) break;
        has_layers = has_layers || key == "layers";
        has_ranks = has_ranks || key == "ranks";
        if ((err = read_step_field(key, v, step, where)) != simdjson::SUCCESS) break;
        where.field = {};
      }
    }
    // Anything after the object (a second one, stray text) is an error.
    if (!err && doc.current_location().error() == simdjson::SUCCESS) err = simdjson::TRAILING_CONTENT;
  }
  if (!has_layers) step.layers.clear();
  if (!has_ranks) step.ranks.clear();
  if (!err) return Status::ok();
  return invalid_argument("{} in line '{}'", failure_message(err, where, step), line_start(line));
}

Status parse_line(LineParser& parser, std::string_view line, StepRecord& step) {
  if (line.size() + simdjson::SIMDJSON_PADDING > parser.scratch.size())
    parser.scratch.resize(line.size() + simdjson::SIMDJSON_PADDING);
  if (!line.empty()) std::memcpy(parser.scratch.data(), line.data(), line.size());  // an empty view's data() may be null
  return parse_padded_line(parser, std::string_view(parser.scratch.data(), line.size()), parser.scratch.size(), step);
}

namespace {
bool is_blank(std::string_view line) {
  return line.find_first_not_of(" \t\r") == std::string_view::npos;
}
}  // namespace

void parse_lines(LineParser& parser, std::string_view text, std::size_t capacity, ParsedLines& out) {
  std::size_t& num_records = out.num_records;
  num_records = 0;
  out.num_lines = 0;
  out.error = Status::ok();
  out.error_line = 0;
  std::size_t begin = 0;
  while (begin < text.size()) {
    const void* nl = std::memchr(text.data() + begin, '\n', text.size() - begin);
    if (nl == nullptr) break;  // a partial last line: the caller keeps it
    const std::size_t end = static_cast<const char*>(nl) - text.data();
    const std::string_view line = text.substr(begin, end - begin);
    ++out.num_lines;
    if (!is_blank(line)) {
      if (num_records == out.records.size()) out.records.emplace_back();
      StepRecord& step = out.records[num_records];
      // The line's own buffer pads it when enough of the text follows;
      // otherwise (the last line or so) a copy in the parser's scratch does.
      const std::size_t room = capacity - begin;
      Status status = room >= line.size() + simdjson::SIMDJSON_PADDING
                          ? parse_padded_line(parser, std::string_view(text.data() + begin, line.size()), room, step)
                          : parse_line(parser, line, step);
      if (!status.is_ok()) {
        out.error = std::move(status);
        out.error_line = out.num_lines;
        break;
      }
      ++num_records;
    }
    begin = end + 1;
  }
  out.consumed = begin;
}

}  // namespace observe_detail

double StepRecord::balancedness() const {
  if (layers.empty()) return 1.0;
  double sum = 0;
  for (const LayerRecord& layer : layers) sum += layer.balancedness();
  return sum / static_cast<double>(layers.size());
}

double StepRecord::max_vio() const {
  if (layers.empty()) return 0.0;
  double sum = 0;
  for (const LayerRecord& layer : layers) sum += layer.max_vio;
  return sum / static_cast<double>(layers.size());
}

Result<StepRecord> parse_step_record(std::string_view line) {
  observe_detail::LineParser parser;
  StepRecord step;
  EPX_RETURN_IF_ERROR(observe_detail::parse_line(parser, line, step));
  return step;
}

}  // namespace epx
