// The stream state machine against arbitrary message sequences, on the real server: a header
// (valid, or of an unknown loss) or not first, valid and invalid datums, a second header,
// unparsable bytes, then a half-close or a cancel. Property: a stream changes the model's state
// only when it began with a valid header, carried at least one datum, every message after the
// header was a valid datum, and the client half-closed; it then accumulates exactly what a unary
// forward_backward of the same datums does (a twin model takes those). A seq_id is consumed
// exactly when the first message was a header. Seeded and deterministic; set
// TINKERD_STREAM_SEQUENCES to run more sequences than the default 48.
#include <grpcpp/impl/client_unary_call.h>
#include <grpcpp/support/sync_stream.h>

#include <cstdlib>
#include <thread>

#include "tests/e2e/e2e_util.h"

namespace tinkerd::testing {
namespace {

enum class Message { kHeader, kBadHeader, kDatum, kBadDatum, kGarbage };
enum class End { kHalfClose, kCancel };

struct Sequence {
  std::vector<Message> messages;
  End end = End::kHalfClose;

  bool StartsWithHeader() const {
    return !messages.empty() &&
           (messages[0] == Message::kHeader || messages[0] == Message::kBadHeader);
  }
  // Whether the server must apply it.
  bool Applies() const {
    if (end != End::kHalfClose || messages.size() < 2 || messages[0] != Message::kHeader) {
      return false;
    }
    for (size_t i = 1; i < messages.size(); ++i) {
      if (messages[i] != Message::kDatum) return false;
    }
    return true;
  }
};

// Mostly well-formed streams, so that about a third of them apply.
Sequence Draw(SplitMix64& g) {
  Sequence s;
  const uint64_t first = g.Next() % 10;
  s.messages.push_back(first < 7   ? Message::kHeader
                       : first < 8 ? Message::kBadHeader
                       : first < 9 ? Message::kDatum
                                   : Message::kGarbage);
  const int n = static_cast<int>(g.Next() % 5);
  for (int i = 0; i < n; ++i) {
    const uint64_t k = g.Next() % 32;
    s.messages.push_back(k < 26   ? Message::kDatum
                         : k < 28 ? Message::kBadDatum
                         : k < 30 ? Message::kHeader
                         : k < 31 ? Message::kBadHeader
                                  : Message::kGarbage);
  }
  s.end = g.Next() % 4 == 0 ? End::kCancel : End::kHalfClose;
  return s;
}

std::string Serialized(const v1::StreamForwardBackwardMessage& m) {
  return m.SerializeAsString();
}

grpc::ByteBuffer Bytes(const std::string& s) {
  grpc::Slice slice(s);
  return grpc::ByteBuffer(&slice, 1);
}

TEST(StreamSequences, OnlyCleanlyClosedValidStreamsChangeState) {
  LiveServer live({}, /*micro_batch_tokens=*/8);  // streams run micro-batches while they arrive
  const std::string model = live.CreateModel();
  const std::string twin = live.CreateModel();  // same seed: the same initial state
  const auto initial = live.StateChecksum(model);
  ASSERT_EQ(initial, live.StateChecksum(twin));
  Scheduler* scheduler = live.server->scheduler();
  const char* env = std::getenv("TINKERD_STREAM_SEQUENCES");
  const int count = env != nullptr ? std::atoi(env) : 48;
  SplitMix64 g(2026);
  int64_t seq = 1, twin_seq = 1;
  int applied = 0;
  for (int n = 0; n < count; ++n) {
    const Sequence s = Draw(g);
    SCOPED_TRACE(::testing::Message() << "sequence " << n);
    const auto before = live.StateChecksum(model);
    std::vector<Datum> sent;  // the valid datums, in order
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    grpc::ByteBuffer response;
    std::unique_ptr<grpc::ClientWriter<grpc::ByteBuffer>> writer(
        grpc::internal::ClientWriterFactory<grpc::ByteBuffer>::Create(
            live.channel.get(),
            grpc::internal::RpcMethod("/tinkerd.v1.Tinkerd/StreamForwardBackward",
                                      grpc::internal::RpcMethod::CLIENT_STREAMING),
            &ctx, &response));
    // Drawn in full before any write, so that the sequences do not depend on timing.
    std::vector<std::string> wire;
    for (Message m : s.messages) {
      v1::StreamForwardBackwardMessage msg;
      std::string bytes;
      switch (m) {
        case Message::kHeader:
        case Message::kBadHeader:
          msg.mutable_header()->set_model_id(model);
          msg.mutable_header()->set_seq_id(seq);
          msg.mutable_header()->mutable_loss_fn()->set_name(m == Message::kHeader ? "cross_entropy"
                                                                                  : "no_such_loss");
          bytes = Serialized(msg);
          break;
        case Message::kDatum:
        case Message::kBadDatum: {
          Datum d = RandomData(g, {static_cast<int>(3 + g.Next() % 5)}, "cross_entropy", 128)[0];
          if (m == Message::kBadDatum) d.tokens[0] = 1 << 20;  // outside the vocabulary
          if (m == Message::kDatum) sent.push_back(d);
          *msg.mutable_datum() = ToProto(d);
          bytes = Serialized(msg);
          break;
        }
        case Message::kGarbage:
          bytes = "\x12\x7f\x01";  // a datum of 127 bytes, cut after one
          break;
      }
      wire.push_back(std::move(bytes));
    }
    for (const std::string& bytes : wire) {
      // A write fails once the server has answered (say, after a bad first message); the
      // stream's outcome is then already decided.
      if (!writer->Write(Bytes(bytes))) break;
    }
    if (s.end == End::kCancel) {
      // Cancel once the server has taken the header (when there is one to take): the cancel
      // then races only with the server's reading of the datums, which must never matter.
      if (s.StartsWithHeader()) {
        WaitFor([&] { return scheduler->Used(model, seq); }, "the stream's header");
      }
      ctx.TryCancel();
    } else {
      writer->WritesDone();
    }
    const grpc::Status st = writer->Finish();
    WaitFor([&] { return scheduler->QueueDepth() == 0; }, "the stream's end");
    if (s.StartsWithHeader()) ++seq;
    ASSERT_EQ(live.Info(model).next_seq_id(), seq);
    if (s.Applies()) {
      ASSERT_TRUE(st.ok()) << st.error_message();
      v1::ForwardBackwardOutput out;
      ASSERT_TRUE(
          grpc::SerializationTraits<v1::ForwardBackwardOutput>::Deserialize(&response, &out).ok());
      EXPECT_EQ(out.outputs_size(), static_cast<int>(sent.size()));
      EXPECT_NE(live.StateChecksum(model), before) << "a valid stream changed nothing";
      v1::ForwardBackwardOutput twin_out;
      ASSERT_TRUE(live.FwdBwd(MakeRequest(twin, twin_seq++, sent), &twin_out).ok());
      ++applied;
    } else {
      EXPECT_FALSE(st.ok());
      ASSERT_EQ(live.StateChecksum(model), before) << "an incomplete or invalid stream applied";
    }
  }
  EXPECT_GT(applied, 0);  // both kinds occurred (about a third apply)
  EXPECT_LT(applied, count);
  // The streams accumulated what the unary calls did, up to the grouping of float64 sums
  // (micro-batches of 8 tokens against one call): relative 1e-12 on O(1) values, so 1e-9.
  const auto got = live.StateChecksum(model), want = live.StateChecksum(twin);
  ASSERT_EQ(got.size(), want.size());
  EXPECT_LT(MaxAbsDiff(got, want), 1e-9);
  EXPECT_GT(MaxAbsDiff(got, initial), 1e-6);  // and they did accumulate something
}

}  // namespace
}  // namespace tinkerd::testing
