/*
 * core/alloc.h - kvrouter's allocator seam.
 *
 * Every allocation the library makes goes through these functions so that
 *  - with jemalloc (meson feature, on by default; used when the process has it, alloc.c) the
 *    library's structures live in private jemalloc arenas, away from the embedder's heap, and
 *    frees are sized (sdallocx);
 *  - tests can fail the Nth allocation (SQLite-style out-of-memory loops) and count live bytes.
 * Sizes must be passed back to kvr_free() exactly as allocated.
 *
 * Sizes past jemalloc's small classes (16 KiB and up) are page-aligned, and the long-lived arena
 * uses two size classes per doubling where jemalloc has four: both for RSS (alloc.c says why).
 *
 * Two lifetimes, two arenas (alloc.c says why): kvr_alloc() & co. are for what lives as long as
 * the cache it describes (index runs, predicted-cache segments, maps, tables); the _transient
 * forms are for what lives as long as one request or message (attempt records, posted token
 * copies, a request's pinned runs).  Mixing the two in one arena left the long-lived objects
 * scattered over slabs the short-lived ones had filled: 13-26 B per (block, rank) of
 * fragmentation in bench_footprint.  Free each with its own family.
 */
#ifndef KVR_CORE_ALLOC_H
#define KVR_CORE_ALLOC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Returns size bytes aligned to 16 (or NULL).  Context: any thread. */
void *kvr_alloc(size_t size);
/* Zeroed. */
void *kvr_calloc(size_t n, size_t size);
/* Cache-line (64-byte) aligned, for structures written by different threads. */
void *kvr_alloc_aligned(size_t size);
/* Resizes; on failure returns NULL and leaves mem untouched. */
void *kvr_realloc(void *mem, size_t old_size, size_t new_size);
/* Frees what kvr_alloc*() returned; size is the size asked for.  NULL is a no-op. */
void kvr_free(void *mem, size_t size);
void kvr_free_aligned(void *mem, size_t size);
/* For objects that live one request or message (see the top): same contracts as kvr_alloc(),
 * kvr_calloc() and kvr_free(), from the transient arena, through the thread's cache.  Memory
 * from these goes back through kvr_free_transient() only.  Context: any thread. */
void *kvr_alloc_transient(size_t size);
void *kvr_calloc_transient(size_t n, size_t size);
void kvr_free_transient(void *mem, size_t size);
/* Gives the whole pages inside [mem, mem + len) of a live allocation back to the system, so that
 * the memory goes a slice at a time and freeing the allocation later is cheap (shards/ttl_map.c:
 * a table being emptied).  Their content becomes unspecified (zero on Linux): the caller must
 * not read that range again before writing it.  Best effort, never fails.  Returns how many
 * bytes from mem are done (to the end of the last page given back, 0 if none): the caller may
 * go on from there.  Context: the allocation's owner. */
size_t kvr_alloc_discard(void *mem, size_t len);
/* What an allocation of size bytes really occupies: the size class it gets (the long-lived
 * arena's two per doubling above 256 B, alloc.c: e.g. 300 -> 384; jemalloc's nallocx); 0 for 0
 * (nothing allocated).  Without jemalloc the C library offers no size-class query
 * (malloc_usable_size needs the pointer): size itself.  The _aligned form is for
 * kvr_alloc_aligned().  Memory counters count these.  Context: any thread. */
size_t kvr_alloc_real_size(size_t size);
size_t kvr_alloc_real_size_aligned(size_t size);
/* Grows the array *p (capacity *cap elements of elem bytes) to hold at least need elements:
 * doubling, 16 at least.  Returns 0 or KVR_ENOMEM (then *p and *cap are unchanged).
 * Context: the array's owner. */
int kvr_grow(void **p, size_t *cap, size_t need, size_t elem);

/* The allocator the library's structures come from: "jemalloc" (built with it, and the process
 * has it: alloc.c says why it must be the process's) or "libc".  Fixed at the first allocation.
 * Context: any thread. */
const char *kvr_alloc_name(void);

/* Test hooks: fail the nth allocation from now (1 = the next one); 0 disables.
 * Counts live bytes allocated through this seam.  Context: tests, single-threaded setup. */
void kvr_alloc_fail_after(uint64_t nth);
/* Persistent (SQLite's "persist" fault mode): the nth allocation from now and every one after it
 * fail, until kvr_alloc_fail_after(0).  Reaches a clean-up that allocates after a failure (a
 * second failure in a row, which kvr_alloc_fail_after gives only when another thread re-arms
 * it in between).  Context: tests, single-threaded setup. */
void kvr_alloc_fail_from(uint64_t nth);
/* Thread roles for scoped failures (bits): a thread tags itself with kvr_alloc_thread_role(). */
#define KVR_ALLOC_ROLE_CALLER (1u << 0) /* a caller's thread, tagged by a test */
/* Replica sync's sender and apply threads, and nats.c's subscription thread while it applies. */
#define KVR_ALLOC_ROLE_REPLICA (1u << 1)
/* Replica sync's sender alone (it carries KVR_ALLOC_ROLE_REPLICA too): a test that holds the
 * sender in its out-of-memory pause while the apply thread goes on (test_replica_ranks
 * a_record_the_sender_holds_across_a_pause_outlives_its_ranks_end). */
#define KVR_ALLOC_ROLE_SENDER (1u << 2)
/* Tags the calling thread with role (KVR_ALLOC_ROLE_* bits; 0: untagged, the default).
 * Context: the thread itself. */
void kvr_alloc_thread_role(unsigned role);
/* Scopes the armed failures (kvr_alloc_fail_after, kvr_alloc_fail_from) to the allocations of
 * threads tagged with one of roles: only those are counted and failed, every other thread's
 * allocations pass untouched (a router's shard threads, untagged, while a test aims at replica
 * sync).  0 (the default) scopes them to every thread.  Stays until changed; arming and
 * disarming leave it.  Context: tests, single-threaded setup, before arming.
 * Ordering: the scope is stored before an arm's release store of the countdown, which a
 * counting thread's acquire load of it (after a relaxed one read it non-zero) pairs with. */
void kvr_alloc_fail_scope(unsigned roles);
/* Allocations left before the armed failure (0: it fired, or none is armed). */
uint64_t kvr_alloc_fail_pending(void);
int64_t kvr_alloc_live_bytes(void);
/* With jemalloc: the bytes allocated in the library's two arenas at their size classes
 * (*allocated, freed objects parked in the threads' caches included) and those parked bytes
 * (*cached); refreshes jemalloc's statistics epoch.  Returns false (both 0) without jemalloc or
 * before the arenas exist.  Context: any thread; not for a hot path (mallctl). */
bool kvr_alloc_arena_bytes(uint64_t *allocated, uint64_t *cached);
/* With jemalloc: returns the library arenas' dirty pages (freed, still resident; jemalloc keeps
 * them ~10 s by default) to the kernel.  A thread with caches of its own
 * (kvr_alloc_thread_cache_begin) purges each time, right after flushing them
 * (kvr_alloc_flush_thread_cache); others at most once per KVR_ALLOC_PURGE_GAP_NS process-wide
 * (now_ns: a monotonic clock; other calls return at once).  For a thread that has been idle a
 * while: the pages it returns fault in again when allocated.  No-op without jemalloc.
 * Context: any thread, never on a latency path. */
#define KVR_ALLOC_PURGE_GAP_NS 100000000ull
void kvr_alloc_purge_idle(uint64_t now_ns);
/* With jemalloc: returns the library arenas' dirty pages to the kernel now, whoever calls (no
 * gap).  For shards/runtime.c's late purge from the RCU callback thread.  No-op without
 * jemalloc.  Context: any thread, never on a latency path. */
void kvr_alloc_purge(void);
/* With jemalloc: gives the calling thread caches of its own for the library's arenas (one
 * jemalloc explicit tcache per arena, holding only that arena's objects: alloc.c says why the
 * threads' automatic caches are not used), so its allocations and small frees skip the arena's
 * lock.  For a thread that allocates and frees library objects all the time (a shard thread);
 * others allocate uncached.  Best effort (without them the thread allocates uncached).  The
 * thread must call kvr_alloc_thread_cache_end() before it exits.  No-op without jemalloc.
 * Context: the thread itself. */
void kvr_alloc_thread_cache_begin(void);
/* Returns the objects the calling thread's caches hold to their arenas and destroys the caches;
 * later allocations are uncached.  No-op if it has none.  Context: the thread itself. */
void kvr_alloc_thread_cache_end(void);
/* Returns the objects the calling thread's caches hold to their arenas (jemalloc counts them as
 * allocated); the caches stay.  For a thread going idle.  No-op if it has none. */
void kvr_alloc_flush_thread_cache(void);

#endif /* KVR_CORE_ALLOC_H */
