#include "server/http/tinker_convert.h"
#include "server/http/json_fields.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"

namespace tinkerd::http {
namespace {

template <typename T>
std::string Bytes(const std::vector<T>& v) {
  std::string s(v.size() * sizeof(T), '\0');
  if (!v.empty()) std::memcpy(s.data(), v.data(), s.size());
  return s;
}

template <typename T>
std::vector<T> Elements(const std::string& s) {
  std::vector<T> v(s.size() / sizeof(T));
  if (!v.empty()) std::memcpy(v.data(), s.data(), v.size() * sizeof(T));
  return v;
}

tinker_public::Tensor Dense(tinker_public::DType dtype, std::string bytes,
                            std::vector<int64_t> shape = {}) {
  tinker_public::Tensor t;
  t.set_dtype(dtype);
  t.set_dense(std::move(bytes));
  for (int64_t d : shape) t.add_shape(d);
  return t;
}

// A sparse CSR tensor as the SDK's TensorData.from_torch_sparse writes it: int64 row pointers and
// column indices, values in the tensor's dtype, the dense shape.
tinker_public::Tensor Csr(tinker_public::DType dtype, std::vector<int64_t> shape,
                          const std::vector<int64_t>& crow, const std::vector<int64_t>& col,
                          const std::vector<float>& values) {
  tinker_public::Tensor t;
  t.set_dtype(dtype);
  for (int64_t d : shape) t.add_shape(d);
  t.mutable_sparse_csr()->set_crow_indices(Bytes(crow));
  t.mutable_sparse_csr()->set_col_indices(Bytes(col));
  if (dtype == tinker_public::DTYPE_INT64) {
    t.mutable_sparse_csr()->set_values(Bytes(std::vector<int64_t>(values.begin(), values.end())));
  } else {
    t.mutable_sparse_csr()->set_values(Bytes(values));
  }
  return t;
}

// A well-formed two-datum cross_entropy request: tokens [10, 11, 12] then [13, 14].
tinker_public::ForwardBackwardRequest GoodRequest() {
  tinker_public::ForwardBackwardRequest r;
  r.set_model_id("s:train:0");
  r.set_seq_id(1);
  r.set_loss_fn("cross_entropy");
  for (int i = 0; i < 2; ++i) {
    tinker_public::Datum* d = r.add_data();
    std::vector<int32_t> toks =
        i == 0 ? std::vector<int32_t>{10, 11, 12} : std::vector<int32_t>{13, 14};
    d->add_model_input()->mutable_encoded_text()->set_tokens(Bytes(toks));
    std::vector<int64_t> targets(toks.begin(), toks.end());
    for (int64_t& t : targets) ++t;
    (*d->mutable_loss_fn_inputs())["target_tokens"] =
        Dense(tinker_public::DTYPE_INT64, Bytes(targets), {static_cast<int64_t>(targets.size())});
    (*d->mutable_loss_fn_inputs())["weights"] =
        Dense(tinker_public::DTYPE_FLOAT32, Bytes(std::vector<float>(toks.size(), 1.0f)));
  }
  return r;
}

TEST(TinkerConvert, TokensWidenFromInt32ToInt64) {
  tinker_public::ForwardBackwardRequest r = GoodRequest();
  const std::vector<int32_t> toks = {0, 1, 70000, std::numeric_limits<int32_t>::max(), -1};
  r.mutable_data(0)->mutable_model_input(0)->mutable_encoded_text()->set_tokens(Bytes(toks));
  // A second chunk stays a second chunk.
  r.mutable_data(0)->add_model_input()->mutable_encoded_text()->set_tokens(
      Bytes(std::vector<int32_t>{42}));
  auto out = FwdBwdFromTinker(&r);
  ASSERT_TRUE(out.ok()) << out.status();
  const v1::ModelInput& mi = out->request.data(0).model_input();
  ASSERT_EQ(mi.chunks_size(), 2);
  EXPECT_EQ(std::vector<int64_t>(mi.chunks(0).encoded_text().tokens().begin(),
                                 mi.chunks(0).encoded_text().tokens().end()),
            (std::vector<int64_t>{0, 1, 70000, 2147483647, -1}));
  EXPECT_EQ(std::vector<int64_t>(mi.chunks(1).encoded_text().tokens().begin(),
                                 mi.chunks(1).encoded_text().tokens().end()),
            (std::vector<int64_t>{42}));
  EXPECT_EQ(out->request.data(1).model_input().chunks(0).encoded_text().tokens_size(), 2);
  // model_id and seq_id are the caller's to set.
  EXPECT_EQ(out->request.model_id(), "");
  EXPECT_EQ(out->request.seq_id(), 0);
}

TEST(TinkerConvert, DenseFloat32AndInt64PassThrough) {
  tinker_public::ForwardBackwardRequest r = GoodRequest();
  auto out = FwdBwdFromTinker(&r);
  ASSERT_TRUE(out.ok()) << out.status();
  const v1::Tensor& targets = out->request.data(0).loss_fn_inputs().at("target_tokens");
  EXPECT_EQ(targets.dtype(), v1::INT64);
  EXPECT_EQ(Elements<int64_t>(targets.data()), (std::vector<int64_t>{11, 12, 13}));
  EXPECT_EQ(std::vector<int64_t>(targets.shape().begin(), targets.shape().end()),
            (std::vector<int64_t>{3}));
  const v1::Tensor& weights = out->request.data(1).loss_fn_inputs().at("weights");
  EXPECT_EQ(weights.dtype(), v1::FLOAT32);
  EXPECT_EQ(Elements<float>(weights.data()), (std::vector<float>{1.0f, 1.0f}));
  EXPECT_EQ(weights.shape_size(), 0);  // no shape given: stays 1-D implied
}

TEST(TinkerConvert, Int32WidensToInt64) {
  tinker_public::ForwardBackwardRequest r = GoodRequest();
  const std::vector<int32_t> v = {std::numeric_limits<int32_t>::min(), -1, 0,
                                  std::numeric_limits<int32_t>::max()};
  (*r.mutable_data(0)->mutable_loss_fn_inputs())["target_tokens"] =
      Dense(tinker_public::DTYPE_INT32, Bytes(v), {2, 2});
  auto out = FwdBwdFromTinker(&r);
  ASSERT_TRUE(out.ok()) << out.status();
  const v1::Tensor& t = out->request.data(0).loss_fn_inputs().at("target_tokens");
  EXPECT_EQ(t.dtype(), v1::INT64);
  EXPECT_EQ(Elements<int64_t>(t.data()),
            (std::vector<int64_t>{-2147483648LL, -1, 0, 2147483647LL}));
  EXPECT_EQ(std::vector<int64_t>(t.shape().begin(), t.shape().end()), (std::vector<int64_t>{2, 2}));
}

TEST(TinkerConvert, Bfloat16WidensToFloat32Exactly) {
  tinker_public::ForwardBackwardRequest r = GoodRequest();
  // bf16 bit patterns: 1.0, -2.0, 0.375, -0.0, +inf, 2^-133 (the smallest subnormal).
  const std::vector<uint16_t> bf16 = {0x3F80, 0xC000, 0x3EC0, 0x8000, 0x7F80, 0x0001};
  (*r.mutable_data(0)->mutable_loss_fn_inputs())["weights"] =
      Dense(tinker_public::DTYPE_BFLOAT16, Bytes(bf16), {6});
  auto out = FwdBwdFromTinker(&r);
  ASSERT_TRUE(out.ok()) << out.status();
  const v1::Tensor& t = out->request.data(0).loss_fn_inputs().at("weights");
  EXPECT_EQ(t.dtype(), v1::FLOAT32);
  const std::vector<float> f = Elements<float>(t.data());
  ASSERT_EQ(f.size(), 6u);
  EXPECT_EQ(f[0], 1.0f);
  EXPECT_EQ(f[1], -2.0f);
  EXPECT_EQ(f[2], 0.375f);
  EXPECT_EQ(f[3], 0.0f);
  EXPECT_TRUE(std::signbit(f[3]));
  EXPECT_EQ(f[4], std::numeric_limits<float>::infinity());
  EXPECT_EQ(f[5], std::ldexp(1.0f, -133));
}

TEST(TinkerConvert, LossConfigAndForwardOnly) {
  tinker_public::ForwardBackwardRequest r = GoodRequest();
  r.set_loss_fn("ppo");
  (*r.mutable_loss_fn_config())["clip_low_threshold"] = 0.8;
  (*r.mutable_loss_fn_config())["clip_high_threshold"] = 1.2;
  auto out = FwdBwdFromTinker(&r);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_FALSE(out->forward_only);
  EXPECT_EQ(out->request.loss_fn().name(), "ppo");
  EXPECT_EQ(out->request.loss_fn().config().size(), 2u);
  EXPECT_EQ(out->request.loss_fn().config().at("clip_low_threshold"), 0.8);
  EXPECT_EQ(out->request.loss_fn().config().at("clip_high_threshold"), 1.2);

  tinker_public::ForwardBackwardRequest fwd = GoodRequest();
  fwd.set_forward_only(true);
  auto out2 = FwdBwdFromTinker(&fwd);
  ASSERT_TRUE(out2.ok()) << out2.status();
  EXPECT_TRUE(out2->forward_only);
}

// SDK 0.38 writes every config value to loss_fn_config_v2 as well, and text values only there:
// v2 wins over the legacy map, and a text value (which no loss of tinkerd's takes) is refused
// naming its key rather than dropped.
TEST(TinkerConvert, LossConfigV2IsPreferredAndTextValuesAreRefused) {
  tinker_public::ForwardBackwardRequest r = GoodRequest();
  r.set_loss_fn("ppo");
  (*r.mutable_loss_fn_config())["clip_low_threshold"] = 0.8;
  (*r.mutable_loss_fn_config_v2())["clip_low_threshold"].set_number(0.7);
  (*r.mutable_loss_fn_config_v2())["clip_high_threshold"].set_number(1.3);
  auto out = FwdBwdFromTinker(&r);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->request.loss_fn().config().size(), 2u);
  EXPECT_EQ(out->request.loss_fn().config().at("clip_low_threshold"), 0.7);
  EXPECT_EQ(out->request.loss_fn().config().at("clip_high_threshold"), 1.3);

  tinker_public::ForwardBackwardRequest text = GoodRequest();
  text.set_loss_fn("ppo");
  (*text.mutable_loss_fn_config_v2())["clip_mode"].set_text("token");
  auto refused = FwdBwdFromTinker(&text);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(refused.status().message(),
            "loss_fn_config[\"clip_mode\"]: ppo takes numbers only, got the text 'token'");

  tinker_public::ForwardBackwardRequest unset = GoodRequest();
  (*unset.mutable_loss_fn_config_v2())["x"];
  EXPECT_EQ(FwdBwdFromTinker(&unset).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(TinkerConvert, EmptyTensorsAreAcceptedWithoutData) {
  tinker_public::ForwardBackwardRequest r = GoodRequest();
  (*r.mutable_data(0)->mutable_loss_fn_inputs())["a"] = Dense(tinker_public::DTYPE_INT32, "", {0});
  (*r.mutable_data(0)->mutable_loss_fn_inputs())["b"] = Dense(tinker_public::DTYPE_BFLOAT16, "");
  tinker_public::Tensor no_encoding;  // neither dense nor sparse_csr set
  no_encoding.set_dtype(tinker_public::DTYPE_FLOAT32);
  (*r.mutable_data(0)->mutable_loss_fn_inputs())["c"] = no_encoding;
  r.mutable_data(1)->mutable_model_input(0)->mutable_encoded_text()->clear_tokens();
  auto out = FwdBwdFromTinker(&r);
  ASSERT_TRUE(out.ok()) << out.status();
  for (const char* key : {"a", "b", "c"}) {
    EXPECT_EQ(out->request.data(0).loss_fn_inputs().at(key).data(), "") << key;
  }
  EXPECT_EQ(out->request.data(0).loss_fn_inputs().at("a").dtype(), v1::INT64);
  EXPECT_EQ(out->request.data(1).model_input().chunks(0).encoded_text().tokens_size(), 0);
}

TEST(TinkerConvert, EachRefusalNamesFieldAndReason) {
  using Req = tinker_public::ForwardBackwardRequest;
  auto input = [](Req& r, int i, const char* key) -> tinker_public::Tensor& {
    return (*r.mutable_data(i)->mutable_loss_fn_inputs())[key];
  };
  struct Case {
    std::string expect;  // the whole message
    std::function<void(Req&)> mutate;
  };
  const std::vector<Case> cases = {
      {"data[1].model_input[1]: image chunks are not supported by this server",
       [](Req& r) { r.mutable_data(1)->add_model_input()->mutable_image()->set_format("png"); }},
      {"data[0].model_input[0]: audio (dmel) chunks are not supported by this server",
       [](Req& r) { r.mutable_data(0)->mutable_model_input(0)->mutable_dmel()->set_dmel("x"); }},
      {"data[0].model_input[1]: empty chunk (none of encoded_text, image, dmel is set)",
       [](Req& r) { r.mutable_data(0)->add_model_input(); }},
      {"data[1].model_input[0]: 7 bytes of tokens is not a whole number of INT32 tokens",
       [](Req& r) {
         r.mutable_data(1)->mutable_model_input(0)->mutable_encoded_text()->set_tokens("1234567");
       }},
      {"data[0].loss_fn_inputs[\"weights\"]: 7 bytes is not a whole number of FLOAT32 elements",
       [&](Req& r) { input(r, 0, "weights").set_dense("1234567"); }},
      {"data[1].loss_fn_inputs[\"target_tokens\"]: 12 bytes is not a whole number of INT64 "
       "elements",
       [&](Req& r) { input(r, 1, "target_tokens").set_dense(std::string(12, '\0')); }},
      {"data[0].loss_fn_inputs[\"w\"]: 3 bytes is not a whole number of BFLOAT16 elements",
       [&](Req& r) { input(r, 0, "w") = Dense(tinker_public::DTYPE_BFLOAT16, "abc"); }},
      {"data[0].loss_fn_inputs[\"w\"]: 6 bytes is not a whole number of INT32 elements",
       [&](Req& r) { input(r, 0, "w") = Dense(tinker_public::DTYPE_INT32, "abcdef"); }},
      {"data[0].loss_fn_inputs[\"weights\"]: dtype is not set",
       [&](Req& r) { input(r, 0, "weights").set_dtype(tinker_public::DTYPE_UNSPECIFIED); }},
      {"data[0].loss_fn_inputs[\"weights\"]: unknown dtype 9",
       [&](Req& r) { input(r, 0, "weights").set_dtype(static_cast<tinker_public::DType>(9)); }},
      {"data[1].loss_fn_inputs[\"weights\"]: a sparse (CSR) tensor needs its 2-D dense shape, "
       "got 0 dimensions",
       [&](Req& r) {
         input(r, 1, "weights") = Csr(tinker_public::DTYPE_FLOAT32, {}, {0}, {}, {});
       }},
      {"data[1].loss_fn_inputs[\"weights\"].sparse_csr.crow_indices: must hold rows + 1 = 3 "
       "pointers from 0 to 1",
       [&](Req& r) {
         input(r, 1, "weights") = Csr(tinker_public::DTYPE_FLOAT32, {2, 3}, {0, 1}, {0}, {1.0f});
       }},
      {"data[1].loss_fn_inputs[\"weights\"].sparse_csr.crow_indices: row 1 ends (1) before it "
       "starts (2)",
       [&](Req& r) {
         input(r, 1, "weights") = Csr(tinker_public::DTYPE_FLOAT32, {2, 3}, {0, 2, 1}, {0}, {1.0f});
       }},
      {"data[1].loss_fn_inputs[\"weights\"].sparse_csr.col_indices: row 1: column 3 is outside "
       "[0, 3) or not after the row's previous column",
       [&](Req& r) {
         input(r, 1, "weights") = Csr(tinker_public::DTYPE_FLOAT32, {2, 3}, {0, 0, 1}, {3}, {1.0f});
       }},
      {"data[1].loss_fn_inputs[\"weights\"].sparse_csr.col_indices: row 0: column 1 is outside "
       "[0, 3) or not after the row's previous column",
       [&](Req& r) {
         input(r, 1, "weights") =
             Csr(tinker_public::DTYPE_FLOAT32, {2, 3}, {0, 2, 2}, {1, 1}, {1.0f, 2.0f});
       }},
      {"data[1].loss_fn_inputs[\"weights\"].sparse_csr: 2 column indices for 1 values",
       [&](Req& r) {
         input(r, 1, "weights") =
             Csr(tinker_public::DTYPE_FLOAT32, {2, 3}, {0, 1, 1}, {0, 1}, {1.0f});
       }},
      // A few bytes standing for 2^40 dense bytes: refused before anything is allocated.
      {"data[0].loss_fn_inputs[\"weights\"]: sparse shape [1048576, 262144] densifies to more "
       "than the request may hold (268435456 bytes left of the body limit)",
       [&](Req& r) {
         input(r, 0, "weights") =
             Csr(tinker_public::DTYPE_FLOAT32, {int64_t{1} << 20, int64_t{1} << 18}, {0}, {}, {});
       }},
      {"data[0].loss_fn_inputs[\"target_tokens\"]: shape [2] holds 2 elements but the data has 3",
       [&](Req& r) { input(r, 0, "target_tokens").set_shape(0, 2); }},
      {"data[0].loss_fn_inputs[\"target_tokens\"]: shape[1] is negative (-3)",
       [&](Req& r) { input(r, 0, "target_tokens").add_shape(-3); }},
      {"data[0].loss_fn_inputs[\"w\"]: shape [4294967296, 4294967296, 4294967296] holds more "
       "than 2^40 elements",
       [&](Req& r) {
         input(r, 0, "w") = Dense(tinker_public::DTYPE_FLOAT32, "",
                                  {int64_t{1} << 32, int64_t{1} << 32, int64_t{1} << 32});
       }},
      // The product would wrap to 0 in 64 bits (2^32 * 2^32) and match the empty data.
      {"data[0].loss_fn_inputs[\"w\"]: shape [4294967296, 4294967296] holds more than 2^40 "
       "elements",
       [&](Req& r) {
         input(r, 0, "w") =
             Dense(tinker_public::DTYPE_FLOAT32, "", {int64_t{1} << 32, int64_t{1} << 32});
       }},
      {"data[0].loss_fn_inputs[\"c\"]: shape [1] holds 1 elements but the data has 0",
       [&](Req& r) {
         tinker_public::Tensor& t = input(r, 0, "c");
         t.set_dtype(tinker_public::DTYPE_FLOAT32);
         t.add_shape(1);
       }},
  };
  for (const Case& c : cases) {
    Req r = GoodRequest();
    c.mutate(r);
    auto out = FwdBwdFromTinker(&r);
    ASSERT_FALSE(out.ok()) << c.expect;
    EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument) << c.expect;
    EXPECT_EQ(out.status().message(), c.expect);
  }
}

// [T, K] targets and weights as the SDK's Datum sends them when sparse is smaller: CSR with the
// zero entries left out, densified with 0 in each.
TEST(TinkerConvert, SparseTopKInputsDensify) {
  tinker_public::ForwardBackwardRequest r = GoodRequest();
  auto& in = *r.mutable_data(0)->mutable_loss_fn_inputs();
  // Dense [[0, 0], [5, 0], [7, 9]] and weights [[0, 0], [0.25, 0], [0.5, 0.25]].
  in["target_tokens"] = Csr(tinker_public::DTYPE_INT64, {3, 2}, {0, 0, 1, 3}, {0, 0, 1}, {5, 7, 9});
  in["weights"] =
      Csr(tinker_public::DTYPE_FLOAT32, {3, 2}, {0, 0, 1, 3}, {0, 0, 1}, {0.25f, 0.5f, 0.25f});
  auto out = FwdBwdFromTinker(&r);
  ASSERT_TRUE(out.ok()) << out.status();
  const v1::Tensor& t = out->request.data(0).loss_fn_inputs().at("target_tokens");
  EXPECT_EQ(t.dtype(), v1::INT64);
  EXPECT_EQ(std::vector<int64_t>(t.shape().begin(), t.shape().end()), (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(Elements<int64_t>(t.data()), (std::vector<int64_t>{0, 0, 5, 0, 7, 9}));
  const v1::Tensor& w = out->request.data(0).loss_fn_inputs().at("weights");
  EXPECT_EQ(Elements<float>(w.data()), (std::vector<float>{0, 0, 0.25f, 0, 0.5f, 0.25f}));

  // The budget is the whole request's: two 24-byte dense tensors fit in 48 bytes, not in 47.
  tinker_public::ForwardBackwardRequest again = GoodRequest();
  (*again.mutable_data(0)->mutable_loss_fn_inputs())["target_tokens"] =
      Csr(tinker_public::DTYPE_INT64, {3, 1}, {0, 1, 1, 1}, {0}, {5});
  (*again.mutable_data(0)->mutable_loss_fn_inputs())["weights"] =
      Csr(tinker_public::DTYPE_FLOAT32, {3, 2}, {0, 1, 1, 1}, {0}, {1.0f});
  tinker_public::ForwardBackwardRequest tight = again;
  EXPECT_TRUE(FwdBwdFromTinker(&again, 48).ok());
  EXPECT_EQ(FwdBwdFromTinker(&tight, 47).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(TinkerConvert, SeveralBadInputsReportTheFirstKeyInSortedOrder) {
  tinker_public::ForwardBackwardRequest r = GoodRequest();
  (*r.mutable_data(0)->mutable_loss_fn_inputs())["zz"] = Dense(tinker_public::DTYPE_FLOAT32, "x");
  (*r.mutable_data(0)->mutable_loss_fn_inputs())["aa"] = Dense(tinker_public::DTYPE_FLOAT32, "x");
  auto out = FwdBwdFromTinker(&r);
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().message(),
            "data[0].loss_fn_inputs[\"aa\"]: 1 bytes is not a whole number of FLOAT32 elements");
}

// Bytes the real Tinker SDK 0.25.0 put on the wire, produced by (in a venv with
// `pip install tinker==0.25.0`):
//   d0 = types.Datum(model_input=types.ModelInput.from_ints([1, 70000, 3]),
//       loss_fn_inputs={"target_tokens": [70000, 3, 4], "logprobs": [-1.5, -0.25, -2.0],
//                       "advantages": [1.0, 0.0, -0.5]})
//   d1 = types.Datum(model_input=types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[5]),
//                                                     types.EncodedTextChunk(tokens=[6, 7])]),
//       loss_fn_inputs={"target_tokens": [6, 7, 8], "logprobs": [-0.5] * 3,
//                       "advantages": [2.0] * 3})
//   req = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(
//       data=[d0, d1], loss_fn="ppo",
//       loss_fn_config={"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
//       model_id="s1:train:0", seq_id=3)
//   msg = tinker.proto.request_conv.forward_backward_request_to_proto(req)
//   msg.forward_only = True  # as tinker/resources/training.py does for forward()
//   print(msg.SerializeToString().hex())
TEST(TinkerConvert, DecodesBytesFromTheRealSdk) {
  const std::string wire = absl::HexStringToBytes(
      "0a0a73313a747261696e3a3010031a88010a100a0e0a0c01000000701101000300000012210a0a616476616e"
      "746167657312130a0c0000803f00000000000000bf1801220103121f0a086c6f6770726f627312130a0c0000"
      "c0bf000080be000000c0180122010312300a0d7461726765745f746f6b656e73121f0a187011010000000000"
      "0300000000000000040000000000000018022201031a8e010a080a060a04050000000a0c0a0a0a0806000000"
      "0700000012210a0a616476616e746167657312130a0c0000004000000040000000401801220103121f0a086c"
      "6f6770726f627312130a0c000000bf000000bf000000bf180122010312300a0d7461726765745f746f6b656e"
      "73121f0a180600000000000000070000000000000008000000000000001802220103220370706f2a1e0a1363"
      "6c69705f686967685f7468726573686f6c6411333333333333f33f2a1d0a12636c69705f6c6f775f74687265"
      "73686f6c64119a9999999999e93f3001");
  tinker_public::ForwardBackwardRequest r;
  ASSERT_TRUE(r.ParseFromString(wire));
  EXPECT_EQ(r.model_id(), "s1:train:0");
  EXPECT_EQ(r.seq_id(), 3);
  auto out = FwdBwdFromTinker(&r);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_TRUE(out->forward_only);
  EXPECT_EQ(out->request.loss_fn().name(), "ppo");
  EXPECT_EQ(out->request.loss_fn().config().at("clip_low_threshold"), 0.8);
  EXPECT_EQ(out->request.loss_fn().config().at("clip_high_threshold"), 1.2);
  ASSERT_EQ(out->request.data_size(), 2);

  auto tokens = [](const v1::Datum& d) {
    std::vector<std::vector<int64_t>> chunks;
    for (const v1::ModelInputChunk& c : d.model_input().chunks()) {
      chunks.emplace_back(c.encoded_text().tokens().begin(), c.encoded_text().tokens().end());
    }
    return chunks;
  };
  const v1::Datum& d0 = out->request.data(0);
  const v1::Datum& d1 = out->request.data(1);
  EXPECT_EQ(tokens(d0), (std::vector<std::vector<int64_t>>{{1, 70000, 3}}));
  EXPECT_EQ(tokens(d1), (std::vector<std::vector<int64_t>>{{5}, {6, 7}}));

  const v1::Tensor& targets = d0.loss_fn_inputs().at("target_tokens");
  EXPECT_EQ(targets.dtype(), v1::INT64);
  EXPECT_EQ(Elements<int64_t>(targets.data()), (std::vector<int64_t>{70000, 3, 4}));
  EXPECT_EQ(std::vector<int64_t>(targets.shape().begin(), targets.shape().end()),
            (std::vector<int64_t>{3}));
  const v1::Tensor& logprobs = d0.loss_fn_inputs().at("logprobs");
  EXPECT_EQ(logprobs.dtype(), v1::FLOAT32);
  EXPECT_EQ(Elements<float>(logprobs.data()), (std::vector<float>{-1.5f, -0.25f, -2.0f}));
  EXPECT_EQ(Elements<float>(d0.loss_fn_inputs().at("advantages").data()),
            (std::vector<float>{1.0f, 0.0f, -0.5f}));
  EXPECT_EQ(Elements<int64_t>(d1.loss_fn_inputs().at("target_tokens").data()),
            (std::vector<int64_t>{6, 7, 8}));
  EXPECT_EQ(Elements<float>(d1.loss_fn_inputs().at("advantages").data()),
            (std::vector<float>{2.0f, 2.0f, 2.0f}));
}

v1::ForwardBackwardOutput OutputOfLengths(const std::vector<int>& lengths) {
  v1::ForwardBackwardOutput in;
  float next = -0.5f;
  for (int n : lengths) {
    std::vector<float> lp;
    for (int k = 0; k < n; ++k, next -= 0.5f) lp.push_back(next);
    v1::Tensor* t = in.add_outputs()->mutable_logprobs();
    t->set_dtype(v1::FLOAT32);
    t->add_shape(n);
    t->set_data(Bytes(lp));
  }
  return in;
}

TEST(TinkerConvert, OutputBatchesLogprobsWithByteOffsets) {
  v1::ForwardBackwardOutput in = OutputOfLengths({0, 2, 5});
  (*in.mutable_metrics())["loss:sum"] = 12.5;
  (*in.mutable_metrics())["num_tokens:sum"] = 7;
  tinker_public::ForwardBackwardOutput out;
  out.set_loss_fn_output_type("stale");  // overwritten, not merged
  FwdBwdOutputToTinker(in, "cross_entropy", &out);

  EXPECT_EQ(out.loss_fn_output_type(), "ArrayRecord");
  ASSERT_EQ(out.loss_fn_outputs_size(), 1);
  const tinker_public::ArrayRecord& rec = out.loss_fn_outputs(0);
  EXPECT_EQ(rec.type_tag(), "ArrayRecord");
  EXPECT_EQ(rec.num_datums(), 3);
  ASSERT_EQ(rec.fields().size(), 1u);
  const tinker_public::BatchedTensor& lp = rec.fields().at("logprobs");
  EXPECT_EQ(lp.dtype(), tinker_public::DTYPE_FLOAT32);
  EXPECT_EQ(lp.trailing_shape_size(), 0);
  EXPECT_EQ(Elements<int64_t>(lp.offsets()), (std::vector<int64_t>{0, 0, 8, 28}));
  EXPECT_EQ(Elements<float>(lp.data()),
            (std::vector<float>{-0.5f, -1.0f, -1.5f, -2.0f, -2.5f, -3.0f, -3.5f}));
  ASSERT_EQ(out.metrics().size(), 2u);
  EXPECT_EQ(out.metrics().at("loss:sum"), 12.5);
  EXPECT_EQ(out.metrics().at("num_tokens:sum"), 7.0);
}

// Top-K targets: each datum's logprobs are [T, K], which the SDK rebuilds from trailing_shape.
TEST(TinkerConvert, TopKOutputCarriesItsTrailingShape) {
  v1::ForwardBackwardOutput in;
  for (int64_t T : {1, 2}) {
    v1::Tensor* t = in.add_outputs()->mutable_logprobs();
    t->set_dtype(v1::FLOAT32);
    t->add_shape(T);
    t->add_shape(3);
    t->set_data(Bytes(std::vector<float>(T * 3, -1.0f)));
  }
  tinker_public::ForwardBackwardOutput out;
  FwdBwdOutputToTinker(in, "cross_entropy", &out);
  const tinker_public::BatchedTensor& lp = out.loss_fn_outputs(0).fields().at("logprobs");
  EXPECT_EQ(std::vector<int64_t>(lp.trailing_shape().begin(), lp.trailing_shape().end()),
            std::vector<int64_t>{3});
  EXPECT_EQ(Elements<int64_t>(lp.offsets()), (std::vector<int64_t>{0, 12, 36}));
}

TEST(TinkerConvert, OutputOfNoDatums) {
  tinker_public::ForwardBackwardOutput out;
  FwdBwdOutputToTinker(v1::ForwardBackwardOutput(), "ppo", &out);
  ASSERT_EQ(out.loss_fn_outputs_size(), 1);
  EXPECT_EQ(out.loss_fn_outputs(0).num_datums(), 0);
  EXPECT_EQ(Elements<int64_t>(out.loss_fn_outputs(0).fields().at("logprobs").offsets()),
            (std::vector<int64_t>{0}));
  EXPECT_EQ(out.loss_fn_outputs(0).fields().at("logprobs").data(), "");
}

// Tinker's stop forms: a string, strings, ids; [] turns off every stop, EOS included; a mixed
// list is refused naming the field.
TEST(TinkerConvert, StopFormsOfSamplingParams) {
  auto convert = [](const char* json, v1::SamplingParams* out) {
    const nlohmann::json params = nlohmann::json::parse(json);
    return SamplingParamsFromTinker(&params, out);
  };
  v1::SamplingParams one, many, ids, none, off, mixed;
  ASSERT_TRUE(convert(R"({"max_tokens": 4, "stop": "\n\nUser:"})", &one).ok());
  EXPECT_EQ(std::vector<std::string>(one.stop_strings().begin(), one.stop_strings().end()),
            std::vector<std::string>{"\n\nUser:"});
  EXPECT_FALSE(one.ignore_eos());
  ASSERT_TRUE(convert(R"({"max_tokens": 4, "stop": ["a", "bc"]})", &many).ok());
  EXPECT_EQ(many.stop_strings_size(), 2);
  EXPECT_EQ(many.stop_size(), 0);
  ASSERT_TRUE(convert(R"({"max_tokens": 4, "stop": [5, 7]})", &ids).ok());
  EXPECT_EQ(ids.stop_size(), 2);
  EXPECT_EQ(ids.stop(1).tokens(0), 7);
  EXPECT_FALSE(ids.ignore_eos());
  ASSERT_TRUE(convert(R"({"max_tokens": 4})", &none).ok());
  EXPECT_FALSE(none.ignore_eos());
  ASSERT_TRUE(convert(R"({"max_tokens": 4, "stop": []})", &off).ok());
  EXPECT_TRUE(off.ignore_eos());
  EXPECT_EQ(off.stop_size() + off.stop_strings_size(), 0);
  const absl::Status st = convert(R"({"max_tokens": 4, "stop": ["a", 5]})", &mixed);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("sampling_params.stop"), absl::string_view::npos) << st.message();
}

TEST(TinkerConvert, APageIsReadFromTheQueryAndEachBadValueIsNamed) {
  auto page = PageFromQuery("access_scope=owned&limit=20&offset=40");
  ASSERT_TRUE(page.ok()) << page.status();
  EXPECT_EQ(page->offset, 40);
  EXPECT_EQ(page->limit, 20);
  page = PageFromQuery("");
  ASSERT_TRUE(page.ok());
  EXPECT_EQ(page->offset, 0);
  EXPECT_FALSE(page->limit.has_value());  // every item
  EXPECT_EQ(PageFromQuery("limit=1000")->limit, kMaxPageLimit);
  EXPECT_TRUE(PageFromQuery("access_scope=accessible&other=x&limit=1").ok());
  for (const auto& [query, field] : std::vector<std::pair<std::string, std::string>>{
           {"limit=0", "limit: "},
           {"limit=1001", "limit: "},
           {"limit=", "limit: "},
           {"limit=2x", "limit: "},
           {"limit=99999999999999999999", "limit: "},
           {"offset=-1", "offset: "},
           {"offset", "offset: "},
           {"offset=1&offset=2", "offset: given twice"},
           {"offset=+1", "offset: "},
           {"access_scope=all", "access_scope: "},
           {"access_scope=owned&access_scope=owned", "access_scope: given twice"},
       }) {
    auto bad = PageFromQuery(query);
    ASSERT_FALSE(bad.ok()) << query;
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << query;
    EXPECT_EQ(bad.status().message().substr(0, field.size()), field) << bad.status();
  }
}

// SDK 0.38's target_prompt_logprobs: dense ids, or sparse CSR whose unlisted cells ask nothing
// (-1); the answer comes back in the request's layout, 0 where nothing was asked.
TEST(TinkerConvert, TargetPromptLogprobsBothLayouts) {
  v1::Tensor dense_ids;
  TargetLayout dense;
  ASSERT_TRUE(TargetPromptFromTinker(nlohmann::json::parse(
                                         R"({"data": [4, -1, 6, 7], "dtype": "int64",
                                             "shape": [2, 2]})"),
                                     8, 20, &dense_ids, &dense)
                  .ok());
  EXPECT_FALSE(dense.sparse);
  EXPECT_EQ(std::vector<int64_t>(dense_ids.shape().begin(), dense_ids.shape().end()),
            (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(Elements<int64_t>(dense_ids.data()), (std::vector<int64_t>{4, -1, 6, 7}));

  v1::Tensor sparse_ids;
  TargetLayout sparse;
  ASSERT_TRUE(TargetPromptFromTinker(nlohmann::json::parse(
                                         R"({"data": [9, 5], "dtype": "int64", "shape": [3, 2],
                                             "sparse_crow_indices": [0, 0, 2, 2],
                                             "sparse_col_indices": [0, 1]})"),
                                     8, 20, &sparse_ids, &sparse)
                  .ok());
  EXPECT_TRUE(sparse.sparse);
  EXPECT_EQ(Elements<int64_t>(sparse_ids.data()), (std::vector<int64_t>{-1, -1, 9, 5, -1, -1}));

  // The sampler's answer: [rows, K] with NaN where nothing was asked.
  v1::SampleResponse in;
  in.add_sequences()->add_tokens(3);
  for (double v : std::vector<double>{-1.0, NAN, -2.0, -3.0}) in.add_target_prompt_logprobs(v);
  SampleAnswer asked;
  asked.target = dense;
  tinker_public::SampleResponse out;
  SampleResponseToTinker(in, asked, &out);
  ASSERT_TRUE(out.has_target_prompt_logprobs());
  EXPECT_EQ(Elements<float>(out.target_prompt_logprobs().dense()),
            (std::vector<float>{-1.0f, 0.0f, -2.0f, -3.0f}));

  v1::SampleResponse in3;
  in3.add_sequences();
  for (double v : std::vector<double>{NAN, NAN, -4.0, -5.0, NAN, NAN}) {
    in3.add_target_prompt_logprobs(v);
  }
  asked.target = sparse;
  tinker_public::SampleResponse out3;
  SampleResponseToTinker(in3, asked, &out3);
  const tinker_public::Tensor& t = out3.target_prompt_logprobs();
  ASSERT_TRUE(t.has_sparse_csr());
  EXPECT_EQ(Elements<float>(t.sparse_csr().values()), (std::vector<float>{-4.0f, -5.0f}));
  EXPECT_EQ(Elements<int64_t>(t.sparse_csr().crow_indices()), (std::vector<int64_t>{0, 0, 2, 2}));
  EXPECT_EQ(Elements<int64_t>(t.sparse_csr().col_indices()), (std::vector<int64_t>{0, 1}));

  struct Case {
    const char* json;
    const char* expect;
  };
  const Case bad[] = {
      {R"({"data": [1.5], "dtype": "float32", "shape": [1, 1]})",
       "target_prompt_logprobs.dtype: must be 'int64' (token ids)"},
      {R"({"data": [1], "dtype": "int64", "shape": [1]})",
       "target_prompt_logprobs.shape: must be [len(prompt) - 1, K]"},
      {R"({"data": [], "dtype": "int64", "shape": [9, 1]})",
       "target_prompt_logprobs.shape: rows must be len(prompt) - 1, in [1, 8], got 9"},
      {R"({"data": [], "dtype": "int64", "shape": [2, 21]})",
       "target_prompt_logprobs.shape: K must be in [1, 20], got 21"},
      {R"({"data": [1, 2, 3], "dtype": "int64", "shape": [2, 2]})",
       "target_prompt_logprobs.data: 3 ids for shape [2, 2]"},
      {R"({"data": [1], "dtype": "int64", "shape": [2, 2], "sparse_crow_indices": [0, 1, 1],
          "sparse_col_indices": [2]})",
       "target_prompt_logprobs.sparse_col_indices: row 0: column 2 is outside [0, 2) or not "
       "after the row's previous column"},
      {R"({"data": [1], "dtype": "int64", "shape": [2, 2], "sparse_crow_indices": [0, 1],
          "sparse_col_indices": [0]})",
       "target_prompt_logprobs: sparse CSR: need rows + 1 = 3 row pointers from 0 to 1 and 1 "
       "column indices, one per id"},
  };
  for (const Case& c : bad) {
    v1::Tensor ids;
    TargetLayout layout;
    const absl::Status st =
        TargetPromptFromTinker(nlohmann::json::parse(c.json), 8, 20, &ids, &layout);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << c.expect;
    EXPECT_EQ(st.message(), c.expect);
  }
}

// A sample's top-k rows come back as its topk_sampled_logprobs, padded to k with the SDK's empty
// slot (token 0, logprob -99999).
TEST(TinkerConvert, TopkSampledLogprobs) {
  v1::SampleResponse in;
  v1::SampledSequence* s = in.add_sequences();
  s->add_tokens(7);
  s->add_tokens(8);
  s->add_logprobs(-0.5);
  s->add_logprobs(-0.25);
  for (int i = 0; i < 2; ++i) {
    v1::TopkLogprobs* row = s->add_topk_logprobs();
    row->add_tokens(7 + i);
    row->add_logprobs(-0.5 / (i + 1));
    if (i == 0) {
      row->add_tokens(3);
      row->add_logprobs(-2.0);
    }
  }
  SampleAnswer asked;
  asked.topk_sample_logprobs = 2;
  tinker_public::SampleResponse out;
  SampleResponseToTinker(in, asked, &out);
  const tinker_public::TopkLogprobs& t = out.sequences(0).topk_sampled_logprobs();
  EXPECT_EQ(t.k(), 2u);
  EXPECT_EQ(t.length(), 2u);
  EXPECT_EQ(Elements<int32_t>(t.token_ids()), (std::vector<int32_t>{7, 3, 8, 0}));
  EXPECT_EQ(Elements<float>(t.logprobs()), (std::vector<float>{-0.5f, -2.0f, -0.25f, -99999.0f}));
  SampleAnswer none;
  tinker_public::SampleResponse plain;
  SampleResponseToTinker(in, none, &plain);
  EXPECT_FALSE(plain.sequences(0).has_topk_sampled_logprobs());
}

}  // namespace
}  // namespace tinkerd::http
