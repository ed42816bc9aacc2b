// Saves one model's training state to the same checkpoint over and over, until killed. Prints
// "saved" after the first complete save so the test knows when to start shooting.
//   ckpt_saver --model_dir=D --path=P
#include <cstdio>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "runner/model_runner.h"
#include "runner/util/log.h"

ABSL_FLAG(std::string, model_dir, "", "base model");
ABSL_FLAG(std::string, path, "", "checkpoint path");

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  tinkerd::InitLogging(0, spdlog::level::warn);
  tinkerd::RunnerConfig rc;
  rc.base_model_path = absl::GetFlag(FLAGS_model_dir);
  auto runner = tinkerd::ModelRunner::Create(rc);
  if (!runner.ok()) return 1;
  tinkerd::CreateModelOptions o;
  o.lora.reset();  // full fine-tuning: every weight and both moments, so a save takes a while
  auto id = (*runner)->CreateModel(o);
  tinkerd::SaveStateOptions so;
  so.overwrite = true;
  for (int i = 0;; ++i) {
    if (!(*runner)->SaveState(*id, absl::GetFlag(FLAGS_path), so).ok()) return 2;
    if (i == 0) {
      std::printf("saved\n");
      std::fflush(stdout);
    }
  }
}
