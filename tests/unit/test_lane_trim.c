/* The routing lane's idle trim (sync/lane.h, kvr_lanes_trim): an empty lane gives its ring's
 * pages back, a lane with a message queued, reserved or in the consumer's burst gives nothing
 * back, messages through a trimmed ring arrive whole and in order, and the shard runtime trims
 * with its idle purge.  Producers posting while the consumer trims:
 * tests/stress/stress_lanes_trim.c. */
#include <criterion/criterion.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "shards/runtime.h"
#include "sync/lane.h"

static void nop(void)
{
}

/* Resident pages wholly inside the routing ring's slots (mincore). */
static size_t resident_pages(const struct kvr_lanes *l)
{
	const struct kvr_ring *r = &l->ring[KVR_LANE_ROUTING];
	size_t page = (size_t)sysconf(_SC_PAGESIZE);
	uintptr_t a = (uintptr_t)r->buf, start = (a + page - 1) & ~(uintptr_t)(page - 1);
	uintptr_t end = (a + (size_t)r->size * sizeof(struct kvr_msg)) & ~(uintptr_t)(page - 1);
	size_t n = (end - start) / page, res = 0;
	unsigned char vec[1024];
	cr_assert_leq(n, sizeof(vec));
	cr_assert_eq(mincore((void *)start, end - start, vec), 0);
	for (size_t i = 0; i < n; i++)
		res += vec[i] & 1;
	return res;
}

/* Passes n messages through the routing lane, 64 at a time, each carrying its sequence number
 * from *seq and a pattern derived from it, and checks each one on the way out. */
static void cycle(struct kvr_lanes *l, uint32_t n, uint32_t *seq)
{
	unsigned char p[KVR_MSG_PAYLOAD];
	struct kvr_msg m;
	uint32_t out = *seq;
	for (uint32_t done = 0; done < n; done += 64) {
		for (uint32_t i = 0; i < 64; i++) {
			uint32_t s = *seq + i;
			memset(p, (int)(s * 7u + 1u), sizeof(p));
			memcpy(p, &s, sizeof(s));
			cr_assert_eq(kvr_lanes_push(l, KVR_LANE_ROUTING, nop, p, sizeof(p), s, 1),
			             0);
		}
		*seq += 64;
		for (uint32_t i = 0; i < 64; i++, out++) {
			cr_assert_eq(kvr_lanes_pop(l, &m), KVR_LANE_ROUTING);
			uint32_t s;
			memcpy(&s, m.payload, sizeof(s));
			cr_assert_eq(s, out, "got message %u, expected %u", s, out);
			cr_assert_eq(m.aux, out);
			cr_assert_eq(m.len, KVR_MSG_PAYLOAD);
			cr_assert_eq(m.fn, nop);
			for (size_t b = sizeof(s); b < sizeof(p); b++)
				cr_assert_eq(m.payload[b], (unsigned char)(out * 7u + 1u));
		}
	}
	cr_assert_eq(kvr_lanes_pop(l, &m), -1);
}

Test(lane_trim, empty_lane_gives_its_pages_back_and_keeps_working)
{
	struct kvr_lanes l;
	cr_assert_eq(kvr_lanes_init(&l, 4095, 64, 200000, NULL, NULL), 0);
	uint32_t seq = 0;
	cycle(&l, 8192, &seq); /* the indices went through every slot twice */
	size_t before = resident_pages(&l);
	cr_assert_geq(before, 63, "a ring whose indices went round is resident (%zu pages)",
	              before);
	size_t done = kvr_lanes_trim(&l);
	cr_assert_geq(done, 63 * (size_t)sysconf(_SC_PAGESIZE));
	cr_assert_eq(l.trimmed_bytes, done);
	cr_assert_eq(l.trimming, 0);
	cr_assert_leq(resident_pages(&l), 1, "%zu pages resident after the trim",
	              resident_pages(&l));
	/* The trimmed ring: the indices carry on from where they were, through zeroed pages. */
	cycle(&l, 8192, &seq);
	cr_assert_geq(resident_pages(&l), 63);
	kvr_lanes_fini(&l);
}

Test(lane_trim, lane_with_a_message_gives_nothing_back)
{
	struct kvr_lanes l;
	struct kvr_msg m;
	cr_assert_eq(kvr_lanes_init(&l, 255, 64, 200000, NULL, NULL), 0);
	uint32_t seq = 0;
	cycle(&l, 512, &seq);
	cr_assert_eq(kvr_lanes_push(&l, KVR_LANE_ROUTING, nop, NULL, 0, 1, 1), 0);
	cr_assert_eq(kvr_lanes_trim(&l), 0, "a message in the ring");
	cr_assert_eq(kvr_lanes_push(&l, KVR_LANE_ROUTING, nop, NULL, 0, 2, 1), 0);
	cr_assert_eq(kvr_lanes_pop(&l, &m), KVR_LANE_ROUTING);
	cr_assert_eq(m.aux, 1);
	cr_assert_eq(kvr_lanes_trim(&l), 0, "a message in the consumer's burst");
	cr_assert_eq(kvr_lanes_pop(&l, &m), KVR_LANE_ROUTING);
	cr_assert_eq(m.aux, 2);
	/* A reserved slot (a producer between its reservation and its commit). */
	uint32_t ticket;
	struct kvr_msg *slot = kvr_ring_reserve(&l.ring[KVR_LANE_ROUTING], &ticket);
	cr_assert_not_null(slot);
	cr_assert_eq(kvr_lanes_trim(&l), 0, "a reserved slot");
	kvr_ring_write(slot, nop, NULL, 0, 3);
	kvr_ring_commit_nowait(&l.ring[KVR_LANE_ROUTING], ticket, 0);
	cr_assert_eq(kvr_lanes_pop(&l, &m), KVR_LANE_ROUTING);
	cr_assert_eq(m.aux, 3);
	cr_assert_gt(kvr_lanes_trim(&l), 0, "empty again");
	cr_assert_eq(l.trimming, 0);
	kvr_lanes_fini(&l);
}

static uint64_t ran;
static void count_task(struct kvr_shard *sh, void *payload)
{
	(void)sh;
	(void)payload;
	__atomic_fetch_add(&ran, 1, __ATOMIC_RELAXED);
}

static void post_and_drain(struct kvr_shards *rt, uint64_t n)
{
	struct kvr_shard *sh = kvr_shards_get(rt, 0);
	uint64_t want = __atomic_load_n(&ran, __ATOMIC_RELAXED) + n;
	for (uint64_t i = 0; i < n; i++)
		while (kvr_shard_post(sh, KVR_LANE_ROUTING, count_task, &i, sizeof(i)) ==
		       KVR_EAGAIN)
			sched_yield();
	for (int k = 0; k < 10000 && __atomic_load_n(&ran, __ATOMIC_RELAXED) < want; k++)
		usleep(1000);
	cr_assert_eq(__atomic_load_n(&ran, __ATOMIC_RELAXED), want);
}

/* The shard runtime trims with its idle purge (100 ms after its last task), and a trimmed lane
 * takes work again. */
Test(lane_trim, idle_shard_trims_and_takes_work_after)
{
	struct kvr_shards_config c = {.n_shards = 1, .lane_capacity = 4095};
	struct kvr_shards *rt;
	cr_assert_eq(kvr_shards_create(&c, &rt), 0);
	struct kvr_shard_stats st;
	post_and_drain(rt, 5000);
	uint64_t trimmed = 0;
	for (int k = 0; k < 200 && !trimmed; k++) {
		usleep(10000);
		kvr_shard_get_stats(kvr_shards_get(rt, 0), &st);
		trimmed = st.lane_trimmed_bytes;
	}
	cr_assert_geq(trimmed, 63 * (uint64_t)sysconf(_SC_PAGESIZE),
	              "an idle shard gave back %llu bytes of its routing ring",
	              (unsigned long long)trimmed);
	post_and_drain(rt, 5000);
	kvr_shards_destroy(rt);
}
