// Writes a small random model in Hugging Face layout, e.g.
//   make_tiny_model --out=/tmp/tiny --family=qwen3 --dtype=bfloat16 --shards=2
#include <cstdio>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "runner/model/tiny_model.h"
#include "runner/tokenizer/tiny_tokenizer.h"

ABSL_FLAG(std::string, out, "", "output directory (created)");
ABSL_FLAG(
    std::string, family, "llama",
    "llama, mistral, qwen2, qwen3, qwen2_moe, qwen3_moe, mixtral, or 'demo' for the default model");
ABSL_FLAG(std::string, dtype, "float32", "stored dtype: float32, bfloat16, float16");
ABSL_FLAG(int, shards, 1, "number of safetensors shards");
ABSL_FLAG(uint64_t, seed, 0, "weight seed");
ABSL_FLAG(bool, tokenizer, false,
          "also write a byte-level BPE tokenizer of the model's vocabulary (at least 258 tokens; "
          "runner/tokenizer/tiny_tokenizer.h)");

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const std::string out = absl::GetFlag(FLAGS_out);
  if (out.empty()) {
    std::fprintf(stderr, "make_tiny_model: --out is required\n");
    return 2;
  }
  tinkerd::TinyModelSpec spec;
  const std::string family = absl::GetFlag(FLAGS_family);
  spec.config = family == "demo" ? tinkerd::DefaultDemoConfig() : tinkerd::TinyConfig(family);
  spec.stored_dtype = absl::GetFlag(FLAGS_dtype);
  spec.num_shards = absl::GetFlag(FLAGS_shards);
  spec.seed = absl::GetFlag(FLAGS_seed);
  absl::Status st = tinkerd::WriteTinyModel(out, spec);
  if (st.ok() && absl::GetFlag(FLAGS_tokenizer)) {
    st = tinkerd::WriteTinyTokenizer(out, spec.config.vocab_size);
  }
  if (!st.ok()) {
    std::fprintf(stderr, "make_tiny_model: %s\n", std::string(st.message()).c_str());
    return 1;
  }
  std::printf("wrote %s model to %s\n", spec.config.architecture.c_str(), out.c_str());
  return 0;
}
