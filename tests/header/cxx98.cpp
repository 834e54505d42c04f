/* The public header from C++98 built with -pedantic-errors: older frontends still compile as
 * C++03, and one trailing comma in an enum (a C++11 extension) stopped every file that included
 * kvrouter.h there.  The program also routes once, so the header's declarations link. */
#include <kvrouter.h>

#include <cstdio>

int main()
{
	struct kvr_config cfg;
	kvr_config_init(&cfg);
	cfg.n_shards = 1;
	struct kvr_router *r = 0;
	int rc = kvr_router_create(&cfg, &r);
	if (rc != KVR_OK) {
		std::fprintf(stderr, "kvr_router_create: %s\n", kvr_strerror(rc));
		return 1;
	}
	struct kvr_rank_id rank;
	rank.worker_id = 1;
	rank.dp_rank = 0;
	rc = kvr_rank_add(r, rank, 1, 1000, 0);
	uint32_t tokens[64];
	for (unsigned i = 0; i < 64; i++)
		tokens[i] = i;
	struct kvr_request req;
	kvr_request_init(&req);
	req.tokens = tokens;
	req.n_tokens = 64;
	struct kvr_decision d;
	if (rc == KVR_OK)
		rc = kvr_route(r, &req, &d);
	if (rc == KVR_OK && d.status == KVR_DECIDED)
		rc = kvr_request_finish(r, d.attempt);
	kvr_router_destroy(r);
	if (rc != KVR_OK) {
		std::fprintf(stderr, "route: %s\n", kvr_strerror(rc));
		return 1;
	}
	return 0;
}
