/* core/metrics.c - per-thread metric blocks, merged on read; see metrics.h. */
#include "core/metrics.h"

#include <pthread.h>
#include <string.h>

#include "core/alloc.h"
#include "core/fork.h"
#include "kvrouter.h"

struct kvr_metrics {
	uint64_t id;                      /* unique for the process: addresses get reused */
	pthread_mutex_t lock;             /* registration and free list only */
	struct kvr_metrics_block *blocks; /* head; published with release */
	struct kvr_metrics_block *free;
	struct kvr_metrics *live_next; /* the live registries (under live_lock) */
};

/* Live registries, so a thread exiting after a router was destroyed never touches it. */
static pthread_mutex_t live_lock = PTHREAD_MUTEX_INITIALIZER;
static struct kvr_metrics *live;
static uint64_t next_id = 1;

/* One-entry cache: the last registry this thread recorded into (by id) and its block there. */
static _Thread_local uint64_t tls_id;
static _Thread_local struct kvr_metrics_block *tls_block;

/* The blocks this thread took, to hand back at thread exit: one per registry (router) it
 * recorded into.  Grown as needed: a thread of a gateway may route through any number of
 * routers (at a fixed 8, the ninth router's calls from that thread went uncounted). */
struct owned_ref {
	struct kvr_metrics *m;
	uint64_t id;
	struct kvr_metrics_block *b;
};
static _Thread_local struct owned {
	struct owned_ref *r; /* kvr_alloc'd, cap entries */
	uint32_t n, cap;
} tls_owned;

#define OWNED_MIN 8u
static pthread_key_t exit_key;
static pthread_once_t exit_once = PTHREAD_ONCE_INIT;

static void on_thread_exit(void *unused)
{
	(void)unused;
	pthread_mutex_lock(&live_lock);
	for (uint32_t i = 0; i < tls_owned.n; i++) {
		struct owned_ref *o = &tls_owned.r[i];
		for (struct kvr_metrics *m = live; m; m = m->live_next) {
			if (m != o->m || m->id != o->id)
				continue;
			pthread_mutex_lock(&m->lock);
			o->b->next_free = m->free;
			m->free = o->b;
			pthread_mutex_unlock(&m->lock);
			break;
		}
	}
	pthread_mutex_unlock(&live_lock);
	kvr_free(tls_owned.r, (size_t)tls_owned.cap * sizeof(*tls_owned.r));
	tls_owned.r = NULL;
	tls_owned.n = tls_owned.cap = 0;
	tls_id = 0;
	tls_block = NULL;
}

static void make_key(void)
{
	pthread_key_create(&exit_key, on_thread_exit);
}

void kvr_metrics_fork(bool before)
{
	if (before)
		pthread_mutex_lock(&live_lock);
	else
		pthread_mutex_unlock(&live_lock);
}

/* Takes m off the live list.  Context: live_lock held. */
static void unlink_live(struct kvr_metrics *m)
{
	for (struct kvr_metrics **pp = &live; *pp; pp = &(*pp)->live_next) {
		if (*pp == m) {
			*pp = m->live_next;
			return;
		}
	}
}

void kvr_metrics_fork_forget(struct kvr_metrics *m)
{
	/* live_lock is this thread's (kvr_metrics_fork(true) before the fork): a thread exiting
	 * in the child then hands its blocks of m to no one, where m's lock may have been copied
	 * held by a thread of the parent. */
	unlink_live(m);
}

int kvr_metrics_create(struct kvr_metrics **out)
{
	struct kvr_metrics *m = kvr_calloc(1, sizeof(*m));
	if (!m)
		return KVR_ENOMEM;
	pthread_once(&exit_once, make_key);
	pthread_mutex_init(&m->lock, NULL);
	pthread_mutex_lock(&live_lock);
	m->id = next_id++;
	m->live_next = live;
	live = m;
	pthread_mutex_unlock(&live_lock);
	*out = m;
	return 0;
}

void kvr_metrics_destroy(struct kvr_metrics *m)
{
	if (!m)
		return;
	pthread_mutex_lock(&live_lock);
	unlink_live(m);
	pthread_mutex_unlock(&live_lock);
	struct kvr_metrics_block *b = m->blocks;
	while (b) {
		struct kvr_metrics_block *next = b->next;
		kvr_free_aligned(b, sizeof(*b));
		b = next;
	}
	pthread_mutex_destroy(&m->lock);
	kvr_free(m, sizeof(*m));
}

/* Makes room for one more ref in tls_owned: drops the refs whose registry is gone (destroyed
 * routers), else doubles the array.  False: no memory. */
static bool owned_room(void)
{
	pthread_mutex_lock(&live_lock);
	uint32_t k = 0;
	for (uint32_t i = 0; i < tls_owned.n; i++) {
		for (struct kvr_metrics *l = live; l; l = l->live_next) {
			if (l == tls_owned.r[i].m && l->id == tls_owned.r[i].id) {
				tls_owned.r[k++] = tls_owned.r[i];
				break;
			}
		}
	}
	tls_owned.n = k;
	pthread_mutex_unlock(&live_lock);
	/* Half full after the drop: grow anyway, so that a thread cycling through routers does
	 * not walk the live list at every new one. */
	if (k < tls_owned.cap / 2)
		return true;
	uint32_t nc = tls_owned.cap ? tls_owned.cap * 2 : OWNED_MIN;
	struct owned_ref *q =
	    kvr_realloc(tls_owned.r, (size_t)tls_owned.cap * sizeof(*q), (size_t)nc * sizeof(*q));
	if (!q)
		return k < tls_owned.cap;
	tls_owned.r = q;
	tls_owned.cap = nc;
	/* The thread's exit frees the array: registered now, not only once a block is taken (a
	 * block that then failed to allocate left the array to leak at the thread's exit). */
	pthread_setspecific(exit_key, &tls_owned);
	return true;
}

struct kvr_metrics_block *kvr_metrics_local(struct kvr_metrics *m)
{
	if (__builtin_expect(tls_id == m->id, 1))
		return tls_block;
	/* Slow path: this thread's block for m, or a new one.  Forget refs to dead registries. */
	for (uint32_t i = 0; i < tls_owned.n; i++) {
		struct owned_ref *o = &tls_owned.r[i];
		if (o->m == m && o->id == m->id) {
			tls_id = m->id;
			tls_block = o->b;
			return o->b;
		}
	}
	if (tls_owned.n == tls_owned.cap && !owned_room())
		return NULL; /* no memory for the ref: this call is not counted */
	pthread_mutex_lock(&m->lock);
	struct kvr_metrics_block *b = m->free;
	if (b) {
		m->free = b->next_free;
	} else {
		b = kvr_alloc_aligned(sizeof(*b));
		if (b) {
			b->next = m->blocks;
			__atomic_store_n(&m->blocks, b, __ATOMIC_RELEASE);
		}
	}
	pthread_mutex_unlock(&m->lock);
	if (!b)
		return NULL;
	tls_owned.r[tls_owned.n++] = (struct owned_ref){m, m->id, b};
	pthread_setspecific(exit_key, &tls_owned);
	tls_id = m->id;
	tls_block = b;
	return b;
}

uint64_t kvr_metrics_counter(struct kvr_metrics *m, enum kvr_counter c)
{
	uint64_t s = 0;
	for (struct kvr_metrics_block *b = __atomic_load_n(&m->blocks, __ATOMIC_ACQUIRE); b;
	     b = b->next)
		s += __atomic_load_n(&b->counter[c], __ATOMIC_RELAXED);
	return s;
}

void kvr_metrics_hist(struct kvr_metrics *m, enum kvr_hist h, uint64_t out[KVR_HIST_BUCKETS],
                      uint64_t *sum)
{
	memset(out, 0, sizeof(uint64_t) * KVR_HIST_BUCKETS);
	uint64_t s = 0;
	for (struct kvr_metrics_block *b = __atomic_load_n(&m->blocks, __ATOMIC_ACQUIRE); b;
	     b = b->next) {
		for (unsigned i = 0; i < KVR_HIST_BUCKETS; i++)
			out[i] += __atomic_load_n(&b->hist[h][i], __ATOMIC_RELAXED);
		uint64_t t = s + __atomic_load_n(&b->hist_sum[h], __ATOMIC_RELAXED);
		s = t < s ? UINT64_MAX : t; /* saturating, as each block's (metrics.h) */
	}
	if (sum)
		*sum = s;
}

uint64_t kvr_hist_bucket_low(unsigned i)
{
	if (i < 4)
		return i;
	unsigned e = i / 4 + 1, sub = i % 4;
	if (e > 63) /* past bucket 251, which ends at UINT64_MAX (and 1 << 64 is undefined) */
		return UINT64_MAX;
	return (1ull << e) + ((uint64_t)sub << (e - 2));
}

uint64_t kvr_hist_quantile(const uint64_t hist[KVR_HIST_BUCKETS], double q)
{
	uint64_t total = 0;
	for (unsigned i = 0; i < KVR_HIST_BUCKETS; i++)
		total += hist[i];
	if (total == 0)
		return 0;
	uint64_t rank = (uint64_t)(q * (double)total);
	if (rank >= total)
		rank = total - 1;
	uint64_t acc = 0;
	for (unsigned i = 0; i < KVR_HIST_BUCKETS; i++) {
		acc += hist[i];
		if (acc > rank)
			return i < kvr_hist_bucket(UINT64_MAX) ? kvr_hist_bucket_low(i + 1) - 1
			                                       : UINT64_MAX;
	}
	return UINT64_MAX;
}
