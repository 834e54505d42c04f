/*
 * core/alloc.c - see alloc.h.  With KVR_HAVE_JEMALLOC the library uses jemalloc's non-standard
 * API (mallocx/sdallocx) on an arena of its own, created once; otherwise the C library.
 */
#include "core/alloc.h"
#include "kvrouter.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#ifdef KVR_HAVE_JEMALLOC
#include <jemalloc/jemalloc.h>
#endif

static uint64_t fail_countdown; /* 0 = never fail */
static int64_t live_bytes;

#ifdef KVR_HAVE_JEMALLOC
static unsigned arena_ind;
static int arena_flags; /* 0 until the arena exists: then MALLOCX_ARENA(arena_ind) */
static pthread_once_t arena_once = PTHREAD_ONCE_INIT;

static void make_arena(void)
{
	size_t sz = sizeof(arena_ind);
	if (mallctl("arenas.create", &arena_ind, &sz, NULL, 0) == 0)
		arena_flags = MALLOCX_ARENA(arena_ind);
}

static inline int flags(void)
{
	pthread_once(&arena_once, make_arena);
	return arena_flags;
}

/* Flags for a free of size bytes: one of 1 KiB or more skips the thread's cache (tcache) and goes
 * back to the arena at once.  jemalloc counts a cached object as allocated and keeps up to
 * hundreds of them per size class and thread: the RCU callback thread, which only frees, parked
 * ~13 B per (block, rank) of runs and segments there (bench_footprint's breakdown).  Small
 * objects, the hot ones, keep the cache. */
#define TCACHE_BYPASS_BYTES 1024

static inline int free_flags(size_t size)
{
	return flags() | (size >= TCACHE_BYPASS_BYTES ? MALLOCX_TCACHE_NONE : 0);
}
#endif

static inline int should_fail(void)
{
	uint64_t c = __atomic_load_n(&fail_countdown, __ATOMIC_RELAXED);
	if (__builtin_expect(c == 0, 1))
		return 0;
	return __atomic_sub_fetch(&fail_countdown, 1, __ATOMIC_RELAXED) == 0;
}

static inline void count(int64_t delta)
{
	__atomic_add_fetch(&live_bytes, delta, __ATOMIC_RELAXED);
}

void *kvr_alloc(size_t size)
{
	if (size == 0)
		size = 1;
	if (should_fail())
		return NULL;
#ifdef KVR_HAVE_JEMALLOC
	void *p = mallocx(size, flags());
#else
	void *p = malloc(size);
#endif
	if (p)
		count((int64_t)size);
	return p;
}

void *kvr_calloc(size_t n, size_t size)
{
	if (size && n > SIZE_MAX / size)
		return NULL;
	size_t total = n * size;
	if (total == 0)
		total = 1;
	if (should_fail())
		return NULL;
#ifdef KVR_HAVE_JEMALLOC
	void *p = mallocx(total, flags() | MALLOCX_ZERO);
#else
	void *p = calloc(1, total);
#endif
	if (p)
		count((int64_t)total);
	return p;
}

void *kvr_alloc_aligned(size_t size)
{
	size_t rounded = (size + 63) & ~(size_t)63;
	if (rounded == 0)
		rounded = 64;
	if (should_fail())
		return NULL;
#ifdef KVR_HAVE_JEMALLOC
	void *p = mallocx(rounded, flags() | MALLOCX_ALIGN(64) | MALLOCX_ZERO);
#else
	void *p = aligned_alloc(64, rounded);
	if (p)
		memset(p, 0, rounded);
#endif
	if (p)
		count((int64_t)size);
	return p;
}

void *kvr_realloc(void *mem, size_t old_size, size_t new_size)
{
	if (!mem)
		return kvr_alloc(new_size);
	if (new_size == 0)
		new_size = 1;
	if (should_fail())
		return NULL;
#ifdef KVR_HAVE_JEMALLOC
	void *p = rallocx(mem, new_size, flags());
#else
	void *p = realloc(mem, new_size);
#endif
	if (p)
		count((int64_t)new_size - (int64_t)(old_size ? old_size : 1));
	return p;
}

size_t kvr_alloc_real_size(size_t size)
{
	if (size == 0)
		return 0;
#ifdef KVR_HAVE_JEMALLOC
	size_t r = nallocx(size, flags());
	return r ? r : size;
#else
	return size;
#endif
}

size_t kvr_alloc_real_size_aligned(size_t size)
{
	if (size == 0)
		return 0;
	size_t rounded = (size + 63) & ~(size_t)63;
#ifdef KVR_HAVE_JEMALLOC
	size_t r = nallocx(rounded, flags() | MALLOCX_ALIGN(64));
	return r ? r : rounded;
#else
	return rounded;
#endif
}

size_t kvr_alloc_discard(void *mem, size_t len)
{
	long p = sysconf(_SC_PAGESIZE); /* glibc: from the auxiliary vector, no system call */
	size_t page = p > 0 ? (size_t)p : 4096;
	uintptr_t a = (uintptr_t)mem, start = (a + page - 1) & ~(uintptr_t)(page - 1);
	uintptr_t end = (a + len) & ~(uintptr_t)(page - 1);
	if (!mem || end <= start)
		return 0;
#ifdef MADV_DONTNEED
	(void)madvise((void *)start, end - start, MADV_DONTNEED);
#endif
	return end - a;
}

void kvr_free(void *mem, size_t size)
{
	if (!mem)
		return;
	count(-(int64_t)(size ? size : 1));
#ifdef KVR_HAVE_JEMALLOC
	sdallocx(mem, size ? size : 1, free_flags(size));
#else
	free(mem);
#endif
}

void kvr_free_aligned(void *mem, size_t size)
{
	if (!mem)
		return;
	count(-(int64_t)size);
#ifdef KVR_HAVE_JEMALLOC
	size_t rounded = (size + 63) & ~(size_t)63;
	sdallocx(mem, rounded ? rounded : 64, free_flags(rounded) | MALLOCX_ALIGN(64));
#else
	free(mem);
#endif
}

void kvr_alloc_fail_after(uint64_t nth)
{
	__atomic_store_n(&fail_countdown, nth, __ATOMIC_RELAXED);
}

uint64_t kvr_alloc_fail_pending(void)
{
	return __atomic_load_n(&fail_countdown, __ATOMIC_RELAXED);
}

int64_t kvr_alloc_live_bytes(void)
{
	return __atomic_load_n(&live_bytes, __ATOMIC_RELAXED);
}

int kvr_grow(void **p, size_t *cap, size_t need, size_t elem)
{
	if (need <= *cap)
		return 0;
	size_t nc = *cap * 2 > need ? *cap * 2 : need;
	if (nc < 16)
		nc = 16;
	void *q = kvr_realloc(*p, *cap * elem, nc * elem);
	if (!q)
		return KVR_ENOMEM;
	*p = q;
	*cap = nc;
	return 0;
}

bool kvr_alloc_arena_bytes(uint64_t *allocated, uint64_t *cached)
{
	*allocated = *cached = 0;
#ifdef KVR_HAVE_JEMALLOC
	if (!flags())
		return false;
	uint64_t epoch = 1;
	size_t sz = sizeof(epoch);
	if (mallctl("epoch", &epoch, &sz, &epoch, sz) != 0)
		return false;
	static const char *const names[] = {"small.allocated", "large.allocated", "tcache_bytes"};
	size_t v[3] = {0};
	for (int i = 0; i < 3; i++) {
		char name[64];
		/* tcache_bytes: every arena's (a cache fills from the arena asked for, but its
		 * bytes count under the thread's own arena). */
		snprintf(name, sizeof(name), "stats.arenas.%u.%s",
		         i == 2 ? (unsigned)MALLCTL_ARENAS_ALL : arena_ind, names[i]);
		sz = sizeof(v[i]);
		if (mallctl(name, &v[i], &sz, NULL, 0) != 0)
			return false;
	}
	*allocated = (uint64_t)v[0] + v[1];
	*cached = v[2];
	return true;
#else
	return false;
#endif
}

void kvr_alloc_purge_idle(uint64_t now_ns)
{
#ifdef KVR_HAVE_JEMALLOC
	static uint64_t last_ns;
	uint64_t last = __atomic_load_n(&last_ns, __ATOMIC_RELAXED);
	if ((last && now_ns - last < KVR_ALLOC_PURGE_GAP_NS) || !flags() ||
	    !__atomic_compare_exchange_n(&last_ns, &last, now_ns ? now_ns : 1, false,
	                                 __ATOMIC_RELAXED, __ATOMIC_RELAXED))
		return;
	char name[48];
	snprintf(name, sizeof(name), "arena.%u.purge", arena_ind);
	(void)mallctl(name, NULL, NULL, NULL, 0);
#else
	(void)now_ns;
#endif
}

void kvr_alloc_flush_thread_cache(void)
{
#ifdef KVR_HAVE_JEMALLOC
	(void)mallctl("thread.tcache.flush", NULL, NULL, NULL, 0);
#endif
}
