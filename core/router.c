/*
 * core/router.c - the router object: configuration, clock, and the parts every call uses (the
 * index, the shard runtime, the metrics registry, the rank table and the RCU-published list of
 * routable ranks).  See core/router_internal.h for who owns what.
 */
#include <string.h>

#include "core/alloc.h"
#include "core/fork.h"
#include "core/replica_hooks.h"
#include "core/router_internal.h"
#include "sync/rcu.h"
#include "sync/nocancel.h"

/* The shards' maintenance lanes: the router posts nothing there (every call and post takes the
 * routing lane; TTL and lease timers run in the shard loop), so a ring of 256 slots (16 KiB)
 * whatever lane_capacity is. */
#define ROUTER_MAINT_CAPACITY 255u

static size_t live_bytes(uint32_t cap)
{
	return sizeof(struct kvr_live) + (size_t)cap * (sizeof(uint64_t) + sizeof(uint32_t));
}

static void live_free(void *p)
{
	struct kvr_live *l = p;
	kvr_free(l, live_bytes(l->cap));
}

static struct kvr_live *live_alloc(uint32_t cap)
{
	struct kvr_live *l = kvr_alloc(live_bytes(cap));
	if (l) {
		l->n = 0;
		l->cap = cap;
		l->slot = (uint32_t *)(void *)(l->gen + cap);
	}
	return l;
}

/* Adds slot to the live list (add; the slot is not in it) or removes it (!add).  An add appends
 * in place while the list has room (entry first, then n: release); a removal, or an add to a
 * full list, publishes a copy (room doubled for adds, so n adds copy O(n) entries in all).
 * Context: under admin_lock.  Ordering: the release store of n or the release publish; pairs
 * with kvr_live_n / kvr_rcu_deref in the readers. */
/* Publishes a copy of the live list with cap entries' room, without slot (UINT32_MAX: none). */
static int live_copy(struct kvr_router *r, uint32_t cap, uint32_t slot)
{
	struct kvr_live *old = r->live;
	uint32_t n = old->n; /* only admin_lock's holder writes it */
	struct kvr_live *nl = live_alloc(cap);
	if (!nl)
		return KVR_ENOMEM;
	uint32_t k = 0;
	for (uint32_t i = 0; i < n; i++) {
		if (old->slot[i] != slot) {
			nl->gen[k] = old->gen[i];
			nl->slot[k++] = old->slot[i];
		}
	}
	nl->n = k;
	kvr_rcu_publish(&r->live, nl);
	kvr_rcu_defer_free(old, live_free);
	return 0;
}

int kvr_router_live_reserve(struct kvr_router *r)
{
	uint32_t n = r->live->n;
	if (n < r->live->cap)
		return 0;
	uint64_t want = n < 8 ? 16 : 2 * (uint64_t)n;
	uint32_t cap = want < r->cfg.max_ranks ? (uint32_t)want : r->cfg.max_ranks;
	return live_copy(r, cap > n ? cap : n + 1, UINT32_MAX); /* never short of one entry */
}

int kvr_router_live_update(struct kvr_router *r, uint32_t slot, bool add)
{
	if (!add)
		return live_copy(r, r->live->cap, slot);
	int rc = kvr_router_live_reserve(r);
	if (rc)
		return rc;
	struct kvr_live *l = r->live;
	uint32_t n = l->n;
	l->gen[n] = __atomic_load_n(&r->ranks[slot].gen, __ATOMIC_RELAXED);
	l->slot[n] = slot;
	__atomic_store_n(&l->n, n + 1, __ATOMIC_RELEASE);
	return 0;
}

/*
 * The embedder's clock (kvr_config.now_ns), called with the calling thread marked as running
 * r's callback (kvr_router_cb_self), as on_admit and on_event_gap are.  The clock runs inside
 * kvr_route and most other calls, on the embedder's own threads: a kvr_router_destroy from it
 * (kvrouter.h forbids it) freed the router under the call that read the clock.  Now it returns at
 * once and destroys nothing, as from the other callbacks.  The default clock cannot call it and
 * is not wrapped, so a router on the default clock pays nothing; a custom clock pays one call and
 * two thread-local stores per reading (docs/measurements.md, robust8).
 * Context: any thread that reads r's clock.
 */
static uint64_t clock_guarded(void *ctx)
{
	/* A replaced clock may be a cancellation point (a sleep, a log write): read with
	 * cancellation disabled, as every call of the library runs, or a cancel pending at the
	 * reading took effect inside the call that read it (kvr_route's queue push and its waited
	 * route's deadline check read it outside any guard: test_cancel, cancel_inside_the_clock).
	 * Two setcancelstate calls a reading, a replaced clock's only. */
	KVR_NOCANCEL(); /* sync/nocancel.h */
	const struct kvr_router *r = ctx;
	const struct kvr_router *prev = kvr_router_callback_enter(r);
	uint64_t t = r->cfg.now_ns(r->cfg.clock_ctx);
	kvr_router_callback_leave(prev);
	return t;
}

int kvr_router_create(const struct kvr_config *cfg, struct kvr_router **out)
{
	KVR_NOCANCEL(); /* sync/nocancel.h */
	if (!out)
		return kvr_fail(KVR_EINVAL, "kvr_router_create: out is NULL");
	*out = NULL;
	struct kvr_config def;
	if (!cfg) {
		kvr_config_init(&def);
		cfg = &def;
	}
	int rc = kvr_config_check(cfg, "kvr_router_create");
	if (rc)
		return rc;
	if ((rc = kvr_rcu_thread_online()))
		return kvr_fail(rc,
		                "kvr_router_create: this thread could not register with RCU: %s",
		                kvr_strerror(rc));
	/* The deferred frees' thread (sync/rcu.c), once per process: the one thread a router
	 * shares with others, and liburcu's would abort() where it cannot be started. */
	int err = kvr_rcu_start();
	if (err)
		return kvr_fail(KVR_ENOMEM,
		                "kvr_router_create: could not start the RCU reclaimer thread: %s",
		                strerror(err));
	struct kvr_router *r = kvr_alloc_aligned(sizeof(*r)); /* zeroed; rng_counter's line */
	if (!r)
		return kvr_fail(KVR_ENOMEM, "kvr_router_create: out of memory for the router");
	kvr_fork_track(r); /* before its threads: a child forked from now on inherits it */
	r->cfg = *cfg;
	r->cfg.cpu_list = NULL; /* the router's own copy, below: the caller's is borrowed */
	r->cfg.n_cpus = 0;
	r->clock.fn = cfg->now_ns ? clock_guarded : kvr_clock_monotonic;
	r->clock.ctx = cfg->now_ns ? (void *)r : NULL;
	pthread_mutex_init(&r->admin_lock, NULL);
	pthread_mutex_init(&r->feeds_lock, NULL);
	rc = KVR_ENOMEM;
	r->ranks = kvr_alloc_aligned((size_t)cfg->max_ranks * sizeof(*r->ranks));
	r->load = kvr_alloc_aligned((size_t)cfg->max_ranks * sizeof(*r->load));
	r->prov = kvr_alloc_aligned((size_t)cfg->max_ranks * sizeof(*r->prov));
	r->live = live_alloc(0);
	if (!r->ranks || !r->load || !r->prov || !r->live)
		goto fail;
	if (cfg->n_cpus) { /* kept for kvr_router_get_config: a router made from it pins alike */
		int *cpus = kvr_alloc(cfg->n_cpus * sizeof(int));
		if (!cpus)
			goto fail;
		memcpy(cpus, cfg->cpu_list, cfg->n_cpus * sizeof(int));
		r->cfg.cpu_list = cpus;
		r->cfg.n_cpus = cfg->n_cpus;
	}
	if ((rc = kvr_metrics_create(&r->metrics)))
		goto fail;
	if ((rc = kvr_index_create(cfg->max_ranks, &r->index)))
		goto fail;
	kvr_index_set_count_copies(r->index, cfg->mode == KVR_MODE_EVENTS);
	/* The approximate modes write the index themselves, in chains below paths and tails or
	 * heads of chains, which the index finds without its block locator (core/index_tops.c);
	 * engine events name arbitrary blocks and keep it. */
	kvr_index_set_locator(r->index, cfg->mode == KVR_MODE_EVENTS);
	if ((rc = kvr_pinmap_create(&r->pinmap)))
		goto fail;
	if ((rc = kvr_leases_create(&r->leases)))
		goto fail;
	if ((rc = kvr_attempt_pool_create(&r->pool)))
		goto fail;
	r->owner = (struct kvr_owner_ctx){
	    .block_size = cfg->block_size,
	    .max_ranks = cfg->max_ranks,
	    .mode = cfg->mode,
	    .free_order = cfg->free_order,
	    .ttl_ns = cfg->ttl_ns,
	    .lease_scan_interval_ns = cfg->lease_scan_interval_ns,
	    .expected_prefill_ns = cfg->expected_prefill_ns,
	    .events_max_blocks = cfg->events_max_blocks,
	    .on_event_gap = cfg->on_event_gap,
	    .callback_ctx = cfg->callback_ctx,
	    .on_expire = kvr_repl_note_expire,
	    .on_rank_end = kvr_repl_note_rank_end,
	    /* With a queue, load a shard lowers by itself wakes the admission thread
	     * (core/queue_thread.c); without one there is nobody to tell. */
	    .on_unloaded = cfg->queue_threshold > 0 ? kvr_admitter_note_unloaded : NULL,
	    .expire_ctx = r,
	    .clock = r->clock,
	    .index = r->index,
	    .pinmap = r->pinmap,
	    .metrics = r->metrics,
	    .ranks = r->ranks,
	    .load = r->load,
	    .prov = r->prov,
	    .leases = r->leases,
	    .pool = r->pool,
	};
	if (cfg->queue_threshold > 0 && (rc = kvr_queue_create(r, &r->queue)))
		goto fail;
	struct kvr_shards_config sc = {
	    .n_shards = cfg->n_shards,
	    .cpus = cfg->cpu_list,
	    .n_cpus = cfg->n_cpus,
	    .lane_capacity = cfg->lane_capacity,
	    .lane_soft_depth = cfg->lane_soft_depth,
	    .maint_capacity = ROUTER_MAINT_CAPACITY,
	    .maint_every_tasks = cfg->maint_every_tasks,
	    .maint_every_ns = cfg->maint_every_ns,
	    .now_ns = r->clock.fn,
	    .clock_ctx = r->clock.ctx,
	    .max_workers = cfg->max_ranks,
	    /* The runtime's 'no spin' is UINT64_MAX, ours is 0: UINT64_MAX asks for the longest. */
	    .idle_spin_ns = !cfg->shard_idle_spin_ns ? KVR_SHARDS_NO_SPIN
	                    : cfg->shard_idle_spin_ns == KVR_SHARDS_NO_SPIN
	                        ? KVR_SHARDS_NO_SPIN - 1
	                        : cfg->shard_idle_spin_ns,
	    .soon_wake_ns = cfg->booking_lazy_ns,
	    .on_thread_start = kvr_owner_shard_start,
	    .on_thread_stop = kvr_owner_shard_stop,
	    .on_idle = kvr_owner_shard_idle,
	    .ctx = &r->owner,
	};
	if ((rc = kvr_shards_create(&sc, &r->shards))) {
		if (rc != KVR_EAGAIN)
			goto fail;
		kvr_router_destroy(r);
		return kvr_fail(KVR_ENOMEM,
		                "kvr_router_create: a shard thread could not be started "
		                "(pthread_create failed: the process's thread limit?)");
	}
	for (uint32_t i = 0; i < kvr_shards_count(r->shards); i++) {
		if (!kvr_shard_userdata(kvr_shards_get(r->shards, i))) {
			rc = KVR_ENOMEM; /* a shard could not set up its state */
			goto fail;
		}
	}
	if (r->queue && (err = kvr_admitter_start(r))) {
		kvr_router_destroy(r);
		return kvr_fail(
		    KVR_ENOMEM,
		    "kvr_router_create: the queue's admission thread could not be started "
		    "(pthread_create: %s; the process's thread limit?)",
		    strerror(err));
	}
	r->cfg.n_shards = kvr_shards_count(r->shards);
	*out = r;
	return 0;
fail:
	kvr_router_destroy(r);
	return kvr_fail(rc, "kvr_router_create: %s setting up the router's tables and shards",
	                kvr_strerror(rc));
}

_Thread_local const struct kvr_router *kvr_router_cb_self;

/* Whether the calling thread is one of r's shard threads (the clock callback runs there). */
static bool on_own_shard(const struct kvr_router *r)
{
	struct kvr_shard *cur = kvr_shard_current();
	for (uint32_t i = 0, n = cur && r->shards ? kvr_shards_count(r->shards) : 0; i < n; i++)
		if (kvr_shards_get(r->shards, i) == cur)
			return true;
	return false;
}

bool kvr_router_runs_thread(const struct kvr_router *r)
{
	return kvr_router_cb_self == r || on_own_shard(r);
}

/* A no-op on a shard: once it returns, the task the shard was in when it was posted has returned
 * (kvr_router_destroy).  Context: the shard's thread. */
static int shard_passed(struct kvr_shard *sh, void *arg)
{
	(void)sh;
	(void)arg;
	return 0;
}

void kvr_router_destroy(struct kvr_router *r)
{
	KVR_NOCANCEL(); /* sync/nocancel.h */
	if (!r)
		return;
	/* Created before this process forked (core/fork.h): the parent's threads and memory; the
	 * call returns and leaves it, as every other call on it does. */
	if (kvr_fork_inherited(r))
		return;
	/* From r's own callbacks or threads: the destroy would join or wait for this thread (a
	 * shard, the replica's apply thread, a feed waiting in kvr_router_destroy for its own
	 * teardown) or free the router under the call that runs the callback.  kvrouter.h forbids
	 * it; it returns at once and destroys nothing, rather than hang or use freed memory. */
	if (kvr_router_runs_thread(r))
		return;
	/* Feeds left alive (kvrouter.h asks for them to go first): stopped and released, all but
	 * their handles, before anything they use goes (sync/feed.c). */
	kvr_feeds_orphan(r);
	/* Ordering: acquire; pairs with the release decrement in sync/feed.c's feed_main, after
	 * which the feed's thread no longer touches the router. */
	while (__atomic_load_n(&r->feeds_closing, __ATOMIC_ACQUIRE) != 0) {
		struct timespec ts = {0, 1000000};
		nanosleep(&ts, NULL);
	}
	kvr_fork_untrack(r);
	kvr_repl_router_destroy(r); /* an attached replica layer lets go first */
	__atomic_store_n(&r->shutting_down, 1, __ATOMIC_RELEASE);
	/* The router's clock runs on the shards, and a lifecycle or rank call it makes (kvrouter.h
	 * allows both) may have passed its shutdown check before the flag above was set; it pumps
	 * the queue when it returns.  The queue was freed while such a call still ran, which then
	 * read it freed (kvr_queue_depth, then the pump).  A call on each shard, queued behind
	 * whatever task it is in, returns once that task (and so that call) has returned; every
	 * later one sees the flag (the post orders it before the shard's next task). */
	for (uint32_t i = 0, n = r->shards ? kvr_shards_count(r->shards) : 0; i < n; i++)
		(void)kvr_shard_call(kvr_shards_get(r->shards, i), KVR_LANE_ROUTING, shard_passed,
		                     NULL);
	/* After the calls above no shard's hook (on_unloaded) wakes it, and before the queue goes:
	 * the admission thread's pass ends on running shards. */
	kvr_admitter_stop(r);
	/* Before the shards stop: waiters are woken with KVR_ESHUTDOWN, and a pump in progress
	 * (a waiter's) finishes its admissions on running shards. */
	if (r->queue)
		kvr_queue_destroy(r->queue);
	/* Stops the shards; each frees the ranks it owns (their index entries, attempts). */
	kvr_shards_destroy(r->shards);
	kvr_rcu_barrier();
	kvr_index_destroy(r->index);
	kvr_pinmap_destroy(r->pinmap); /* after the barrier: the shards unpublished every run */
	kvr_leases_destroy(r->leases);
	kvr_attempt_pool_destroy(r->pool); /* after the shards: they return records to it */
	kvr_metrics_destroy(r->metrics);
	if (r->live)
		live_free(r->live);
	kvr_free_aligned(r->ranks, (size_t)r->cfg.max_ranks * sizeof(*r->ranks));
	kvr_free_aligned(r->load, (size_t)r->cfg.max_ranks * sizeof(*r->load));
	kvr_free_aligned(r->prov, (size_t)r->cfg.max_ranks * sizeof(*r->prov));
	if (r->cfg.cpu_list)
		kvr_free((void *)r->cfg.cpu_list, r->cfg.n_cpus * sizeof(int));
	pthread_mutex_destroy(&r->admin_lock);
	pthread_mutex_destroy(&r->feeds_lock);
	kvr_free_aligned(r, sizeof(*r));
}

uint64_t kvr_router_now(const struct kvr_router *r)
{
	return r ? kvr_clock_now(&r->clock) : 0;
}

int kvr_router_get_config(const struct kvr_router *r, struct kvr_config *out)
{
	if (!r || !out)
		return kvr_fail(KVR_EINVAL, "kvr_router_get_config: %s is NULL",
		                !r ? "router" : "out");
	*out = r->cfg;
	return 0;
}

void kvr_router_settle(struct kvr_router *r)
{
	if (!r->cfg.sync_booking || kvr_shard_current())
		return; /* a shard thread waits for no shard (no cycles) */
	for (uint32_t i = 0, n = kvr_shards_count(r->shards); i < n; i++)
		(void)kvr_shard_settle(kvr_shards_get(r->shards, i)); /* 0, or stopping */
}

int kvr_router_sync(struct kvr_router *r, uint32_t timeout_ms)
{
	KVR_NOCANCEL(); /* sync/nocancel.h */
	if (!r)
		return kvr_fail(KVR_EINVAL, "kvr_router_sync: router is NULL");
	if (kvr_router_stopping(r))
		return kvr_fail(KVR_ESHUTDOWN, "kvr_router_sync: %s", kvr_router_gone(r));
	/* On a shard's thread (the router's clock) the wait would include that shard, inside the
	 * task that read the clock: the runtime refuses it, which read as KVR_EINVAL, "invalid
	 * argument", for a call whose only argument was valid. */
	if (kvr_shard_current())
		return kvr_fail(KVR_EBUSY,
		                "kvr_router_sync: called on a shard thread (the router's clock), "
		                "where it would wait for that shard to go idle, i.e. for itself; "
		                "nothing done");
	int rc = kvr_shards_quiesce(r->shards, (uint64_t)timeout_ms * 1000000ull);
	if (rc == KVR_ETIMEDOUT)
		return kvr_fail(rc, "kvr_router_sync: the shards were not idle within %u ms",
		                timeout_ms);
	if (rc)
		return kvr_fail_code(rc, "kvr_router_sync");
	if (r->queue)
		kvr_queue_pump(r);
	return 0;
}

int kvr_router_find_rank_gen(struct kvr_router *r, struct kvr_rank_id id, uint32_t *slot,
                             uint64_t *gen)
{
	uint32_t s;
	if (kvr_rcu_thread_online())
		return KVR_ENOMEM;
	/* The lookup and the generation in one read section: the index hands a removed rank's
	 * slot to the next rank added only after a grace period, so the generation read here is
	 * the found rank's (live, or already removed: the shard's check refuses that), never the
	 * generation of another rank that took the slot meanwhile.  Read apart, a call naming a
	 * removed rank acted on the rank added into its slot (its reset, capacity, events). */
	kvr_rcu_read_lock();
	int rc = KVR_ENOENT;
	if (kvr_index_rank_find(r->index, id.worker_id, id.dp_rank, &s) == 0 &&
	    s < r->cfg.max_ranks) {
		uint64_t g = kvr_router_gen_of(r, s);
		if (__atomic_load_n(&r->ranks[s].live, __ATOMIC_ACQUIRE)) {
			*slot = s;
			if (gen)
				*gen = g;
			rc = 0;
		}
	}
	kvr_rcu_read_unlock();
	return rc;
}

int kvr_router_find_rank(struct kvr_router *r, struct kvr_rank_id id, uint32_t *slot)
{
	return kvr_router_find_rank_gen(r, id, slot, NULL);
}

int kvr_router_get_memory(struct kvr_router *r, struct kvr_memory *out)
{
	KVR_NOCANCEL(); /* sync/nocancel.h */
	if (!r || !out)
		return kvr_fail(KVR_EINVAL, "kvr_router_get_memory: %s is NULL",
		                !r ? "router" : "out");
	if (kvr_router_stopping(r))
		return kvr_fail(KVR_ESHUTDOWN, "kvr_router_get_memory: %s", kvr_router_gone(r));
	if (kvr_rcu_thread_online())
		return kvr_fail(KVR_ENOMEM,
		                "kvr_router_get_memory: this thread could not register with RCU");
	kvr_router_settle(r);
	memset(out, 0, sizeof(*out));
	size_t m = r->cfg.max_ranks;
	out->rank_tables = kvr_alloc_real_size_aligned(m * sizeof(*r->ranks)) +
	                   kvr_alloc_real_size_aligned(m * sizeof(*r->load)) +
	                   kvr_alloc_real_size_aligned(m * sizeof(*r->prov));
	out->lanes = kvr_shards_memory_bytes(r->shards);
	out->attempt_pool = kvr_attempt_pool_bytes(r->pool);
	out->replica_ranks = kvr_repl_memory(r);
	/* The live slots, copied out of the read section (a shard call blocks). */
	uint32_t *slot = kvr_alloc(m * sizeof(*slot));
	if (!slot)
		return kvr_fail(KVR_ENOMEM, "kvr_router_get_memory: out of memory copying the live "
		                            "ranks");
	kvr_rcu_read_lock();
	const struct kvr_live *live = kvr_rcu_deref(&r->live);
	uint32_t n = kvr_live_n(live);
	n = n < m ? n : (uint32_t)m;
	memcpy(slot, live->slot, n * sizeof(*slot));
	kvr_rcu_read_unlock();
	bool busy = false;
	for (uint32_t i = 0; i < n && !busy; i++) {
		struct kvr_rank_args a = {.slot = slot[i], .gen = kvr_router_gen_of(r, slot[i])};
		int rc = kvr_shard_call_read(kvr_router_shard_of(r, slot[i]), KVR_LANE_ROUTING,
		                             kvr_owner_rank_memory, &a);
		if (rc == 0) {
			out->caches += a.cache_bytes; /* a rank removed meanwhile counts nothing */
			out->load += a.load_bytes;
		}
		busy = rc == KVR_EBUSY;
	}
	kvr_free(slot, m * sizeof(*slot));
	if (busy)
		return kvr_fail(KVR_EBUSY, "kvr_router_get_memory: %s", KVR_SHARD_CYCLE_DETAIL);
	out->index = kvr_index_memory_bytes(r->index);
	int64_t lib = kvr_alloc_live_bytes();
	out->library = lib > 0 ? (uint64_t)lib : 0;
	(void)kvr_alloc_arena_bytes(&out->arena, &out->arena_cached);
	return 0;
}
