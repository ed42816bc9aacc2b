#include "server/http/json_body.h"

#include <algorithm>
#include <exception>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace tinkerd::http {
namespace {

using Json = nlohmann::json;

// What each part of a DOM costs, as glibc's malloc serves it: a request of n bytes takes a chunk
// of max(32, n + 8 rounded up to 16) bytes. The unit test checks the sum against the heap.
constexpr int64_t Chunk(int64_t n) {
  return std::max<int64_t>(32, (n + 8 + 15) / 16 * 16);
}
// An array element: its slot in the array's buffer. The buffer doubles as it grows and, while
// its elements move, the old buffer lives beside the new one: 3 slots per element at that moment.
constexpr int64_t kElement = 3 * sizeof(Json);
// An object member: a std::map node (tree links, the key, the value).
constexpr int64_t kMember = Chunk(32 + sizeof(Json::string_t) + sizeof(Json));
// Containers and strings are held by pointer: the std::vector (and its buffer's chunk header),
// the std::map, the std::string.
constexpr int64_t kArray = Chunk(sizeof(Json::array_t)) + 16;
constexpr int64_t kObject = Chunk(sizeof(Json::object_t));
constexpr int64_t kString = Chunk(sizeof(Json::string_t));
// A string's characters past the small-string buffer (15 in libstdc++) take a chunk of their own,
// exactly their size: strings are copied out of the parser's buffer, whose capacity may be twice.
int64_t Characters(const std::string& s) {
  constexpr size_t kSmallString = 15;
  return s.size() <= kSmallString ? 0 : Chunk(static_cast<int64_t>(s.size()) + 1);
}
// The charge is taken ahead of the DOM in steps of at least this, or half what was taken, so a
// small body holds little and a large one costs a few dozen calls.
constexpr int64_t kChargeStep = int64_t{16} << 10;

// Reads text a character at a time for the parser, counting how far it got: the DOM's bound is
// measured against the text read so far, so a dense body is refused at its start.
class CountingIterator {
 public:
  using iterator_category = std::forward_iterator_tag;
  using value_type = char;
  using difference_type = std::ptrdiff_t;
  using pointer = const char*;
  using reference = const char&;

  CountingIterator(const char* at, int64_t* read) : at_(at), read_(read) {}
  reference operator*() const { return *at_; }
  CountingIterator& operator++() {
    ++at_;
    ++*read_;
    return *this;
  }
  CountingIterator operator++(int) {
    CountingIterator before = *this;
    ++*this;
    return before;
  }
  bool operator==(const CountingIterator& other) const { return at_ == other.at_; }
  bool operator!=(const CountingIterator& other) const { return at_ != other.at_; }

 private:
  const char* at_;
  int64_t* read_;
};

// nlohmann's SAX events into a DOM, as its own DOM parser builds it, each value paid for first.
class Builder {
 public:
  Builder(const int64_t* read, const JsonCharge& charge) : read_(read), charge_(charge) {}

  bool null() { return Add(nullptr, 0); }
  bool boolean(bool v) { return Add(v, 0); }
  bool number_integer(Json::number_integer_t v) { return Add(v, 0); }
  bool number_unsigned(Json::number_unsigned_t v) { return Add(v, 0); }
  bool number_float(Json::number_float_t v, const std::string&) { return Add(v, 0); }
  bool string(std::string& v) {
    return Add(static_cast<const std::string&>(v), kString + Characters(v));
  }
  bool binary(Json::binary_t&) { return Refuse(absl::InvalidArgumentError("body: binary")); }
  bool start_object(std::size_t) { return Open(Json::value_t::object, kObject); }
  bool start_array(std::size_t) { return Open(Json::value_t::array, kArray); }
  bool end_object() { return Close(); }
  bool end_array() { return Close(); }
  bool key(std::string& k) {
    if (!Pay(kMember + Characters(k))) return false;
    member_ = &(*open_.back())[k];  // a repeated key: the last one wins, as json::parse has it
    return true;
  }
  bool parse_error(std::size_t at, const std::string&, const nlohmann::detail::exception&) {
    return Refuse(absl::InvalidArgumentError(
        absl::StrCat("body: not a JSON object (malformed at byte ", at, ")")));
  }

  ~Builder() { FreeJson(root_); }

  absl::StatusOr<JsonDom> Finish(bool parsed) && {
    if (!status_.ok()) return std::move(status_);
    if (!parsed) return absl::InvalidArgumentError("body: not a JSON object");
    if (!root_.is_object()) return absl::InvalidArgumentError("body: not a JSON object");
    return JsonDom(new Json(std::move(root_)));
  }

 private:
  bool Refuse(absl::Status st) {
    if (status_.ok()) status_ = std::move(st);
    return false;
  }

  // Counts `bytes` more of DOM against the text read so far, and charges ahead when past what
  // was charged.
  bool Pay(int64_t bytes) {
    cost_ += bytes;
    if (cost_ > kJsonBytesPerTextByte * *read_ + kJsonFixedBytes) {
      return Refuse(absl::InvalidArgumentError(absl::StrCat(
          "body: its JSON would take more than ", kJsonBytesPerTextByte,
          " bytes of memory per byte of text (", cost_, " bytes after ", *read_,
          " bytes); no request of this API is that dense (nested or empty arrays, objects or "
          "strings by the thousand)")));
    }
    if (cost_ > charged_) {
      const int64_t step = std::max({kChargeStep, charged_ / 2, cost_ - charged_});
      if (absl::Status st = charge_(step); !st.ok()) return Refuse(std::move(st));
      charged_ += step;
    }
    return true;
  }

  // Puts `v` where the parse is (the root, the open array's end, the member just keyed).
  template <typename V>
  bool Add(V&& v, int64_t cost) {
    return Place(std::forward<V>(v), cost) != nullptr;
  }
  template <typename V>
  Json* Place(V&& v, int64_t cost) {
    if (open_.empty()) {
      if (!Pay(sizeof(Json) + cost)) return nullptr;
      root_ = Json(std::forward<V>(v));
      return &root_;
    }
    if (open_.back()->is_array()) {
      if (!Pay(kElement + cost)) return nullptr;
      return &open_.back()->get_ref<Json::array_t&>().emplace_back(std::forward<V>(v));
    }
    if (!Pay(cost)) return nullptr;  // the member's node was paid for with its key
    *member_ = Json(std::forward<V>(v));
    return member_;
  }

  bool Open(Json::value_t type, int64_t cost) {
    if (static_cast<int>(open_.size()) >= kMaxJsonDepth) {
      return Refuse(absl::InvalidArgumentError(absl::StrCat(
          "body: nested deeper than ", kMaxJsonDepth, " levels, which no request of this API is")));
    }
    Json* opened = Place(type, cost);
    if (opened == nullptr) return false;
    open_.push_back(opened);
    return true;
  }
  bool Close() {
    open_.pop_back();
    return true;
  }

  const int64_t* read_;
  const JsonCharge& charge_;
  Json root_;
  std::vector<Json*> open_;  // the arrays and objects not yet closed, outermost first
  Json* member_ = nullptr;
  int64_t cost_ = 0;
  int64_t charged_ = 0;
  absl::Status status_;
};

}  // namespace

void FreeJson(Json& dom) {
  // Depth is at most kMaxJsonDepth here, so the recursion is too.
  if (dom.is_array()) {
    Json::array_t& elements = dom.get_ref<Json::array_t&>();
    for (Json& e : elements) FreeJson(e);
    elements.clear();
  } else if (dom.is_object()) {
    Json::object_t& members = dom.get_ref<Json::object_t&>();
    for (auto& [key, value] : members) FreeJson(value);
    members.clear();
  }
  dom = nullptr;
}

absl::StatusOr<JsonDom> ParseJsonBody(absl::string_view text, const JsonCharge& charge) {
  int64_t read = 0;
  Builder builder(&read, charge);
  bool parsed = false;
  try {
    parsed = Json::sax_parse(CountingIterator(text.data(), &read),
                             CountingIterator(text.data() + text.size(), &read), &builder);
  } catch (const std::exception& e) {
    // The parser reports errors to the builder; an allocation failing is what can still throw.
    return absl::ResourceExhaustedError(absl::StrCat("body: cannot be parsed here: ", e.what()));
  }
  return std::move(builder).Finish(parsed);
}

}  // namespace tinkerd::http
