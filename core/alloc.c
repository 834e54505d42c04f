/*
 * core/alloc.c - see alloc.h.  With KVR_HAVE_JEMALLOC, and jemalloc in the process (below), the
 * library uses jemalloc's non-standard API (mallocx/sdallocx) on two arenas of its own, created
 * once; otherwise the C library.
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
/* Weak: libkvrouter.so does not depend on libjemalloc.so.2, so that it can be loaded with
 * dlopen (plugins, FFI): Debian's jemalloc keeps 2.6 KiB of thread-locals in the initial-exec
 * model, more than glibc's reserve of static TLS for libraries loaded after startup, and a
 * dlopen of anything that needs it fails ("cannot allocate memory in static TLS block").  The
 * library uses jemalloc when the process has it in its global scope (linked into the executable,
 * as `pkg-config --libs kvrouter` does, or preloaded), else the C library (kvr_alloc_name).  The
 * choice is made once, at the first allocation, and never changes. */
#pragma weak mallocx
#pragma weak rallocx
#pragma weak sdallocx
#pragma weak nallocx
#pragma weak mallctl
#endif

enum { LONG, TRANSIENT }; /* the arenas (alloc.h) */

static uint64_t fail_countdown;       /* 0 = never fail */
static int fail_persist;              /* the armed failure is followed by failures until disarmed */
static unsigned fail_roles;           /* kvr_alloc_fail_scope: 0 = every thread counts */
static __thread unsigned thread_role; /* kvr_alloc_thread_role */
static int64_t live_bytes;

#ifdef KVR_HAVE_JEMALLOC
/* The two arenas (alloc.h).  Why two, and why neither uses the threads' own caches:
 *
 * jemalloc serves every small size class from slabs (a few pages cut into equal regions) and
 * frees a slab only when all its regions are free.  The router's long-lived objects (index
 * runs, segment hash arrays: 48 B to 14 KiB, sized by the prompts) die in eviction order, and
 * the same size classes are used by short-lived ones (a request's attempt record, its pinned
 * runs, a posted copy of output tokens) whose numbers swing with the load: when the lanes back
 * up, hundreds of records are in flight, fill fresh slabs, and every long-lived array allocated
 * meanwhile pins one of those slabs after the burst is freed.  bench_footprint --bins (8 ranks,
 * 2k prompts) found slabs of the 320-1,280 B classes a third full and 18-26 B per (block, rank)
 * of such waste; in an arena of their own the long-lived objects leave 4 B.
 *
 * A thread's automatic cache (tcache) is shared by every arena the thread allocates from: an
 * object freed into it is handed to the next request of its size class whatever arena that one
 * asked for (jemalloc's MALLOCX_ARENA "has no effect for regions that were allocated via an
 * arena other than the one specified"), so cached frees would carry the embedder's objects and
 * transient ones into the long-lived arena and back.  So the library never uses it
 * (MALLOCX_TCACHE_NONE: each call takes the arena bin's lock, ~150 instructions more); a thread
 * that allocates and frees library objects all the time (a shard) asks for caches of its own,
 * one per arena (jemalloc's explicit tcaches: kvr_alloc_thread_cache_begin), which only ever
 * hold that arena's objects.  Frees of 1 KiB or more skip even those: a thread that mostly
 * frees a class (a shard freeing the frontends' attempt records) would park hundreds. */
static unsigned arena_ind[2];
static int arena_flags[2]; /* 0 until the arenas exist: then MALLOCX_ARENA(arena_ind[k]) */
static pthread_once_t arena_once = PTHREAD_ONCE_INIT;
static bool je_on; /* jemalloc's API is in the process (the weak references above resolved) */
/* The calling thread's explicit caches: MALLOCX_TCACHE(index) per arena, or 0 (none). */
static __thread int thread_tc[2];
static __thread unsigned thread_tc_ind[2];

/* Large allocations (past the last small size class) are asked page-aligned.  jemalloc's
 * default "cache-oblivious" placement gives every large allocation one page more than its size
 * class and starts it at a random cache line of the first page, so the data runs into that extra
 * page: 4 KiB more resident per live large allocation (the predicted caches' heaps, segment
 * arrays and maps, the index's tables: 57 of them at 8 ranks).  Page-aligned, the allocation
 * starts at the extent's first page and the extra page stays untouched.  What the randomness
 * buys (the arrays' first lines spread over cache sets) is nothing for arrays probed at random
 * offsets.  large_align: MALLOCX_ALIGN(page), 0 until make_arenas ran or without the stats
 * (then nothing changes); large_min: the first size that is large. */
static int large_align;
static size_t large_min = SIZE_MAX;

static void find_large(void)
{
	unsigned nbins = 0;
	size_t page = 0, small_max = 0, sz = sizeof(nbins);
	if (mallctl("arenas.nbins", &nbins, &sz, NULL, 0) != 0 || nbins == 0)
		return;
	char name[48];
	snprintf(name, sizeof(name), "arenas.bin.%u.size", nbins - 1);
	sz = sizeof(small_max);
	if (mallctl(name, &small_max, &sz, NULL, 0) != 0)
		return;
	sz = sizeof(page);
	if (mallctl("arenas.page", &page, &sz, NULL, 0) != 0 || page == 0 || (page & (page - 1)))
		return;
	large_min = small_max + 1;
	large_align = MALLOCX_ALIGN(page);
}

/* The alignment flag for an allocation of size bytes: the page for a large one, else 0. */
static inline int big(size_t size)
{
	return size >= large_min ? large_align : 0;
}

/* The size the long-lived arena is asked for, for size bytes: above 256 B and below the large
 * sizes, the next of two classes per doubling (3/4 of a power of two, or the power: 384, 512,
 * 768, 1,024, ..., 12 KiB), instead of jemalloc's four.
 *
 * Why.  A small size class is served from slabs of one to seven pages, and a slab is given back
 * only when all its regions are free.  The long-lived objects (index runs and holder sets, 48 B
 * to 12 KiB, sized by the prompts) die in eviction order, so every class in use keeps some
 * slabs partly used: bench_footprint --bins (8 ranks x 2k prompts) found 3.0-4.6 B per (block,
 * rank) of such waste over ~30 classes, the seven-page ones (448, 896, 1,792 B ...) and
 * five-page ones (320, 640, 1,280 B ...) the worst, and a class with a handful of live objects
 * holds a whole slab.  The classes kept have slabs of one or three pages, and half as many of
 * them are in use.  What it costs is the rounding: an object takes up to half again its size, a
 * fifth on average, where jemalloc's classes give up to a quarter.  Measured (bench_footprint
 * --bins, 8 ranks, alternated with jemalloc's classes, 3 runs): slab waste 3.6-3.8 -> 2.3-2.7 B
 * per pair at 2k prompts, 2.8-3.5 -> 1.5-1.9 at 32k.  Rounding from 64 B up took 0.7 B more off
 * at 2k but made the index's own objects 7-17 % larger (bench_index_runs --mem-only: 16-block
 * runs 14.6 -> 15.6 B per held block, one-block runs 92 -> 108), where the small classes' slabs
 * are well filled anyway: up to 256 B jemalloc's classes stay.  The transient arena keeps them too:
 * its objects are all freed within a request, so no slab stays pinned.  The rounding is the same on
 * every path (alloc, free, realloc, real size), so sized frees name the class they have. */
#define LONG_CLASS_MIN 256
static inline size_t long_class(size_t size)
{
	if (size <= LONG_CLASS_MIN || size >= large_min)
		return size;
	size_t pow = (size_t)1 << (64 - __builtin_clzll(size - 1));
	size_t r = size <= pow / 4 * 3 ? pow / 4 * 3 : pow;
	return r >= large_min ? size : r; /* a large size keeps jemalloc's (page) classes */
}

/* What arena k is asked for when the caller asks size bytes. */
static inline size_t ask(int k, size_t size)
{
	return k == LONG ? long_class(size) : size;
}

static void make_arenas(void)
{
	unsigned ind[2];
	je_on = mallocx && rallocx && sdallocx && nallocx && mallctl;
	if (!je_on)
		return;
	find_large();
	for (int k = 0; k < 2; k++) {
		size_t sz = sizeof(ind[k]);
		if (mallctl("arenas.create", &ind[k], &sz, NULL, 0) != 0)
			return; /* both stay 0: the default arenas */
	}
	for (int k = 0; k < 2; k++) {
		arena_ind[k] = ind[k];
		arena_flags[k] = MALLOCX_ARENA(ind[k]);
	}
}

/* Whether the library allocates from jemalloc (else the C library); decided at the first call. */
static inline bool je(void)
{
	pthread_once(&arena_once, make_arenas);
	return je_on;
}

/* The flags of an allocation from arena k (LONG, TRANSIENT).  Context: after je() (which
 * makes the arenas, once). */
static inline int flags(int k)
{
	if (!arena_flags[k])
		return 0;
	return arena_flags[k] | (thread_tc[k] ? thread_tc[k] : MALLOCX_TCACHE_NONE);
}

#define TCACHE_BYPASS_BYTES 1024

/* Flags for a free of size bytes from arena k. */
static inline int free_flags(int k, size_t size)
{
	int f = flags(k);
	return size >= TCACHE_BYPASS_BYTES && f ? arena_flags[k] | MALLOCX_TCACHE_NONE : f;
}
#endif

static inline int should_fail(void)
{
	uint64_t c = __atomic_load_n(&fail_countdown, __ATOMIC_RELAXED);
	if (__builtin_expect(c == 0, 1))
		return 0;
	/* Armed: read again with acquire (pairs with the arm's release store; not a fence, which
	 * ThreadSanitizer does not model), so the scope stored before the arm is seen. */
	c = __atomic_load_n(&fail_countdown, __ATOMIC_ACQUIRE);
	unsigned roles = __atomic_load_n(&fail_roles, __ATOMIC_RELAXED);
	if (roles && !(thread_role & roles))
		return 0; /* out of scope: neither counted nor failed */
	/* Counted down only while still armed: two threads that both read 1 took it below 0
	 * with a plain decrement (it wrapped to 2^64 - 1), so the failure that fired read as
	 * still pending (kvr_alloc_fail_pending) and an OOM loop stopped as if it had passed
	 * untouched (test_replica_oom, whose other threads allocate meanwhile). */
	while (c && !__atomic_compare_exchange_n(&fail_countdown, &c, c - 1, true, __ATOMIC_RELAXED,
	                                         __ATOMIC_RELAXED))
		;
	if (c != 1)
		return 0;
	if (__atomic_load_n(&fail_persist, __ATOMIC_RELAXED))
		__atomic_store_n(&fail_countdown, 1, __ATOMIC_RELAXED); /* the next one fails too */
	return 1;
}

static inline void count(int64_t delta)
{
	__atomic_add_fetch(&live_bytes, delta, __ATOMIC_RELAXED);
}

/* size bytes (at least 1) from arena k, zeroed if zero. */
static void *alloc_in(int k, size_t size, bool zero)
{
	if (size == 0)
		size = 1;
	if (should_fail())
		return NULL;
	void *p;
	(void)k; /* the arena: jemalloc's only */
#ifdef KVR_HAVE_JEMALLOC
	if (je())
		p = mallocx(ask(k, size), flags(k) | big(size) | (zero ? MALLOCX_ZERO : 0));
	else
#endif
		p = zero ? calloc(1, size) : malloc(size);
	if (p)
		count((int64_t)size);
	return p;
}

static void free_in(int k, void *mem, size_t size)
{
	if (!mem)
		return;
	if (size == 0)
		size = 1;
	count(-(int64_t)size);
#ifdef KVR_HAVE_JEMALLOC
	if (je()) {
		int f = free_flags(k, size);
		sdallocx(mem, ask(k, size), f | big(size));
		return;
	}
#endif
	(void)k;
	free(mem);
}

void *kvr_alloc(size_t size)
{
	return alloc_in(LONG, size, false);
}

void *kvr_calloc(size_t n, size_t size)
{
	if (size && n > SIZE_MAX / size)
		return NULL;
	return alloc_in(LONG, n * size, true);
}

void *kvr_alloc_transient(size_t size)
{
	return alloc_in(TRANSIENT, size, false);
}

void *kvr_calloc_transient(size_t n, size_t size)
{
	if (size && n > SIZE_MAX / size)
		return NULL;
	return alloc_in(TRANSIENT, n * size, true);
}

void kvr_free_transient(void *mem, size_t size)
{
	free_in(TRANSIENT, mem, size);
}

/* size rounded up to whole cache lines (64 for 0), or 0 when that overflows. */
static inline size_t lines(size_t size)
{
	if (size > SIZE_MAX - 63)
		return 0; /* (size + 63) wrapped: SIZE_MAX - 10 came back as a 64-byte block */
	return size ? (size + 63) & ~(size_t)63 : 64;
}

void *kvr_alloc_aligned(size_t size)
{
	size_t rounded = lines(size);
	if (rounded == 0)
		return NULL;
	if (should_fail())
		return NULL;
	void *p;
#ifdef KVR_HAVE_JEMALLOC
	if (je()) {
		int f = flags(LONG);
		int align = big(rounded) ? big(rounded) : MALLOCX_ALIGN(64);
		p = mallocx(rounded, f | align | MALLOCX_ZERO);
	} else
#endif
	{
		p = aligned_alloc(64, rounded);
		if (p)
			memset(p, 0, rounded);
	}
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
	void *p;
#ifdef KVR_HAVE_JEMALLOC
	if (je())
		p = rallocx(mem, long_class(new_size), flags(LONG) | big(new_size));
	else
#endif
		p = realloc(mem, new_size);
	if (p)
		count((int64_t)new_size - (int64_t)(old_size ? old_size : 1));
	return p;
}

size_t kvr_alloc_real_size(size_t size)
{
	if (size == 0)
		return 0;
#ifdef KVR_HAVE_JEMALLOC
	if (je()) {
		size_t r = nallocx(long_class(size), flags(LONG) | big(size));
		return r ? r : size;
	}
#endif
	return size;
}

size_t kvr_alloc_real_size_aligned(size_t size)
{
	if (size == 0)
		return 0;
	size_t rounded = lines(size);
	if (rounded == 0)
		return size; /* no such allocation */
#ifdef KVR_HAVE_JEMALLOC
	if (je()) {
		int f = flags(LONG);
		size_t r = nallocx(rounded, f | (big(rounded) ? big(rounded) : MALLOCX_ALIGN(64)));
		return r ? r : rounded;
	}
#endif
	return rounded;
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
	free_in(LONG, mem, size);
}

void kvr_free_aligned(void *mem, size_t size)
{
	if (!mem)
		return;
	count(-(int64_t)size);
#ifdef KVR_HAVE_JEMALLOC
	if (je()) {
		size_t rounded = lines(size);
		int f = free_flags(LONG, rounded);
		sdallocx(mem, rounded, f | (big(rounded) ? big(rounded) : MALLOCX_ALIGN(64)));
		return;
	}
#endif
	free(mem);
}

const char *kvr_alloc_name(void)
{
#ifdef KVR_HAVE_JEMALLOC
	if (je())
		return "jemalloc";
#endif
	return "libc";
}

void kvr_alloc_fail_after(uint64_t nth)
{
	__atomic_store_n(&fail_persist, 0, __ATOMIC_RELAXED);
	__atomic_store_n(&fail_countdown, nth, __ATOMIC_RELEASE);
}

void kvr_alloc_fail_from(uint64_t nth)
{
	__atomic_store_n(&fail_persist, nth != 0, __ATOMIC_RELAXED);
	__atomic_store_n(&fail_countdown, nth, __ATOMIC_RELEASE);
}

void kvr_alloc_thread_role(unsigned role)
{
	thread_role = role;
}

void kvr_alloc_fail_scope(unsigned roles)
{
	__atomic_store_n(&fail_roles, roles, __ATOMIC_RELAXED);
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
	/* Before, nc * elem could wrap: a small buffer, and 0. */
	size_t max = elem ? SIZE_MAX / elem : SIZE_MAX;
	if (need > max)
		return KVR_ENOMEM;
	size_t nc = *cap <= max / 2 && *cap * 2 > need ? *cap * 2 : need;
	if (nc < 16 && max >= 16)
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
	if (!je() || !flags(LONG))
		return false;
	uint64_t epoch = 1;
	size_t sz = sizeof(epoch);
	if (mallctl("epoch", &epoch, &sz, &epoch, sz) != 0)
		return false;
	/* tcache_bytes: every arena's (a cache fills from the arena asked for, but its bytes count
	 * under the thread's own arena). */
	static const struct {
		int arena; /* LONG, TRANSIENT, or -1: all */
		const char *name;
	} stat[] = {{LONG, "small.allocated"},
	            {LONG, "large.allocated"},
	            {TRANSIENT, "small.allocated"},
	            {TRANSIENT, "large.allocated"},
	            {-1, "tcache_bytes"}};
	size_t v[5] = {0};
	for (int i = 0; i < 5; i++) {
		char name[64];
		snprintf(name, sizeof(name), "stats.arenas.%u.%s",
		         stat[i].arena < 0 ? (unsigned)MALLCTL_ARENAS_ALL
		                           : arena_ind[stat[i].arena],
		         stat[i].name);
		sz = sizeof(v[i]);
		if (mallctl(name, &v[i], &sz, NULL, 0) != 0)
			return false;
	}
	*allocated = (uint64_t)v[0] + v[1] + v[2] + v[3];
	*cached = v[4];
	return true;
#else
	return false;
#endif
}

void kvr_alloc_purge_idle(uint64_t now_ns)
{
#ifdef KVR_HAVE_JEMALLOC
	/* A thread with caches of its own purges every time: it has just flushed them
	 * (shards/runtime.c: idle_purge), and the pages that flush emptied would otherwise wait
	 * for another shard's purge.  When two shards went idle together the second one's flush
	 * came after the first one's purge, and the transient arena kept 3.7-4.6 B per (block,
	 * rank) of dirty pages in bench_footprint (8 ranks, 2k prompts). */
	static uint64_t last_ns;
	uint64_t last = __atomic_load_n(&last_ns, __ATOMIC_RELAXED);
	bool own = thread_tc[LONG] || thread_tc[TRANSIENT];
	if (!je() || !flags(LONG) || (!own && last && now_ns - last < KVR_ALLOC_PURGE_GAP_NS) ||
	    !__atomic_compare_exchange_n(&last_ns, &last, now_ns ? now_ns : 1, false,
	                                 __ATOMIC_RELAXED, __ATOMIC_RELAXED))
		return;
	kvr_alloc_purge();
	/* And arena 0, after a flush: jemalloc (5.3: tcaches_flush) flushes an explicit cache by
	 * destroying it, to be made again at its next use, and its bin stacks (~60 KiB a cache, two
	 * a shard) were allocated from arena 0, whatever arena the cache serves, so they lie there
	 * freed and resident (dirty: 0.6-0.9 B per (block, rank) in bench_footprint at 8 ranks x 2k
	 * prompts, 2.4 B on one rank) until arena 0's decay, which runs only when arena 0 is used.
	 * No call purges a given extent, so this purges the whole of arena 0's dirty pages, the
	 * embedder's too (returned to the system sooner than its decay time would: faulted in
	 * again when reused).  At most once per idle period of a shard, i.e. when the router has
	 * had no work for IDLE_PURGE_NS. */
	if (own)
		(void)mallctl("arena.0.purge", NULL, NULL, NULL, 0);
#else
	(void)now_ns;
#endif
}

void kvr_alloc_purge(void)
{
#ifdef KVR_HAVE_JEMALLOC
	if (!je() || !flags(LONG))
		return;
	for (int k = 0; k < 2; k++) {
		char name[48];
		snprintf(name, sizeof(name), "arena.%u.purge", arena_ind[k]);
		(void)mallctl(name, NULL, NULL, NULL, 0);
	}
#endif
}

void kvr_alloc_thread_cache_begin(void)
{
#ifdef KVR_HAVE_JEMALLOC
	if (!je() || !flags(LONG))
		return;
	for (int k = 0; k < 2; k++) {
		unsigned ind;
		size_t sz = sizeof(ind);
		if (thread_tc[k] || mallctl("tcache.create", &ind, &sz, NULL, 0) != 0)
			continue; /* without one the thread allocates uncached */
		thread_tc_ind[k] = ind;
		thread_tc[k] = MALLOCX_TCACHE(ind);
	}
#endif
}

void kvr_alloc_thread_cache_end(void)
{
#ifdef KVR_HAVE_JEMALLOC
	for (int k = 0; k < 2; k++) {
		if (!thread_tc[k])
			continue;
		thread_tc[k] = 0; /* first: nothing allocates through it any more */
		(void)mallctl("tcache.destroy", NULL, NULL, &thread_tc_ind[k], sizeof(unsigned));
	}
#endif
}

void kvr_alloc_flush_thread_cache(void)
{
#ifdef KVR_HAVE_JEMALLOC
	for (int k = 0; k < 2; k++)
		if (thread_tc[k])
			(void)mallctl("tcache.flush", NULL, NULL, &thread_tc_ind[k],
			              sizeof(unsigned));
#endif
}
