/*
 * stress_feed - the KV event feed while other threads use its API: a publisher thread sends
 * vLLM batches (msgpack-c, map form) for 4 ranks on 4 loopback PUB sockets, stores and removals
 * with copies; meanwhile API threads add and remove endpoints, read stats and render metrics.
 * At the end every rank's index must equal the publisher's model (hash -> copies), and nothing
 * may be malformed, refused or missing.  Run under TSan in CI.
 * Plain program: exit 0 pass, 1 fail, 77 skip (built without zmq).  argv[1]: duration, ms.
 */
#include <inttypes.h>
#include <msgpack.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "kvrouter.h"
#include "shards/u64map.h"
#include "tests/common/mono_clock.h"

#define BS     16
#define RANKS  4
#define WINDOW 64

static struct kvr_router *R;
static struct kvr_feed *F;
static int stop;

static void pstr(msgpack_packer *pk, const char *s)
{
	msgpack_pack_str(pk, strlen(s));
	msgpack_pack_str_body(pk, s, strlen(s));
}

/* Batch b of a rank: store 4 root blocks (the even batches store the previous batch's blocks
 * again: a second copy), and from WINDOW on remove one copy of batch b - WINDOW's blocks. */
static uint64_t hash_of(uint32_t rank, uint64_t b, int i)
{
	return 0x8000000000000000ull | (uint64_t)rank << 56 | b << 4 | (uint64_t)i;
}

static void encode(msgpack_sbuffer *sb, uint32_t rank, uint64_t b, uint64_t *blk, int *nblk)
{
	msgpack_packer pk;
	msgpack_sbuffer_clear(sb);
	msgpack_packer_init(&pk, sb, msgpack_sbuffer_write);
	msgpack_pack_map(&pk, 2);
	pstr(&pk, "ts");
	msgpack_pack_double(&pk, 1.0);
	pstr(&pk, "events");
	bool rm = b >= WINDOW;
	msgpack_pack_array(&pk, rm ? 2 : 1);
	uint64_t src = (b & 1) && b ? b - 1 : b; /* odd batches repeat the previous: copies */
	*nblk = 4;
	msgpack_pack_map(&pk, 6);
	pstr(&pk, "type");
	pstr(&pk, "BlockStored");
	pstr(&pk, "block_hashes");
	msgpack_pack_array(&pk, 4);
	for (int i = 0; i < 4; i++)
		msgpack_pack_uint64(&pk, blk[i] = hash_of(rank, src, i));
	pstr(&pk, "parent_block_hash");
	msgpack_pack_nil(&pk);
	pstr(&pk, "token_ids");
	msgpack_pack_array(&pk, 4 * BS);
	for (int i = 0; i < 4; i++)
		for (int j = 0; j < BS; j++)
			msgpack_pack_uint32(&pk, (uint32_t)(blk[i] * 2654435761u) + (uint32_t)j);
	pstr(&pk, "block_size");
	msgpack_pack_int(&pk, BS);
	pstr(&pk, "medium");
	msgpack_pack_nil(&pk);
	if (rm) {
		uint64_t old = b - WINDOW, osrc = (old & 1) && old ? old - 1 : old;
		msgpack_pack_map(&pk, 2);
		pstr(&pk, "type");
		pstr(&pk, "BlockRemoved");
		pstr(&pk, "block_hashes");
		msgpack_pack_array(&pk, 4);
		for (int i = 0; i < 4; i++)
			msgpack_pack_uint64(&pk, blk[4 + i] = hash_of(rank, osrc, i));
		*nblk = 8;
	}
}

static struct kvr_u64map model[RANKS];
static uint64_t published[RANKS];
static uint32_t ids[RANKS];

static void *publisher(void *arg)
{
	void **pub = arg;
	msgpack_sbuffer sb;
	msgpack_sbuffer_init(&sb);
	for (uint64_t b = 0; !__atomic_load_n(&stop, __ATOMIC_ACQUIRE); b++) {
		for (uint32_t r = 0; r < RANKS; r++) {
			uint64_t h[8];
			int n;
			encode(&sb, r, b, h, &n);
			uint8_t s[8];
			for (int i = 0; i < 8; i++)
				s[i] = (uint8_t)(b >> (56 - 8 * i));
			zmq_send(pub[r], "", 0, ZMQ_SNDMORE);
			zmq_send(pub[r], s, 8, ZMQ_SNDMORE);
			zmq_send(pub[r], sb.data, sb.size, 0);
			kvr_u64map_reserve(&model[r], 4);
			for (int i = 0; i < 4; i++) {
				uint32_t *c = kvr_u64map_find(&model[r], h[i]);
				if (c)
					++*c;
				else
					kvr_u64map_insert(&model[r], h[i], 1);
			}
			for (int i = 4; i < n; i++) {
				uint32_t *c = kvr_u64map_find(&model[r], h[i]);
				if (c && *c > 1)
					--*c;
				else if (c)
					kvr_u64map_remove(&model[r], h[i]);
			}
			published[r] = b + 1;
		}
		if (b % 16 == 15)
			usleep(1000);
	}
	msgpack_sbuffer_destroy(&sb);
	return NULL;
}

static int api_errors, add_retries;

/* kvr_feed_add, again while it says KVR_ENOMEM, up to a second: ZeroMQ frees closed sockets
 * on its reaper thread, and two threads adding and removing endpoints as fast as they can
 * (3 sockets each: SUB, its monitor, the monitor's reader) can reach the context's socket
 * limit while a loaded machine keeps the reaper waiting. */
static int add_retry(const struct kvr_feed_endpoint *e, uint32_t *id)
{
	int rc;
	for (int k = 0; (rc = kvr_feed_add(F, e, id)) == KVR_ENOMEM && k < 1000; k++) {
		__atomic_add_fetch(&add_retries, 1, __ATOMIC_RELAXED);
		usleep(1000);
	}
	return rc;
}

static void *api_user(void *arg)
{
	(void)arg;
	char *text = malloc(1 << 16);
	while (!__atomic_load_n(&stop, __ATOMIC_ACQUIRE)) {
		struct kvr_feed_stats st;
		struct kvr_feed_endpoint e = {.endpoint = "tcp://127.0.0.1:9", .worker_id = 99};
		uint32_t id;
		int rc, step = 0;
		if ((rc = kvr_feed_get_stats(F, KVR_FEED_ALL, &st)) ||
		    (++step, rc = add_retry(&e, &id)) ||
		    (++step, rc = kvr_feed_get_stats(F, id, &st)) ||
		    (++step, rc = kvr_feed_remove(F, id))) {
			if (__atomic_add_fetch(&api_errors, 1, __ATOMIC_RELAXED) == 1)
				fprintf(stderr,
				        "stress_feed: API call %d (stats, add, stats, remove) "
				        "failed: %s\n",
				        step, kvr_strerror(rc));
		}
		size_t len;
		kvr_metrics_render(R, text, 1 << 16, &len);
	}
	free(text);
	return NULL;
}

static int cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return x < y ? -1 : x > y;
}

int main(int argc, char **argv)
{
	uint64_t ms = argc > 1 ? strtoull(argv[1], NULL, 10) : 1500;
	struct kvr_config cfg;
	kvr_config_init(&cfg);
	cfg.mode = KVR_MODE_EVENTS;
	cfg.block_size = BS;
	cfg.n_shards = 2;
	if (kvr_router_create(&cfg, &R))
		return 1;
	for (uint32_t r = 0; r < RANKS; r++)
		kvr_rank_add(R, (struct kvr_rank_id){r, 0}, 1, KVR_CAPACITY_NONE, 0);
	struct kvr_feed_config fc;
	kvr_feed_config_init(&fc);
	fc.rcv_hwm = 1u << 30;
	int rc = kvr_feed_create(R, &fc, &F);
	if (rc == KVR_ENOTSUP)
		return 77;
	if (rc)
		return 1;
	void *zctx = zmq_ctx_new();
	void *pub[RANKS];
	for (uint32_t r = 0; r < RANKS; r++) {
		kvr_u64map_init(&model[r]);
		pub[r] = zmq_socket(zctx, ZMQ_XPUB);
		int zero = 0;
		zmq_setsockopt(pub[r], ZMQ_SNDHWM, &zero, sizeof(zero));
		zmq_setsockopt(pub[r], ZMQ_LINGER, &zero, sizeof(zero));
		if (zmq_bind(pub[r], "tcp://127.0.0.1:*"))
			return 1;
		char ep[256];
		size_t len = sizeof(ep);
		zmq_getsockopt(pub[r], ZMQ_LAST_ENDPOINT, ep, &len);
		struct kvr_feed_endpoint e = {.endpoint = ep, .worker_id = r, .dp_rank = 0};
		if (kvr_feed_add(F, &e, &ids[r]))
			return 1;
		char sub[64];
		if (zmq_recv(pub[r], sub, sizeof(sub), 0) < 1)
			return 1;
	}
	pthread_t pt, at[2];
	pthread_create(&pt, NULL, publisher, pub);
	for (int i = 0; i < 2; i++)
		pthread_create(&at[i], NULL, api_user, NULL);
	usleep((useconds_t)(ms * 1000));
	__atomic_store_n(&stop, 1, __ATOMIC_RELEASE);
	pthread_join(pt, NULL);
	for (int i = 0; i < 2; i++)
		pthread_join(at[i], NULL);
	int fail = api_errors ? 1 : 0;
	if (api_errors)
		fprintf(stderr, "stress_feed: %d API calls failed\n", api_errors);
	uint64_t total = 0;
	for (uint32_t r = 0; r < RANKS; r++) {
		struct kvr_feed_stats st = {0};
		uint64_t end = now_ms() + 60000;
		while (now_ms() < end && kvr_feed_get_stats(F, ids[r], &st) == 0 &&
		       st.next_seq < published[r])
			usleep(1000);
		if (st.next_seq != published[r] || st.malformed || st.refused || st.gaps ||
		    st.restarts || st.duplicates) {
			fprintf(stderr,
			        "stress_feed: rank %u: next_seq %" PRIu64 " of %" PRIu64
			        ", malformed %" PRIu64 ", refused %" PRIu64 ", gaps %" PRIu64 "\n",
			        r, st.next_seq, published[r], st.malformed, st.refused, st.gaps);
			fail = 1;
		}
		total += published[r];
		size_t n = 0, w = 0;
		kvr_rank_blocks(R, (struct kvr_rank_id){r, 0}, NULL, 0, &n);
		uint64_t *got = malloc((n + 1) * sizeof(uint64_t)),
		         *want = malloc((model[r].count + 1) * sizeof(uint64_t));
		kvr_rank_blocks(R, (struct kvr_rank_id){r, 0}, got, n, &n);
		for (size_t i = 0; i < model[r].cap; i++)
			if (model[r].slots[i].val != KVR_U64MAP_EMPTY)
				want[w++] = model[r].slots[i].key;
		qsort(got, n, sizeof(*got), cmp_u64);
		qsort(want, w, sizeof(*want), cmp_u64);
		if (n != w || memcmp(got, want, n * sizeof(*got))) {
			fprintf(stderr, "stress_feed: rank %u: index %zu blocks, publisher %zu\n",
			        r, n, w);
			fail = 1;
		}
		free(got);
		free(want);
		kvr_u64map_fini(&model[r]);
	}
	for (uint32_t r = 0; r < RANKS; r++)
		zmq_close(pub[r]);
	kvr_feed_destroy(F);
	kvr_router_destroy(R);
	zmq_ctx_term(zctx);
	printf("stress_feed: %" PRIu64 " batches on %d ranks, %s (endpoint adds retried: %d)\n",
	       total, RANKS, fail ? "FAILED" : "index == publisher model", add_retries);
	return fail;
}
