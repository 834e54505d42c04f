/*
 * core/metrics.h - counters and histograms with no lock and no shared cache line on the hot path.
 *
 * Each thread that records into a router gets a block of its own (found through a one-entry
 * thread-local cache, registered once under a mutex).  Only that thread writes its block, with
 * relaxed atomic load+store (no lock prefix); a reader sums all blocks with relaxed loads, so a
 * render sees every increment that happened before it, give or take the ones in flight.  When a
 * thread exits, its block goes to a free list and the next new thread continues adding into it:
 * sums stay right and thread churn does not grow memory.
 *
 * Histograms are log-linear: four sub-buckets per power of two (<= 19% relative error), 256
 * buckets covering all of uint64.
 */
#ifndef KVR_CORE_METRICS_H
#define KVR_CORE_METRICS_H

#include <stddef.h>
#include <stdint.h>

enum kvr_counter {
	KVR_C_ROUTES,
	KVR_C_ROUTE_ERRORS,
	KVR_C_ROUTES_QUERY_ONLY,
	KVR_C_ROUTED_BLOCKS,
	KVR_C_PREDICTED_OVERLAP_BLOCKS,
	KVR_C_EV_STORED_OK,
	KVR_C_EV_STORED_ERR,
	KVR_C_EV_REMOVED_OK,
	KVR_C_EV_REMOVED_ERR,
	KVR_C_EV_CLEARED_OK,
	KVR_C_EV_CLEARED_ERR,
	KVR_C_EV_STALE,
	KVR_C_EV_GAPS,
	KVR_C_EV_BLOCK_NOT_FOUND,
	KVR_C_EV_PARENT_NOT_FOUND,
	KVR_C_EV_STORED_OVER,   /* stored events refused: their rank would exceed its bound */
	KVR_C_EV_OVER_BLOCKS,   /* ... their blocks */
	KVR_C_EV_OVER_EPISODES, /* times a rank reached its bound (on_event_gap once each) */
	KVR_C_EV_STORED_FULL,   /* stored events refused: the index's run ids are all in use */
	KVR_C_EV_RANK_GONE,     /* events whose rank was removed after the call found it */
	KVR_C_EVICTIONS,
	KVR_C_TTL_EXPIRIES,
	KVR_C_LEASE_EXPIRIES,
	KVR_C_FINISHED,
	KVR_C_ABORTED,
	KVR_C_STALE_CALLS,
	KVR_C_QUEUED,
	KVR_C_QUEUE_ADMITTED,
	KVR_C_QUEUE_REJECTED,
	KVR_C_QUEUE_TIMEOUTS,
	KVR_C_SHARD_INDEX_WRITE_ERRORS, /* index writes a shard could not make (out of memory) */
	KVR_C_SHARD_TIMER_ERRORS,       /* timers a shard could not arm (retried) */
	KVR_C_SHARD_RELEASE_ERRORS,     /* predicted-cache releases out of memory (retried) */
	KVR_C_LANE_FULL_WAITS,          /* posts that found a shard lane full and waited */
	KVR_C_LANE_FULL_DROPS,          /* posts given up after the bounded wait */
	KVR_C_LANE_FULL_REFUSALS,       /* a frontend pass's bookings refused at once (full lane) */
	KVR_C_LANE_SOFT_THROTTLES,      /* admissions that waited at a lane's soft depth */
	KVR_C_LANE_SOFT_SPILLS,         /* admissions posted past it (the shard had stalled) */
	KVR_C_STALE_BOOKINGS,           /* admissions whose rank went away before the booking */
	KVR_C_SHARD_WAKES_DEFERRED,     /* lifecycle posts that left an idle shard asleep */
	KVR_C_BOOKING_WAITS,            /* sync_booking admissions that waited for their shard */
	KVR_C_OUTPUT_OVER_BOUND,        /* attempts whose output reached the attempt bound */
	KVR_C_FEED_MESSAGES,            /* sync/feed.c: vLLM KV event feeds */
	KVR_C_FEED_BATCHES,
	KVR_C_FEED_EVENTS,
	KVR_C_FEED_BLOCKS_STORED,
	KVR_C_FEED_BLOCKS_REMOVED,
	KVR_C_FEED_OTHER_MEDIUM,
	KVR_C_FEED_MALFORMED,
	KVR_C_FEED_REFUSED,
	KVR_C_FEED_UNKNOWN_RANK,
	KVR_C_FEED_DUPLICATES,
	KVR_C_FEED_GAPS,
	KVR_C_FEED_REPLAYS,
	KVR_C_FEED_REPLAYED_BATCHES,
	KVR_C_FEED_RESTARTS,
	KVR_C_FEED_LOST, /* events or batches not applied for lack of memory (rank cleared) */
	/* replay requests asked again (sync/feed_seq.c, replay()) */
	KVR_C_FEED_REPLAY_REASKS,
	KVR_C_HEAL_FEEDBACK,   /* core/heal.c: kvr_request_cached calls applied */
	KVR_C_HEAL_OVER,       /* ... whose prediction was above the engine's cached depth */
	KVR_C_HEAL_UNDER,      /* ... below it */
	KVR_C_HEAL_UNPROVABLE, /* over-predictions the release order could not explain */
	KVR_C_HEAL_OBSERVE,    /* kvr_rank_observe calls applied */
	KVR_C_HEAL_WM_UNKNOWN, /* watermarks with no inactive predicted copy */
	KVR_C_HEAL_EVICTED,    /* predicted blocks evicted by healing */
	KVR_C_HEAL_CAP_RAISED, /* observations that raised an under-registered capacity */
	KVR_C__COUNT
};

enum kvr_hist {
	KVR_H_ROUTE_NS,
	KVR_H_HASH_NS,
	KVR_H_MATCH_NS,
	KVR_H_SELECT_NS,
	KVR_H_ADMIT_NS,
	KVR_H_QUEUE_WAIT_NS,
	KVR_H_OVERLAP_BLOCKS,
	KVR_H_FEED_LAG_NS, /* batch ts (publisher wall clock) to applied */
	KVR_H__COUNT
};

#define KVR_HIST_BUCKETS 256

struct kvr_metrics_block {
	uint64_t counter[KVR_C__COUNT];
	uint64_t hist[KVR_H__COUNT][KVR_HIST_BUCKETS];
	uint64_t hist_sum[KVR_H__COUNT];
	struct kvr_metrics_block *next; /* all blocks of the registry (immutable once linked) */
	struct kvr_metrics_block *next_free;
};

struct kvr_metrics; /* the registry, one per router */

int kvr_metrics_create(struct kvr_metrics **out);
/* Context: after every recording thread of this registry has stopped recording. */
void kvr_metrics_destroy(struct kvr_metrics *m);

/* The calling thread's block for m (registering it on first use), or NULL without memory
 * (recording is then skipped: metrics never fail a request).  Context: any thread. */
struct kvr_metrics_block *kvr_metrics_local(struct kvr_metrics *m);

static inline void kvr_metrics_add(struct kvr_metrics_block *b, enum kvr_counter c, uint64_t v)
{
	if (!b)
		return;
	/* Single writer: a relaxed load and store, no read-modify-write instruction. */
	__atomic_store_n(&b->counter[c], __atomic_load_n(&b->counter[c], __ATOMIC_RELAXED) + v,
	                 __ATOMIC_RELAXED);
}

/* Bucket of value v: 4 linear sub-buckets per power of two. */
static inline unsigned kvr_hist_bucket(uint64_t v)
{
	if (v < 4)
		return (unsigned)v;
	unsigned e = 63u - (unsigned)__builtin_clzll(v); /* >= 2 */
	unsigned sub = (unsigned)(v >> (e - 2)) & 3u;
	return (e - 1) * 4 + sub; /* e=2 -> 4..7, max (62)*4+3 = 251 */
}

/* Smallest value of bucket i (its lower bound); UINT64_MAX past the last bucket a value maps to
 * (kvr_hist_bucket(UINT64_MAX) = 251). */
uint64_t kvr_hist_bucket_low(unsigned i);

static inline void kvr_metrics_observe(struct kvr_metrics_block *b, enum kvr_hist h, uint64_t v)
{
	if (!b)
		return;
	unsigned k = kvr_hist_bucket(v);
	__atomic_store_n(&b->hist[h][k], __atomic_load_n(&b->hist[h][k], __ATOMIC_RELAXED) + 1,
	                 __ATOMIC_RELAXED);
	/* Saturating: a sum that wrapped would go down on the page (a Prometheus counter reset);
	 * only absurd observations get there (feed lag from a ts that is not wall-clock time). */
	uint64_t s = __atomic_load_n(&b->hist_sum[h], __ATOMIC_RELAXED), t = s + v;
	__atomic_store_n(&b->hist_sum[h], t < s ? UINT64_MAX : t, __ATOMIC_RELAXED);
}

/* Sums every block.  Context: any thread (a consistent-enough snapshot, see the essay).  A
 * histogram's *sum saturates at UINT64_MAX, as each block's does. */
uint64_t kvr_metrics_counter(struct kvr_metrics *m, enum kvr_counter c);
void kvr_metrics_hist(struct kvr_metrics *m, enum kvr_hist h, uint64_t out[KVR_HIST_BUCKETS],
                      uint64_t *sum);
/* The q-quantile (0..1) of a merged histogram: the upper bound of the bucket that holds it. */
uint64_t kvr_hist_quantile(const uint64_t hist[KVR_HIST_BUCKETS], double q);

#endif
