// tinkerctl: model management, and trying a model from the shell, against a running tinkerd.
//   tinkerctl [--target H:P] [--api_key K] [--deadline_ms MS]
//             health | list | create | delete ID | info ID | sample TOKEN,TOKEN,...
// Exit status: 0 success, 1 the call failed (reason on stderr; for health also NOT_SERVING),
// 2 usage error. Flag syntax errors are reported by absl itself, which exits with 1.
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "client/client.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "server address host:port");
ABSL_FLAG(std::string, api_key, "", "sent as x-api-key metadata when set");
ABSL_FLAG(bool, tls, false, "connect with TLS (implied by the --tls_* flags)");
ABSL_FLAG(std::string, tls_ca, "", "PEM root certificates to verify the server (default: system)");
ABSL_FLAG(std::string, tls_cert, "", "PEM client certificate, for a server in mutual-TLS mode");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(int64_t, deadline_ms, 60000, "deadline per attempt, in milliseconds");
ABSL_FLAG(int64_t, lora_rank, 0, "create: LoRA rank (0: server default, 32)");
ABSL_FLAG(double, lora_alpha, 0, "create: LoRA alpha (0: server default, 32)");
ABSL_FLAG(std::string, lora_targets, "attn,mlp,unembed",
          "create: comma list of attn, mlp, unembed");
ABSL_FLAG(bool, full, false, "create: full fine-tuning instead of a LoRA adapter");
ABSL_FLAG(std::string, loss_reduction, "",
          "create: token_mean (default), sum, seq_mean_token_mean, seq_mean_token_sum");
ABSL_FLAG(uint64_t, seed, 0, "create: adapter initialization seed; sample: sampling seed");
ABSL_FLAG(std::string, model, "", "sample: a model's current weights (default: the base model)");
ABSL_FLAG(std::string, sampler, "", "sample: a sampler id (instead of --model)");
ABSL_FLAG(int, max_tokens, 16, "sample: tokens per completion");
ABSL_FLAG(int, num_samples, 1, "sample: completions of the prompt");
ABSL_FLAG(double, temperature, 1.0, "sample: 0 is greedy");

namespace {

namespace v1 = tinkerd::v1;
using tinkerd::client::Connection;

constexpr int kOk = 0, kFailed = 1, kUsage = 2;

int Fail(const absl::Status& status) {
  std::fprintf(stderr, "error: %s\n", status.ToString().c_str());
  return kFailed;
}

int Usage(const std::string& why) {
  std::fprintf(stderr, "%s\nusage: %s\n", why.c_str(),
               std::string(absl::ProgramUsageMessage()).c_str());
  return kUsage;
}

std::string Adapter(const v1::ModelInfo& info) {
  if (!info.is_lora()) return "full fine-tune";
  std::vector<std::string> targets;
  if (info.lora().train_attn()) targets.push_back("attn");
  if (info.lora().train_mlp()) targets.push_back("mlp");
  if (info.lora().train_unembed()) targets.push_back("unembed");
  return absl::StrFormat("LoRA rank %d alpha %g on %s", info.lora().rank(), info.lora().alpha(),
                         targets.empty() ? "nothing" : absl::StrJoin(targets, ","));
}

void PrintInfo(const v1::ModelInfo& m) {
  auto line = [](const char* key, const std::string& value) {
    std::printf("%-20s %s\n", key, value.c_str());
  };
  line("model_id", m.model_id());
  line("base_model", m.base_model());
  line("architecture", m.architecture());
  line("adapter", Adapter(m));
  line("loss_reduction", m.loss_reduction());
  line("step", absl::StrCat(m.step()));
  line("accumulated",
       absl::StrCat(m.accumulated_tokens(), " tokens, ", m.accumulated_sequences(), " sequences"));
  line("skipped_steps", absl::StrCat(m.skipped_steps()));
  line("trainable_params", absl::StrCat(m.trainable_parameters()));
  line("vocab_size", absl::StrCat(m.vocab_size()));
  line("max_context_length", absl::StrCat(m.max_context_length()));
  line("next_seq_id", absl::StrCat(m.next_seq_id()));
}

int Health(Connection& conn) {
  auto serving = conn.Health();
  if (!serving.ok()) return Fail(serving.status());
  std::printf("%s\n", *serving ? "SERVING" : "NOT_SERVING");
  return *serving ? kOk : kFailed;
}

int List(Connection& conn) {
  auto models = conn.ListModels();
  if (!models.ok()) return Fail(models.status());
  std::printf("%-28s %-16s %-40s %8s %10s\n", "MODEL_ID", "ARCHITECTURE", "ADAPTER", "STEP",
              "NEXT_SEQ");
  for (const auto& m : *models) {
    std::printf("%-28s %-16s %-40s %8lld %10lld\n", m.model_id().c_str(), m.architecture().c_str(),
                Adapter(m).c_str(), static_cast<long long>(m.step()),
                static_cast<long long>(m.next_seq_id()));
  }
  return kOk;
}

int Create(Connection& conn) {
  v1::CreateModelRequest request;
  request.set_full_finetune(absl::GetFlag(FLAGS_full));
  request.set_loss_reduction(absl::GetFlag(FLAGS_loss_reduction));
  request.set_seed(absl::GetFlag(FLAGS_seed));
  if (!request.full_finetune()) {
    // Always sent: with the default --lora_targets this equals the server's own default.
    v1::LoraConfig* lora = request.mutable_lora();
    lora->set_rank(absl::GetFlag(FLAGS_lora_rank));
    lora->set_alpha(absl::GetFlag(FLAGS_lora_alpha));
    for (absl::string_view t :
         absl::StrSplit(absl::GetFlag(FLAGS_lora_targets), ',', absl::SkipEmpty())) {
      if (t == "attn")
        lora->set_train_attn(true);
      else if (t == "mlp")
        lora->set_train_mlp(true);
      else if (t == "unembed")
        lora->set_train_unembed(true);
      else
        return Usage(absl::StrCat("unknown --lora_targets entry '", t, "'"));
    }
  } else if (absl::GetFlag(FLAGS_lora_rank) != 0 || absl::GetFlag(FLAGS_lora_alpha) != 0) {
    return Usage("--full trains every weight; --lora_rank/--lora_alpha do not apply");
  }
  auto info = conn.CreateModel(request);
  if (!info.ok()) return Fail(info.status());
  PrintInfo(*info);
  return kOk;
}

int Info(Connection& conn, const std::string& model_id) {
  auto info = conn.GetInfo(model_id);
  if (!info.ok()) return Fail(info.status());
  PrintInfo(*info);
  return kOk;
}

int Delete(Connection& conn, const std::string& model_id) {
  if (auto status = conn.DeleteModel(model_id); !status.ok()) return Fail(status);
  std::printf("deleted %s\n", model_id.c_str());
  return kOk;
}

// The prompt is token ids ("17,4,99"): the server has no tokenizer.
int Sample(Connection& conn, const std::string& prompt) {
  v1::SampleRequest request;
  request.set_model_id(absl::GetFlag(FLAGS_model));
  request.set_sampler_id(absl::GetFlag(FLAGS_sampler));
  v1::EncodedTextChunk* text = request.mutable_prompt()->add_chunks()->mutable_encoded_text();
  for (absl::string_view t : absl::StrSplit(prompt, ',', absl::SkipEmpty())) {
    int64_t token = 0;
    if (!absl::SimpleAtoi(t, &token)) {
      return Usage(absl::StrCat("prompt: '", t, "' is not a token id (give ids like 17,4,99)"));
    }
    text->add_tokens(token);
  }
  request.set_num_samples(absl::GetFlag(FLAGS_num_samples));
  v1::SamplingParams* params = request.mutable_sampling_params();
  params->set_max_tokens(absl::GetFlag(FLAGS_max_tokens));
  params->set_temperature(absl::GetFlag(FLAGS_temperature));
  if (absl::GetFlag(FLAGS_seed) != 0) params->set_seed(absl::GetFlag(FLAGS_seed));
  v1::SampleResponse response;
  absl::Status status = tinkerd::client::CallWithRetry(
      conn.options(),
      [&](grpc::ClientContext& ctx) { return conn.stub().Sample(&ctx, request, &response); });
  if (!status.ok()) return Fail(status);
  for (int i = 0; i < response.sequences_size(); ++i) {
    const v1::SampledSequence& s = response.sequences(i);
    double sum = 0;
    for (double lp : s.logprobs()) sum += lp;
    std::printf("sample %d (%s, logprob %.4f): %s\n", i,
                s.stop_reason() == v1::STOP_REASON_STOP ? "stop" : "length", sum,
                absl::StrJoin(s.tokens(), ",").c_str());
  }
  return kOk;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "tinkerctl [flags] health | list | create [--lora_rank N --lora_alpha A --lora_targets L "
      "--full --loss_reduction MODE --seed S] | delete MODEL_ID | info MODEL_ID | sample "
      "[--model ID | --sampler ID] [--max_tokens N --num_samples N --temperature T --seed S] "
      "TOKEN,TOKEN,...");
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() < 2) return Usage("missing command");
  const std::string command = args[1];
  const size_t operands = args.size() - 2;

  tinkerd::client::ClientOptions options;
  options.target = absl::GetFlag(FLAGS_target);
  options.api_key = absl::GetFlag(FLAGS_api_key);
  options.deadline = std::chrono::milliseconds(absl::GetFlag(FLAGS_deadline_ms));
  const std::string ca = absl::GetFlag(FLAGS_tls_ca), cert = absl::GetFlag(FLAGS_tls_cert),
                    key = absl::GetFlag(FLAGS_tls_key);
  if (absl::GetFlag(FLAGS_tls) || !ca.empty() || !cert.empty() || !key.empty()) {
    if (absl::Status s = tinkerd::client::LoadTlsFiles(ca, cert, key, options); !s.ok()) {
      return Usage(std::string(s.message()));
    }
  }
  auto conn = Connection::Create(options);

  if (command == "health" && operands == 0) return Health(*conn);
  if (command == "list" && operands == 0) return List(*conn);
  if (command == "create" && operands == 0) return Create(*conn);
  if (command == "info" && operands == 1) return Info(*conn, args[2]);
  if (command == "delete" && operands == 1) return Delete(*conn, args[2]);
  if (command == "sample" && operands == 1) return Sample(*conn, args[2]);
  const bool known = command == "health" || command == "list" || command == "create" ||
                     command == "info" || command == "delete" || command == "sample";
  return Usage(known ? absl::StrCat("wrong number of arguments for '", command, "'")
                     : absl::StrCat("unknown command '", command, "'"));
}
