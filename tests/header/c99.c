/* The public header from C99 built with -pedantic-errors (tests/header/cxx98.cpp is the C++98
 * twin): the library is C11, but the header promises no more than C99 to the programs that
 * include it.  The program also routes once, so the header's declarations link; cxx98.cpp
 * compiles this same file. */
#include <kvrouter.h>

#include <stdio.h>

int main(void)
{
	struct kvr_config cfg;
	kvr_config_init(&cfg);
	cfg.n_shards = 1;
	struct kvr_router *r = NULL;
	int rc = kvr_router_create(&cfg, &r);
	if (rc != KVR_OK) {
		fprintf(stderr, "kvr_router_create: %s\n", kvr_strerror(rc));
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
		fprintf(stderr, "route: %s\n", kvr_strerror(rc));
		return 1;
	}
	return 0;
}
