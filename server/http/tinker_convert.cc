#include "server/http/tinker_convert.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "absl/algorithm/container.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "runner/util/echo.h"
#include "server/http/json_fields.h"

namespace tinkerd::http {
namespace {

// Both wires are little-endian, and so is every platform this builds on, so FLOAT32/INT64 bytes
// pass through untouched and widening reads elements with memcpy (checked at compile time).
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "wire decoding assumes little-endian");

// A shape's element count is compared with what the bytes hold, never multiplied by the element
// size, so this bound only keeps the product itself from overflowing (2^40 elements is far beyond
// any request that fits in a protobuf message).
constexpr int64_t kMaxShapeElements = int64_t{1} << 40;

absl::Status Invalid(const std::string& path, const std::string& why) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": ", why));
}

const char* DTypeName(tinker_public::DType d) {
  switch (d) {
    case tinker_public::DTYPE_FLOAT32:
      return "FLOAT32";
    case tinker_public::DTYPE_INT64:
      return "INT64";
    case tinker_public::DTYPE_INT32:
      return "INT32";
    case tinker_public::DTYPE_BFLOAT16:
      return "BFLOAT16";
    default:
      return "UNSPECIFIED";
  }
}

absl::Status TokensFromTinker(const std::string& bytes, const std::string& path,
                              v1::EncodedTextChunk* out) {
  if (bytes.size() % sizeof(int32_t) != 0) {
    return Invalid(
        path, absl::StrCat(bytes.size(), " bytes of tokens is not a whole number of INT32 tokens"));
  }
  const size_t n = bytes.size() / sizeof(int32_t);
  // RepeatedField sizes are int. A parsed message cannot exceed 2 GiB, so this never trips, but
  // the bound is what makes the cast below safe.
  if (n > static_cast<size_t>(INT_MAX)) return Invalid(path, "too many tokens");
  if (n == 0) return absl::OkStatus();
  google::protobuf::RepeatedField<int64_t>* tokens = out->mutable_tokens();
  tokens->Resize(static_cast<int>(n), 0);
  int64_t* dst = tokens->mutable_data();
  for (size_t k = 0; k < n; ++k) {
    int32_t t;  // memcpy: the bytes have no alignment guarantee
    std::memcpy(&t, bytes.data() + k * sizeof(int32_t), sizeof(t));
    dst[k] = t;
  }
  return absl::OkStatus();
}

size_t WireElementSize(tinker_public::DType d) {
  switch (d) {
    case tinker_public::DTYPE_INT64:
      return 8;
    case tinker_public::DTYPE_FLOAT32:
    case tinker_public::DTYPE_INT32:
      return 4;
    case tinker_public::DTYPE_BFLOAT16:
      return 2;
    default:
      return 0;
  }
}

// Reads little-endian int64 index arrays (the SDK always writes CSR indices as int64).
absl::StatusOr<std::vector<int64_t>> Indices(const std::string& bytes, const std::string& path) {
  if (bytes.size() % sizeof(int64_t) != 0) {
    return Invalid(path,
                   absl::StrCat(bytes.size(), " bytes is not a whole number of INT64 indices"));
  }
  std::vector<int64_t> out(bytes.size() / sizeof(int64_t));
  if (!out.empty()) std::memcpy(out.data(), bytes.data(), bytes.size());
  return out;
}

// A CSR layout's order, given row pointers from 0 to nnz and nnz column indices (the callers
// check those counts): the pointers never decrease, so every row's range lies within the column
// indices, and each row's columns rise strictly within [0, cols), so no cell is named twice.
absl::Status CheckCsrOrder(const std::vector<int64_t>& crow, const std::vector<int64_t>& col,
                           int64_t cols, const std::string& crow_path,
                           const std::string& col_path) {
  const int64_t rows = static_cast<int64_t>(crow.size()) - 1;
  for (int64_t r = 0; r < rows; ++r) {
    if (crow[r + 1] < crow[r]) {
      return Invalid(crow_path, absl::StrCat("row ", r, " ends (", crow[r + 1],
                                             ") before it starts (", crow[r], ")"));
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t k = crow[r]; k < crow[r + 1]; ++k) {
      if (col[k] < 0 || col[k] >= cols || (k > crow[r] && col[k] <= col[k - 1])) {
        return Invalid(col_path, absl::StrCat("row ", r, ": column ", col[k], " is outside [0, ",
                                              cols, ") or not after the row's previous column"));
      }
    }
  }
  return absl::OkStatus();
}

// Replaces t's sparse CSR encoding with the dense bytes it stands for, in t's own dtype: the
// entries it does not list are 0, the pad value the SDK's Datum drops when it encodes 2-D
// target_tokens and weights sparsely. *budget is what the dense bytes of the whole request may
// still take: a few bytes of CSR can stand for a huge dense shape, so the densified size is held to
// what a dense body could have sent.
absl::Status Densify(tinker_public::Tensor* t, const std::string& path, int64_t* budget) {
  const tinker_public::SparseCsr& csr = t->sparse_csr();
  const size_t esize = WireElementSize(t->dtype());
  if (esize == 0) return Invalid(path, "dtype is not set or unknown");
  if (t->shape_size() != 2) {
    return Invalid(path, absl::StrCat("a sparse (CSR) tensor needs its 2-D dense shape, got ",
                                      t->shape_size(), " dimensions"));
  }
  const int64_t rows = t->shape(0), cols = t->shape(1);
  if (rows < 0 || cols < 0) return Invalid(path, "shape has a negative dimension");
  if (cols > 0 && rows > *budget / static_cast<int64_t>(esize) / cols) {
    return Invalid(path, absl::StrCat("sparse shape [", rows, ", ", cols,
                                      "] densifies to more "
                                      "than the request may hold (",
                                      *budget,
                                      " bytes left of "
                                      "the body limit)"));
  }
  *budget -= rows * cols * static_cast<int64_t>(esize);
  const std::string sub = absl::StrCat(path, ".sparse_csr");
  absl::StatusOr<std::vector<int64_t>> crow = Indices(csr.crow_indices(), sub + ".crow_indices");
  if (!crow.ok()) return crow.status();
  absl::StatusOr<std::vector<int64_t>> col = Indices(csr.col_indices(), sub + ".col_indices");
  if (!col.ok()) return col.status();
  if (csr.values().size() % esize != 0) {
    return Invalid(sub + ".values", absl::StrCat(csr.values().size(),
                                                 " bytes is not a whole "
                                                 "number of ",
                                                 DTypeName(t->dtype()), " elements"));
  }
  const int64_t nnz = static_cast<int64_t>(csr.values().size() / esize);
  if (static_cast<int64_t>(col->size()) != nnz) {
    return Invalid(sub, absl::StrCat(col->size(), " column indices for ", nnz, " values"));
  }
  if (static_cast<int64_t>(crow->size()) != rows + 1 || crow->front() != 0 || crow->back() != nnz) {
    return Invalid(sub + ".crow_indices",
                   absl::StrCat("must hold rows + 1 = ", rows + 1, " pointers from 0 to ", nnz));
  }
  if (absl::Status st =
          CheckCsrOrder(*crow, *col, cols, sub + ".crow_indices", sub + ".col_indices");
      !st.ok()) {
    return st;
  }
  std::string dense(static_cast<size_t>(rows * cols) * esize, '\0');
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t k = (*crow)[r]; k < (*crow)[r + 1]; ++k) {
      const int64_t c = (*col)[k];
      std::memcpy(&dense[static_cast<size_t>(r * cols + c) * esize],
                  csr.values().data() + static_cast<size_t>(k) * esize, esize);
    }
  }
  *t->mutable_dense() = std::move(dense);  // clears the sparse_csr member of the oneof
  return absl::OkStatus();
}

// Moves t's dense bytes into out where they need no widening.
absl::Status TensorFromTinker(tinker_public::Tensor* t, const std::string& path, v1::Tensor* out,
                              int64_t* dense_budget) {
  if (t->has_sparse_csr()) {
    if (absl::Status s = Densify(t, path, dense_budget); !s.ok()) return s;
  }
  // A Tensor with neither encoding set is read as empty dense data: proto3 writers always emit a
  // set oneof member, even an empty one, so only a hand-made message lacks it, and the shape check
  // below still refuses it unless the shape holds no elements.
  size_t esize = 0;
  v1::DType dtype = v1::DTYPE_UNSPECIFIED;
  switch (t->dtype()) {
    case tinker_public::DTYPE_FLOAT32:
      esize = 4;
      dtype = v1::FLOAT32;
      break;
    case tinker_public::DTYPE_INT64:
      esize = 8;
      dtype = v1::INT64;
      break;
    case tinker_public::DTYPE_INT32:
      esize = 4;
      dtype = v1::INT64;
      break;
    case tinker_public::DTYPE_BFLOAT16:
      esize = 2;
      dtype = v1::FLOAT32;
      break;
    case tinker_public::DTYPE_UNSPECIFIED:
      return Invalid(path, "dtype is not set");
    default:  // proto3 enums are open: an unknown number arrives as is
      return Invalid(path, absl::StrCat("unknown dtype ", static_cast<int>(t->dtype())));
  }
  const std::string& bytes = t->dense();  // "" when no encoding is set
  if (bytes.size() % esize != 0) {
    return Invalid(path, absl::StrCat(bytes.size(), " bytes is not a whole number of ",
                                      DTypeName(t->dtype()), " elements"));
  }
  const size_t n = bytes.size() / esize;
  int64_t prod = 1;
  for (int k = 0; k < t->shape_size(); ++k) {
    const int64_t d = t->shape(k);
    if (d < 0) return Invalid(path, absl::StrCat("shape[", k, "] is negative (", d, ")"));
    if (d != 0 && prod > kMaxShapeElements / d) {
      return Invalid(path, absl::StrCat("shape [", absl::StrJoin(t->shape(), ", "),
                                        "] holds more than 2^40 elements"));
    }
    prod *= d;
  }
  // prod <= 2^40, so the comparison in uint64 is exact.
  if (t->shape_size() > 0 && static_cast<uint64_t>(prod) != static_cast<uint64_t>(n)) {
    return Invalid(path, absl::StrCat("shape [", absl::StrJoin(t->shape(), ", "), "] holds ", prod,
                                      " elements but the data has ", n));
  }

  out->set_dtype(dtype);
  out->mutable_shape()->CopyFrom(t->shape());
  // An empty tensor has nothing to copy, and memcpy from or to null is undefined even for zero
  // bytes, so stop here.
  if (n == 0) return absl::OkStatus();
  const char* src = bytes.data();
  std::string* dst = out->mutable_data();
  switch (t->dtype()) {
    case tinker_public::DTYPE_INT32:
      // n <= bytes.size() / 4, so n * 8 <= 2 * bytes.size(): no overflow.
      dst->resize(n * sizeof(int64_t));
      for (size_t k = 0; k < n; ++k) {
        int32_t v;
        std::memcpy(&v, src + k * sizeof(int32_t), sizeof(v));
        const int64_t w = v;  // sign-extends
        std::memcpy(&(*dst)[k * sizeof(int64_t)], &w, sizeof(w));
      }
      break;
    case tinker_public::DTYPE_BFLOAT16:
      // bfloat16 is the upper half of a binary32, so shifting it into place is exact for every
      // value, NaN and infinities included (what the SDK itself does with bf16 results).
      dst->resize(n * sizeof(float));
      for (size_t k = 0; k < n; ++k) {
        uint16_t h;
        std::memcpy(&h, src + k * sizeof(uint16_t), sizeof(h));
        const uint32_t bits = static_cast<uint32_t>(h) << 16;
        std::memcpy(&(*dst)[k * sizeof(float)], &bits, sizeof(bits));
      }
      break;
    default:  // FLOAT32, INT64: the same bytes; move them rather than copy a possibly large array
      *dst = std::move(*t->mutable_dense());
      break;
  }
  return absl::OkStatus();
}

absl::Status DatumFromTinker(tinker_public::Datum* in, size_t i, v1::Datum* out,
                             int64_t* dense_budget) {
  for (int j = 0; j < in->model_input_size(); ++j) {
    const std::string path = absl::StrCat("data[", i, "].model_input[", j, "]");
    const tinker_public::Chunk& c = in->model_input(j);
    switch (c.chunk_case()) {
      case tinker_public::Chunk::kEncodedText: {
        // One v1 chunk per Tinker chunk, so indices in tinkerd's later errors still match.
        v1::EncodedTextChunk* text =
            out->mutable_model_input()->add_chunks()->mutable_encoded_text();
        if (absl::Status s = TokensFromTinker(c.encoded_text().tokens(), path, text); !s.ok()) {
          return s;
        }
        break;
      }
      case tinker_public::Chunk::kImage:
        return Invalid(path, "image chunks are not supported by this server");
      case tinker_public::Chunk::kDmel:
        return Invalid(path, "audio (dmel) chunks are not supported by this server");
      default:
        return Invalid(path, "empty chunk (none of encoded_text, image, dmel is set)");
    }
  }
  // Keys in sorted order: map iteration order is unspecified, and with several bad inputs the
  // error should not depend on it.
  auto* inputs = in->mutable_loss_fn_inputs();
  std::vector<std::string> keys;
  keys.reserve(inputs->size());
  for (const auto& [key, unused] : *inputs) keys.push_back(key);
  std::sort(keys.begin(), keys.end());
  for (const std::string& key : keys) {
    const std::string path = absl::StrCat("data[", i, "].loss_fn_inputs[\"", key, "\"]");
    v1::Tensor& t = (*out->mutable_loss_fn_inputs())[key];
    if (absl::Status s = TensorFromTinker(&inputs->at(key), path, &t, dense_budget); !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<TinkerFwdBwd> FwdBwdFromTinker(tinker_public::ForwardBackwardRequest* in,
                                              int64_t max_dense_bytes) {
  TinkerFwdBwd out;
  out.forward_only = in->forward_only();
  v1::LossFn* loss = out.request.mutable_loss_fn();
  loss->set_name(std::move(*in->mutable_loss_fn()));
  loss->mutable_config()->insert(in->loss_fn_config().begin(), in->loss_fn_config().end());
  for (const auto& [key, value] : in->loss_fn_config_v2()) {
    // Every config value of tinkerd's losses is a number: a text value would otherwise be
    // dropped, and the loss run without what the client set.
    if (value.value_case() != tinker_public::LossConfigValue::kNumber) {
      return absl::InvalidArgumentError(absl::StrCat(
          "loss_fn_config[\"", Echo(key), "\"]: ", Echo(loss->name()),
          value.value_case() == tinker_public::LossConfigValue::kText
              ? absl::StrCat(" takes numbers only, got the text '", Echo(value.text()), "'")
              : std::string(" takes numbers only, got no value")));
    }
    (*loss->mutable_config())[key] = value.number();
  }
  out.request.mutable_data()->Reserve(in->data_size());
  int64_t dense_budget = max_dense_bytes;
  for (int i = 0; i < in->data_size(); ++i) {
    if (absl::Status s =
            DatumFromTinker(in->mutable_data(i), i, out.request.add_data(), &dense_budget);
        !s.ok()) {
      return s;
    }
  }
  return out;
}

void FwdBwdOutputToTinker(const v1::ForwardBackwardOutput& in, const std::string& loss_fn,
                          tinker_public::ForwardBackwardOutput* out) {
  out->Clear();
  // The SDK keeps loss_fn_output_type after its last ':' as ForwardBackwardOutput's
  // loss_fn_output_type and never interprets it; "ArrayRecord" is what it assumes itself when
  // there are no records, and names what the record is.
  out->set_loss_fn_output_type("ArrayRecord");
  tinker_public::ArrayRecord* rec = out->add_loss_fn_outputs();
  rec->set_type_tag("ArrayRecord");  // not read by the SDK
  // num_datums is what the SDK counts datums by (it falls back to a field's count only when 0).
  rec->set_num_datums(in.outputs_size());

  // Only "logprobs", the one output the SDK reads (forward() hands it to custom losses). Tinker
  // also returns a per-token "elementwise_loss", which the SDK neither requires nor reads; tinkerd
  // computes no per-token losses, so emitting one would mean making numbers up. A caller that
  // indexes it gets a KeyError instead of wrong values.
  tinker_public::BatchedTensor& lp = (*rec->mutable_fields())["logprobs"];
  lp.set_dtype(tinker_public::DTYPE_FLOAT32);
  // Each datum's tensor is [T] (no trailing_shape: T = its byte count / 4) or, for top-K
  // targets, [T, K] with trailing_shape [K]: every datum of a call has the same K
  // (runner/validate.h).
  if (in.outputs_size() > 0 && in.outputs(0).logprobs().shape_size() == 2) {
    lp.add_trailing_shape(in.outputs(0).logprobs().shape(1));
  }
  size_t total = 0;
  for (const v1::DatumOutput& d : in.outputs()) total += d.logprobs().data().size();
  std::string* data = lp.mutable_data();
  data->reserve(total);
  // offsets: int64 byte offsets into data, one per datum boundary (N + 1, starting at 0). The
  // logprobs are tinkerd's own FLOAT32 tensors (Float32ToProto), whole elements by construction.
  std::string* offsets = lp.mutable_offsets();
  offsets->resize((static_cast<size_t>(in.outputs_size()) + 1) * sizeof(int64_t));
  int64_t off = 0;
  std::memcpy(offsets->data(), &off, sizeof(off));
  for (int i = 0; i < in.outputs_size(); ++i) {
    const std::string& bytes = in.outputs(i).logprobs().data();
    data->append(bytes);
    off += static_cast<int64_t>(bytes.size());
    std::memcpy(offsets->data() + (static_cast<size_t>(i) + 1) * sizeof(int64_t), &off,
                sizeof(off));
  }
  out->mutable_metrics()->insert(in.metrics().begin(), in.metrics().end());
}

namespace {

template <typename T, typename Range>
std::string Packed(const Range& values) {
  std::string out(values.size() * sizeof(T), '\0');
  size_t i = 0;
  for (const auto v : values) {
    const T x = static_cast<T>(v);
    std::memcpy(out.data() + sizeof(T) * i++, &x, sizeof(T));
  }
  return out;
}

}  // namespace

namespace {

constexpr float kMissing = -99999.0f;  // the SDK's MASK_LOGPROB: an empty top-k slot

// Rows of (token, logprob) as Tinker's TopkLogprobs of width k: short rows padded with the SDK's
// empty slot, so a row with none (a prompt's position 0, or one prompt_logprobs_last_n left out)
// reads as None.
void TopkToTinker(const google::protobuf::RepeatedPtrField<v1::TopkLogprobs>& rows, int64_t k,
                  tinker_public::TopkLogprobs* out) {
  const int64_t n = rows.size();
  std::vector<int32_t> tokens(n * k, 0);
  std::vector<float> logprobs(n * k, kMissing);
  for (int64_t i = 0; i < n; ++i) {
    const v1::TopkLogprobs& row = rows[static_cast<int>(i)];
    for (int64_t j = 0; j < std::min<int64_t>(k, row.tokens_size()); ++j) {
      tokens[i * k + j] = static_cast<int32_t>(row.tokens(j));
      logprobs[i * k + j] = static_cast<float>(row.logprobs(j));
    }
  }
  out->set_token_ids(Packed<int32_t>(tokens));
  out->set_logprobs(Packed<float>(logprobs));
  out->set_k(static_cast<uint32_t>(k));
  out->set_length(static_cast<uint32_t>(n));
}

// target_prompt_logprobs' answer in the request's layout: each asked cell's logprob, 0 where the
// request had -1 (Tinker's convention; tinkerd's own answer says NaN there).
void TargetToTinker(const google::protobuf::RepeatedField<double>& logprobs_RK,
                    const TargetLayout& layout, tinker_public::Tensor* out) {
  out->set_dtype(tinker_public::DTYPE_FLOAT32);
  out->add_shape(layout.rows);
  out->add_shape(layout.k);
  auto at = [&](int64_t cell) {
    const double v = cell < logprobs_RK.size() ? logprobs_RK[static_cast<int>(cell)] : 0.0;
    return std::isnan(v) ? 0.0f : static_cast<float>(v);
  };
  if (!layout.sparse) {
    std::vector<float> dense(layout.rows * layout.k);
    for (size_t c = 0; c < dense.size(); ++c) dense[c] = at(static_cast<int64_t>(c));
    out->set_dense(Packed<float>(dense));
    return;
  }
  std::vector<float> values;
  for (int64_t r = 0; r < layout.rows; ++r) {
    for (int64_t i = layout.crow[r]; i < layout.crow[r + 1]; ++i) {
      values.push_back(at(r * layout.k + layout.col[i]));
    }
  }
  tinker_public::SparseCsr* csr = out->mutable_sparse_csr();
  csr->set_values(Packed<float>(values));
  csr->set_crow_indices(Packed<int64_t>(layout.crow));
  csr->set_col_indices(Packed<int64_t>(layout.col));
}

}  // namespace

void SampleResponseToTinker(const v1::SampleResponse& in, const SampleAnswer& asked,
                            tinker_public::SampleResponse* out) {
  for (const v1::SampledSequence& s : in.sequences()) {
    tinker_public::SampledSequence* seq = out->add_sequences();
    seq->set_stop_reason(s.stop_reason() == v1::STOP_REASON_STOP
                             ? tinker_public::STOP_REASON_STOP
                             : tinker_public::STOP_REASON_LENGTH);
    seq->set_tokens(Packed<int32_t>(s.tokens()));
    seq->set_logprobs(Packed<float>(s.logprobs()));
    if (asked.topk_sample_logprobs > 0) {
      TopkToTinker(s.topk_logprobs(), asked.topk_sample_logprobs,
                   seq->mutable_topk_sampled_logprobs());
    }
  }
  if (asked.prompt_logprobs) out->set_prompt_logprobs(Packed<float>(in.prompt_logprobs()));
  if (asked.topk_prompt_logprobs > 0) {
    TopkToTinker(in.topk_prompt_logprobs(), asked.topk_prompt_logprobs,
                 out->mutable_topk_prompt_logprobs());
  }
  if (asked.target) {
    TargetToTinker(in.target_prompt_logprobs(), *asked.target,
                   out->mutable_target_prompt_logprobs());
  }
  if (asked.prompt_alt_tokens_k > 0) {
    const int64_t k = asked.prompt_alt_tokens_k, rows = in.prompt_alt_tokens_size() / k;
    for (tinker_public::Tensor* t : {out->mutable_prompt_alt_tokens()->mutable_tokens(),
                                     out->mutable_prompt_alt_tokens()->mutable_logprobs()}) {
      t->add_shape(rows);
      t->add_shape(k);
    }
    tinker_public::Tensor* tokens = out->mutable_prompt_alt_tokens()->mutable_tokens();
    tokens->set_dtype(tinker_public::DTYPE_INT64);
    tokens->set_dense(Packed<int64_t>(in.prompt_alt_tokens()));
    tinker_public::Tensor* logprobs = out->mutable_prompt_alt_tokens()->mutable_logprobs();
    logprobs->set_dtype(tinker_public::DTYPE_FLOAT32);
    logprobs->set_dense(Packed<float>(in.prompt_alt_logprobs()));
  }
}

absl::Status TargetPromptFromTinker(const nlohmann::json& t, int64_t max_rows, int64_t max_k,
                                    v1::Tensor* out, TargetLayout* layout) {
  const std::string field = "target_prompt_logprobs";
  if (!t.is_object()) return Invalid(field, "must be a TensorData object");
  Fields f(t);
  const std::optional<std::string> dtype = f.OptStr("dtype");
  if (!f.status().ok()) return Invalid(field, std::string(f.status().message()));
  if (dtype != "int64") return Invalid(field + ".dtype", "must be 'int64' (token ids)");
  auto shape = t.find("shape");
  if (shape == t.end() || !shape->is_array() || shape->size() != 2 || !IsInt64((*shape)[0]) ||
      !IsInt64((*shape)[1])) {
    return Invalid(field + ".shape", "must be [len(prompt) - 1, K]");
  }
  const int64_t rows = (*shape)[0].get<int64_t>(), k = (*shape)[1].get<int64_t>();
  if (rows < 1 || rows > max_rows) {
    return Invalid(field + ".shape", absl::StrCat("rows must be len(prompt) - 1, in [1, ", max_rows,
                                                  "], got ", rows));
  }
  if (k < 1 || k > max_k) {
    return Invalid(field + ".shape", absl::StrCat("K must be in [1, ", max_k, "], got ", k));
  }
  auto data = t.find("data");
  if (data == t.end() || !data->is_array()) return Invalid(field + ".data", "must be an array");
  auto ints = [&](const nlohmann::json& a, const std::string& name,
                  std::vector<int64_t>* v) -> absl::Status {
    if (!a.is_array()) return Invalid(name, "must be an array of integers");
    v->reserve(a.size());
    for (const nlohmann::json& x : a) {
      if (!IsInt64(x)) return Invalid(name, "must be an array of int64 integers");
      v->push_back(x.get<int64_t>());
    }
    return absl::OkStatus();
  };
  std::vector<int64_t> values;
  if (absl::Status s = ints(*data, field + ".data", &values); !s.ok()) return s;
  layout->rows = rows;
  layout->k = k;
  std::vector<int64_t> ids;
  auto crow = t.find("sparse_crow_indices");
  auto col = t.find("sparse_col_indices");
  layout->sparse = crow != t.end() && !crow->is_null();
  if (!layout->sparse) {
    if (static_cast<int64_t>(values.size()) != rows * k) {
      return Invalid(field + ".data",
                     absl::StrCat(values.size(), " ids for shape [", rows, ", ", k, "]"));
    }
    ids = std::move(values);
  } else {
    // Sparse: only the listed cells ask; every other is -1 (the SDK's from_torch_sparse with
    // pad_value=-1, as its documentation says to send it).
    if (col == t.end()) return Invalid(field + ".sparse_col_indices", "required with crow");
    if (absl::Status s = ints(*crow, field + ".sparse_crow_indices", &layout->crow); !s.ok()) {
      return s;
    }
    if (absl::Status s = ints(*col, field + ".sparse_col_indices", &layout->col); !s.ok()) {
      return s;
    }
    const int64_t nnz = static_cast<int64_t>(values.size());
    if (static_cast<int64_t>(layout->col.size()) != nnz ||
        static_cast<int64_t>(layout->crow.size()) != rows + 1 || layout->crow.front() != 0 ||
        layout->crow.back() != nnz) {
      return Invalid(
          field, absl::StrCat("sparse CSR: need rows + 1 = ", rows + 1, " row pointers from 0 to ",
                              nnz, " and ", nnz, " column indices, one per id"));
    }
    ids.assign(rows * k, -1);
    if (absl::Status st =
            CheckCsrOrder(layout->crow, layout->col, k, field + ".sparse_crow_indices",
                          field + ".sparse_col_indices");
        !st.ok()) {
      return st;
    }
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t i = layout->crow[r]; i < layout->crow[r + 1]; ++i) {
        ids[r * k + layout->col[i]] = values[i];
      }
    }
  }
  out->set_dtype(v1::INT64);
  out->add_shape(rows);
  out->add_shape(k);
  out->set_data(Packed<int64_t>(ids));
  return absl::OkStatus();
}

absl::Status PromptFromTinker(const nlohmann::json* prompt, v1::ModelInput* out) {
  if (prompt == nullptr) return Invalid("prompt", "required");
  auto chunks = prompt->find("chunks");
  if (chunks == prompt->end() || !chunks->is_array()) {
    return Invalid("prompt.chunks", "must be an array");
  }
  v1::EncodedTextChunk* text = out->add_chunks()->mutable_encoded_text();
  for (size_t i = 0; i < chunks->size(); ++i) {
    const std::string field = absl::StrCat("prompt.chunks[", i, "]");
    const nlohmann::json& c = (*chunks)[i];
    if (!c.is_object()) return Invalid(field, "must be an object");
    Fields f(c);
    const std::string type = f.OptStr("type").value_or("encoded_text");
    if (!f.status().ok()) return Invalid(field, std::string(f.status().message()));
    if (type != "encoded_text") {
      return Invalid(field, absl::StrCat("'", Echo(type),
                                         "' chunks are not supported by this server (text only)"));
    }
    auto tokens = c.find("tokens");
    if (tokens == c.end() || !tokens->is_array()) return Invalid(field + ".tokens", "required");
    for (const nlohmann::json& t : *tokens) {
      if (!IsInt64(t)) return Invalid(field + ".tokens", "must be int64 integers");
      text->add_tokens(t.get<int64_t>());
    }
  }
  return absl::OkStatus();
}

absl::Status SamplingParamsFromTinker(const nlohmann::json* params, v1::SamplingParams* out) {
  if (params == nullptr) return Invalid("sampling_params", "required");
  Fields f(*params);
  const std::optional<int64_t> max_tokens = f.OptInt("max_tokens");
  const std::optional<double> temperature = f.OptNum("temperature");
  const std::optional<int64_t> top_k = f.OptInt("top_k");
  const std::optional<double> top_p = f.OptNum("top_p");
  if (!f.status().ok()) return Invalid("sampling_params", std::string(f.status().message()));
  if (!max_tokens) return Invalid("sampling_params.max_tokens", "required");
  constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
  if (*max_tokens > kInt32Max || (top_k && (*top_k > kInt32Max || *top_k < -kInt32Max))) {
    return Invalid("sampling_params", "max_tokens or top_k out of range");
  }
  out->set_max_tokens(static_cast<int32_t>(std::max<int64_t>(*max_tokens, -1)));
  if (temperature) out->set_temperature(*temperature);
  if (top_k) out->set_top_k(static_cast<int32_t>(*top_k));  // -1 (Tinker): every token, as <= 0
  if (top_p) out->set_top_p(*top_p);
  if (auto seed = params->find("seed"); seed != params->end() && !seed->is_null()) {
    if (seed->is_number_unsigned()) {
      out->set_seed(seed->get<uint64_t>());
    } else if (!seed->is_number_integer()) {
      return Invalid("sampling_params.seed", "must be an integer");
    } else {
      // Python's hash-like seeds may be negative: their two's complement is as good a seed.
      out->set_seed(static_cast<uint64_t>(seed->get<int64_t>()));
    }
  }
  auto stop = params->find("stop");
  if (stop == params->end() || stop->is_null()) return absl::OkStatus();
  // Tinker's forms: a string, a list of strings, or a list of token ids. Strings are matched on
  // the decoded text by the sampler (docs/sampling.md), which refuses them for a model without a
  // tokenizer.
  if (stop->is_string()) {
    out->add_stop_strings(stop->get<std::string>());
    return absl::OkStatus();
  }
  if (!stop->is_array()) {
    return Invalid("sampling_params.stop", "must be a string, a list of strings or token ids");
  }
  // An empty list turns off every stop, the model's end-of-sequence tokens included.
  if (stop->empty()) out->set_ignore_eos(true);
  const bool strings = !stop->empty() && (*stop)[0].is_string();
  for (const nlohmann::json& t : *stop) {
    if (strings) {
      if (!t.is_string()) return Invalid("sampling_params.stop", "mixes strings and token ids");
      out->add_stop_strings(t.get<std::string>());
    } else {
      if (!IsInt64(t)) return Invalid("sampling_params.stop", "must be token ids");
      out->add_stop()->add_tokens(t.get<int64_t>());  // each id stops on its own
    }
  }
  return absl::OkStatus();
}

namespace {

// Whether `body[key]` is set to something other than its off value.
bool IsOn(const nlohmann::json& body, const char* key) {
  auto it = body.find(key);
  if (it == body.end() || it->is_null()) return false;
  if (it->is_boolean()) return it->get<bool>();
  if (it->is_number_integer()) return it->get<int64_t>() != 0;
  return true;  // an object, a string, a float: set
}

}  // namespace

absl::Status RefuseUnservedSampleFields(const nlohmann::json& body) {
  if (!body.is_object()) return absl::OkStatus();
  if (IsOn(body, "record_stability_info")) {
    return Invalid("record_stability_info",
                   "stability records (for stable_reinforce, whose loss Tinker has not published) "
                   "are not kept by this server; sample without them and train with another loss");
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> InflightFromTinker(const nlohmann::json& body) {
  if (!body.is_object()) return false;
  auto kind = body.find("kind");
  if (kind == body.end() || kind->is_null()) return false;
  if (kind->is_string() && kind->get<std::string>() == "snapshot") return false;
  if (kind->is_string() && kind->get<std::string>() == "inflight") return true;
  return Invalid("kind", "must be 'snapshot' or 'inflight'");
}

absl::StatusOr<std::optional<absl::Duration>> TtlFromTinker(const nlohmann::json& body) {
  constexpr int64_t kMin = 3600, kMax = int64_t{10} * 365 * 86400;
  if (!body.is_object()) return std::nullopt;
  auto it = body.find("ttl_seconds");
  if (it == body.end() || it->is_null()) return std::nullopt;
  // Read as the type it was parsed as: values past int64 are out of range, never wrapped.
  const bool in_range =
      it->is_number_unsigned()  ? it->get<uint64_t>() >= kMin && it->get<uint64_t>() <= kMax
      : it->is_number_integer() ? it->get<int64_t>() >= kMin && it->get<int64_t>() <= kMax
                                : false;
  if (!in_range) {
    return Invalid("ttl_seconds",
                   absl::StrCat("must be an integer from ", kMin, " (one hour) to ", kMax,
                                " (ten years), or null for a checkpoint that never expires"));
  }
  return absl::Seconds(it->get<int64_t>());
}

absl::StatusOr<Page> PageFromQuery(absl::string_view query) {
  Page page;
  bool seen_limit = false, seen_offset = false, seen_scope = false;
  for (absl::string_view pair : absl::StrSplit(query, '&', absl::SkipEmpty())) {
    const size_t eq = pair.find('=');
    const absl::string_view key = pair.substr(0, eq);
    const absl::string_view value = eq == pair.npos ? "" : pair.substr(eq + 1);
    bool* seen = key == "limit"          ? &seen_limit
                 : key == "offset"       ? &seen_offset
                 : key == "access_scope" ? &seen_scope
                                         : nullptr;
    if (seen == nullptr) continue;
    if (*seen) return Invalid(std::string(key), "given twice");
    *seen = true;
    if (seen == &seen_scope) {
      if (value != "owned" && value != "accessible") {
        return Invalid("access_scope",
                       absl::StrCat("must be 'owned' or 'accessible', not '", Echo(value), "'"));
      }
      continue;
    }
    // Digits only: SimpleAtoi would also take a sign and surrounding spaces.
    int64_t n = -1;
    const bool digits =
        !value.empty() && absl::c_all_of(value, absl::ascii_isdigit) && absl::SimpleAtoi(value, &n);
    if (seen == &seen_limit) {
      if (!digits || n < 1 || n > kMaxPageLimit) {
        return Invalid("limit", absl::StrCat("must be an integer in [1, ", kMaxPageLimit,
                                             "], not '", Echo(value), "'"));
      }
      page.limit = n;
    } else {
      if (!digits) {
        return Invalid("offset", absl::StrCat("must be an integer >= 0, not '", Echo(value), "'"));
      }
      page.offset = n;
    }
  }
  return page;
}

}  // namespace tinkerd::http
