/*
 * Replicas of one cluster with different block sizes (a rolling upgrade that changed
 * block_size, one router misconfigured).
 *
 * The wire carries no block size, and a peer's admission was mirrored whenever its tail fitted
 * this router's block: with block sizes 16 and 5, 7 of 20 admissions were booked with the
 * sender's block geometry (their blocks' hashes meaningless here, their load counted in the
 * other's blocks) and the other 13 counted as refused, with nothing saying why.  An admission
 * tells its sender's geometry: a known chain has prompt_tokens = n_blocks x block size +
 * tail_n, and any chain has n_blocks x block size <= prompt_tokens.  One that does not fit this
 * router's block size is not booked, and is counted (kvr_sync_stats.block_size_mismatch) apart
 * from the refusals.
 *
 * Over the in-process bus (tests/unit/replica_bus.h).
 */
#include "tests/unit/replica_bus.h"

static struct kvr_router *make_bs(uint32_t bs)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 2;
	c.sync_booking = true;
	c.block_size = bs;
	struct kvr_router *r;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	for (uint64_t w = 0; w < 2; w++)
		cr_assert_eq(kvr_rank_add(r, (struct kvr_rank_id){w, 0}, 7, 1000, 4096), 0);
	return r;
}

static struct kvr_sync_stats stats(int i)
{
	struct kvr_sync_stats s;
	kvr_replica_get_stats(bus.rep[i], &s);
	return s;
}

/* Routes a prompt of hashes only (n tokens, nb hashes: the chain unknown unless n = nb x bs). */
static void route_hashes(struct kvr_router *r, uint32_t seed, size_t n, size_t nb)
{
	uint64_t h[64];
	cr_assert(nb <= 64);
	for (size_t j = 0; j < nb; j++)
		h[j] = (uint64_t)seed << 32 | j;
	struct kvr_request q;
	kvr_request_init(&q);
	q.local_hashes = h;
	q.n_hashes = nb;
	q.n_tokens = n;
	struct kvr_decision d;
	cr_assert_eq(kvr_route(r, &q, &d), 0);
}

/* Replicas 1 and 2 on an emptied bus, their routers (block sizes bs0, bs1) in r. */
static void pair(struct kvr_router **r, uint32_t bs0, uint32_t bs1)
{
	memset(&bus.rep, 0, sizeof(bus.rep));
	r[0] = make_bs(bs0);
	bus_attach(0, r[0]);
	r[1] = make_bs(bs1);
	bus_attach(1, r[1]);
}

/* r's active blocks and predicted blocks over both ranks. */
static void totals(struct kvr_router *r, uint64_t *active, size_t *blocks)
{
	*active = 0;
	*blocks = 0;
	for (uint64_t w = 0; w < 2; w++) {
		struct kvr_rank_stats rs;
		cr_assert_eq(kvr_rank_get_stats(r, (struct kvr_rank_id){w, 0}, &rs), 0);
		*active += rs.active_blocks;
		*blocks += n_blocks(r, (struct kvr_rank_id){w, 0});
	}
}

Test(replica_geometry, a_peer_with_another_block_size_is_not_mirrored, .timeout = 60)
{
	struct kvr_router *r[2];
	pair(r, 16, 5);

	/* Token prompts of 20..210 tokens, every one with a block under either size; then hash
	 * prompts whose chain the sender did not know (n_tokens not a multiple): 16 x 8 blocks
	 * need 128 tokens, more than 5's 8 blocks in 45 tokens have. */
	for (uint32_t k = 0; k < 20; k++)
		bus_route(r[1], 200 + k, 20 + 10 * k);
	route_hashes(r[1], 300, 45, 8);
	bus_quiet(r, 2);
	uint64_t own_active, active;
	size_t own_blocks, blocks;
	totals(r[1], &own_active, &own_blocks);
	for (uint32_t k = 0; k < 20; k++)
		bus_route(r[0], 100 + k, 20 + 10 * k);
	bus_quiet(r, 2);

	struct kvr_sync_stats s0 = stats(0), s1 = stats(1);
	cr_assert_eq(s1.block_size_mismatch, 20, "16 -> 5: %lu of 20 seen as another block size",
	             (unsigned long)s1.block_size_mismatch);
	cr_assert_eq(s0.block_size_mismatch, 21, "5 -> 16: %lu of 21 seen as another block size",
	             (unsigned long)s0.block_size_mismatch);
	cr_assert_eq(s0.mirrored, 0, "replica 1 mirrors nothing of replica 2 (%u)", s0.mirrored);
	cr_assert_eq(s1.mirrored, 0, "replica 2 mirrors nothing of replica 1 (%u)", s1.mirrored);
	cr_assert_eq(metric(r[1], "kvr_sync_messages_total{what=\"block_size_mismatch\"} "), 20);
	/* A mismatch is not a refusal (the router was never asked). */
	cr_assert_eq(s0.refused, 0);
	cr_assert_eq(s1.refused, 0);
	/* Nothing of the other geometry was booked: replica 2's load and predictions are its
	 * own. */
	totals(r[1], &active, &blocks);
	cr_assert_eq(active, own_active, "active blocks %lu, its own %lu", (unsigned long)active,
	             (unsigned long)own_active);
	cr_assert_eq(blocks, own_blocks, "predicted blocks %zu, its own %zu", blocks, own_blocks);

	/* A prompt shorter than either block: no geometry to get wrong, mirrored. */
	bus_route(r[0], 400, 3);
	bus_quiet(r, 2);
	cr_assert_eq(stats(1).mirrored, 1, "replica 2 mirrors the 3-token prompt");
	cr_assert_eq(stats(1).block_size_mismatch, 20);
	bus_teardown(r, 2);
}

Test(replica_geometry, peers_with_the_same_block_size_mirror_everything, .timeout = 60)
{
	struct kvr_router *r[2];
	pair(r, 5, 5);
	for (uint32_t k = 0; k < 20; k++)
		bus_route(r[0], 100 + k, 20 + 10 * k);
	route_hashes(r[0], 300, 45, 8); /* unknown chain, 40 <= 45 tokens: fits */
	route_hashes(r[0], 301, 40, 8); /* known chain (40 = 8 x 5) */
	bus_quiet(r, 2);
	struct kvr_sync_stats s1 = stats(1);
	cr_assert_eq(s1.block_size_mismatch, 0);
	cr_assert_eq(s1.refused, 0);
	cr_assert_eq(s1.mirrored, 22, "mirrored %u of 22", s1.mirrored);
	all_agree(r, 2, "one block size");
	bus_teardown(r, 2);
}
