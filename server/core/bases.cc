#include "server/core/bases.h"

#include <set>

#include <nlohmann/json.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "runner/checkpoint/store.h"
#include "runner/model/safetensors.h"
#include "runner/model_runner.h"
#include "runner/util/echo.h"
#include "server/core/replicated_runner.h"

namespace tinkerd {

absl::StatusOr<std::unique_ptr<Bases>> Bases::Create(std::vector<Served> served) {
  if (served.empty()) return absl::InvalidArgumentError("server: no base model to serve");
  std::set<std::string> names;
  std::set<uint64_t> fingerprints;
  for (size_t i = 0; i < served.size(); ++i) {
    Served& s = served[i];
    if (s.base.name.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("server: base model ", i, " has no name"));
    }
    if (!names.insert(s.base.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("server: two base models are served as '", s.base.name, "'"));
    }
    if (!fingerprints.insert(s.runner->local()->base_fingerprint()).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("server: base model '", s.base.name,
                       "' has another base's fingerprint (its config, final norm and first "
                       "embedding rows): the same model twice, or one whose fine-tune left those "
                       "alike; serve it once"));
    }
    if (served.size() > 1 && s.runner->world_size() > 1) {
      return absl::InvalidArgumentError(
          "server: several base models serve in one process only (world size 1)");
    }
    s.base.index = static_cast<int>(i);
  }
  return std::unique_ptr<Bases>(new Bases(std::move(served)));
}

absl::StatusOr<const Bases::Served*> Bases::Named(absl::string_view name,
                                                  absl::string_view field) const {
  if (name.empty()) return &served_.front();
  for (const Served& s : served_) {
    if (s.base.name == name) return &s;
  }
  std::vector<std::string> names;
  for (const Served& s : served_) names.push_back(absl::StrCat("'", s.base.name, "'"));
  return absl::InvalidArgumentError(absl::StrCat(
      field, ": this server serves ", absl::StrJoin(names, ", "), ", not '", Echo(name), "'"));
}

const Bases::Served& Bases::Of(const std::string& model_id) const {
  const Served* s = Holding(model_id);
  return s != nullptr ? *s : served_.front();
}

const Bases::Served* Bases::Holding(const std::string& model_id) const {
  absl::MutexLock lock(&mu_);
  auto it = homes_.find(model_id);
  return it == homes_.end() ? nullptr : &served_[it->second];
}

void Bases::Created(const std::string& model_id, const BaseModel& base) {
  absl::MutexLock lock(&mu_);
  homes_[model_id] = base.index;
}

void Bases::Deleted(const std::string& model_id) {
  absl::MutexLock lock(&mu_);
  homes_.erase(model_id);
}

const Bases::Served* Bases::Made(const std::string& path) const {
  if (served_.size() == 1) return &served_.front();
  const absl::StatusOr<std::string> dir = ResolveCheckpoint(path);
  if (!dir.ok()) return nullptr;
  const absl::StatusOr<std::string> text = ReadFileToString(*dir + "/manifest.json");
  if (!text.ok()) return nullptr;
  const nlohmann::json m = nlohmann::json::parse(*text, nullptr, false);
  if (!m.is_object()) return nullptr;
  uint64_t fingerprint = 0;
  if (auto f = m.find("base_fingerprint");
      f != m.end() && f->is_string() && absl::SimpleAtoi(f->get<std::string>(), &fingerprint)) {
    for (const Served& s : served_) {
      if (s.runner->local()->base_fingerprint() == fingerprint) return &s;
    }
  }
  if (auto id = m.find("model_id"); id != m.end() && id->is_string()) {
    return Holding(id->get<std::string>());
  }
  return nullptr;
}

std::string Bases::JoinGroup(absl::string_view kind, const BaseModel& base) {
  if (base.index == 0) return std::string(kind);
  return absl::StrCat(kind, "@", base.index);
}

}  // namespace tinkerd
