/*
 * core/cpu.h - what the CPU can run, asked once: the vector paths (core/select.c's scoring,
 * core/index_match.c's find_depths) are compiled for AVX2 with target attributes and chosen
 * at run time, so the library runs on any x86-64.
 */
#ifndef KVR_CORE_CPU_H
#define KVR_CORE_CPU_H

#include <stdbool.h>

#if defined(__x86_64__) && defined(__GNUC__)
/* Whether the CPU runs AVX2.  Each file that asks keeps its own answer (racing first calls
 * compute the same one), so a decision pays one relaxed load, not a call. */
static inline bool kvr_cpu_has_avx2(void)
{
	static int have = -1;
	int h = __atomic_load_n(&have, __ATOMIC_RELAXED);
	if (h < 0) {
		__builtin_cpu_init();
		h = __builtin_cpu_supports("avx2") ? 1 : 0;
		__atomic_store_n(&have, h, __ATOMIC_RELAXED);
	}
	return h;
}
#endif

#endif
