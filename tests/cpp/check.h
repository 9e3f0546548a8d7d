// The host tests' one assertion: a failed check names file, line and condition and exits 1.
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
