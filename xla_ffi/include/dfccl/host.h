// Host helpers both runtimes share: a string hash that is the same in every
// process and build (FNV-1a: signatures, group names and pid spaces compared
// across processes), the names of the runtimes' threads, and the liveness of a
// process of this host.
#pragma once

#include <pthread.h>
#include <signal.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <string_view>

namespace dfccl {

inline uint64_t HashString(std::string_view s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

// Names the calling thread (what `top -H` and /proc/<pid>/task/*/comm show; at
// most 15 characters): the runtimes' threads are "dfccl-..." so a process can
// tell them from XLA's.
inline void NameThisThread(const char* name) { pthread_setname_np(pthread_self(), name); }

// Whether pid (of this host's pid namespace) is a live process; a zombie, or a
// pid <= 0, is not.
inline bool ProcessAlive(int32_t pid) {
  if (pid <= 0) return false;
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", pid);
  FILE* f = std::fopen(path, "r");
  if (!f) return false;
  char buf[512];
  const size_t got = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[got] = 0;
  const char* close = nullptr;  // "pid (comm) S ...": the state follows the last ')'
  for (const char* c = buf; *c; ++c)
    if (*c == ')') close = c;
  return !(close && close[1] == ' ' && (close[2] == 'Z' || close[2] == 'X'));
}

}  // namespace dfccl
