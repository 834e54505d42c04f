/* perf/bench_util.h - the clocks, pinning, sort order and option parsing every benchmark here
 * needs, once.
 * Header-only (static inline): each bench is one program, and perf/meson.build lists one
 * source per program. */
#ifndef KVR_PERF_BENCH_UTIL_H
#define KVR_PERF_BENCH_UTIL_H

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#ifdef KVR_HAVE_JEMALLOC
#include <jemalloc/jemalloc.h>
#endif

/* CLOCK_MONOTONIC in ns: wall time, for latencies and durations. */
static inline uint64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* This thread's CPU time in ns: what a call cost without the time the (shared) machine ran
 * others. */
static inline uint64_t cpu_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Pins the calling thread to cpu (modulo the CPUs online). */
static inline void pin(int cpu)
{
	cpu_set_t set;
	CPU_ZERO(&set);
	long n = sysconf(_SC_NPROCESSORS_ONLN);
	CPU_SET(cpu % (n > 0 ? (int)n : 1), &set);
	pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
}

/* qsort order of uint64_t values, ascending. */
static inline int cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return x < y ? -1 : x > y;
}

/* Options, strictly: an unknown option, a missing value or a value that is not a number in
 * range is an error, exit 2 with a message naming the option. atoi, strtoull and strtod read
 * "abc" as 0 and the loops skipped what they did not know, so a typo ran the defaults without
 * a word (bench_footprint --churn abc ran churn 0). The messages name the program by argv[0]'s
 * last component. */
static inline const char *opt_prog(char **argv)
{
	const char *s = strrchr(argv[0], '/');
	return s ? s + 1 : argv[0];
}

/* Never returns: argv[i] is not an option this program knows. */
static inline _Noreturn void opt_unknown(char **argv, int i)
{
	fprintf(stderr, "%s: unknown option '%s' (see the usage at the top of perf/%s.c)\n",
	        opt_prog(argv), argv[i], opt_prog(argv));
	exit(2);
}

static inline _Noreturn void opt_bad(char **argv, int i, const char *want, const char *v)
{
	fprintf(stderr, "%s: %s needs %s, not '%s'\n", opt_prog(argv), argv[i], want, v);
	exit(2);
}

/* The k-th value of option argv[i] (argv[i + k]), or exit 2 when there is none. */
static inline const char *opt_arg(int argc, char **argv, int i, int k)
{
	if (i + k >= argc) {
		fprintf(stderr, "%s: %s needs %s\n", opt_prog(argv), argv[i],
		        k > 1 ? "more values" : "a value");
		exit(2);
	}
	return argv[i + k];
}

/* The value of option argv[i] (argv[i + 1]), or exit 2 when there is none. */
static inline const char *opt_str(int argc, char **argv, int i)
{
	return opt_arg(argc, argv, i, 1);
}

/* s as a whole decimal number in [lo, hi]; digits only (no sign, space or base prefix:
 * strtoull reads " -1" as 2^64 - 1 and "0x10" as 0). */
static inline int opt_parse_u64(const char *s, uint64_t lo, uint64_t hi, uint64_t *v)
{
	if (!*s || strspn(s, "0123456789") != strlen(s))
		return -1;
	errno = 0;
	unsigned long long x = strtoull(s, NULL, 10);
	if (errno || x < lo || x > hi)
		return -1;
	*v = x;
	return 0;
}

/* Option argv[i]'s k-th value as a whole decimal number in [lo, hi], or exit 2. */
static inline uint64_t opt_arg_u64(int argc, char **argv, int i, int k, uint64_t lo, uint64_t hi)
{
	const char *s = opt_arg(argc, argv, i, k);
	uint64_t v = 0;
	if (opt_parse_u64(s, lo, hi, &v) != 0) {
		char want[96];
		snprintf(want, sizeof(want), "a whole number in %llu..%llu", (unsigned long long)lo,
		         (unsigned long long)hi);
		opt_bad(argv, i, want, s);
	}
	return v;
}

/* Option argv[i]'s value as a whole decimal number in [lo, hi], or exit 2. */
static inline uint64_t opt_u64(int argc, char **argv, int i, uint64_t lo, uint64_t hi)
{
	return opt_arg_u64(argc, argv, i, 1, lo, hi);
}

/* Option argv[i]'s value as a decimal number (a fraction and an exponent allowed; no inf,
 * nan, hex or space) in [lo, hi], or exit 2. */
static inline double opt_f64(int argc, char **argv, int i, double lo, double hi)
{
	const char *s = opt_str(argc, argv, i);
	char *end = NULL;
	double v = NAN;
	if (*s && strspn(s, "0123456789.eE+-") == strlen(s))
		v = strtod(s, &end);
	if (!end || end == s || *end || !(v >= lo && v <= hi)) {
		char want[96];
		snprintf(want, sizeof(want), "a number in %g..%g", lo, hi);
		opt_bad(argv, i, want, s);
	}
	return v;
}

/* Option argv[i]'s value as a comma-separated list of 1..max whole decimal numbers in
 * [lo, hi], into out; returns how many, or exits 2 (an empty item, a bad one or too many). */
static inline size_t opt_list(int argc, char **argv, int i, uint64_t lo, uint64_t hi, uint64_t *out,
                              size_t max)
{
	const char *s = opt_str(argc, argv, i);
	size_t n = 0;
	for (const char *p = s;; p++) {
		const char *comma = strchr(p, ',');
		size_t len = comma ? (size_t)(comma - p) : strlen(p);
		char item[32];
		if (n == max || len == 0 || len >= sizeof(item))
			goto bad;
		memcpy(item, p, len);
		item[len] = 0;
		if (opt_parse_u64(item, lo, hi, &out[n++]) != 0)
			goto bad;
		if (!comma)
			return n;
		p = comma;
	}
bad:;
	char want[128];
	snprintf(want, sizeof(want), "1 to %zu comma-separated whole numbers in %llu..%llu", max,
	         (unsigned long long)lo, (unsigned long long)hi);
	opt_bad(argv, i, want, s);
}

/* Bytes live in jemalloc (all arenas, its statistics refreshed first), or -1 without jemalloc. */
static inline long long bench_jemalloc_allocated(void)
{
#ifdef KVR_HAVE_JEMALLOC
	uint64_t epoch = 1;
	size_t sz = sizeof(epoch);
	mallctl("epoch", &epoch, &sz, &epoch, sz);
	size_t allocated = 0;
	sz = sizeof(allocated);
	if (mallctl("stats.allocated", &allocated, &sz, NULL, 0) == 0)
		return (long long)allocated;
#endif
	return -1;
}

#endif
