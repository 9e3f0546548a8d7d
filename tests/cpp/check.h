// The host tests' assertions: CHECK, a failed check names file, line and condition and exits 1;
// Expect, a failed expectation names what it expected and the test goes on (it returns
// Failures() != 0 at the end).
#pragma once

#include <cstdio>
#include <cstdlib>

#define CHECK(c)                                                                 \
  do {                                                                           \
    if (!(c)) {                                                                  \
      std::fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #c); \
      std::exit(1);                                                              \
    }                                                                            \
  } while (0)

inline int& Failures() {
  static int n = 0;
  return n;
}

inline void Expect(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "expectation failed: %s\n", what);
    Failures()++;
  }
}
