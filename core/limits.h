/*
 * core/limits.h - the one source of kvrouter's configuration limits and defaults.
 *
 * kvr_config_init() (core/config.c), kvr_config_validate() and the shard runtime
 * (shards/runtime.c, for its own zero-means-default fields) all read these, so a default or a
 * bound is typed out once.  The public header documents the same numbers for users; the unit
 * test tests/unit/test_config.c checks that every documented default is what kvr_config_init()
 * gives.  Base layer: no includes beyond <stdint.h>, usable from core/ and shards/.
 */
#ifndef KVR_CORE_LIMITS_H
#define KVR_CORE_LIMITS_H

#include <stdint.h>

#define KVR_NS_PER_S UINT64_C(1000000000)

/* Limits (inclusive). */
#define KVR_LIMIT_BLOCK_SIZE_MAX    65536u
#define KVR_LIMIT_SHARDS_MAX        256u
#define KVR_LIMIT_CPU_ID_MAX        4095 /* cpu_list entries: 0..4095 */
#define KVR_LIMIT_MAX_RANKS_MAX     65536u
#define KVR_LIMIT_LANE_CAPACITY_MIN 2u
#define KVR_LIMIT_LANE_CAPACITY_MAX (1u << 22)
#define KVR_LIMIT_WORKERS_MAX       (1u << 20) /* shard runtime: distinct workers placed */

/* Defaults (kvr_config_init, and the runtime's 0 = default fields). */
#define KVR_DEFAULT_BLOCK_SIZE             16u
#define KVR_DEFAULT_TTL_NS                 (120 * KVR_NS_PER_S)
#define KVR_DEFAULT_LEASE_SCAN_INTERVAL_NS (120 * KVR_NS_PER_S)
#define KVR_DEFAULT_QUEUE_CAPACITY         4096u
#define KVR_DEFAULT_MAX_RANKS              4096u
#define KVR_DEFAULT_SEED                   UINT64_C(0x6b76726f75746572) /* "kvrouter" */
#define KVR_DEFAULT_LANE_CAPACITY          4095u /* ring of N slots holds N - 1; see below */
#define KVR_DEFAULT_LANE_SOFT_DEPTH        127u  /* paced posts wait above it; see below */
#define KVR_DEFAULT_LANE_STALL_NS          UINT64_C(50000) /* no message taken: spill */
#define KVR_LANE_THROTTLE_MAX_STALLS       10u /* one post's wait in all, in stall intervals */
#define KVR_DEFAULT_MAINT_EVERY_TASKS      64u
#define KVR_DEFAULT_MAINT_EVERY_NS         UINT64_C(200000)
#define KVR_DEFAULT_SHARD_IDLE_SPIN_NS     UINT64_C(50000)
#define KVR_DEFAULT_SHARD_LAZY_WAKE_NS     UINT64_C(1000000) /* shards/runtime.h lazy_wake_ns */
#define KVR_DEFAULT_BOOKING_LAZY_NS        UINT64_C(250000)  /* kvr_config.booking_lazy_ns */
#define KVR_DEFAULT_MAX_WORKERS            KVR_DEFAULT_MAX_RANKS
#define KVR_DEFAULT_EVENTS_MAX_BLOCKS      (UINT64_C(1) << 21) /* kvr_config.events_max_blocks */
/* Events mode: a rank registered with a capacity may hold twice it plus this many blocks
 * (shards/owner_events.c, "The stored-block bound", says why). */
#define KVR_EVENTS_BOUND_FLOOR_BLOCKS UINT64_C(1024)

/* KVR_DEFAULT_LANE_CAPACITY and KVR_DEFAULT_LANE_SOFT_DEPTH: a deep ring and a shallow soft
 * depth in it, because each alone fails one of two measured goals.  A shallow lane keeps an
 * overloaded router's decisions fresh: bookings wait in the lane while kvr_route decides on an
 * index without them, so a deep lane makes decisions stale, stale decisions recompute prefixes
 * on other ranks and evict more, and the shard falls further behind (bench_route --threads-max
 * 1, 2k tokens, unpaced, capacity 4095 alone: 3,358-3,669 deep, overlap 0.72-0.75, 4.8-6.5 us
 * of shard CPU per route; capacity 127: 40-63 deep, overlap 0.94-0.98, 1.7-2.2 us).  But a
 * ring holds only capacity x task time of a shard's stall: one shard task of 10-95 ms (an ASan
 * build, a preempted shard on a loaded machine) made posts at capacity 127 wait out
 * KVR_LANE_FULL_WAIT_NS and return KVR_EAGAIN from kvr_route and kvr_request_output
 * (test_replica_hooks under ASan: 1 run in 2 failed in CI, 1 in 6 here).  So the ring stays
 * 4095 deep and kvr_route's booking throttles at the soft depth only while its shard keeps
 * taking messages; once the shard has taken none for KVR_DEFAULT_LANE_STALL_NS it spills into
 * the rest of the ring.  50 us: several times one booking of the prompts whose lanes fill
 * (2k-32k tokens: 2-10 us of shard time), so a shard that is merely busy is not taken for a
 * stalled one, and short against a scheduler slice (1-4 ms) or the 10 ms full-lane bound, so a
 * preempted shard costs a poster about that (and nothing once it has been stalled that long:
 * the shard stamps each take, sync/lane.h).  Longer bookings (128k tokens, ~60 us) may be
 * taken for a stall and spill: their frontends hash slower than the shard books, so those
 * lanes stay short anyway.  200 us measured the same freshness (bench_route 2k-8k, load 5-6).
 * KVR_LANE_THROTTLE_MAX_STALLS bounds one post's wait when other posters keep taking the room
 * the shard makes.  The deep ring's memory (256 KiB a shard, all resident once its indices
 * have gone round) is given back while the shard idles (sync/lane.h, idle trim); 1023, a
 * quarter of it while busy too, filled under a loaded machine where 4095 did not (bench_route,
 * 2 frontends, 2k tokens, two busy loops beside: 3 full-lane waits in 4 runs, against none at
 * 4095, whose lanes reached 3,698 deep in the same runs), so the capacity stays. */

#endif /* KVR_CORE_LIMITS_H */
