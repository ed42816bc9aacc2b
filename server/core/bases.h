// The base models one server serves (--base_model, given once per base), each under the name
// clients give it (create_model's and create_sampling_client's base_model). Each base has its own
// runner: a model lives in the runner of the base it was created on, so every op on a model goes
// to that runner, and a base's samplers sample through its weights. The runners share one memory
// account (RunnerConfig::account). Several bases serve at world size 1 only: the ranks' command
// protocol names no base.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "runner/validate.h"

namespace tinkerd {

class ReplicatedRunner;

// A base model as the edges see it.
struct BaseModel {
  std::string name;          // as clients name it
  std::string tokenizer_id;  // where clients load its tokenizer (get_info); empty: none
  ModelLimits limits;        // what requests on it are checked against
  int index = 0;             // its place among the served bases, 0 the default
};

class Bases {
 public:
  struct Served {
    BaseModel base;
    ReplicatedRunner* runner = nullptr;
  };
  // At least one base; names non-empty and distinct, and no base twice (one fingerprint), else
  // INVALID_ARGUMENT.
  static absl::StatusOr<std::unique_ptr<Bases>> Create(std::vector<Served> served);

  const std::vector<Served>& all() const { return served_; }
  const Served& first() const { return served_.front(); }
  // The base named `name` (empty: the first), or INVALID_ARGUMENT naming `field` and the served
  // names.
  absl::StatusOr<const Served*> Named(absl::string_view name, absl::string_view field) const;
  // The base whose runner holds `model_id`; the first when none does (the op then answers
  // NOT_FOUND for the model, as it would with one base).
  const Served& Of(const std::string& model_id) const;
  // The same, null when no runner holds it.
  const Served* Holding(const std::string& model_id) const;
  // A model was made on `base` / deleted. Kept here rather than asked of the runners, whose lock
  // a running step holds.
  void Created(const std::string& model_id, const BaseModel& base);
  void Deleted(const std::string& model_id);
  // The base a checkpoint or sampler export at `path` (on disk) was made on: the one whose
  // fingerprint its manifest records, else (an export from before merged exports recorded it)
  // the one that holds its model; null when neither says (the first base then tries it, and
  // a load on the wrong base fails naming why). With one base, that base, unread.
  const Served* Made(const std::string& path) const;
  // The scheduler's join group of `kind` for `base`: only one base's calls share a pass.
  static std::string JoinGroup(absl::string_view kind, const BaseModel& base);

 private:
  explicit Bases(std::vector<Served> served) : served_(std::move(served)) {}
  std::vector<Served> served_;
  mutable absl::Mutex mu_;
  std::map<std::string, int> homes_ ABSL_GUARDED_BY(mu_);  // model id -> its base's index
};

}  // namespace tinkerd
