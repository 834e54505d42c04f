/*
 * kvrouter.h - the one public header of kvrouter.
 *
 * kvrouter decides which LLM inference worker rank should serve each request so that the
 * rank's KV cache already holds as much of the prompt's prefix as possible, without
 * overloading anyone.  Prompts are cut into fixed-size token blocks; each block gets a chained
 * 64-bit XXH3 hash, so one hash names one whole prefix (compatible with NVIDIA Dynamo's router).
 *
 * Conventions:
 *  - every function that can fail returns 0 (KVR_OK) or a negative KVR_E* code;
 *    kvr_strerror() explains a code.  Nothing aborts, exits or prints on bad input.  A NULL
 *    router, feed or replica handle is KVR_EINVAL for every call below that returns int (the
 *    per-call lists leave it out; README.md, "Bad input", has every case).  So is
 *    KVR_ESHUTDOWN: a call on a router being destroyed, or made in a forked child on a router
 *    (feed, replica) its parent created, returns it whether or not its list names it
 *    (kvr_router_get_config, a read of the copied memory, returns 0 there).
 *  - pointer parameters are borrowed for the duration of the call unless documented otherwise.
 *  - whatever the library allocates, the library frees; destroy(NULL) is a no-op.
 *  - usable from C99 and C++98 on (extern "C"; tests/header/ builds both pedantic); no
 *    third-party type appears here.
 *  - callbacks (the clock, on_admit, the thread and log hooks) must return normally: a C++
 *    exception or a longjmp out of one unwinds through the library's frames without releasing
 *    what they hold (on a library thread, std::terminate).  Catch inside the callback.
 *  - no call is a cancellation point: a thread cancelled (pthread_cancel) inside one acts on
 *    it at its next cancellation point after the call returns, with the call's work done.  So
 *    a kvr_route_wait (or KVR_ROUTE_WAIT) without a deadline cannot be cancelled while it
 *    waits: give it a deadline, or kvr_route_cancel its ticket from another thread.
 */
#ifndef KVROUTER_H
#define KVROUTER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__) && !defined(KVR_STATIC_BUILD)
#define KVR_API __attribute__((visibility("default")))
#else
#define KVR_API
#endif

/* ---------------------------------------------------------------- version */

#define KVR_VERSION_MAJOR  0
#define KVR_VERSION_MINOR  1
#define KVR_VERSION_PATCH  0
#define KVR_VERSION_STRING "0.1.0"
/* Encoded as MAJOR*10000 + MINOR*100 + PATCH, for #if comparisons. */
#define KVR_VERSION_NUMBER (KVR_VERSION_MAJOR * 10000 + KVR_VERSION_MINOR * 100 + KVR_VERSION_PATCH)

/* The library's version string at run time (may differ from the header it was built with). */
KVR_API const char *kvr_version(void);

/* ---------------------------------------------------------------- errors */

enum kvr_error {
	KVR_OK = 0,
	KVR_EINVAL = -1,     /* an argument is invalid (NULL with a length, block size 0, ...) */
	KVR_ENOMEM = -2,     /* an allocation failed; nothing was changed */
	KVR_ENOENT = -3,     /* the named rank, attempt, parent block or object does not exist */
	KVR_ESTALE = -4,     /* stale incarnation or attempt already finished/aborted/expired */
	KVR_EAGAIN = -5,     /* overloaded: a bounded queue or lane is full; try again later */
	KVR_EEXIST = -6,     /* the object already exists (duplicate rank or attempt) */
	KVR_EBUSY = -7,      /* the object is in use or the router is shutting down */
	KVR_ERANGE = -8,     /* a value is outside its allowed range (too many ranks, too long) */
	KVR_ETIMEDOUT = -9,  /* a deadline passed before the operation could complete */
	KVR_ESHUTDOWN = -10, /* the router or shard runtime is being destroyed */
	KVR_ENOTSUP = -11    /* not built in (e.g. the KV event feed without -Dzmq) */
};

/* A static, human-readable message for a KVR_* code (or "unknown error"). Never NULL. */
KVR_API const char *kvr_strerror(int code);

/*
 * What the calling thread's latest failing kvr_ call found wrong: the function, the argument
 * or configuration field, the bad value where it is cheap to say, and what is allowed, e.g.
 * "kvr_route: req.n_tokens is 0; a prompt needs at least one token" or "kvr_router_create:
 * config.block_size 0 is out of range [1, 65536]".  Never NULL.
 *  - Read it right after a call returned a KVR_E* code.  Every failing call of a function in
 *    this header that returns int sets it (a code with no more to say reads
 *    "<function>: <kvr_strerror(code)>"); before the thread's first failure it is "".
 *  - A successful call does not write it (errno's convention: success costs nothing, and
 *    kvr_route is a microsecond), so it still holds the last failure's detail; do not read it
 *    to learn whether a call failed.  (A call that makes failing calls inside and succeeds,
 *    such as kvr_sync_drain applying a peer's finish of an attempt already ended here, may
 *    have replaced it, as errno may be.  kvr_route with KVR_ROUTE_WAIT reports a failure of
 *    its wait as kvr_route_wait's, which it calls.)
 *  - Per thread, in a fixed buffer of the library's (at most 255 bytes: a longer detail keeps
 *    its start and its end, " ... " between, cut between UTF-8 characters): nothing is
 *    allocated, so it works after KVR_ENOMEM, inside the router's callbacks (whose
 *    failing calls replace it) and on any thread; two threads never see each other's.  The
 *    pointer stays valid until the thread ends; its text changes at the thread's next failure,
 *    so copy it to keep it.
 * Why this shape: the detail is the calling thread's, as errno and zmq_errno() are, because
 * kvr_route runs on many threads at once on one router (a per-handle message, as
 * sqlite3_errmsg(), would be overwritten by another thread's call) and several failures have
 * no handle (kvr_router_create, a NULL router); a caller-supplied buffer (libcurl's
 * CURLOPT_ERRORBUFFER) would be a parameter on every call.
 */
KVR_API const char *kvr_last_error(void);

/* ---------------------------------------------------------------- hashing */

/* Seed of every XXH3 call in the block hash chain (Dynamo compatible). */
#define KVR_HASH_SEED 1337u

/*
 * Hashes the complete blocks of a token sequence.
 *   tokens      borrowed; n_tokens token ids, each hashed as a little-endian u32.
 *   block_size  tokens per block, >= 1.  A partial tail block is ignored.
 *   lora_name   borrowed, may be NULL or "" (no adapter).  A non-empty name changes every local
 *               hash (block seed = 1337 + XXH3_64(name, seed 0)); the chain seed stays 1337.
 *   local_out   may be NULL; else n_tokens / block_size entries: each block's own hash.
 *   seq_out     may be NULL; else n_tokens / block_size entries: seq[0] = local[0],
 *               seq[i] = XXH3_64(LE64(seq[i-1]) || LE64(local[i]), 1337); names the whole prefix.
 * Returns the number of complete blocks written; 0 on bad arguments (tokens NULL with
 * n_tokens > 0, block_size 0) - use kvr_hash_extend() to get an error code.
 * Context: any thread; no allocation, no lock.
 */
KVR_API size_t kvr_hash_blocks(const uint32_t *tokens, size_t n_tokens, uint32_t block_size,
                               const char *lora_name, uint64_t *local_out, uint64_t *seq_out);

/*
 * Like kvr_hash_blocks(), but continues a chain: with parent_seq non-NULL, the first block's
 * sequence hash is XXH3_64(LE64(*parent_seq) || LE64(local[0]), 1337) - used for output tokens
 * that complete new blocks during decode.  With parent_seq NULL it starts a new chain.
 * *n_blocks_out (required) receives the number of complete blocks written.
 * Returns 0, or KVR_EINVAL (tokens NULL with n_tokens > 0, block_size 0, n_blocks_out NULL).
 * Context: any thread; no allocation, no lock.
 */
KVR_API int kvr_hash_extend(const uint64_t *parent_seq, const uint32_t *tokens, size_t n_tokens,
                            uint32_t block_size, const char *lora_name, uint64_t *local_out,
                            uint64_t *seq_out, size_t *n_blocks_out);

/* The XXH3-64 block seed for a LoRA adapter name (1337 for NULL or ""). */
KVR_API uint64_t kvr_hash_lora_seed(const char *lora_name);

/* ---------------------------------------------------------------- configuration */

struct kvr_decision;

/* How the index learns what each rank caches. */
enum kvr_mode {
	KVR_MODE_APPROX_LRU = 0, /* predict: capacity-bounded LRU mirroring vLLM (default) */
	KVR_MODE_APPROX_TTL = 1, /* predict: forget a routed block after ttl_ns */
	KVR_MODE_EVENTS = 2      /* workers publish KV events (kvr_events_apply) */
};

/* Order in which queued requests are admitted when every rank is saturated. */
enum kvr_queue_policy {
	KVR_QUEUE_FCFS = 0, /* first come, first served */
	KVR_QUEUE_WSPT = 1  /* weighted shortest processing time: fewest uncached tokens first */
};

/* Where the engine puts a finished request's blocks in its free queue (whose head is reused
 * first, evicting the prefix it held), which approx_lru mirrors to predict what goes next.  The
 * two differ only for blocks without a hash (a request's partial last block). */
enum kvr_free_order {
	/* vLLM's v1 block pool since its 2026 releases (BlockPool.free_blocks, "fresh blocks go to
	 * front"): blocks without a hash go to the queue's front and are reused first, evicting
	 * nothing; cached blocks go to the back, the request's deepest first.  Default. */
	KVR_FREE_FRESH_FIRST = 0,
	/* vLLM's v1 block pool of 2025: every freed block appended, the request's deepest first,
	 * so its partial last block holds a slot until the cached blocks ahead of it are evicted
	 * (the router's only behaviour before this setting). */
	KVR_FREE_TAIL_FIRST = 1
};

/* The router's clock: monotonic nanoseconds.  Replace it for virtual time. */
typedef uint64_t (*kvr_clock_fn)(void *ctx);

struct kvr_config {
	/* Tokens per block.  Default 16.  Range 1..65536. */
	uint32_t block_size;
	/* Shard threads.  Default 0 = one per CPU: per CPU of cpu_list when given, else of the
	 * process's affinity mask, but no more than the CPU time its cgroups allow (cgroup v2
	 * cpu.max or v1 cpu.cfs_quota_us / cpu.cfs_period_us, the smallest along its cgroup's
	 * path, rounded up: a container limited to 2 CPUs on a 64-CPU host gets 2 shards, not 64
	 * threads sharing 2 CPUs' worth of time).  kvr_router_get_config tells the count.
	 * Max 256. */
	uint32_t n_shards;
	/* CPUs to pin shard i to (cpu_list[i % n_cpus]); borrowed, copied at create (the
	 * copy is what kvr_router_get_config gives back).  A CPU the thread cannot be pinned to
	 * (absent, offline, outside the process's affinity mask or cgroup cpuset) does not fail
	 * the create: that shard runs unpinned, wherever the scheduler puts it.  An entry outside
	 * 0..4095 is a bad config (KVR_ERANGE).
	 * Default NULL = CPUs of the process affinity mask, in order. */
	const int *cpu_list;
	size_t n_cpus;
	/* Where cache knowledge comes from.  Default KVR_MODE_APPROX_LRU. */
	enum kvr_mode mode;
	/* Weight of one predicted cached block against one block of prefill.  Default 1.0; >= 0. */
	double overlap_credit;
	/* Weight of prefill load against decode load.  Default 1.0; >= 0. */
	double prefill_load_scale;
	/* Selection temperature; 0 = argmin (ties uniformly at random).  Default 0; >= 0. */
	double temperature;
	/* TTL retention (approx_ttl mode, or a rank without capacity), ns.  Default 120 s. */
	uint64_t ttl_ns;
	/* Events mode: the most distinct blocks the index keeps for one rank registered without a
	 * capacity (KVR_CAPACITY_NONE or 0), so that a publisher whose removals are lost, or a
	 * buggy or hostile one, cannot grow the router's memory without limit; a rank with a
	 * capacity may hold twice it plus 1,024 blocks instead (no engine that fits its
	 * registration gets there: kvr_events_apply says why, and what happens at the bound).
	 * Default 2,097,152 (2^21 blocks: 33.5M tokens at block size 16, more than one GPU's KV
	 * cache holds; 71-83 MB of index for a rank that fills it, at 34-39 bytes a block);
	 * range 1..UINT64_MAX (0: KVR_ERANGE). */
	uint64_t events_max_blocks;
	/* Lease reaper scan interval, ns; an idle attempt expires after one to two.  Default 120 s.
	 */
	uint64_t lease_scan_interval_ns;
	/* Queue when every eligible rank's active prefill tokens exceed threshold * its max
	 * batched tokens.  Default 0 = never queue.  >= 0. */
	double queue_threshold;
	/* Admission order of queued requests.  Default KVR_QUEUE_FCFS.  A queued request is
	 * admitted as soon as one of the ranks it may use (its pin, its allow-list, or every live
	 * rank) is no longer saturated: one whose ranks are all saturated does not hold back a
	 * later one that has a free rank, and requests that share ranks are admitted in this order.
	 * A new request goes straight to a rank only when no queued one could be admitted: while
	 * another thread is admitting queued requests it may queue (KVR_QUEUED) behind them. */
	enum kvr_queue_policy queue_policy;
	/* Bound of the waiting queue, requests.  Default 4096; >= 1. */
	uint32_t queue_capacity;
	/* Most ranks the router holds at once.  Default 4096.  Range 1..65536. */
	uint32_t max_ranks;
	/* Seed of every random choice (tie-breaks, softmax).  Default 0x6b76726f75746572. */
	uint64_t seed;
	/* Clock.  Default NULL = CLOCK_MONOTONIC.  clock_ctx is passed to it unchanged.  It is
	 * called on the callers' threads and on the router's own (its shards), so it should only
	 * read a time: the feed calls that wait for a feed's thread return KVR_EBUSY on a shard
	 * (see kvr_feed_add), a call that waits for another shard returns KVR_EBUSY (nothing done)
	 * when that shard waits for this one, directly or through others (two shards' clocks
	 * calling kvr_events_apply or kvr_rank_remove on each other's ranks), so does a
	 * kvr_rank_add / kvr_rank_remove on a shard while another thread's add or remove waits
	 * for that shard, and so does a call that would change the state of the shard the clock
	 * runs on (it runs inside one of that shard's tasks: kvr_rank_remove of one of its ranks,
	 * kvr_events_apply, kvr_rank_reset or _set_capacity on one; reads such as
	 * kvr_rank_get_stats run, lifecycle calls post their work, and on a full lane never wait
	 * for room: see the lifecycle calls, above kvr_request_prefill_done); kvr_router_destroy
	 * from it destroys nothing.  It should not go back, but a clock that does (a wall clock
	 * set back, a rewound virtual clock) loses, leaks or double-ends nothing: lease scans,
	 * TTL expiry and queue deadlines go by its readings as they come, so a lease may expire
	 * up to the step back sooner than one lease_scan_interval_ns after its last progress
	 * (its scan was armed from a reading ahead of the clock), and the lease scans and TTL
	 * expiries armed before the step come due only once the clock is back at
	 * the readings they were armed from, up to the step back later than the clock says
	 * (a shard's time never goes back); tests/fuzz/fuzz_api.c, --clock-back. */
	kvr_clock_fn now_ns;
	void *clock_ctx;
	/* Capacity of each shard's routing lane ring, messages (bookings and lifecycle work): the
	 * ring has the smallest power-of-two number of 64-byte slots above it (it holds its size
	 * minus one, so 4096 would take 8192 slots).  Default 4095 (256 KiB a shard).  Range
	 * 2..1<<22.  It bounds how far the shards' work may lag the decisions: a decision does not
	 * see the blocks of bookings still in the lanes, so an overloaded router with deep lanes
	 * recomputes prefixes on other ranks, evicts more and falls further behind; a full lane
	 * makes the poster wait instead (kvr_lane_full_waits_total), up to 10 ms, then
	 * KVR_EAGAIN.  The default absorbs a shard's stalls (a long task, preemption), while
	 * lane_soft_depth keeps the lane short when the shard is merely behind.  Memory: the
	 * ring's indices pass through every slot, so a busy shard holds all of its ring however
	 * shallow the lane stays; a shard idle for 100 ms gives the pages back (they return as
	 * posts reach them), so a router at rest pays nearly nothing for its lanes.  A smaller
	 * capacity saves memory while busy (1023: 192 KiB less a shard, ~2 B per tracked (block,
	 * rank) at 8 ranks x 25,600 blocks over 2 shards) but absorbs a quarter of the stall: on a
	 * loaded machine 1023 filled in runs where 4095 reached 3,698 deep and never filled
	 * (docs/measurements.md, "The routing lanes' memory"), so the default stays.  (The
	 * maintenance lane, which the router leaves empty, holds 255.) */
	uint32_t lane_capacity;
	/* Soft depth of each routing lane, messages.  Default 127; 0 = none; range 0..1<<22 (at
	 * or above lane_capacity it is never reached).  kvr_route's booking post, finding this
	 * many messages queued, waits (a spin, yields, then sleeps of up to 64 us) while the
	 * shard is taking messages, so an overloaded router's lanes stay about this deep and its
	 * decisions see fresh bookings (docs/measurements.md, "Routing lane capacity"); counted in
	 * kvr_lane_soft_throttles_total.  Once the shard has taken no message for 50 us (one
	 * long task, a preempted shard), or after 500 us of waiting in all, the booking goes into
	 * the ring's room above the soft depth instead (kvr_lane_soft_spills_total; at once when
	 * the shard has been stalled that long already), so a stalled shard delays kvr_route by
	 * about 50 us (plus the scheduler's delays on a loaded machine) and fails it only when the
	 * whole lane_capacity is full.  Lifecycle
	 * calls never wait here: they are claimed already and release what the next decisions
	 * need.  With sync_booking every call settles instead, so this does not apply. */
	uint32_t lane_soft_depth;
	/* Biased scheduler: run one maintenance task at least every maint_every_tasks routing
	 * tasks (default 64, >= 1) or every maint_every_ns of continuous routing work
	 * (default 200 us, >= 1). */
	uint32_t maint_every_tasks;
	uint64_t maint_every_ns;
	/* A shard that runs out of work polls this long before it parks on a futex: the next
	 * message then costs no wake-up (tens of microseconds on a loaded machine), at the price
	 * of up to this much CPU per idle period.  Adaptive: while its idle periods outlast the
	 * spin (it did not pay), a shard spins less and then not at all, and spins again after
	 * an idle period shorter than this; while 3/4 of its recent idle periods ended with work
	 * within 4x this (a stream a little sparser than the spin), it polls 4x this (200 us),
	 * yielding the CPU between polls past this.  A spin ends at the shard's next timer (TTL
	 * expiry, the lease reaper), however long this is.  Default 50 us; 0 = park at once. */
	uint64_t shard_idle_spin_ns;
	/* How long kvr_route's booking may wait for a shard that sleeps, ns (without
	 * sync_booking).  A shard that booked within the last 10 ms parks for at most this long at
	 * a time, and a booking posted to it is left for it to find when it wakes instead of
	 * waking it from the caller's thread (a FUTEX_WAKE: 10-40 us of kvr_route on a loaded
	 * 2-core machine, 0.6-0.9 per route at 128k-token prompts); the first booking after a lull
	 * still wakes its shard.  The price: such a booking's blocks and pinned runs reach the
	 * index up to this much later (plus the shard's scheduling delay; its load is seen at
	 * once), so a decision in that window on the same new prefix misses them, as it does
	 * while a woken shard waits for a CPU; and a shard wakes by itself every this-long for
	 * 10 ms after its last booking (a few microseconds of its CPU each).  Lifecycle work
	 * posted meanwhile rides the same short parks.  Default 250 us: at 128k tokens the route
	 * p50 went from 1.9-2.4x the hashing floor (median 2.0) to 1.1-2.3x (median 1.16), and
	 * followers of a hot new prefix 100-1000 us apart found it about as often as with eager
	 * wakes (within 0.05; docs/measurements.md,
	 * "Admissions that leave the shard asleep"); 0 = every booking wakes a sleeping shard at
	 * once; range 0..1 ms (KVR_ERANGE above).  With sync_booking it does not apply (every
	 * call settles first). */
	uint64_t booking_lazy_ns;
	/* Admission booking.  false (default): kvr_route and the lifecycle calls post their work to
	 * the rank's shard and return without waiting; the request's load is visible at once, its
	 * blocks in the predicted cache and the index microseconds later (as with engine KV
	 * events).  true: exact and deterministic back-to-back decisions (simulation, tests): every
	 * call observes the effects of every call that returned before it, applied at the router
	 * time of the call that made them (with the timers due by then, e.g. TTL expiry and the
	 * lease reaper, run before them at their own times), as if each call had returned only
	 * after its shard applied it.  The work is still posted (kvr_route's booking, the lifecycle
	 * calls' releases and output blocks), and the next call that reads what it changes
	 * first waits until the shards have applied it (kvr_route, the lifecycle calls' lease
	 * checks, kvr_request_cached, metrics, memory, kvr_router_sync; the rank calls and events
	 * queue behind it on their rank's shard), usually at once: the shards ran it while the
	 * caller went on.  Return codes are the waited-for
	 * ones, but under memory exhaustion: kvr_route waits for a booking whenever the shard
	 * would have to allocate to track the attempt (so that KVR_ENOMEM is returned as before;
	 * each shard keeps that room made ahead, from its start and each rank's creation on, so
	 * this waits only once the room is used up: kvr_booking_waits_total counts them), but a
	 * shard that cannot record a deferred booking's load books it without (see kvr_route),
	 * and a shard-side failure while predicting kvr_request_output's blocks is counted
	 * (kvr_shard_errors_total{what="index_write"}) instead of returned, as without
	 * sync_booking.  kvr_route decides again when the rank is removed before it returns (a
	 * removal after it returns ends the attempt: KVR_ESTALE). */
	bool sync_booking;
	/* Expected prefill duration of a request, ns (0 = unknown, the default): the oldest
	 * in-prefill request of a rank then counts linearly less prefill load as it progresses
	 * (decisions read it in steps of 1/16 of this: the shard publishes it again each step). */
	uint64_t expected_prefill_ns;
	/* Called (never under a router lock) when a queued request is admitted, or could not be
	 * (d->status KVR_FAILED, d->error why: KVR_ESHUTDOWN for one still queued when the router
	 * is destroyed), unless a kvr_route_wait caller collects it; d is borrowed for the call.
	 * It runs on the thread whose call admitted it: inside kvr_route, a lifecycle call,
	 * kvr_rank_add, _remove, _reset or _set_capacity (a removal tells the requests restricted
	 * to ranks now gone at once), kvr_router_sync, another ticket's kvr_route_wait, or
	 * kvr_router_destroy, so it must not wait for a lock its caller may hold around those
	 * calls; or, for load the router lowers by itself (an attempt's lease expiring, a step of
	 * the expected_prefill_ns decay) or once a posted lifecycle call's work is applied (an
	 * output, say, which implies its prefill is done), on the router's admission thread (one
	 * per router with a queue, started by kvr_router_create), so a request queued behind an
	 * attempt that vanished, or routed just before such work was applied, is admitted with no
	 * further call.  Default NULL. */
	void (*on_admit)(void *ctx, uint64_t ticket, const struct kvr_decision *d);
	/* Called when a rank's KV event ids skip ahead: events expected..got-1 were lost, so the
	 * embedder can ask the worker to replay.  Also, once per episode, when a rank reaches its
	 * stored-block bound (events_max_blocks; kvr_events_apply), or a stored event of the rank
	 * is refused because the index holds the most runs it can name (kvr_events_apply): the
	 * refused event is reported lost (expected = its id, got = its id + 1; 0 and 1 when
	 * unnumbered, as a feed's are) and the rank is out of sync until resynced (a cleared event,
	 * kvr_rank_reset): replaying will not help.
	 * Called once the event is applied, on the thread
	 * that called kvr_events_apply (a feed's thread for a feed), with no router lock held: the
	 * API may be called from it (see kvr_feed_add for a feed's calls).  Default NULL. */
	void (*on_event_gap)(void *ctx, uint64_t worker_id, uint32_t dp_rank, uint64_t expected,
	                     uint64_t got);
	void *callback_ctx;
	/* approx_lru: the engine's free-queue order (enum kvr_free_order).  Default
	 * KVR_FREE_FRESH_FIRST (current vLLM); KVR_FREE_TAIL_FIRST for a vLLM of 2025.  With the
	 * wrong one, predictions still hold while the ranks have room, and drift under eviction
	 * (kvr-replay --free-order measures by how much).  Other values: KVR_EINVAL. */
	enum kvr_free_order free_order;
};

/* Fills *cfg with the documented defaults.  NULL is a no-op. */
KVR_API void kvr_config_init(struct kvr_config *cfg);

/* Checks a configuration.  Returns 0 or KVR_EINVAL / KVR_ERANGE for an impossible value. */
KVR_API int kvr_config_validate(const struct kvr_config *cfg);

/* ---------------------------------------------------------------- router */

struct kvr_router;

/*
 * Creates a router.  cfg is borrowed (copied); NULL means all defaults.
 * Returns 0 and *out, or KVR_EINVAL (out NULL, bad config), KVR_ERANGE, KVR_ENOMEM (out of
 * memory, or a thread could not be started: the process's thread limit; the detail says which).
 * Context: any thread; starts the shard threads, with a queue (queue_threshold > 0) the
 * admission thread (see on_admit), and, with the process's first router, the thread that runs
 * the library's deferred frees, shared by every router.  The library's
 * threads block the asynchronous signals (all but SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGTRAP,
 * SIGSYS), so a signal sent to the process reaches one of the program's threads.
 *
 * fork(2): a process may fork at any time, with routers live and threads calling them (the
 * library holds its own locks and liburcu's across the fork: pthread_atfork handlers, registered
 * with the first router).  In the child, a router created before the fork is the parent's: its
 * threads are not in the child, so every call on it returns KVR_ESHUTDOWN at once ("... was
 * created before this process forked"), kvr_router_destroy returns leaving it (its memory is the
 * parent's copy), and so do the feeds and replica handles attached to it (kvr_feed_destroy,
 * kvr_sync_detach).  A router the child creates is the child's and works as any (a pre-fork
 * server: one router per worker process).  The library's handlers take liburcu-bp's locks
 * across the fork (urcu_bp_before_fork and its pair): an embedder that also uses liburcu-bp
 * must not call those as well.
 */
KVR_API int kvr_router_create(const struct kvr_config *cfg, struct kvr_router **out);

/* Stops the shard threads (and the admission thread), frees everything.  NULL is a no-op.  Like any
 * destroy, it must not race with other calls on the router: stop (join) the threads that use it
 * first.  Threads blocked in kvr_route_wait are woken with KVR_ESHUTDOWN before anything is freed.
 * It must not be called from the router's own callbacks (on_admit, on_event_gap, the clock, on
 * whichever thread: a shard's, or the caller's inside kvr_route and the like) nor from a feed's or
 * replica's thread of this router (their callbacks): it would wait for, or free under, the call
 * that runs the callback; there it returns at once and destroys nothing (call it from another
 * thread once the callback returned).  It waits for feeds
 * destroyed from callbacks or library threads to finish their teardown (kvr_feed_destroy), and
 * stops the feeds not destroyed yet (see kvr_feed_create). */
KVR_API void kvr_router_destroy(struct kvr_router *router);

/* The router's current time on its clock, ns (0 for router NULL). */
KVR_API uint64_t kvr_router_now(const struct kvr_router *router);

/* Copies the router's effective configuration (defaults resolved) into *out.  cpu_list points
 * at the router's own copy of the list it was created with (valid until kvr_router_destroy;
 * NULL and n_cpus 0 when none was given), so a router created from *out pins its shards alike.
 * Returns 0 or KVR_EINVAL (router or out NULL). */
KVR_API int kvr_router_get_config(const struct kvr_router *router, struct kvr_config *out);

/* ---------------------------------------------------------------- ranks */

/* A worker rank: a worker and one of its data-parallel ranks. */
struct kvr_rank_id {
	uint64_t worker_id;
	uint32_t dp_rank;
};

/* KVR_CAPACITY_NONE: no known capacity; the rank's blocks are kept by TTL retention. */
#define KVR_CAPACITY_NONE UINT64_MAX

/*
 * Adds a rank.  incarnation names this life of the rank (e.g. the engine's start time): a later
 * command carrying another incarnation is stale, or (set_capacity/reset) starts a new life.
 * max_batched_tokens: the engine's token budget per step (queue threshold; 0 = unknown).
 * capacity_blocks: its KV cache size in blocks for approx_lru, or KVR_CAPACITY_NONE; in events
 * mode it bounds what the rank's events may store (kvr_events_apply).
 * Returns 0, KVR_EEXIST, KVR_ERANGE (max_ranks reached), KVR_ENOMEM, KVR_EINVAL, KVR_EBUSY
 * (only from a router callback on a shard's thread, where it would wait for good: see
 * kvr_config.now_ns; nothing added).
 * Context: any thread.
 */
KVR_API int kvr_rank_add(struct kvr_router *r, struct kvr_rank_id rank, uint64_t incarnation,
                         uint64_t capacity_blocks, uint32_t max_batched_tokens);

/* Sets the capacity (blocks; KVR_CAPACITY_NONE or 0 = TTL retention).  A different incarnation
 * clears the rank and starts a new life; an older one is KVR_ESTALE.  Shrinking evicts.  With
 * the same incarnation, a switch between TTL retention and a finite capacity (either way)
 * forgets the rank's predicted cache; its live attempts stay live (their later output is
 * tracked for load only).
 * Returns 0, KVR_ENOENT, KVR_ESTALE, KVR_ENOMEM, KVR_EBUSY (as kvr_rank_add). */
KVR_API int kvr_rank_set_capacity(struct kvr_router *r, struct kvr_rank_id rank,
                                  uint64_t incarnation, uint64_t capacity_blocks);

/* Forgets everything known about the rank's cache and requests (its attempts become stale) and
 * continues with new_incarnation.  Returns 0, KVR_ENOENT, KVR_ESTALE (new_incarnation older),
 * KVR_ENOMEM (the new, empty predicted cache could not be made: nothing changed), KVR_EBUSY (as
 * kvr_rank_add). */
KVR_API int kvr_rank_reset(struct kvr_router *r, struct kvr_rank_id rank, uint64_t new_incarnation);

/* Removes the rank; its attempts become stale, and in events mode its blocks leave the index (a
 * feed rebuilds a rank it fed if it is added back: see the feed's rules).  Returns 0,
 * KVR_ENOENT, KVR_ENOMEM (the copy of the routable-rank list without it could not be made:
 * nothing changed, the rank still routes) or KVR_EBUSY (as kvr_rank_add; nothing changed). */
KVR_API int kvr_rank_remove(struct kvr_router *r, struct kvr_rank_id rank);

struct kvr_rank_stats {
	uint64_t incarnation;
	uint64_t capacity_blocks; /* as registered (kvr_rank_add, _set_capacity; not raised by
	                           * kvr_rank_observe); KVR_CAPACITY_NONE for a rank without one
	                           * (registered with KVR_CAPACITY_NONE or 0: TTL retention in
	                           * approx_lru).  approx_ttl keeps every rank by TTL whatever it
	                           * reads */
	uint64_t resident_blocks; /* predicted (approx_lru) or indexed blocks */
	uint64_t indexed_blocks;  /* blocks the index holds for the rank */
	uint64_t active_blocks;   /* distinct blocks pinned by in-flight requests */
	uint64_t active_prefill_tokens;
	uint64_t active_requests; /* live attempts */
	uint64_t evictions;
	uint64_t event_id;   /* last applied KV event id (events mode) */
	uint64_t event_gaps; /* event id gaps, episodes at the stored-block bound or with the
	                      * index's run ids used up (kvr_events_apply) */
};

/* A snapshot of one rank's state.  Returns 0, KVR_ENOENT, KVR_EINVAL (out NULL), KVR_EBUSY
 * (from the router's clock on a shard that the rank's shard waits for), KVR_ENOMEM (the calling
 * thread's first call, see the lifecycle calls). */
KVR_API int kvr_rank_get_stats(struct kvr_router *r, struct kvr_rank_id rank,
                               struct kvr_rank_stats *out);

/*
 * The blocks the router believes the rank caches (approx modes: predicted; events mode: as the
 * engine reported), as external hashes (the sequence hashes of kvr_hash_blocks in approx
 * modes).  Writes up to cap hashes to out (any order); *n_out (required) gets the total.
 * Returns 0, KVR_ERANGE (cap too small: *n_out says how many), KVR_ENOENT, KVR_EINVAL,
 * KVR_EBUSY and KVR_ENOMEM (as kvr_rank_get_stats).
 * Context: any thread; one round trip to the rank's shard.  For observability and tests.
 */
KVR_API int kvr_rank_blocks(struct kvr_router *r, struct kvr_rank_id rank, uint64_t *out,
                            size_t cap, size_t *n_out);

/* ---------------------------------------------------------------- routing */

enum kvr_route_flags {
	/* Decide, book nothing (no attempt, no index change; with requests queued, the call may
	 * still run the queue's admission pass, as any call does, admitting those).  It advances
	 * no random stream
	 * either, so asking never changes a later decision: with temperature > 0 (or ties),
	 * repeated queries on an unchanged router give the same rank, not a sample. */
	KVR_ROUTE_QUERY_ONLY = 1u << 0,
	KVR_ROUTE_WAIT = 1u << 1 /* if queued, block until admitted or deadline_ns (not inside
	                          * the router - its clock, a callback, one of its threads: a
	                          * queued request comes back KVR_QUEUED there, KVR_ETIMEDOUT if
	                          * deadline_ns has passed, see kvr_route) */
};

/* The longest prompt kvr_route accepts, tokens (a longer n_tokens is KVR_EINVAL).  Its complete
 * blocks must also number fewer than 2^32 (the block counts are 32-bit): with block_size 1 the
 * longest is one token less. */
#define KVR_MAX_PROMPT_TOKENS (UINT64_C(1) << 32)

struct kvr_request {
	/* The prompt: tokens (borrowed), or precomputed local block hashes (borrowed) with
	 * n_tokens still giving the prompt length (n_hashes <= n_tokens / block_size).  Exactly
	 * one of tokens / local_hashes, or both with seq_hashes (below).
	 * 1 <= n_tokens <= KVR_MAX_PROMPT_TOKENS, and n_tokens / block_size < 2^32. */
	const uint32_t *tokens;
	size_t n_tokens;
	const uint64_t *local_hashes;
	size_t n_hashes;
	/* Optional, with local_hashes: their sequence hashes (seq_out of kvr_hash_blocks /
	 * kvr_hash_extend for the same blocks; n_hashes of them; borrowed).  A frontend that keeps
	 * a session's chain and hashes only each turn's new tokens passes both, and the router
	 * hashes nothing (without them it chains local_hashes again: one dependent XXH3 per
	 * block, about as long as hashing the tokens).  With tokens too, the hashes must be those
	 * of the tokens' complete blocks (n_hashes = n_tokens / block_size): the router then
	 * keeps the partial last block's tokens, so output tokens extend the chain as with tokens
	 * alone.  Not checked: hashes that are not the chain of the prompt route the prompt they
	 * name; made-up ones (repeated within a prompt, or naming another chain's block) never
	 * corrupt the router's state, they only make its predictions less exact
	 * (tests/fuzz/fuzz_api.c --craft).  NULL = the router hashes. */
	const uint64_t *seq_hashes;
	const char *lora_name;            /* borrowed; NULL = none */
	uint64_t request_id;              /* the frontend's id, for probes and logs */
	uint32_t expected_output_tokens;  /* adds to the request's potential decode blocks */
	uint32_t flags;                   /* enum kvr_route_flags */
	const struct kvr_rank_id *pinned; /* route here (must be in allow if both are set) */
	const struct kvr_rank_id *allow;  /* candidates restricted to these (duplicates and
	                                   * unknown ranks are ignored; any length) */
	size_t n_allow;
	/* Per-request overrides; a negative value means "the router's"; NaN or infinite (-inf
	 * too) is KVR_EINVAL. */
	double overlap_credit;
	double prefill_load_scale;
	double temperature;
	/* KVR_ROUTE_WAIT deadline on the router clock (ns); 0 = wait forever. */
	uint64_t deadline_ns;
};

/* Fills *req with "no prompt, no options, router's parameters". */
KVR_API void kvr_request_init(struct kvr_request *req);

enum kvr_decision_status {
	KVR_DECIDED = 0, /* admitted: rank and attempt are valid */
	KVR_QUEUED = 1,  /* waiting: ticket is valid; on_admit or KVR_ROUTE_WAIT tells the rest */
	KVR_FAILED = 2   /* a queued request could not be admitted (its pinned or allowed ranks
	                  * went away, no memory): error says why; given to on_admit and by
	                  * kvr_route_wait, which then also returns error */
};

struct kvr_decision {
	int status; /* enum kvr_decision_status */
	struct kvr_rank_id rank;
	uint32_t overlap_blocks;  /* predicted cached prefix on the rank, blocks */
	uint32_t required_blocks; /* the prompt's blocks routed on: n_tokens / block_size, or
	                           * n_hashes when hashes are given */
	uint64_t cached_tokens;   /* overlap_blocks * block_size */
	uint64_t attempt;         /* the attempt id (lease); 0 for query-only */
	uint64_t ticket;          /* queue ticket when status == KVR_QUEUED */
	double cost;              /* the chosen rank's cost (Dynamo's formula, kvr_config's
	                           * weights); +-inf where finite weights overflow a double
	                           * (1e308: the choice is still the least cost's) */
	int error;                /* KVR_FAILED: the KVR_E* code of the failed admission; else 0 */
};

/*
 * Routes one request: hashes it, finds which ranks hold its prefix, scores every candidate by
 * overlap and load, picks one and admits the request there (lease, LRU, load, index).  The cost
 * is Dynamo's: prefill_load_scale * (prefill tokens / block_size - overlap_credit * cached
 * blocks) + decode blocks, where decode blocks = the rank's active blocks + the request's blocks
 * NOT already pinned there by in-flight requests (a sibling decoding the same prefix).
 * Returns 0 (see d->status), KVR_EINVAL (bad request), KVR_ENOENT (no eligible rank: none
 * added, pinned/allowed rank unknown), KVR_EAGAIN (queue full; or the chosen rank's shard lane
 * stayed full for 10 ms: the router is overloaded, nothing was admitted; or over 2^20 attempts
 * are live), KVR_ETIMEDOUT (KVR_ROUTE_WAIT deadline; d->ticket names the request, which stays
 * queued), KVR_ENOMEM, KVR_ERANGE (the router's 2^46 attempt ids are used up), KVR_ESHUTDOWN,
 * KVR_EBUSY (KVR_ROUTE_WAIT from on_admit, inside the queue's admission pass, with every
 * eligible rank saturated: only that pass could admit it; nothing queued; also a sync_booking
 * booking from the router's clock on a shard that the chosen rank's shard waits for).  On a
 * failure other than KVR_EINVAL, KVR_ETIMEDOUT and a failed queued admission (whose d is the
 * outcome's, as kvr_route_wait's), d is zeroed with status KVR_FAILED and error the code: a
 * decision whose booking failed is not left reading KVR_DECIDED.
 * Context: any thread, concurrently.  The whole call runs on the caller's thread and never
 * waits for a shard (unless sync_booking): the attempt id is minted lock-free, the request's
 * load is added to the rank's published load at once (the very next decision on any thread
 * sees it), and the booking (predicted cache, index writes, exact load) is posted to the rank's
 * shard.  A full lane is waited on for at most 10 ms (kvr_lane_full_waits_total counts the
 * waits, kvr_lane_full_drops_total the give-ups); without sync_booking, a queued request's
 * booking in an admission pass that a call runs on the caller's thread (see on_admit) does not
 * wait at all: refused at once, the request stays queued and the router's admission thread
 * retries it, with that bounded wait (counted there).  Because the booking is posted, a decision
 * taken microseconds later may not see this prompt's blocks yet (it does see its load); a
 * shard that booked within the last 10 ms and sleeps is not woken for it, and applies it
 * within kvr_config.booking_lazy_ns (250 us by default) plus its scheduling delay.  If the
 * rank is removed between the decision and the booking, the attempt is stale: nothing is
 * booked and its lifecycle calls return KVR_ESTALE once the rank's shard has seen the booking
 * (kvr_stale_bookings_total); with sync_booking, kvr_route decides again instead when the rank
 * is removed before it returns (see kvr_config.sync_booking for what it waits for), and returns
 * KVR_ENOENT when the rank it chose went away so at each of 4 decisions.  A posted booking that
 * runs out of memory on the shard is dropped the same way (the attempt is stale,
 * kvr_shard_errors_total{what="index_write"} counts it); with sync_booking kvr_route returns
 * KVR_ENOMEM when the shard must allocate to track the attempt (it waits for that booking), and
 * a booking whose load the shard cannot record is made without it (the request's load stays
 * counted provisionally until it ends; counted the same way), so an attempt it returned lives.
 */
KVR_API int kvr_route(struct kvr_router *r, const struct kvr_request *req, struct kvr_decision *d);

/* Waits for a queued request (ticket from a KVR_QUEUED decision) until deadline_ns (router
 * clock; 0 = forever).  Returns 0 with d filled, KVR_ETIMEDOUT (the request stays queued, and
 * the caller's to collect: on_admit never reports a ticket once waited on, so wait again or
 * cancel it, or its admission is reported to nobody: it is then kept until its attempt's lease
 * expires, as an idle attempt's does, and dropped with it; a failed admission is kept two
 * lease_scan_interval_ns),
 * KVR_ENOENT (unknown ticket - another router's too: the routers of a process issue different
 * tickets -, already collected - by on_admit too -, cancelled meanwhile, or its admission
 * dropped uncollected as above; d is then not written), KVR_ESHUTDOWN, KVR_EBUSY (called from
 * on_admit, inside the queue's admission pass, for a ticket not admitted yet: only that pass admits
 * it; or called inside the router - its clock, a callback, one of its threads or shards - for a
 * ticket not admitted yet and a deadline not passed: a wait there could wait for the call it runs
 * in, such as the pass that reads the clock; it stays queued, nothing waited), or the error of a
 * failed admission (d->status KVR_FAILED, d->error the same code: KVR_ENOENT when its
 * pinned/allowed ranks are gone, KVR_ENOMEM, KVR_ERANGE).  KVR_EINVAL: r or d NULL, ticket 0.  A
 * ticket is collected once, by kvr_route_wait or (when set and nobody waits) by on_admit, which
 * also receives failed admissions (status KVR_FAILED).  The deadline is checked against the
 * router's clock about every millisecond of the wait: with a replaced clock (kvr_config.now_ns), it
 * passes only when something moves that clock. */
KVR_API int kvr_route_wait(struct kvr_router *r, uint64_t ticket, uint64_t deadline_ns,
                           struct kvr_decision *d);

/* Cancels a queued request: after 0 the request holds nothing and its ticket is gone.  If it was
 * admitted (or failed) meanwhile and nobody collected the outcome yet (a kvr_route_wait that
 * timed out, then lost the race to the admission), the cancel takes the outcome and ends the
 * attempt as kvr_request_abort does (exactly once: a lease expiry may have ended it already), so
 * the usual way to give up (wait with a deadline, then cancel) leaves no attempt and no load
 * behind; a caller that would rather take a late admission collects it first (kvr_route_wait
 * with a past deadline returns it at once).  Returns 0 or KVR_ENOENT (not queued and nothing
 * to take: reported to on_admit or collected by kvr_route_wait already, cancelled, dropped
 * uncollected (see kvr_route_wait), or unknown, as another router's ticket is); KVR_EINVAL for
 * r NULL or ticket 0; KVR_ESHUTDOWN; KVR_EBUSY (nothing cancelled) when the request is being
 * admitted at that moment and the call comes from inside the router (its clock, a callback, one
 * of its threads or shards), which that admission may be waiting for.  Otherwise, if the request
 * is being admitted at that moment, it waits for the outcome (one routing decision): a cancel that
 * returns 0 guarantees the request is never served (never admitted, or its admission ended before
 * anyone was told of it).  Context: any thread; an abort of a taken admission runs as
 * kvr_request_abort (it does not wait for the rank's shard either). */
KVR_API int kvr_route_cancel(struct kvr_router *r, uint64_t ticket);

/* ---------------------------------------------------------------- request lifecycle */
/* All are idempotent on the request's end: after finish, abort or lease expiry, every call on
 * the attempt returns KVR_ESTALE and changes nothing.  Context: any thread, not only the one
 * that routed.  None waits for a shard: finish and abort claim the attempt (one atomic
 * compare-and-swap; finish, abort, lease expiry and a rank's reset or removal race through it and
 * exactly one wins), prefill_done and output mark it alive, so 0 or KVR_ESTALE is known at once;
 * the work (blocks released, load returned, output blocks predicted) is posted to the rank's
 * shard and applied after the attempt's booking, even when another thread calls right after
 * kvr_route returned.  The post does not wake a shard that went idle within the last 100 ms:
 * such a shard sleeps at most 1 ms at a time (booking_lazy_ns while it booked within the last
 * 10 ms) and applies the work when it wakes, so the load
 * released shows in decisions at most 1 ms (plus the shard thread's scheduling delay) after the
 * call (kvr_shard_wakes_deferred_total counts these; a shard idle for longer is woken at once,
 * and any later synchronous call or kvr_router_sync() applies it first).  With sync_booking the
 * work is applied before anything later reads it (see kvr_config.sync_booking).  A router that
 * queues: where queued requests may wait for what the call releases (finish/abort/prefill_done
 * while requests are queued or the rank is saturated; output while the rank is saturated), the
 * shard is woken for the work at once, and once it has applied it the router's admission thread
 * runs the queue's admission pass; the call returns without waiting for either.  So a route
 * right after a finish on a saturated rank may queue and be admitted a moment later (on_admit,
 * kvr_route_wait), where before the finish waited for its shard and admitted it first; with
 * sync_booking the work is applied, and the pass run, before the call returns.  A full lane
 * (overload): finish/abort wait for room (they are claimed already); prefill_done/output wait at
 * most 10 ms, then return KVR_EAGAIN (nothing changed; with sync_booking every call waits for
 * room).  On the router's shard threads (a router callback there, the clock) none waits for room:
 * finish/abort return 0 and the shard thread posts their work once there is room (kvr_router_sync
 * waits for it); prefill_done/output return KVR_EAGAIN when the lane is the calling shard's own and
 * KVR_EBUSY when its shard waits for the calling one (nothing changed either way), and otherwise
 * wait as above.  Output may also return KVR_ENOMEM (copying more than 6 tokens), and every one of
 * them when it is the calling thread's first call into the library and the thread cannot be
 * registered with RCU (the process used up its pthread keys, or memory): nothing changed, the
 * attempt not claimed.  An attempt id this router never issued: KVR_ENOENT or KVR_ESTALE.  That
 * includes another router's ids: each router of a process renames its ids (shards/lease.c), so a
 * call given the wrong router's handle (or a router created to replace the one that issued the id)
 * is refused instead of ending the attempt that router issued under the same number; the ids of a
 * router and the next one created cannot meet before one has issued 2^45.  r NULL, attempt 0, or
 * output tokens NULL with n_tokens > 0 or n_tokens > UINT32_MAX: KVR_EINVAL (README.md, "Bad
 * input"). */

/* The prompt is prefilled: its prefill tokens leave the rank's load. */
KVR_API int kvr_request_prefill_done(struct kvr_router *r, uint64_t attempt);

/* New output tokens (borrowed), in order; pass every sampled token, as a streaming frontend sees
 * them.  Blocks are chained after the prompt and materialized in the rank's cache prediction the
 * way vLLM computes them: a token's KV exists only once the engine has fed it back to sample the
 * next one, so a block counts as cached only after a token AFTER it has been reported.  At
 * finish or abort the last reported token never got KV: a block that only it completes is not
 * predicted, and the partial block of computed tokens is held (not cached) until the end, as in
 * vLLM.  After P prompt and O >= 1 output tokens with block size B the rank holds
 * ceil((P+O-1)/B) blocks and caches floor((P+O-1)/B) (B = 16: prompt 10 + 6 output caches
 * nothing, 10 + 7 caches one block); with no output, what the prefill computed: every prompt
 * token has KV, so it caches floor(P/B) (prompt 32: two blocks).  Not mirrored: with vLLM's
 * async scheduling a request that stops on a stop token has already been given one more slot,
 * which can allocate (and evict) one extra block at the very end; the prediction follows the
 * synchronous scheduler.  One step behind while the request runs: vLLM allocates (and caches
 * up to) the last sampled token's slot as it schedules the next step, the router only once a
 * later token is reported (it cannot tell that the last one is not the final one), so a request
 * routed to the rank within that step finds one block fewer than predicted when that allocation
 * evicted one (kvr_request_output_ex, told which token is final, has no such step).  Sending
 * tokens in batches adds to this unless each batch ends one token past a block boundary (with
 * kvr_request_output_ex: at a block boundary; tools/replay/replay.c, "When a batch goes out").
 * Bound (approx_lru, a rank with a capacity): one attempt's predicted blocks grow through its
 * output up to twice the rank's capacity (the larger of the registered one and the estimate)
 * plus 1,024 blocks.  No engine holds one request larger than its KV cache, so an honest
 * stream never gets there; past it (a runaway generation, a bug) the rest of the attempt's
 * output is not predicted (its liveness still is), counted once in
 * kvr_output_over_bound_total, so that it cannot grow the router's memory without limit while
 * the attempt lives.  TTL retention has no such bound: its blocks expire anyway. */
KVR_API int kvr_request_output(struct kvr_router *r, uint64_t attempt, const uint32_t *tokens,
                               size_t n_tokens);

#define KVR_OUTPUT_FINAL 1u /* tokens[n_tokens - 1] is the request's final output token */

/* kvr_request_output for a frontend that knows, as it passes tokens, whether the last one ends
 * the request (a streaming response carries finish_reason with its last token): exact instead
 * of one step behind.  Without KVR_OUTPUT_FINAL the last token is NOT the final one: vLLM
 * allocates its slot as it schedules the next step (a block it opens is taken then, evicting if
 * the rank is full), and the router counts it at once.  With KVR_OUTPUT_FINAL it is the final
 * one, which never gets KV (as in kvr_request_output, it is dropped at finish or abort).  Calls
 * may mix with kvr_request_output (a token of unknown finality is held back until a later one
 * comes).  n_tokens 0 changes nothing.  A frontend that learns of the end only after it passed
 * the last token (finish_reason in a later, empty chunk) should use kvr_request_output: a token
 * passed as not final is counted.  Replicas (replica sync) apply it exactly so: the replicated
 * output carries whether the last token is final.
 * Returns as kvr_request_output, and KVR_EINVAL for unknown flags.  Context: as
 * kvr_request_output (any thread; never waits for a shard). */
KVR_API int kvr_request_output_ex(struct kvr_router *r, uint64_t attempt, const uint32_t *tokens,
                                  size_t n_tokens, uint32_t flags);

/* The request ended normally / was aborted: its blocks are released, its load returned. */
KVR_API int kvr_request_finish(struct kvr_router *r, uint64_t attempt);
KVR_API int kvr_request_abort(struct kvr_router *r, uint64_t attempt);

/* ---------------------------------------------------------------- engine ground truth
 *
 * The approximate modes predict each rank's cache from this router's own decisions; traffic the
 * router never saw (other routers, direct clients), preemption, or a capacity registered wrong
 * make the prediction drift.  The engine's own numbers correct it.  Eviction is ORDERED (least
 * recently released first, deepest block first), so one fact about a block the engine no longer
 * holds proves that everything released before it went too, and all of it leaves the
 * prediction (and the index) at once.  Only blocks no live request holds are ever evicted this
 * way.  Events mode has nothing to heal (its index is the engine's report): these calls change
 * nothing there and return 0 once their checks pass (an unknown rank, a stale attempt or
 * incarnation, a bad argument are refused as in the other modes; kvr_request_cached still
 * marks a live attempt alive, as any call on it does).  Both calls wait for the rank's shard
 * (feedback, not the routing path).
 */

/*
 * The engine's answer for this attempt: how many of its prompt tokens it found cached (vLLM:
 * usage.prompt_tokens_details.cached_tokens; SGLang: meta_info.cached_tokens), counted in whole
 * blocks (cached_tokens / block_size).  Call it once the engine has admitted the request (at
 * the first token), before finish or abort.
 * Below the predicted cached prefix: the first block the engine missed had been evicted, and so
 * had every block released before it; they are evicted from the prediction now.  At or above it:
 * nothing to evict (the blocks the engine proved cached are held by the attempt already).
 * Either way the answer bounds the engine's real capacity (a block it still holds that the
 * prediction had evicted proves it larger than registered; a block it lost proves it smaller),
 * and approx_lru keeps each rank's prediction at its estimate of that capacity (starting at the
 * registered one; kvr_rank_set_capacity resets it).
 * Counted in kvr_heal_* metrics (over / under predictions, blocks evicted).
 * Returns 0; KVR_EINVAL (r NULL, attempt 0, cached_tokens above the prompt's token count);
 * KVR_ESTALE (the attempt ended, expired, or its rank was reset or removed); KVR_ENOENT or
 * KVR_ESTALE (not an id this router issued: as for the other lifecycle calls, an id whose rank
 * slot exists reads as ended); KVR_ESHUTDOWN; KVR_ENOMEM.  Nothing changes on error.
 */
KVR_API int kvr_request_cached(struct kvr_router *r, uint64_t attempt, uint64_t cached_tokens);

#define KVR_OBSERVE_RESIDENT  1u /* resident_blocks is given */
#define KVR_OBSERVE_WATERMARK 2u /* watermark_hash is given */

/* What a rank's engine reports about its cache (a Prometheus scrape, a stats endpoint). */
struct kvr_rank_observation {
	uint32_t flags;           /* KVR_OBSERVE_*: at least one */
	uint64_t incarnation;     /* the rank incarnation the numbers are from */
	uint64_t resident_blocks; /* cached blocks the engine holds (vLLM: kv_cache_usage_perc x
	                           * num_gpu_blocks); the oldest predicted blocks that no live
	                           * request holds are evicted until the prediction holds no more.
	                           * Above the rank's capacity it proves the capacity
	                           * under-registered: the prediction's capacity is raised to it
	                           * (never lowered this way; kvr_rank_set_capacity replaces it) */
	uint64_t watermark_hash;  /* the engine's oldest resident block, as kvrouter's sequence
	                           * hash of its prefix: every predicted block released before it
	                           * is evicted */
};

/*
 * Reconciles one rank's prediction with its engine's numbers (see struct kvr_rank_observation).
 * A watermark the prediction does not hold on its evictable list proves nothing (counted in
 * kvr_heal_watermark_unknown_total; 0).  A resident count above the registered capacity raises
 * the capacity the prediction evicts at to that count (counted in
 * kvr_heal_capacity_raised_total): the engine holding it proves it fits.  Returns 0; KVR_EINVAL
 * (NULL, no or unknown flags); KVR_ENOENT (no such rank); KVR_ESTALE (obs->incarnation is not the
 * rank's current one); KVR_ESHUTDOWN; KVR_ENOMEM.  Nothing changes on error, but for a
 * KVR_ENOMEM of the resident part with both flags given: the watermark's evictions, true on
 * their own, stay applied.  In events mode the checks above still run (KVR_ENOENT, KVR_ESTALE).
 */
KVR_API int kvr_rank_observe(struct kvr_router *r, struct kvr_rank_id rank,
                             const struct kvr_rank_observation *obs);

/* ---------------------------------------------------------------- KV events */

enum kvr_event_type { KVR_EVENT_STORED = 0, KVR_EVENT_REMOVED = 1, KVR_EVENT_CLEARED = 2 };

struct kvr_event_block {
	uint64_t ext_hash;      /* the engine's hash of the block */
	const uint32_t *tokens; /* borrowed: the block's block_size token ids, or NULL */
	uint64_t local_hash;    /* used when tokens is NULL */
	uint32_t n_tokens;      /* must equal the router's block_size when tokens is set */
};

struct kvr_event {
	int type;          /* enum kvr_event_type */
	uint64_t event_id; /* per (worker, dp rank), increasing; 0 = unnumbered; UINT64_MAX is
	                    * KVR_EINVAL (a lost event's report, its id + 1, must not wrap) */
	bool has_parent;   /* stored: blocks follow parent_ext_hash */
	uint64_t parent_ext_hash;
	const struct kvr_event_block *blocks; /* stored (borrowed) */
	size_t n_blocks;
	const uint64_t *removed; /* removed: external hashes (borrowed) */
	size_t n_removed;
	const char *lora_name; /* stored with tokens: the adapter (borrowed) */
};

/*
 * Applies one KV event of a rank on the rank's shard.  Event ids: an id at or below the last
 * applied one is dropped (KVR_ESTALE); a jump ahead is applied, counted as a gap and reported
 * through on_event_gap.  Returns 0, KVR_ESTALE, KVR_ENOENT (unknown rank, or one removed while
 * the call ran; stored: parent not held, nothing applied, the event id cursor moves past it, so
 * a parent's event sent after its child's is KVR_ESTALE; kvr_last_error says which),
 * KVR_EINVAL (malformed, nothing applied: block size mismatch, self-parent, NULL arrays, an
 * empty stored or removed list, event_id UINT64_MAX; or a stored block that contradicts the
 * rank's - an external hash it holds for another block, or a block it holds under another
 * hash -: the blocks before it stay applied and the event id cursor moves past it), KVR_ERANGE
 * (stored: the rank would exceed its bound, or the index holds the most runs it can name, 2^25 - 1;
 * see Bound and Run ids below; nothing applied, the event id cursor moves past it; kvr_last_error
 * says which), KVR_ENOMEM (nothing changed, the event id cursor included: the same event may be
 * applied again).  Removed hashes the rank does not hold are counted and skipped.  Copies count (as
 * in vLLM, which may hold two physical copies of one hash and sends one removal per copy):
 * storing a block the rank already holds adds a copy, a removal drops one, and the block leaves
 * the rank with its last copy; a cleared event drops them all, on every dp rank of the
 * rank's worker (a feed's AllBlocksCleared, which one engine sends for itself, clears its own
 * dp rank only), and ends the run-id episode (below) of each.
 * Bound: a rank holds at most twice its capacity plus 1,024 distinct blocks
 * (kvr_config.events_max_blocks without a capacity), so that lost removals or a wrong
 * publisher cannot exhaust the router's memory.  An engine no larger than its registered
 * capacity never gets there: vLLM reports an eviction before it stores into the freed block,
 * so a rank fed in order holds at most its engine's blocks.  A stored event that would take
 * the rank past it (its blocks counted as new, copies too) is refused whole (KVR_ERANGE, the
 * event id cursor moves past it), counted (kvr_events_total{type="stored",
 * status="over_bound"}, kvr_event_over_bound_blocks_total), and the rank is treated as out of
 * sync, as after a gap: on_event_gap once per episode (see there), event_gaps and
 * kvr_event_over_bound_episodes_total count it.  Nothing held is dropped: the embedder
 * resyncs (a cleared event, kvr_rank_reset).  An episode ends when the rank is down to half
 * its bound (after a clear, or removals).  Removed and cleared events are never refused.
 * Run ids: the index names each run of two blocks or more that are named by the router's own
 * sequence hashes (as kvr_hash_blocks gives them; engines' own hashes need none) with an id, at
 * most 2^25 - 1 live at once (~4 GB of index).  A stored event that needs one more is refused
 * whole (KVR_ERANGE), counted (kvr_events_total{type="stored", status="index_full"}) and
 * reported lost as at the bound: on_event_gap, event_gaps, once per episode (refusals of the
 * rank in a row; its next applied store, a cleared event or kvr_rank_reset ends it).  Ids come
 * back as runs die (removals, clears).
 * Context: any thread.  Meant for KVR_MODE_EVENTS; in other modes it is KVR_EINVAL.
 */
KVR_API int kvr_events_apply(struct kvr_router *r, struct kvr_rank_id rank,
                             const struct kvr_event *ev);

/* ---------------------------------------------------------------- vLLM KV event feed */
/*
 * A feed subscribes to vLLM's KV event publishers (vllm/distributed/kv_events.py, ZeroMQ PUB
 * with an optional ROUTER for replay) and applies their events to the router through the same
 * path as kvr_events_apply.  One background thread per feed polls every endpoint's socket.
 * Built with the meson feature `zmq` (on by default); without it every kvr_feed_* call that
 * returns int returns KVR_ENOTSUP, whatever its arguments, and clears *out / *n_out
 * (sync/feed_none.c; kvr_feed_config_init and kvr_feed_destroy work as documented).  Wire
 * rules, as the feed applies them:
 *  - messages are 3 frames: topic, seq (8-byte big-endian, from 0 at publisher start), msgpack
 *    payload [ts, events, dp_rank] or {ts, events, data_parallel_rank}; events as tagged maps
 *    (current vLLM) or tagged arrays (legacy).  Anything else is counted as malformed and
 *    skipped; a malformed batch applies nothing.
 *  - hashes: msgpack ints (uint64, including >= 2^63) are the external hashes; a bin digest
 *    (sha256, xxh3_128) is folded to its last 8 bytes big-endian, which is the int vLLM sends
 *    for the same block with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1.
 *  - BlockStored: block_size must equal the router's and token_ids must hold block_size tokens
 *    per block, else the event is refused (counted, logged); lora_name seeds the local hashes
 *    like kvr_request.lora_name; an event with a lora_id but no lora_name is refused (its
 *    adapter cannot be named, and crediting its blocks to base-model prompts would be wrong).
 *    One the index refuses (kvr_events_apply: the rank's stored-block bound, the index's run
 *    ids used up, a parent not held, blocks that contradict the rank's) is counted in refused
 *    and logged with its reason; the first two are also reported lost through on_event_gap
 *    once per episode, as kvr_events_apply says (0 and 1: the feed's events are unnumbered).
 *  - medium other than "GPU" (nil = GPU): counted and kept in a separate per-rank set, not in
 *    the GPU index, of at most kvr_config.events_max_blocks hashes (an offload tier's size is
 *    not registered): a BlockStored that could take it past is refused (counted, logged), and
 *    the GPU view is untouched, so no gap is reported.
 *  - copies: vLLM may hold two physical copies of one hash and sends one BlockRemoved per copy;
 *    in events mode the index counts copies per (rank, block), and a block leaves the index
 *    with its last copy.
 *  - AllBlocksCleared clears that rank only (each vLLM dp rank has its own publisher).
 *  - seq jump: the feed asks the replay endpoint (DEALER, ["", start_seq]) and applies the
 *    missing batches in order, dropping what already arrived; if there is no replay endpoint
 *    or it cannot cover the jump (buffer too short, replay_timeout_ms), the gap is reported
 *    through kvr_config.on_event_gap (expected/got are seqs) and the rank is cleared.  The first
 *    message of a stream with seq > 0 (router started after the publisher) is a gap from 0.
 *  - seq not above the last one received live: the publisher restarted; the rank is cleared.
 *  - a rank an endpoint feeds for the first time is cleared before its first batch applies:
 *    what it held came from elsewhere (an earlier feed or endpoint of the same publisher, whose
 *    stores the stream brings again from its start, or kvr_events_apply), and the stream
 *    rebuilds it.  Feed each rank from one endpoint at a time.
 *  - a batch for a rank the router does not have is dropped (unknown_rank); once the rank is
 *    added, the feed asks the replay endpoint for what it missed, applies that rank's batches,
 *    and reports what the replay cannot bring through on_event_gap, as for a gap.  A rank the
 *    feed fed and the router then removed lost its blocks with the removal (its engine keeps
 *    them): added back (same worker_id and dp_rank), it is rebuilt the same way from where
 *    what the index held of it began (the stream's start or its last clear), not only from
 *    the batches it missed.  The feed learns of the removal from a batch for the missing rank,
 *    from its events refused because it went meanwhile (kvr_events_total{status="rank_gone"};
 *    counted in refused), from another life of the rank found by its next batch or post, or
 *    from kvr_rank_add, which wakes the router's feeds: a rank removed and added back while its
 *    publisher is quiet is rebuilt then, without waiting for the publisher's next batch.
 */

struct kvr_feed;

/* kvr_feed_endpoint.dp_rank: take the rank from each batch's data_parallel_rank (nil: 0). */
#define KVR_FEED_DP_FROM_BATCH UINT32_MAX

/* Log levels of kvr_feed_config.log. */
enum kvr_log_level { KVR_LOG_ERROR = 0, KVR_LOG_WARN = 1, KVR_LOG_INFO = 2 };

struct kvr_feed_config {
	/* Longest wait for one answer of a replay, ms; an answer with a hole or short of its end is
	 * asked for again from what it lacks, and a replay ends within 8 times this (8 s at least)
	 * in all, what it still lacks then a gap.  The feed thread serves nothing else meanwhile
	 * (no other endpoint's batches, no call), so replays take turns: one at most is asked for
	 * before every endpoint and every waiting call is served again, a second gap or rank
	 * added late waiting for the next turn (it is then replayed, or reported, as it would have
	 * been), and N slow replays hold the thread one replay's end at a time, not N in a row.
	 * A kvr_feed_destroy or kvr_router_destroy does not wait it out: the replay is given up
	 * at once, and what it did not bring is no gap (on_event_gap is not called, gaps not
	 * counted: the feed going away missed nothing of the publisher's).  A rank the replay
	 * leaves short of what the publisher had sent (a gap being healed, or a rank added late
	 * being rebuilt, when some batch it needed did not come) is cleared all the same, as
	 * after a gap: those batches may have removed blocks, and no later event of this feed
	 * will say so; the rank refills from the next feed's events.  A rank the replay brought
	 * up to date, or had not begun to rebuild, is kept as it is.  Default 1000; >= 1. */
	uint32_t replay_timeout_ms;
	/* Largest message accepted, bytes (ZMQ_MAXMSGSIZE).  Default 64 MiB; 1024..INT64_MAX. */
	uint64_t max_msg_bytes;
	/* Messages queued per endpoint before ZeroMQ drops (ZMQ_RCVHWM), and per replay answer
	 * before the publisher's side must hold the rest.  Default 100000; >= 1 (ZeroMQ's 0, no
	 * limit, is KVR_EINVAL: the feed's memory would have no bound). */
	uint32_t rcv_hwm;
	/* After its sockets run dry the feed thread polls this long before it blocks, so the next
	 * batch costs no thread wake-up (lag), at the price of up to this much CPU per idle
	 * period.  Default 0 = block at once: on a machine with no core to spare, spinning delays
	 * the very threads (shards, ZeroMQ's I/O thread) the feed waits for.  50 us suits a
	 * machine with a core to spare (like kvr_config.shard_idle_spin_ns). */
	uint64_t idle_spin_ns;
	/* One-line messages (refused events, gaps, restarts, malformed input), called on the feed
	 * thread (see kvr_feed_add for the feed calls it may make); msg is borrowed for the call.
	 * Repeats of one kind are thinned out (logged at counts 1, 2, 4, 8, ...).  Default NULL =
	 * silent. */
	void (*log)(void *ctx, int level, const char *msg);
	void *log_ctx;
};

/* Fills *cfg with the documented defaults.  NULL is a no-op. */
KVR_API void kvr_feed_config_init(struct kvr_feed_config *cfg);

struct kvr_feed_endpoint {
	const char *endpoint; /* the PUB socket to connect: "tcp://host:port", "ipc://path" */
	const char *topic;    /* subscription prefix; NULL or "" = every topic */
	const char *replay_endpoint; /* the publisher's ROUTER socket for replay; NULL = none */
	uint64_t worker_id;          /* the rank it feeds: (worker_id, dp_rank) */
	uint32_t dp_rank;            /* or KVR_FEED_DP_FROM_BATCH */
};

/* Counters of one endpoint (or a whole feed).  Monotonic unless said otherwise. */
struct kvr_feed_stats {
	uint64_t messages;         /* messages received live (any shape) */
	uint64_t batches;          /* batches applied, live or replayed */
	uint64_t events;           /* events applied */
	uint64_t blocks_stored;    /* GPU blocks of applied BlockStored events */
	uint64_t blocks_removed;   /* GPU block removals (copies) applied */
	uint64_t malformed;        /* messages skipped: frames, seq or msgpack payload */
	uint64_t refused;          /* events refused: block size, token count, lora, index, bound */
	uint64_t unknown_rank;     /* batches for a rank absent, or whose resync is to come */
	uint64_t unknown_events;   /* events of an unknown type (skipped) */
	uint64_t duplicates;       /* batches dropped as already applied */
	uint64_t gaps;             /* seq jumps not healed (on_event_gap called, rank cleared;
	                            * not those a destroy ended: see replay_timeout_ms) */
	uint64_t replays;          /* replay requests answered (up to their end marker) */
	uint64_t replayed_batches; /* batches applied from replays */
	uint64_t restarts;         /* publisher restarts (seq went backwards) */
	/* Events (or batches, when their payload could not be decoded) not applied for lack of
	 * memory, not brought back by a replay: their rank is cleared and on_event_gap called
	 * (expected..got-1: the batches they came from), as after a gap, so the index never
	 * keeps a block the engine removed.  Counted in events too when they had been accepted.
	 * Logged only, with no rank to clear: an other-medium BlockStored (that set can then only
	 * fall short), and a batch whose dp rank was in the payload that could not be decoded
	 * while its endpoint (KVR_FEED_DP_FROM_BATCH) had fed no rank yet. */
	uint64_t lost;
	uint64_t other_medium_blocks; /* gauge: non-GPU blocks held now */
	uint64_t last_lag_ns;         /* gauge: publish (batch ts) to applied, wall clock; a
	                               * ts more than a day behind (not wall-clock seconds)
	                               * is no lag: left out, here and in the histogram */
	uint64_t next_seq;            /* gauge: the next seq expected (0 before the first) */
	uint64_t reasks; /* replay requests asked again: an answer with a hole or cut short */
};

/*
 * Creates a feed on r (an events-mode router) and starts its thread.  cfg is copied; NULL =
 * defaults.  Destroy the feed before the router; a feed left alive is stopped and released by
 * kvr_router_destroy but for its handle, on which every call then returns KVR_ESHUTDOWN and
 * kvr_feed_destroy frees.
 * Returns 0 and *out, KVR_EINVAL (r or out NULL, r not in KVR_MODE_EVENTS, bad cfg: a value
 * outside its range above), KVR_ENOMEM (also: the feed's thread could not be started, or fewer
 * than 13 file descriptors are left under the process's limit: ZeroMQ calls abort() when its
 * start runs out of them, so the feed makes sure they are there first), KVR_ENOTSUP
 * (built without zmq, whatever the arguments: kvr_feed_create(NULL, NULL, NULL) tells a program
 * whether the feed is built in).  libzmq calls abort() when it cannot start its reaper and I/O
 * threads (at the feed's first socket), so the feed first checks that two more threads can run
 * (KVR_ENOMEM if not); a thread limit reached by another thread between that check and
 * ZeroMQ's start is still fatal there.  On every
 * failure *out is NULL (out not NULL), as kvr_router_create and kvr_sync_attach.  Context:
 * any thread.
 */
KVR_API int kvr_feed_create(struct kvr_router *r, const struct kvr_feed_config *cfg,
                            struct kvr_feed **out);

/*
 * Subscribes to one publisher (its strings are copied).  *id_out (may be NULL) names it for
 * kvr_feed_remove / kvr_feed_get_stats; the feeds of a process give different ids, so another
 * feed's id is KVR_ENOENT there.  The socket connects in the background and reconnects
 * by itself; the publisher may start before or after (an absent publisher is tried again
 * after 100 ms, then ever less often, at least once a second).
 * Returns 0, KVR_EINVAL (NULL endpoint, an endpoint ZeroMQ refuses, a tcp:// port that is not
 * a number in 1..65535, which ZeroMQ would cut to another port), KVR_ENOMEM (also: no socket
 * left: a feed's ZeroMQ context allows 1,023, four an endpoint with a replay address, and
 * closes removed endpoints' in the background, or the process's descriptor limit).
 * Context: any thread; one round trip to the feed thread.  From the callbacks the feed thread
 * runs (its log, the router's on_event_gap for the gaps it reports), kvr_feed_add and
 * kvr_feed_remove return KVR_EBUSY, kvr_feed_get_stats and kvr_feed_other_medium_blocks answer
 * at once (without what the feed has yet to apply), and kvr_feed_destroy is deferred (see it).
 * From the callbacks of ANOTHER feed's thread (A's log calling on feed B), these four calls wait
 * for B's thread as from any thread, but A's thread serves the calls on A meanwhile, so feeds
 * whose callbacks call each other (A on B while B on A, A -> B -> C -> A, or B's on A while an
 * ordinary thread waits for A) never wait for each other for good: reads on A are answered at
 * once (as from A's own callbacks); kvr_feed_add and kvr_feed_remove on A run once A's thread
 * is back from its callback (their caller waits), except when that wait would close a cycle
 * (A's callback itself waits, directly or through other feeds' adds and removes, for the
 * caller's callback to return): that call returns KVR_EBUSY at once.  Such a call whose target
 * is torn down meanwhile (destroyed from a callback or another library thread, see
 * kvr_feed_destroy) returns KVR_ESHUTDOWN (one begun after the destroy is still forbidden).
 * Calls from other threads on A wait until A's callback returned, as before, but one: from a
 * callback a replica's thread runs while applying a peer's message (on_admit there), each of
 * these four calls returns KVR_EBUSY at once while A's callback waits for that replica
 * (kvr_sync_drain, kvr_sync_wait_ready), and such a wait from A's callback returns KVR_EBUSY at
 * once while that replica's thread waits in one of these calls on A: each would wait for the
 * other (until the drain's timeout).  Longer cycles through other feeds likewise: of the
 * waits that close one (that thread's call on feed B, B's callback's call on A, A's callback's
 * wait for the replica), the one that would close it returns KVR_EBUSY at once, whichever it
 * is; only there do kvr_feed_get_stats and kvr_feed_other_medium_blocks from another feed's
 * callback return KVR_EBUSY.
 * On the router's shard threads (where kvr_config.now_ns runs), these four calls return
 * KVR_EBUSY at once: a feed's thread settles before every call it answers, i.e. waits for the
 * shards to apply what it posted them, this one included.
 */
KVR_API int kvr_feed_add(struct kvr_feed *f, const struct kvr_feed_endpoint *ep, uint32_t *id_out);

/* Unsubscribes (closes its sockets).  What it applied stays in the index (until a later endpoint
 * feeds the rank: cleared, then rebuilt from its stream, see the wire rules).  Returns 0 or
 * KVR_ENOENT (KVR_EBUSY, KVR_ESHUTDOWN: see kvr_feed_add).  Context: any thread; one round trip
 * to the feed thread; from feeds' callbacks see kvr_feed_add. */
KVR_API int kvr_feed_remove(struct kvr_feed *f, uint32_t id);

/* KVR_FEED_ALL: kvr_feed_get_stats over every endpoint (counters and other_medium_blocks
 * summed, last_lag_ns the largest, next_seq 0). */
#define KVR_FEED_ALL UINT32_MAX

/* A snapshot of one endpoint's counters (or KVR_FEED_ALL).  Returns 0, KVR_ENOENT, KVR_EINVAL
 * (KVR_ESHUTDOWN, KVR_EBUSY: see kvr_feed_add).  Context: any thread; one round trip to the feed
 * thread (waits while it serves a replay); from feeds' callbacks see kvr_feed_add (KVR_EBUSY
 * there only to break a cycle through a replica). */
KVR_API int kvr_feed_get_stats(struct kvr_feed *f, uint32_t id, struct kvr_feed_stats *out);

/*
 * The blocks an endpoint reported on a medium other than GPU (e.g. vLLM's CPU offloading
 * connector) for dp rank dp_rank, as engine hashes: up to cap written to out (any order), the
 * total in *n_out (required).  Kept apart from the GPU index; each hash once, however many
 * copies.  Returns 0, KVR_ERANGE (cap too small: *n_out says how many), KVR_ENOENT (no such
 * endpoint), KVR_EINVAL (KVR_ESHUTDOWN, KVR_EBUSY: see kvr_feed_add).  Context: any thread; one
 * round trip to the feed thread; from feeds' callbacks see kvr_feed_add (KVR_EBUSY there only
 * to break a cycle through a replica).
 */
KVR_API int kvr_feed_other_medium_blocks(struct kvr_feed *f, uint32_t id, uint32_t dp_rank,
                                         uint64_t *out, size_t cap, size_t *n_out);

/* Stops the thread, closes every socket, frees everything.  NULL is a no-op.  Must not race
 * with other calls on the feed.  From a callback the feed's own thread runs (its log, the
 * router's on_event_gap for a gap it reports), the thread cannot join itself: the call marks the
 * feed and returns at once; the feed then takes no more messages, calls its log no more, and once
 * the callback returned applies what it had accepted and frees everything on its own thread
 * (detached).  From any other thread the library runs (another feed's, a replica's, a shard's,
 * e.g. another feed's log or on_admit on a replica's apply thread) or from any router callback,
 * it does not wait for f's thread either, which may be waiting for the caller (two feeds'
 * callbacks destroying each other): it marks f, wakes its thread and returns; f's thread stops
 * taking messages when it next looks (at once when idle, once the callback or replay it is
 * running returned otherwise) and tears down as above.  Until then f's log may still be running
 * or be called: keep its log_ctx valid until kvr_router_destroy returned.  f must not be used
 * after the call in every case; kvr_router_destroy, which may follow at once (from another
 * thread), waits for such teardowns.  A replay in progress is given up, unreported, and a rank
 * it leaves short of what its publisher sent is cleared (see replay_timeout_ms): from an
 * ordinary thread, by the time the call returns; otherwise by the end of the teardown. */
KVR_API void kvr_feed_destroy(struct kvr_feed *f);
/* ---------------------------------------------------------------- replica sync (NATS) */
/*
 * Several routers (replicas, e.g. one per frontend) in front of the same workers share what
 * each routes: admissions (rank, block hashes, prompt tokens, predicted cached prefix, expected
 * output), output, prefill done, finish/abort and rank changes go out on NATS, and every replica
 * applies its peers' to its OWN predicted caches and load exactly as if it had routed them, so
 * with the same traffic their predictions converge.  Replicas heartbeat; a peer that stops (or
 * says goodbye) has its attempts released everywhere.  A new replica, or one that lost messages
 * (NATS outage, gap), asks a live peer for a snapshot (NATS request-reply, chunked: ranks,
 * recently finished chains, live attempts, per-peer stream positions), then applies the stream
 * from there.  During an outage routing continues on local knowledge.  Wire format:
 * sync/replica_msg.h.  Built with the meson feature `nats` (libnats, nats.c 3.x); without it
 * kvr_sync_attach returns KVR_ENOTSUP whatever its arguments (and *out NULL), and the calls on
 * a handle KVR_EINVAL, as for the NULL handle that is all such a build can have
 * (sync/replica_none.c).
 */
struct kvr_sync;

struct kvr_sync_config {
	/* NATS server URLs, comma separated ("nats://host:4222,nats://other:4222"): 1 to 32 of
	 * them, at most 2047 characters, ports 1..65535 (else KVR_EINVAL); borrowed for the call.
	 * Default "nats://127.0.0.1:4222". */
	const char *servers;
	/* Subject prefix shared by the replicas of one cluster: [A-Za-z0-9_-], 1..64 chars.
	 * Default "kvr".  The routers of one cluster must use one block_size: a peer's admission
	 * cut into blocks of another size is not mirrored (kvr_sync_stats.block_size_mismatch).
	 * They should share free_order too (not checked): with two orders their predicted caches
	 * drift apart once ranks evict. */
	const char *cluster;
	/* This replica's id: nonzero, unique in the cluster (kvr_sync_attach refuses one in use:
	 * KVR_EEXIST).  No default (0 is KVR_EINVAL). */
	uint64_t replica_id;
	/* Credentials and TLS, passed to nats.c unchanged; NULL = not used. */
	const char *user, *password, *token;
	const char *creds_file; /* NATS chained credentials (JWT + seed) */
	bool tls;               /* require TLS */
	const char *tls_ca_file, *tls_cert_file, *tls_key_file;
	/* Heartbeat period, ms.  Default 100; 1..60000. */
	uint32_t heartbeat_ms;
	/* A peer silent for this many heartbeat periods is gone: its attempts are released on
	 * this router.  Default 5; >= 2.  Silence counts only while this replica listened: time
	 * it did not run itself (a starved process) is not held against its peers, and nobody
	 * is judged while received messages wait to be handled.  A peer that was only slow (a
	 * false death) is asked, once heard again, to re-announce its live attempts, and every
	 * replica's load converges again; until then routers that gave it up route without its
	 * load.  Too small a bound for the machine makes false deaths frequent (each costs a
	 * re-announce of the peer's live and recently finished attempts). */
	uint32_t dead_after;
	/* Snapshot request deadline, ms: between chunks of the snapshot (a peer that takes the
	 * request and sends nothing for this long is given up), and a whole resync's, its retries
	 * included (one declined by resyncing peers for half of it takes a resyncing peer's
	 * table).  A request nobody answered within an eighth of it (20 ms at least) is sent
	 * again, up to 7 times, so that the queue group may pick another peer than one alive but
	 * stuck; the first peer to answer is taken.  Default 2000 (0 reads as the default). */
	uint32_t snapshot_timeout_ms;
	/* Blocks of recently finished attempts remembered per rank for snapshots.  Default 0 =
	 * twice the rank's capacity (65536 without capacity). */
	uint64_t journal_blocks;
	/* Bytes of notes (admissions with their block hashes, output, ends) kept aside while the
	 * sender is stalled behind a full queue (a connection that takes nothing), at most.
	 * Default 0 = 64 MiB.  Past it notes are dropped (kvr_sync_stats.notes_over_cap) until
	 * the sender runs again; then its attempts that ended meanwhile are published as aborts
	 * (their ends were among the dropped: kvr_sync_stats.ends_reconciled), and if output was
	 * among them its live ones take no more output (some of theirs may be lost, and what
	 * follows would land out of place in their chains on the peers).  What the dropped notes
	 * told (admissions, output, prefill done) stays missing from the peers' load while those
	 * attempts live and from their prediction after: only this router had it.  Rank changes are
	 * always kept. */
	uint64_t kept_bytes_max;
};

struct kvr_sync_stats {
	uint64_t published;   /* messages sent */
	uint64_t batches;     /* transport messages they went out in (a burst of notes is one) */
	uint64_t unpublished; /* messages not sent (disconnected, or the send failed) */
	uint64_t received;    /* messages delivered by the transport */
	uint64_t applied;     /* peers' stream messages applied */
	uint64_t dropped;     /* malformed, unknown version, truncated, forged, or lost for memory
	                       * on arrival: not applied (a lost message shows as a gap at the
	                       * sender's next heartbeat, and its sender re-announces); also every
	                       * message of a 257th peer while 256 others are alive (a replica
	                       * hears at most 256 at once; a gone peer's place is reused), and
	                       * every rank change (or snapshot's removal floor) versioned over an
	                       * hour ahead of this replica's wall clock: a faulty clock's */
	uint64_t forged;      /* of those: carrying this replica's id: another replica uses it
	                       * (kvr_sync_attach refuses an id in use, but cannot see one whose
	                       * holder is reconnecting meanwhile); detach one of them (see
	                       * displaced for which) */
	uint64_t duplicates;  /* stream messages at or below a peer's position (not applied) */
	uint64_t refused;     /* peer admissions the router refused (unknown rank, stale) */
	uint64_t orphans;     /* lifecycle messages for attempts this replica does not mirror */
	uint64_t gaps;        /* a peer's stream skipped ahead (messages lost) */
	uint64_t resyncs;     /* snapshots requested */
	uint64_t snapshots_applied;
	uint64_t snapshots_served;
	uint64_t disconnects, reconnects;
	uint64_t peers_lost; /* peers released after silence or goodbye */
	uint64_t released;   /* mirrored attempts released because their replica went */
	/* Own attempts whose end reached the sender before their admission (a booking the shard
	 * dropped for memory) and that were given up: the set remembering such ends was full
	 * and could not grow for memory.  Each one's admission may then be published with no
	 * end, and stay mirrored (and loaded) on the peers until this replica goes; nonzero
	 * only after allocation failures. */
	uint64_t early_lost;
	/* Peers' output tokens not applied here: no memory, or their rank's lane stayed full.
	 * Their attempt takes no more output (it would land out of place in its chain) until
	 * its origin re-announces it, which is asked at once; its load still ends with it. */
	uint64_t output_dropped;
	uint64_t lag_messages; /* stream messages peers announced that are not applied yet */
	uint64_t seq;          /* this replica's stream position (its last message's number) */
	uint32_t peers_alive;
	uint32_t mirrored; /* peers' live attempts mirrored on this router */
	bool connected;
	bool ready; /* the first snapshot (or its absence) is settled */
	/* Own notes dropped because those kept aside for a stalled sender held kept_bytes_max
	 * (counted in unpublished too), and own attempts whose end was among them, published as
	 * aborts once the sender ran again. */
	uint64_t notes_over_cap, ends_reconciled;
	/* Peer admissions not mirrored because they show another block size than this router's
	 * (a known chain of n blocks and t tail tokens that is not n x block_size + t tokens long,
	 * or a chain longer than its prompt): replicas of one cluster must share block_size.  Not
	 * counted in refused. */
	uint64_t block_size_mismatch;
	/* Publishes and subscriptions the NATS server refused for lack of permission after the
	 * attach (which checks the subscriptions and the id question: KVR_EINVAL): e.g. a user
	 * that may not publish on <cluster>.stream, whose peers then never hear it. */
	uint64_t denied;
	/* Own messages larger than the NATS server's max_payload on their own, not sent: only a
	 * server limit under 104 bytes leaves one (an admission too long is cut, below).  Peers do
	 * not mirror that attempt (its later messages are orphans there).  Batches, snapshot
	 * chunks and output are cut to fit and never counted here. */
	uint64_t oversized;
	/* Admissions (and attempts re-announced or in snapshots served) longer than the server's
	 * max_payload, sent with the first blocks of their chain that fit (8,179 at 64 KiB,
	 * 131,059 at the default 1 MiB) as a chain the caller gave: peers mirror the attempt, its
	 * load and that prefix, but predict no blocks for its output (before: not sent at all). */
	uint64_t truncated;
	/* True while another replica holding this one's id with a newer life (a larger epoch: the
	 * wall clock at its attach) is heard: peers follow the newer life and drop this replica's
	 * messages, so its decisions and load no longer reach them (it still mirrors theirs).  The
	 * one to detach (and attach again under a free id).  False again at the other's goodbye
	 * or once it has been silent for dead_after heartbeats; then peers take this replica up
	 * again (they ask it to re-announce).  The other replica only counts forged messages.
	 * displacements counts the times it became true. */
	bool displaced;
	uint64_t displacements;
	/* Peers' rank changes (add, remove, reset, capacity) not applied because this replica holds
	 * a newer version of that rank (a re-announce or a snapshot telling an older state again:
	 * harmless, counted so that it shows), or, for a rank it holds nothing of, because a
	 * removal newer than the change was made and its tombstone forgotten since; and ranks
	 * removed here because a snapshot, newer than them, no longer named them.  Not counted in
	 * refused. */
	uint64_t rank_stale;
};

/* Fills *c with the defaults.  NULL is a no-op. */
KVR_API void kvr_sync_config_init(struct kvr_sync_config *c);

/*
 * Connects router r to NATS as replica c->replica_id and starts sharing.  The ranks already
 * added are announced; a live peer's snapshot is asked for in the background
 * (kvr_sync_wait_ready).  c is borrowed for the call.  One attachment per router.
 * Returns 0 and *out, KVR_EINVAL (r, c or out NULL, bad config; the server refused the
 * credentials, or TLS failed: wanted and not offered, required and not wanted, a certificate
 * refused; the user may not subscribe to <cluster>.stream, <cluster>.id.<id> or _INBOX.>, or
 * publish on <cluster>.id.<id> or _INBOX.> (a replica answers peers' snapshot requests on the
 * asker's inbox; a server's allow_responses instead does, with a max of more than one
 * response: a snapshot goes in chunks): later refusals are counted, kvr_sync_stats.denied),
 * KVR_EBUSY (already attached),
 * KVR_EEXIST (a replica attached under c->replica_id in this cluster answered, or a connection
 * holding that id's subject did not answer for 2 s; two attaching under one id at once may both
 * get it, and so may one attaching while the id's holder is reconnecting: the one with the
 * older life then reports kvr_sync_stats.displaced), KVR_ENOMEM (also: a replica thread could
 * not be started, or no file descriptor was left for the connection), KVR_ETIMEDOUT (no server
 * reachable),
 * KVR_ENOTSUP (built without the `nats` feature); *out is NULL after any failure. Context: any
 * thread.  The calling thread's asynchronous signals are held (blocked, then delivered) while
 * nats.c connects, subscribes, flushes, asks who holds the id and probes the inbox permission:
 * at most ~8 s with one server, 2 s more for each further server it must try, and for a user
 * refused the inbox probe a second connection's ~8 s more (its answer probe); and in
 * kvr_sync_detach while it closes: nats.c takes an interrupted system call for a broken
 * connection.
 */
KVR_API int kvr_sync_attach(struct kvr_router *r, const struct kvr_sync_config *c,
                            struct kvr_sync **out);

/* Says goodbye (peers release this replica's attempts at once), stops, releases the peers'
 * attempts mirrored on the router, disconnects, frees.  NULL is a no-op.  The router may be
 * destroyed first: kvr_router_destroy stops the replica's use of it (goodbye included), the
 * other calls on s then return KVR_ESHUTDOWN, and kvr_sync_detach only disconnects and frees.
 * Context: any thread; not concurrently with other calls on s.  Not from a router callback that
 * the replica's own threads run while applying peers' messages (on_admit there): it would wait
 * for that very call; there it returns at once and does nothing (detach from another thread).
 * From a feed's callback (its log, on_event_gap on a feed's thread): while a replica thread
 * waits in a call on that feed (on_admit calling kvr_feed_get_stats), or on another feed whose
 * callback waits, directly or through other feeds, for this callback, it returns at once and
 * does nothing as well; otherwise it detaches, and such calls meanwhile return KVR_EBUSY. */
KVR_API void kvr_sync_detach(struct kvr_sync *s);

/* Waits until the replica has applied its first snapshot (or found no peer: a replica alone in
 * its cluster is ready as soon as the server says nobody answers, within milliseconds; a peer
 * that does not answer is waited for up to snapshot_timeout_ms, the request sent again to the
 * queue group meanwhile; the replica's own wait for a snapshot ends at once when kvr_sync_detach
 * or kvr_router_destroy begins, which no call on s may run beside).  Once ready it
 * also answers its peers' snapshot requests, so a replica attached after this returned finds it. 0,
 * KVR_ETIMEDOUT, KVR_EINVAL; from a callback the replica's own threads run (see
 * kvr_sync_drain), 0 at once if ready, else KVR_EBUSY; from a feed's callback, as
 * kvr_sync_drain. */
KVR_API int kvr_sync_wait_ready(struct kvr_sync *s, uint32_t timeout_ms);

/* Waits until every message received so far is applied.  0, KVR_ETIMEDOUT, KVR_EINVAL, or
 * KVR_EBUSY at once when called from a router callback that the replica's own threads run while
 * applying a peer's message (on_admit after a peer's finish freed room): the message being
 * applied is among those it would wait for; or from a feed's callback while the replica's
 * thread waits in a call on that feed, directly or through other feeds' callbacks (see
 * kvr_feed_add).  For tests and quiet points. */
KVR_API int kvr_sync_drain(struct kvr_sync *s, uint32_t timeout_ms);

/* How far this replica has applied peer replica_id's stream: *seq gets the number of the last
 * message applied (compare with that peer's kvr_sync_stats.seq).  0, KVR_ENOENT (peer not
 * known or not alive), KVR_EINVAL. */
KVR_API int kvr_sync_peer_seq(struct kvr_sync *s, uint64_t replica_id, uint64_t *seq);

/* Counters and state; also rendered by kvr_metrics_render (kvr_sync_*).  0 or KVR_EINVAL. */
KVR_API int kvr_sync_get_stats(struct kvr_sync *s, struct kvr_sync_stats *out);

/* ---------------------------------------------------------------- metrics */

/*
 * Writes every metric in Prometheus text exposition format into buf (cap bytes, always
 * NUL-terminated when cap > 0).  *len_out (may be NULL) gets the size the text needs with its
 * NUL (its strlen + 1), on success too; when it does not fit, returns KVR_ERANGE and *len_out
 * tells that size (buf NULL with cap 0 asks only that).  Other returns: KVR_EINVAL (buf NULL with
 * cap > 0), KVR_ENOMEM, KVR_ESHUTDOWN.  Context: any thread. Among them
 * kvr_allocator{name="jemalloc"} 1 (or "libc"): the allocator the library's structures come from,
 * jemalloc when the process has it (linked as `pkg-config --libs kvrouter` links it, or preloaded),
 * else the C library's (a process that loaded the library with dlopen; README.md, "Link after
 * `meson install`").  Numbers are written as Prometheus reads them ("0.5") whatever the process's
 * locale (setlocale) says.
 */
KVR_API int kvr_metrics_render(struct kvr_router *r, char *buf, size_t cap, size_t *len_out);

/*
 * Makes the shards re-read the clock and waits until each has run every message posted before
 * the call and every timer due by now (TTL expiry, lease reaper).  For virtual-time simulation
 * and tests; never needed with the real clock.  Returns 0, KVR_ETIMEDOUT (timeout_ms; 0 looks
 * once without waiting, which the shards seldom answer in time), KVR_ESHUTDOWN, or KVR_EBUSY
 * (called on a shard thread, i.e. from the router's clock there: it would wait for itself;
 * nothing done).
 */
KVR_API int kvr_router_sync(struct kvr_router *r, uint32_t timeout_ms);

/* The memory a router holds, bytes, by part: each module's own counter (index, lanes and rank
 * tables at the allocator's real sizes, i.e. their size classes; caches and load at the sizes
 * asked for). */
struct kvr_memory {
	uint64_t index;       /* block index: runs, hash arrays, tables, rank sets, slot table */
	uint64_t caches;      /* predicted caches (approx_lru segments and maps; 0 otherwise) */
	uint64_t load;        /* in-flight load trackers (pinned runs, requests) */
	uint64_t lanes;       /* shard runtime: lane rings, shard records, worker placement */
	uint64_t rank_tables; /* the router's per-rank arrays, sized for max_ranks */
	/* Everything the library has allocated now, asked-for sizes, every router in the process
	 * together; minus the parts (the fields above it, attempt_pool and replica_ranks) leaves
	 * what has no counter of its own (pinned-run map, leases, attempt records in flight,
	 * metrics, memory retired but not yet past its RCU grace period) less the size-class
	 * rounding the parts include. */
	uint64_t library;
	/* On jemalloc (kvr_allocator, kvr_metrics_render; 0 otherwise): the bytes allocated in the
	 * library's own arena at their size classes (every router in the process), and of those,
	 * freed objects parked in the threads' caches (tcaches), which jemalloc still counts as
	 * allocated. */
	uint64_t arena, arena_cached;
	/* Recycled attempt records kept for the next admissions (at most 4.25 MB of hashes, real
	 * sizes; none once the router has been idle 100 ms), and the pool itself.  Last, so that
	 * the earlier fields keep their offsets. */
	uint64_t attempt_pool;
	/* Replica sync's rank table (kvr_sync_attach; 0 unattached): an entry per rank (160
	 * bytes, its index 8, its tombstone's room 64 and that room's index 8), and a tombstone
	 * (64 bytes, its index 8) per rank removed within the last hour, at the sizes asked for
	 * (arrays that double, and halve as they empty); and each rank's journal of finished
	 * attempts (what a snapshot replays to rebuild a joiner's predicted cache: a record of 184
	 * bytes, 8 a block and 4 a tail and an output token each, up to the journal's budget, twice
	 * the rank's capacity in blocks by default: megabytes for a large rank), given back as the
	 * rank's life ends (a reset, a removal).  After attempt_pool, for the same reason. */
	uint64_t replica_ranks;
};

/*
 * Fills *out.  O(ranks + the caches' segments); each rank's part is read on its shard (a
 * synchronous call), so the parts are consistent per rank, not across ranks.  For sizing,
 * monitoring and benchmarks.  Returns 0, KVR_EINVAL, KVR_ENOMEM or KVR_ESHUTDOWN; KVR_EBUSY
 * when called on a shard thread after all (the router's clock: the read would wait for its own
 * shard, or close a cycle of shards waiting for each other).  On a failure *out may hold the
 * parts read before it: not a total.
 * Context: any thread except a shard thread (callbacks), outside an RCU read section.
 */
KVR_API int kvr_router_get_memory(struct kvr_router *r, struct kvr_memory *out);

#ifdef __cplusplus
}
#endif
#endif /* KVROUTER_H */
