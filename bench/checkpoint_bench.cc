// Save and load times of training checkpoints for the embedded default model (LoRA rank 32 and
// full fine-tuning), median of several rounds, written to --dir (default: a temp directory).
//   build/bench/checkpoint_bench --rounds=5
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "runner/model_runner.h"
#include "runner/util/cpu_environment.h"
#include "runner/util/log.h"

ABSL_FLAG(int, rounds, 5, "save/load rounds per configuration");
ABSL_FLAG(std::string, dir, "", "where to write (default: a fresh temp directory)");

int main(int argc, char** argv) {
  tinkerd::PrepareCpuEnvironment(argv);  // first: it may re-execute the program
  absl::ParseCommandLine(argc, argv);
  tinkerd::InitLogging(0, spdlog::level::warn);
  std::string dir = absl::GetFlag(FLAGS_dir);
  if (dir.empty()) dir = (std::filesystem::temp_directory_path() / "tinkerd-ckpt-bench").string();
  std::filesystem::remove_all(dir);
  tinkerd::RunnerConfig rc;
  rc.base_model_path = tinkerd::kEmbeddedDefaultModel;
  auto runner = std::move(*tinkerd::ModelRunner::Create(rc));
  using Clock = std::chrono::steady_clock;
  for (bool full : {false, true}) {
    tinkerd::CreateModelOptions o;
    if (full) o.lora.reset();
    const std::string id = *runner->CreateModel(o);
    const int64_t params = runner->GetInfo(id)->trainable_parameters;
    std::vector<double> save_s, load_s;
    for (int r = 0; r < absl::GetFlag(FLAGS_rounds); ++r) {
      tinkerd::SaveStateOptions so;
      so.overwrite = true;
      auto t0 = Clock::now();
      if (!runner->SaveState(id, dir + "/ckpt", so).ok()) return 1;
      save_s.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
      t0 = Clock::now();
      auto loaded = runner->CreateModelFromState(dir + "/ckpt", true);
      if (!loaded.ok()) return 1;
      load_s.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
      (void)runner->DeleteModel(*loaded);
    }
    std::sort(save_s.begin(), save_s.end());
    std::sort(load_s.begin(), load_s.end());
    uint64_t bytes = 0;
    for (const auto& e : std::filesystem::recursive_directory_iterator(dir)) {
      if (e.is_regular_file()) bytes += e.file_size();
    }
    std::printf(
        "%-22s %9lld trainable params, %7.1f MB on disk: save %.3f s, load %.3f s (median of %d)\n",
        full ? "full fine-tuning" : "LoRA rank 32 (all)", static_cast<long long>(params),
        bytes / 1e6, save_s[save_s.size() / 2], load_s[load_s.size() / 2],
        absl::GetFlag(FLAGS_rounds));
    (void)runner->DeleteModel(id);
    std::filesystem::remove_all(dir);
  }
  return 0;
}
