// Logging: spdlog with every line tagged by the process's rank. Call InitLogging once in main.
#pragma once

#include <spdlog/spdlog.h>

namespace tinkerd {

// Installs the default logger's pattern "[time] [level] [rank R] message". Safe to call again
// (e.g. after the rank becomes known).
void InitLogging(int rank, spdlog::level::level_enum level = spdlog::level::info);

}  // namespace tinkerd

#define TLOG_DEBUG(...) SPDLOG_DEBUG(__VA_ARGS__)
#define TLOG_INFO(...) ::spdlog::info(__VA_ARGS__)
#define TLOG_WARN(...) ::spdlog::warn(__VA_ARGS__)
#define TLOG_ERROR(...) ::spdlog::error(__VA_ARGS__)
