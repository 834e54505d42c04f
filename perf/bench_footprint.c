/*
 * bench_footprint - the memory the WHOLE router holds per (block, rank) it tracks.
 *
 * bench_index_runs measures the index alone and bench_lru the predicted cache alone; a user pays
 * for both, plus the rank table, the shards' lanes and whatever the RCU side keeps.  This program
 * goes through the public API only (kvrouter.h): a router in the default approximate-LRU mode
 * (shards running, sync_booking off), R ranks of C blocks each, and session-like traffic:
 * conversations whose every turn routes the whole transcript so far (the previous prompt, its
 * output and a new user message), each starting from one of a few shared system prompts or a
 * prefix of its own, until the transcript reaches L tokens and a new conversation takes its
 * place.  Every route is followed by its output (kvr_request_output) and its finish, so the
 * blocks become cached and evictable.  It routes until every rank's predicted cache is full
 * (stats: resident_blocks reaches the capacity or the rank has evicted), quiesces
 * (kvr_router_sync, a pause for the RCU callbacks, sync again) and reads:
 *
 *   pairs      tracked (block, rank) pairs = the sum over ranks of resident_blocks (the blocks
 *              the router predicts the rank holds; indexed_blocks is printed beside it),
 *   rss        the process RSS (/proc/self/statm) now minus before kvr_router_create; every
 *              buffer of the bench itself (transcripts, output tokens) is allocated and touched
 *              before that first reading, so the delta is the router's,
 *   alloc      with jemalloc: stats.allocated (after an "epoch" refresh) now minus before, i.e.
 *              the bytes live in every arena (the library allocates from two arenas of its own,
 *              core/alloc.c, and liburcu from the default ones) at their size classes.  Objects
 *              cached in the threads' tcaches count as allocated (bounded, a few KiB a thread).
 *
 * The same readings are taken once more right after the ranks are added, before any route:
 * empty_rss / empty_alloc is what an empty router costs (shard lanes, rank table, index tables;
 * independent of the blocks), and marginal_* divides only what the blocks added (end minus
 * empty) by the pairs.  bytes_per_block_rank_* (the brief's definition) includes the empty
 * router, so it falls as the capacity grows.  marginal_* still carries what the first routes
 * allocate once (thread caches, the first table segments), so slope_* gives the cost of a
 * further block alone: a reading when the ranks hold a quarter of their capacity, and
 * slope = (full - quarter) / (pairs at full - pairs at a quarter).
 *
 * A user sees RSS with the allocator's dirty pages in it: jemalloc keeps freed pages ~10 s before
 * it returns them, except that a shard idle for 100 ms purges the library's arena (shards/
 * runtime.c: idle_purge), which the quiesce's pause lets happen.  The last reading also purges
 * every arena (arena.<ALL>.purge) and reads RSS again (bytes_per_block_rank_rss_purged): what is
 * allocated plus fragmentation.  Two footprint_breakdown lines per shape split the empty
 * router's reading (state=empty) and the last one (state=end), both divided by the last
 * reading's pairs (print_breakdown).
 *
 * It then keeps routing for --churn x (R x C) further new blocks (the steady state of a full
 * router, evicting on every admission) and reads again: the SUMMARY figures are from that second
 * reading, the first is printed as full_*.  Each shape runs in a child process of its own, so a
 * shape never reuses pages another one left in the allocator.
 *
 * Baseline: the project brief's figures, printed for reference only (never compared against a
 * hard-coded result): ~220 B per (block, rank) before the run-compressed index and segment LRU,
 * target <= 32 B.  ratio_target = measured / 32.
 *
 * --bins adds, per shape, a line per jemalloc arena: where its fragmentation sits, its metadata
 * (base, internal), its resident bytes and the threads bound to it (print_bins).
 *
 * --lane-capacity N sets kvr_config.lane_capacity (the shards' routing rings, 64 B a slot; default
 * 4095): what the lanes cost at another size.  The readings follow a quiesce longer than a
 * shard's 100 ms idle purge, with which each shard gives its routing ring's pages back
 * (sync/lane.h, idle trim): the breakdown's lanes= counts the rings allocated, the RSS figures
 * only the pages posts touched since (a busy router holds the whole rings).
 *
 * --tokens L runs only the shapes of L-token conversations (2048 or 32768).
 *
 * usage: bench_footprint [--quick] [--ranks R (8)] [--capacity C blocks per rank
 *                        (25600, README: one vLLM rank; --quick 8192)] [--churn F (1.0; --quick
 * 0.5)] [--tokens L] [--lane-capacity N] [--bins]
 */
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifdef KVR_HAVE_JEMALLOC
#include <jemalloc/jemalloc.h>
#endif

#include "kvrouter.h"
#include "perf/bench_util.h"
#include "tests/common/xorshift.h"

#define REF_OLD_BYTES    220.0 /* the brief: before this round's index and cache */
#define REF_TARGET_BYTES 32.0  /* the brief's target */
#define N_SESSIONS       32    /* conversations in flight (interleaved turns) */
#define N_SYSTEM         4     /* shared system prompts */
#define MAX_RANKS        64

struct shape {
	uint32_t block_size;
	size_t len; /* a conversation ends once its transcript reaches this many tokens */
	uint32_t ranks;
	uint64_t capacity;
};

struct session {
	uint32_t *tok; /* the transcript; len + one turn of room, allocated before the baseline */
	size_t n;
};

/* The process RSS in bytes (-1 if unknown); *file, when not NULL, gets the part of it that is
 * file-backed (statm's "shared": the pages of the program's and libraries' code and data read
 * in, not the heap). */
static long rss_bytes_file(long *file)
{
	FILE *f = fopen("/proc/self/statm", "r");
	long size = 0, resident = -1, shared = -1;
	if (!f)
		return -1;
	if (fscanf(f, "%ld %ld %ld", &size, &resident, &shared) != 3)
		resident = shared = -1;
	fclose(f);
	if (file)
		*file = shared < 0 ? -1 : shared * sysconf(_SC_PAGESIZE);
	return resident < 0 ? -1 : resident * sysconf(_SC_PAGESIZE);
}

static long rss_bytes(void)
{
	return rss_bytes_file(NULL);
}

/* A jemalloc stat ("stats.active", "stats.metadata"), or -1. */
static long long je_stat(const char *name)
{
#ifdef KVR_HAVE_JEMALLOC
	size_t v = 0, sz = sizeof(v);
	return mallctl(name, &v, &sz, NULL, 0) == 0 ? (long long)v : -1;
#else
	(void)name;
	return -1;
#endif
}

/* Returns the dirty pages every jemalloc arena keeps after a free (decay: ~10 s by default) to
 * the kernel, so RSS read after it holds only what is allocated plus fragmentation.  Returns
 * false without jemalloc. */
static bool purge_all(void)
{
#ifdef KVR_HAVE_JEMALLOC
	char name[64];
	snprintf(name, sizeof(name), "arena.%u.purge", (unsigned)MALLCTL_ARENAS_ALL);
	return mallctl(name, NULL, NULL, NULL, 0) == 0;
#else
	return false;
#endif
}

static void quiesce(struct kvr_router *r)
{
	kvr_router_sync(r, 60000);
	struct timespec ts = {0,
	                      200 * 1000 * 1000}; /* call_rcu's thread frees after a grace period */
	nanosleep(&ts, NULL);
	kvr_router_sync(r, 60000);
}

struct counts {
	uint64_t resident, indexed, evictions;
	bool full;
};

static int count_ranks(struct kvr_router *r, const struct shape *sh, struct counts *c)
{
	memset(c, 0, sizeof(*c));
	c->full = true;
	for (uint32_t i = 0; i < sh->ranks; i++) {
		struct kvr_rank_stats st;
		int rc = kvr_rank_get_stats(r, (struct kvr_rank_id){.worker_id = i}, &st);
		if (rc)
			return rc;
		c->resident += st.resident_blocks;
		c->indexed += st.indexed_blocks;
		c->evictions += st.evictions;
		if (st.resident_blocks < st.capacity_blocks && st.evictions == 0)
			c->full = false;
	}
	return 0;
}

/* The traffic: buffers allocated once, before the baseline reading. */
struct traffic {
	struct session s[N_SESSIONS];
	uint32_t *system[N_SYSTEM];
	size_t system_len[N_SYSTEM];
	uint32_t *out; /* one turn of output tokens */
	size_t turn;   /* tokens of user message, and of output, per turn (at most) */
	uint64_t seed;
	uint32_t fresh; /* next never-used token */
};

static void fresh_tokens(struct traffic *t, uint32_t *dst, size_t n)
{
	for (size_t k = 0; k < n; k++)
		dst[k] = t->fresh++;
}

/* Starts conversation i: a shared system prompt (3 in 4) or a prefix of its own, then a first
 * user message. */
static void session_start(struct traffic *t, struct session *s)
{
	uint64_t pick = xorshift64(&t->seed);
	size_t first = t->turn / 2 + (size_t)(xorshift64(&t->seed) % (t->turn + 1));
	s->n = 0;
	if (pick % 4 != 0) {
		size_t j = (size_t)(pick >> 8) % N_SYSTEM;
		memcpy(s->tok, t->system[j], t->system_len[j] * sizeof(uint32_t));
		s->n = t->system_len[j];
	}
	fresh_tokens(t, s->tok + s->n, first);
	s->n += first;
}

static int traffic_init(struct traffic *t, const struct shape *sh)
{
	memset(t, 0, sizeof(*t));
	t->seed = 0x9e3779b97f4a7c15ull ^ sh->len ^ ((uint64_t)sh->ranks << 32);
	t->fresh = 1;
	t->turn = sh->len / 16 > 64 ? sh->len / 16 : 64;
	size_t room = sh->len + 4 * t->turn;
	t->out = calloc(t->turn, sizeof(uint32_t));
	if (!t->out)
		return -1;
	for (int j = 0; j < N_SYSTEM; j++) {
		t->system_len[j] = sh->len / 8 + (size_t)j * sh->block_size * 3;
		t->system[j] = calloc(t->system_len[j], sizeof(uint32_t));
		if (!t->system[j])
			return -1;
		fresh_tokens(t, t->system[j], t->system_len[j]);
	}
	for (int i = 0; i < N_SESSIONS; i++) {
		t->s[i].tok = calloc(room, sizeof(uint32_t)); /* calloc touches nothing: memset */
		if (!t->s[i].tok)
			return -1;
		memset(t->s[i].tok, 0xff, room * sizeof(uint32_t));
		session_start(t, &t->s[i]);
	}
	memset(t->out, 0xff, t->turn * sizeof(uint32_t));
	return 0;
}

static void traffic_fini(struct traffic *t)
{
	for (int i = 0; i < N_SESSIONS; i++)
		free(t->s[i].tok);
	for (int j = 0; j < N_SYSTEM; j++)
		free(t->system[j]);
	free(t->out);
}

/* One turn of a random conversation: route its transcript, pass output, finish; the output and
 * a new user message join the transcript (or the conversation ends at len and another starts).
 * *new_blocks gets the prompt's blocks the chosen rank did not hold. */
static int turn(struct kvr_router *r, struct traffic *t, const struct shape *sh,
                uint64_t *new_blocks)
{
	struct session *s = &t->s[xorshift64(&t->seed) % N_SESSIONS];
	struct kvr_request req;
	kvr_request_init(&req);
	req.tokens = s->tok;
	req.n_tokens = s->n;
	struct kvr_decision d;
	int rc;
	/* KVR_EAGAIN: a shard lane stayed full for 10 ms (overload; here a shard descheduled on
	 * a busy machine): as a user would, let the shards drain and call again. */
	for (int k = 0; (rc = kvr_route(r, &req, &d)) == KVR_EAGAIN && k < 100; k++)
		kvr_router_sync(r, 60000);
	if (rc)
		return rc;
	if (d.status != KVR_DECIDED)
		return -1;
	*new_blocks = d.required_blocks - d.overlap_blocks;
	size_t n_out = t->turn / 2 + (size_t)(xorshift64(&t->seed) % (t->turn / 2 + 1));
	fresh_tokens(t, t->out, n_out);
	for (int k = 0;
	     (rc = kvr_request_output(r, d.attempt, t->out, n_out)) == KVR_EAGAIN && k < 100; k++)
		kvr_router_sync(r, 60000);
	if (rc == 0)
		rc = kvr_request_finish(r, d.attempt);
	if (rc)
		return rc;
	if (s->n + n_out >= sh->len) {
		session_start(t, s);
		return 0;
	}
	memcpy(s->tok + s->n, t->out, n_out * sizeof(uint32_t));
	s->n += n_out;
	size_t user = t->turn / 2 + (size_t)(xorshift64(&t->seed) % (t->turn / 2 + 1));
	fresh_tokens(t, s->tok + s->n, user);
	s->n += user;
	return 0;
}

struct reading {
	struct counts c;
	long rss, rss_purged; /* rss_purged: after purge_all(), or -1 */
	long rss_file;        /* of rss, the file-backed pages (code), or -1 */
	long long alloc;
	long long active, metadata; /* jemalloc: pages of live extents, allocator metadata */
	struct kvr_memory mem;      /* the router's own counters */
};

/* purge: also read RSS after purge_all(), which changes what later readings see: last one only. */
static int read_now(struct kvr_router *r, const struct shape *sh, struct reading *rd, bool purge)
{
	quiesce(r);
	rd->rss = rss_bytes_file(&rd->rss_file);
	rd->alloc = bench_jemalloc_allocated(); /* refreshes the epoch for the two below */
	rd->active = je_stat("stats.active");
	rd->metadata = je_stat("stats.metadata");
	rd->rss_purged = purge && purge_all() ? rss_bytes() : -1;
	int rc = kvr_router_get_memory(r, &rd->mem);
	return rc ? rc : count_ranks(r, sh, &rd->c);
}

static double per_pair(long long bytes, long long base, uint64_t pairs)
{
	return pairs ? (double)(bytes - base) / (double)pairs : 0.0;
}

/* The end reading split by where the bytes go, per (block, rank): the router's parts
 * (kvr_router_get_memory: each module's counter at real allocator sizes), what the library
 * allocated beyond them (lib_other: pinned-run map, leases, attempt records in flight, metrics,
 * memory waiting for a grace period, less the parts' size-class rounding), the rest of the
 * library's arena (size_classes: what rounding to size classes adds to the asked-for bytes; tcache:
 * freed objects parked in the threads' caches, still allocated for jemalloc), what the process
 * allocated outside the library's arena (outside: liburcu, libc, the bench's stdio), then
 * the allocator: fragmentation (active pages minus allocated bytes), its metadata, and the
 * dirty pages it kept (RSS minus RSS after the purge).  rss_rest is what RSS holds beyond
 * allocated + fragmentation + metadata + dirty (thread stacks, libraries' data), and may be
 * negative when allocated pages were never touched (zeroed tables sized for max_ranks).
 * rss_file is the part of rss (in rss_rest) that is file-backed: the library's, libc's and
 * jemalloc's code paged in as the router first runs it (~1.9 B at 8 ranks x 25,600 blocks: ~380
 * KiB), shared with other processes and not per block. */
static long rss_file0 = -1; /* the baseline's file-backed RSS */

static void print_breakdown(const struct shape *sh, const char *state, const struct reading *e,
                            uint64_t pairs, long rss0, long long alloc0, long long active0,
                            long long meta0)
{
	double p = pairs ? (double)pairs : 1.0;
	const struct kvr_memory *m = &e->mem;
	double parts =
	    (double)(m->index + m->caches + m->load + m->lanes + m->rank_tables + m->attempt_pool);
	printf("SUMMARY bench=footprint_breakdown tokens=%zu ranks=%u state=%s pairs=%" PRIu64
	       " index=%.1f caches=%.1f load=%.1f lanes=%.1f rank_tables=%.1f attempt_pool=%.1f"
	       " lib_other=%.1f",
	       sh->len, sh->ranks, state, pairs, (double)m->index / p, (double)m->caches / p,
	       (double)m->load / p, (double)m->lanes / p, (double)m->rank_tables / p,
	       (double)m->attempt_pool / p, ((double)m->library - parts) / p);
	if (e->alloc >= 0 && alloc0 >= 0 && e->active >= 0 && e->metadata >= 0) {
		double alloc = (double)(e->alloc - alloc0);
		double frag = (double)((e->active - active0) - (e->alloc - alloc0));
		double meta = (double)(e->metadata - meta0);
		double dirty = e->rss_purged >= 0 ? (double)(e->rss - e->rss_purged) : 0.0;
		double rest = (double)(e->rss - rss0) - alloc - frag - meta - dirty;
		double arena = (double)m->arena, cached = (double)m->arena_cached;
		printf(" size_classes=%.1f tcache=%.1f outside=%.1f alloc=%.1f fragmentation=%.1f"
		       " metadata=%.1f dirty=%.1f rss_rest=%.1f rss=%.1f",
		       (arena - cached - (double)m->library) / p, cached / p, (alloc - arena) / p,
		       alloc / p, frag / p, meta / p, dirty / p, rest / p,
		       (double)(e->rss - rss0) / p);
	}
	if (e->rss_file >= 0 && rss_file0 >= 0)
		printf(" rss_file=%.1f", (double)(e->rss_file - rss_file0) / p);
	printf("\n");
}

/* --bins: where jemalloc's fragmentation sits.  For every arena with live slabs, each small size
 * class whose slabs hold free regions: its slabs (curslabs x slab_size) minus its live regions
 * (curregs x size): the wasted bytes per pair for those over 0.1 B a pair, then the arena's
 * total, and its dirty and muzzy pages (freed, not yet returned).  A diagnostic: the library's
 * two arenas are the ones created last (core/alloc.c). */
static void print_bins(const struct shape *sh, uint64_t pairs)
{
#ifdef KVR_HAVE_JEMALLOC
	unsigned narenas = 0, nbins = 0;
	size_t sz = sizeof(unsigned);
	if (mallctl("arenas.narenas", &narenas, &sz, NULL, 0) || sz != sizeof(unsigned) ||
	    mallctl("arenas.nbins", &nbins, &sz, NULL, 0))
		return;
	double p = pairs ? (double)pairs : 1.0;
	for (unsigned a = 0; a < narenas; a++) {
		char name[96];
		bool init = false;
		size_t bsz = sizeof(init);
		snprintf(name, sizeof(name), "arena.%u.initialized", a);
		if (mallctl(name, &init, &bsz, NULL, 0) || !init)
			continue;
		double total = 0;
		printf("# bins tokens=%zu ranks=%u arena=%u:", sh->len, sh->ranks, a);
		for (unsigned j = 0; j < nbins; j++) {
			size_t size = 0, slab = 0, regs = 0, slabs = 0;
			uint32_t nregs = 0;
			sz = sizeof(size_t);
			snprintf(name, sizeof(name), "arenas.bin.%u.size", j);
			mallctl(name, &size, &sz, NULL, 0);
			snprintf(name, sizeof(name), "arenas.bin.%u.slab_size", j);
			mallctl(name, &slab, &sz, NULL, 0);
			snprintf(name, sizeof(name), "stats.arenas.%u.bins.%u.curregs", a, j);
			mallctl(name, &regs, &sz, NULL, 0);
			snprintf(name, sizeof(name), "stats.arenas.%u.bins.%u.curslabs", a, j);
			mallctl(name, &slabs, &sz, NULL, 0);
			sz = sizeof(nregs);
			snprintf(name, sizeof(name), "arenas.bin.%u.nregs", j);
			mallctl(name, &nregs, &sz, NULL, 0);
			double waste = (double)slabs * (double)slab - (double)regs * (double)size;
			total += waste;
			if (waste / p >= 0.1)
				printf(" %zu:%.1f(%zu/%zu)", size, waste / p, regs,
				       slabs * (size_t)nregs);
		}
		size_t pdirty = 0, pmuzzy = 0, page = (size_t)sysconf(_SC_PAGESIZE);
		sz = sizeof(size_t);
		snprintf(name, sizeof(name), "stats.arenas.%u.pdirty", a);
		mallctl(name, &pdirty, &sz, NULL, 0);
		snprintf(name, sizeof(name), "stats.arenas.%u.pmuzzy", a);
		mallctl(name, &pmuzzy, &sz, NULL, 0);
		size_t base = 0, internal = 0;
		snprintf(name, sizeof(name), "stats.arenas.%u.base", a);
		mallctl(name, &base, &sz, NULL, 0);
		snprintf(name, sizeof(name), "stats.arenas.%u.internal", a);
		mallctl(name, &internal, &sz, NULL, 0);
		/* nthreads: threads bound to it (a default arena is made for each thread that
		 * touches jemalloc while fewer arenas than opt.narenas exist: ~90 KB of base each);
		 * resident: jemalloc's count of its resident pages, which takes every active
		 * page as resident, touched or not (the tables sized for max_ranks are not). */
		size_t resident = 0;
		snprintf(name, sizeof(name), "stats.arenas.%u.resident", a);
		mallctl(name, &resident, &sz, NULL, 0);
		unsigned nthreads = 0;
		size_t usz = sizeof(nthreads);
		snprintf(name, sizeof(name), "stats.arenas.%u.nthreads", a);
		mallctl(name, &nthreads, &usz, NULL, 0);
		printf(" total=%.1f dirty=%.1f muzzy=%.1f base=%.1f internal=%.1f resident=%.1f"
		       " nthreads=%u\n",
		       total / p, (double)(pdirty * page) / p, (double)(pmuzzy * page) / p,
		       (double)base / p, (double)internal / p, (double)resident / p, nthreads);
	}
#else
	(void)sh;
	(void)pairs;
#endif
}

/* --lane-capacity: the routing lanes' capacity (kvr_config.lane_capacity; 0: the default). */
static uint32_t lane_capacity;

/* Runs one shape (in a child process) and prints its SUMMARY line.  Returns 0 or 1. */
static int run_shape(const struct shape *sh, double churn, bool bins)
{
	struct traffic t;
	if (traffic_init(&t, sh)) {
		fprintf(stderr, "bench_footprint: out of memory for the prompts\n");
		return 1;
	}
	long rss0 = rss_bytes_file(&rss_file0);
	long long alloc0 = bench_jemalloc_allocated();
	long long active0 = je_stat("stats.active"), meta0 = je_stat("stats.metadata");

	struct kvr_config cfg;
	kvr_config_init(&cfg);
	cfg.block_size = sh->block_size;
	if (lane_capacity)
		cfg.lane_capacity = lane_capacity;
	struct kvr_router *r = NULL;
	int rc = kvr_router_create(&cfg, &r);
	for (uint32_t i = 0; rc == 0 && i < sh->ranks; i++)
		rc = kvr_rank_add(r, (struct kvr_rank_id){.worker_id = i}, 1, sh->capacity, 0);
	if (rc) {
		fprintf(stderr, "bench_footprint: create/add: %s\n", kvr_strerror(rc));
		kvr_router_destroy(r);
		return 1;
	}
	struct reading empty;
	rc = read_now(r, sh, &empty, false);

	/* Fill: until every rank is full (checked every 16 turns after a sync), bounded. */
	uint64_t routes = 0, routed_new = 0, nb = 0;
	uint64_t total_cap = sh->capacity * sh->ranks;
	uint64_t max_routes = 64 * total_cap; /* a rank the selection never fills ends the run */
	struct counts c = {0};
	struct reading quarter = {.rss = -1};
	while (!c.full && routes < max_routes) {
		for (int k = 0; k < 16 && rc == 0; k++, routes++) {
			rc = turn(r, &t, sh, &nb);
			routed_new += nb;
		}
		if (rc == 0) {
			kvr_router_sync(r, 60000);
			rc = count_ranks(r, sh, &c);
		}
		if (rc == 0 && quarter.rss < 0 && c.resident >= total_cap / 4)
			rc = read_now(r, sh, &quarter, false);
		if (rc) {
			fprintf(stderr, "bench_footprint: route: %s\n", kvr_strerror(rc));
			kvr_router_destroy(r);
			return 1;
		}
	}
	struct reading full, end;
	uint64_t routes_full = routes;
	rc = read_now(r, sh, &full, false);

	/* Churn: the steady state of a full router, every admission evicting. */
	uint64_t churn_until = routed_new + (uint64_t)(churn * (double)total_cap);
	while (rc == 0 && routed_new < churn_until) {
		rc = turn(r, &t, sh, &nb);
		routed_new += nb;
		routes++;
	}
	if (rc == 0)
		rc = read_now(r, sh, &end, true);
	if (rc) {
		fprintf(stderr, "bench_footprint: %s\n", kvr_strerror(rc));
		kvr_router_destroy(r);
		return 1;
	}

	double rss_pp = per_pair(end.rss, rss0, end.c.resident);
	double full_rss_pp = per_pair(full.rss, rss0, full.c.resident);
	double marg_rss_pp = per_pair(end.rss, empty.rss, end.c.resident);
	char alloc_s[32] = "na", full_alloc_s[32] = "na", ratio_alloc_s[32] = "na";
	char marg_alloc_s[32] = "na", slope_alloc_s[32] = "na", purged_s[32] = "na";
	if (end.rss_purged >= 0)
		snprintf(purged_s, sizeof(purged_s), "%.1f",
		         per_pair(end.rss_purged, rss0, end.c.resident));
	/* The slope needs a quarter reading taken before the full one: none (a rank never filled
	 * to a quarter) divided by rss -1's, and one taken at full (a capacity the first turns
	 * fill) by no pairs, 0.0; na instead of either. */
	const bool slope = quarter.rss >= 0 && full.c.resident > quarter.c.resident;
	const uint64_t dp = slope ? full.c.resident - quarter.c.resident : 0;
	char slope_rss_s[32] = "na";
	if (slope)
		snprintf(slope_rss_s, sizeof(slope_rss_s), "%.1f",
		         per_pair(full.rss, quarter.rss, dp));
	if (end.alloc >= 0 && alloc0 >= 0) {
		double a = per_pair(end.alloc, alloc0, end.c.resident);
		snprintf(alloc_s, sizeof(alloc_s), "%.1f", a);
		snprintf(full_alloc_s, sizeof(full_alloc_s), "%.1f",
		         per_pair(full.alloc, alloc0, full.c.resident));
		snprintf(marg_alloc_s, sizeof(marg_alloc_s), "%.1f",
		         per_pair(end.alloc, empty.alloc, end.c.resident));
		if (slope && quarter.alloc >= 0)
			snprintf(slope_alloc_s, sizeof(slope_alloc_s), "%.1f",
			         per_pair(full.alloc, quarter.alloc, dp));
		snprintf(ratio_alloc_s, sizeof(ratio_alloc_s), "%.2f", a / REF_TARGET_BYTES);
	}
	printf("SUMMARY bench=footprint block_size=%u tokens=%zu ranks=%u capacity=%" PRIu64
	       " full=%s routes_to_full=%" PRIu64 " routes=%" PRIu64 " pairs=%" PRIu64
	       " indexed=%" PRIu64 " evictions=%" PRIu64 " rss_delta=%ld alloc_delta=%lld"
	       " bytes_per_block_rank_rss=%.1f bytes_per_block_rank_alloc=%s"
	       " bytes_per_block_rank_rss_purged=%s"
	       " full_bytes_per_block_rank_rss=%.1f full_bytes_per_block_rank_alloc=%s"
	       " marginal_bytes_per_block_rank_rss=%.1f marginal_bytes_per_block_rank_alloc=%s"
	       " slope_bytes_per_block_rank_rss=%s slope_bytes_per_block_rank_alloc=%s"
	       " empty_rss=%ld empty_alloc=%lld ratio_target_rss=%.2f ratio_target_alloc=%s\n",
	       sh->block_size, sh->len, sh->ranks, sh->capacity, full.c.full ? "yes" : "no",
	       routes_full, routes, end.c.resident, end.c.indexed, end.c.evictions, end.rss - rss0,
	       end.alloc >= 0 ? end.alloc - alloc0 : -1LL, rss_pp, alloc_s, purged_s, full_rss_pp,
	       full_alloc_s, marg_rss_pp, marg_alloc_s, slope_rss_s, slope_alloc_s,
	       empty.rss - rss0, empty.alloc >= 0 ? empty.alloc - alloc0 : -1LL,
	       rss_pp / REF_TARGET_BYTES, ratio_alloc_s);
	print_breakdown(sh, "empty", &empty, end.c.resident, rss0, alloc0, active0, meta0);
	print_breakdown(sh, "end", &end, end.c.resident, rss0, alloc0, active0, meta0);
	if (bins)
		print_bins(sh, end.c.resident);
	fflush(stdout);
	kvr_router_destroy(r);
	traffic_fini(&t);
	return 0;
}

int main(int argc, char **argv)
{
	bool quick = false, bins = false;
	uint32_t ranks = 8;
	size_t only_tokens = 0;
	uint64_t capacity = 0;
	double churn = -1;
	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--quick"))
			quick = true;
		else if (!strcmp(argv[i], "--bins"))
			bins = true;
		else if (!strcmp(argv[i], "--ranks"))
			ranks = (uint32_t)opt_u64(argc, argv, i++, 1, MAX_RANKS);
		else if (!strcmp(argv[i], "--capacity"))
			capacity = opt_u64(argc, argv, i++, 1, 1ull << 32);
		else if (!strcmp(argv[i], "--churn"))
			churn = opt_f64(argc, argv, i++, 0, 1e6);
		else if (!strcmp(argv[i], "--tokens")) {
			/* a length no shape has ran nothing and said nothing */
			only_tokens = (size_t)opt_u64(argc, argv, i, 1, 1u << 24);
			if (only_tokens != 2048 && only_tokens != 32768)
				opt_bad(argv, i, "2048 or 32768", argv[i + 1]);
			i++;
		} else if (!strcmp(argv[i], "--lane-capacity"))
			lane_capacity = (uint32_t)opt_u64(argc, argv, i++, 0, UINT32_MAX);
		else
			opt_unknown(argv, i);
	}
	if (capacity == 0)
		capacity = quick ? 8192 : 25600;
	if (churn < 0)
		churn = quick ? 0.5 : 1.0;

	const struct shape shapes[] = {
	    {16, 2048, ranks, capacity},
	    {16, 32768, ranks, capacity},
	    {16, 2048, 1, capacity},
	};
	printf("# bench_footprint: approx_lru router, session prompts, capacity %" PRIu64
	       " blocks per rank, churn %.2f x capacity, jemalloc %s\n",
	       capacity, churn, bench_jemalloc_allocated() >= 0 ? "yes" : "no");
	printf("SUMMARY bench=footprint_reference old_bytes_per_block_rank=%.0f "
	       "target_bytes_per_block_rank=%.0f\n",
	       REF_OLD_BYTES, REF_TARGET_BYTES);
	fflush(stdout);
	int failed = 0;
	for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++) {
		if (i > 0 && shapes[i].ranks == shapes[0].ranks && shapes[i].len == shapes[0].len)
			continue; /* --ranks 1: the 1-rank shape is the first one */
		if (only_tokens && shapes[i].len != only_tokens)
			continue;
		pid_t pid = fork();
		if (pid < 0) {
			perror("fork");
			return 1;
		}
		if (pid == 0)
			_exit(run_shape(&shapes[i], churn, bins));
		int st = 0;
		if (waitpid(pid, &st, 0) < 0 || !WIFEXITED(st) || WEXITSTATUS(st) != 0)
			failed = 1;
	}
	return failed;
}
