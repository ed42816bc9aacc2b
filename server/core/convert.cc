#include "server/core/convert.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "runner/loss/loss_spec.h"

namespace tinkerd {
namespace {

// The wire is little-endian; so is every platform this builds on (checked at compile time).
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "wire decoding assumes little-endian");

absl::Status Bad(size_t i, const std::string& key, const std::string& why) {
  return absl::InvalidArgumentError(
      absl::StrCat("data[", i, "].loss_fn_inputs[\"", key, "\"]: ", why));
}

absl::StatusOr<TensorData> TensorFromProto(const v1::Tensor& t, size_t i, const std::string& key) {
  TensorData out;
  size_t esize = 0;
  switch (t.dtype()) {
    case v1::FLOAT32:
      out.dtype = TensorData::DType::kFloat32;
      esize = 4;
      break;
    case v1::INT64:
      out.dtype = TensorData::DType::kInt64;
      esize = 8;
      break;
    default:
      return Bad(i, key, "dtype must be FLOAT32 or INT64");
  }
  if (t.data().size() % esize != 0) {
    return Bad(
        i, key,
        absl::StrCat(t.data().size(), " bytes is not a whole number of ", esize, "-byte elements"));
  }
  const int64_t n = static_cast<int64_t>(t.data().size() / esize);
  int64_t prod = 1;
  for (int64_t d : t.shape()) {
    if (d < 0) return Bad(i, key, "negative dimension in shape");
    if (d != 0 && prod > (int64_t{1} << 40) / d) return Bad(i, key, "shape too large");
    prod *= d;
  }
  if (t.shape_size() > 0 && prod != n) {
    return Bad(i, key, absl::StrCat("shape holds ", prod, " elements but data has ", n));
  }
  out.shape.assign(t.shape().begin(), t.shape().end());
  if (out.shape.empty()) out.shape = {n};
  // An empty vector's data() may be null, and memcpy from or to null is undefined even for zero
  // bytes (found by tests/fuzz/fuzz_request), hence the guard.
  if (n == 0) return out;
  if (out.dtype == TensorData::DType::kFloat32) {
    out.float32_data.resize(n);
    std::memcpy(out.float32_data.data(), t.data().data(), t.data().size());
  } else {
    out.int64_data.resize(n);
    std::memcpy(out.int64_data.data(), t.data().data(), t.data().size());
  }
  return out;
}

}  // namespace

absl::StatusOr<Datum> DatumFromProto(const v1::Datum& d, size_t index) {
  Datum out;
  for (const v1::ModelInputChunk& c : d.model_input().chunks()) {
    if (!c.has_encoded_text()) {
      return absl::InvalidArgumentError(
          absl::StrCat("data[", index, "].model_input: only encoded_text chunks are supported"));
    }
    out.tokens.insert(out.tokens.end(), c.encoded_text().tokens().begin(),
                      c.encoded_text().tokens().end());
  }
  for (const auto& [key, t] : d.loss_fn_inputs()) {
    auto td = TensorFromProto(t, index, key);
    if (!td.ok()) return td.status();
    out.loss_fn_inputs[key] = std::move(*td);
  }
  return out;
}

absl::StatusOr<std::vector<Datum>> DatumsFromProto(
    const google::protobuf::RepeatedPtrField<v1::Datum>& data, size_t first_index) {
  std::vector<Datum> out;
  out.reserve(data.size());
  for (int i = 0; i < data.size(); ++i) {
    auto d = DatumFromProto(data[i], first_index + i);
    if (!d.ok()) return d.status();
    out.push_back(std::move(*d));
  }
  return out;
}

v1::Tensor Float32ToProto(const std::vector<float>& v, const std::vector<int64_t>& shape) {
  v1::Tensor t;
  t.set_dtype(v1::FLOAT32);
  if (shape.empty()) {
    t.add_shape(static_cast<int64_t>(v.size()));
  } else {
    t.mutable_shape()->Add(shape.begin(), shape.end());
  }
  t.set_data(std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float)));
  return t;
}

void TopLogprobsToProto(const TopLogprobs& row, v1::TopkLogprobs* out) {
  for (const auto& [token, logprob] : row) {
    out->add_tokens(token);
    out->add_logprobs(logprob);
  }
}

void ResultToProto(const ForwardBackwardResult& r, v1::ForwardBackwardOutput* out) {
  for (const DatumOutput& o : r.outputs)
    *out->add_outputs()->mutable_logprobs() = Float32ToProto(o.logprobs, o.logprobs_shape);
  for (const auto& [k, v] : r.metrics) (*out->mutable_metrics())[k] = v;
}

void OptimStepToProto(const OptimStepResult& r, v1::OptimStepResponse* out) {
  out->set_grad_norm(r.grad_norm);
  out->set_learning_rate(r.learning_rate);
  out->set_denominator(r.denominator);
  out->set_clipped(r.clipped);
  out->set_skipped(r.skipped);
  out->set_num_tokens(r.num_tokens);
  out->set_num_sequences(r.num_sequences);
  out->set_step(r.step);
  auto& m = *out->mutable_metrics();
  m["grad_norm:mean"] = r.grad_norm;
  m["learning_rate:mean"] = r.learning_rate;
  m["num_tokens:sum"] = static_cast<double>(r.num_tokens);
  m["num_sequences:sum"] = static_cast<double>(r.num_sequences);
  m["clipped:max"] = r.clipped ? 1.0 : 0.0;
  m["skipped:max"] = r.skipped ? 1.0 : 0.0;
}

void InfoToProto(const ModelInfo& info, v1::ModelInfo* out) {
  out->set_model_id(info.model_id);
  out->set_base_model(info.base_model);
  out->set_architecture(info.architecture);
  out->set_is_lora(info.is_lora);
  if (info.is_lora) {
    out->mutable_lora()->set_rank(info.lora.rank);
    out->mutable_lora()->set_alpha(info.lora.alpha);
    out->mutable_lora()->set_train_attn(info.lora.train_attn);
    out->mutable_lora()->set_train_mlp(info.lora.train_mlp);
    out->mutable_lora()->set_train_unembed(info.lora.train_unembed);
  }
  out->set_loss_reduction(std::string(LossReductionName(info.loss_reduction)));
  out->set_step(info.step);
  out->set_accumulated_tokens(info.accumulated_tokens);
  out->set_accumulated_sequences(info.accumulated_sequences);
  out->set_skipped_steps(info.skipped_steps);
  out->set_trainable_parameters(info.trainable_parameters);
  out->set_vocab_size(info.vocab_size);
  out->set_max_context_length(info.max_context_length);
}

AdamParams AdamFromProto(const v1::AdamParams& p) {
  AdamParams a;
  if (p.has_learning_rate()) a.learning_rate = p.learning_rate();
  if (p.has_beta1()) a.beta1 = p.beta1();
  if (p.has_beta2()) a.beta2 = p.beta2();
  if (p.has_eps()) a.eps = p.eps();
  if (p.has_weight_decay()) a.weight_decay = p.weight_decay();
  if (p.has_grad_clip_norm()) a.grad_clip_norm = p.grad_clip_norm();
  return a;
}

absl::StatusOr<CreateModelOptions> CreateOptionsFromProto(const v1::CreateModelRequest& r) {
  CreateModelOptions o;
  auto mode = ParseLossReduction(r.loss_reduction());
  if (!mode.ok()) return mode.status();
  o.loss_reduction = *mode;
  o.seed = r.seed();
  if (r.full_finetune()) {
    o.lora.reset();
  } else if (r.has_lora()) {
    const v1::LoraConfig& l = r.lora();
    o.lora = LoraConfig{l.rank() == 0 ? 32 : l.rank(), l.alpha() == 0 ? 32.0 : l.alpha(),
                        l.train_attn(), l.train_mlp(), l.train_unembed()};
  }
  return o;
}

absl::StatusOr<Batch> BatchFromProto(const google::protobuf::RepeatedPtrField<v1::Datum>& data,
                                     const v1::LossFn& loss_fn, const ModelLimits& limits) {
  absl::StatusOr<ResolvedLoss> loss = ResolveLoss(loss_fn.name(), ConfigFromProto(loss_fn));
  if (!loss.ok()) return loss.status();
  absl::StatusOr<std::vector<Datum>> datums = DatumsFromProto(data);
  if (!datums.ok()) return datums.status();
  return Batch::Check(*std::move(datums), *std::move(loss), limits);
}

std::map<std::string, double> ConfigFromProto(const v1::LossFn& loss) {
  return {loss.config().begin(), loss.config().end()};
}

}  // namespace tinkerd
