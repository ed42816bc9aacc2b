#include "runner/util/log.h"

#include <string>

namespace tinkerd {

void InitLogging(int rank, spdlog::level::level_enum level) {
  spdlog::set_pattern("[%Y-%m-%d %H:%M:%S.%e] [%^%l%$] [rank " + std::to_string(rank) + "] %v");
  spdlog::set_level(level);
}

}  // namespace tinkerd
