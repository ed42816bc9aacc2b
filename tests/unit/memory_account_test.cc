// runner/util/memory_account.h: reservations within the capacity, refusals that reserve nothing
// and say what is held, shares given back when a reservation ends or moves; and
// runner/call_memory.h's estimate against the peaks bench/RESULTS.md measured.
#include "runner/util/memory_account.h"

#include <gtest/gtest.h>

#include <string>
#include <utility>

#include "runner/call_memory.h"
#include "runner/model/tiny_model.h"

namespace tinkerd::testing {
namespace {

TEST(MemoryAccount, ReservesWithinItsCapacityAndGivesBackWhatEnds) {
  auto account = MemoryAccount::Create(1000, "--memory_budget_mb");
  absl::StatusOr<Reservation> a = account->Reserve(600, "a model", "");
  ASSERT_TRUE(a.ok());
  const absl::StatusOr<Reservation> b = account->Reserve(401, "a call", "");
  EXPECT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(b.status().message().find("a call needs"), std::string::npos) << b.status();
  EXPECT_NE(b.status().message().find("--memory_budget_mb"), std::string::npos) << b.status();
  EXPECT_EQ(account->reserved(), 600) << "a refusal reserves nothing";
  const absl::StatusOr<Reservation> never = account->Reserve(1001, "a big call", "");
  EXPECT_EQ(never.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(never.status().message().find("more than the server's whole memory budget"),
            std::string::npos)
      << never.status();
  {
    absl::StatusOr<Reservation> c = account->Reserve(400, "a sample", "");
    ASSERT_TRUE(c.ok()) << "exactly the rest fits";
    EXPECT_EQ(account->reserved(), 1000);
    Reservation moved = *std::move(c);
    EXPECT_EQ(moved.bytes(), 400);
    EXPECT_EQ(account->reserved(), 1000) << "a move keeps one share";
  }
  EXPECT_EQ(account->reserved(), 600);
  *a = Reservation();
  EXPECT_EQ(account->reserved(), 0);
}

// A share holds at most its capacity of its parent, and what it holds the parent holds too: a
// flood of one kind of use (HTTP bodies) leaves the rest of the parent to the others.
TEST(MemoryAccount, AShareIsBoundedByItsCapacityAndByItsParent) {
  auto parent = MemoryAccount::Create(1000, "--memory_budget_mb");
  auto share = MemoryAccount::CreateShare(parent, 250, "the quarter for HTTP bodies");
  absl::StatusOr<Reservation> a = share->Reserve(200, "a body", "");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(share->reserved(), 200);
  EXPECT_EQ(parent->reserved(), 200);
  const absl::StatusOr<Reservation> over = share->Reserve(51, "another body", "; retry");
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(
      over.status().message().find("the quarter for HTTP bodies (0.2 KiB) has 0.0 KiB left; retry"),
      std::string::npos)
      << over.status();
  EXPECT_EQ(parent->reserved(), 200) << "the share's refusal took nothing from the parent";
  // The parent full: the share, within its own capacity, is refused by the parent.
  absl::StatusOr<Reservation> models = parent->Reserve(790, "models", "");
  ASSERT_TRUE(models.ok());
  const absl::StatusOr<Reservation> parent_full = share->Reserve(20, "a third body", "");
  EXPECT_EQ(parent_full.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(parent_full.status().message().find("--memory_budget_mb"), std::string::npos)
      << parent_full.status();
  EXPECT_EQ(share->reserved(), 200);
  *a = Reservation();
  EXPECT_EQ(share->reserved(), 0);
  EXPECT_EQ(parent->reserved(), 790) << "a share's release returns the parent's part";
}

// The bench model of RESULTS.md's "Memory against tokens" (hidden 512, 6 layers, vocabulary
// 131,072, float32, LoRA rank 32): one 4,096-token call peaked 2.0 GB above the weights without
// checkpointing and 0.5 GB with it (2,880 and 1,395 MB less about 0.9 GB of weights and pools).
// The estimate must cover both without asking for more than twice as much.
TEST(CallBytes, CoversTheMeasuredPeaksOfTheBenchModel) {
  ModelConfig c = TinyConfig("llama");
  c.hidden_size = 512;
  c.intermediate_size = 1408;
  c.num_hidden_layers = 6;
  c.num_attention_heads = 8;
  c.num_key_value_heads = 4;
  c.head_dim = 64;
  c.vocab_size = 131072;
  CallShape call;
  call.tokens = 4096;
  call.trainable_values = 1794048;  // the bench's LoRA rank 32 on attention and MLP
  const double kMB = 1e6;
  const double off = static_cast<double>(CallBytes(c, call)) / kMB;
  EXPECT_GE(off, 2000.0);
  EXPECT_LE(off, 4000.0);
  call.checkpointing = true;
  const double on = static_cast<double>(CallBytes(c, call)) / kMB;
  EXPECT_GE(on, 500.0);
  EXPECT_LE(on, 1000.0);
  call.backward = false;
  EXPECT_LT(static_cast<double>(CallBytes(c, call)) / kMB, on) << "a forward keeps less";
}

// What a call holds of gathered units beyond the rest of its estimate: a full fine-tune's
// (--shard=full) as float32 weights and, in a backward, their float32 gradients; a sharded base's
// (--shard_base) in bf16 as weights alone, a quarter of that (frozen: no gradient is made).
TEST(CallBytes, CountsAShardedBasesGatheredLayersFrozenInTheirDtype) {
  const ModelConfig c = TinyConfig("llama");
  CallShape call;
  call.tokens = 64;
  call.checkpointing = true;
  const int64_t none = CallBytes(c, call);
  constexpr int64_t kValues = 1 << 20;
  call.gathered_values = kValues;
  EXPECT_EQ(CallBytes(c, call) - none, 8 * kValues) << "full fine-tune, backward";
  call.gathered_bytes = 2;
  call.gathered_frozen = true;
  EXPECT_EQ(CallBytes(c, call) - none, 2 * kValues) << "bf16 base, backward";
  call.backward = false;
  call.gathered_values = 0;
  const int64_t forward = CallBytes(c, call);
  call.gathered_values = kValues;
  EXPECT_EQ(CallBytes(c, call) - forward, 2 * kValues) << "bf16 base, forward";
}

}  // namespace
}  // namespace tinkerd::testing
