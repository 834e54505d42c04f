/*
 * examples/check.h - how the examples check what README.md and kvrouter.h say a call does: a
 * failed CHECK prints where, why and the thread's kvr_last_error(), and counts; each example
 * exits 1 if any failed.  Not part of what README.md shows.
 */
#ifndef KVR_EXAMPLES_CHECK_H
#define KVR_EXAMPLES_CHECK_H

#include <stdio.h>

#include <kvrouter.h>

static int fails;
#define CHECK(c, ...)                                                                              \
	do {                                                                                       \
		if (!(c)) {                                                                        \
			fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);                       \
			fprintf(stderr, __VA_ARGS__);                                              \
			fprintf(stderr, " (last error: %s)\n", kvr_last_error());                  \
			fails++;                                                                   \
		}                                                                                  \
	} while (0)

#endif
