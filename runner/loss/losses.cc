#include "runner/loss/losses.h"

namespace tinkerd {

LossTokenOutputs PerTokenLoss(const std::string& name, const LossTokenInputs& in,
                              const Config& cfg) {
  if (name == "cross_entropy") return CrossEntropyLoss(in, cfg);
  if (name == "importance_sampling") return ImportanceSamplingLoss(in, cfg);
  if (name == "ppo") return PpoLoss(in, cfg);
  if (name == "cispo") return CispoLoss(in, cfg);
  if (name == "gspo") return GspoLoss(in, cfg);
  return DroLoss(in, cfg);
}

}  // namespace tinkerd
