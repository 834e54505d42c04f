/*
 * kvr-demo - hashes the prompts of a real trace with kvrouter's block hashing and prints block
 * counts and shared-prefix statistics: how many blocks repeat a prefix seen before (the hit-rate
 * ceiling of an infinite cache).
 *
 * usage: kvr-demo [--block-size N] [--max N] TRACE...
 */
#include <errno.h>
#include <getopt.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvrouter.h"
#include "tools/trace.h"

struct set {
	uint64_t *slot;
	size_t cap, n;
};

/* Returns 1 if h was already present; inserts it otherwise. 0 is used as the empty marker, so a
 * hash of 0 is remapped (sequence hashes are never compared across the remap). */
static int set_add(struct set *s, uint64_t h)
{
	if (h == 0)
		h = 1;
	if (s->n * 2 >= s->cap) {
		size_t nc = s->cap ? s->cap * 2 : 1 << 16;
		uint64_t *ns = calloc(nc, sizeof(*ns));
		if (!ns) {
			fprintf(stderr, "kvr-demo: out of memory\n");
			exit(1);
		}
		for (size_t i = 0; i < s->cap; i++) {
			uint64_t v = s->slot[i];
			if (!v)
				continue;
			size_t j = (v * 0x9e3779b97f4a7c15ull) & (nc - 1);
			while (ns[j])
				j = (j + 1) & (nc - 1);
			ns[j] = v;
		}
		free(s->slot);
		s->slot = ns;
		s->cap = nc;
	}
	size_t j = (h * 0x9e3779b97f4a7c15ull) & (s->cap - 1);
	while (s->slot[j]) {
		if (s->slot[j] == h)
			return 1;
		j = (j + 1) & (s->cap - 1);
	}
	s->slot[j] = h;
	s->n++;
	return 0;
}

/* A whole decimal number in [lo, hi] (strtoull alone took "16k" for 16, wrapped "-16" and
 * 4294967312 into other block sizes, and read "abc" as 0: a silently different run). */
static int parse_u64(const char *s, unsigned long long lo, unsigned long long hi,
                     unsigned long long *out)
{
	char *end;
	errno = 0;
	unsigned long long v = strtoull(s, &end, 10);
	if (s[0] < '0' || s[0] > '9' || *end || errno || v < lo || v > hi)
		return -1;
	*out = v;
	return 0;
}

int main(int argc, char **argv)
{
	uint32_t bs = 16;
	size_t max = 0;
	static const struct option opts[] = {{"block-size", required_argument, 0, 'b'},
	                                     {"max", required_argument, 0, 'm'},
	                                     {"help", no_argument, 0, 'h'},
	                                     {0, 0, 0, 0}};
	int c;
	while ((c = getopt_long(argc, argv, "b:m:h", opts, NULL)) != -1) {
		switch (c) {
		case 'b':
		case 'm': {
			unsigned long long v;
			if (parse_u64(optarg, c == 'b' ? 1 : 0, c == 'b' ? 65536 : SIZE_MAX, &v)) {
				fprintf(stderr, "kvr-demo: --%s %s: expected %s\n",
				        c == 'b' ? "block-size" : "max", optarg,
				        c == 'b' ? "a number in 1..65536" : "a number of requests");
				return 2;
			}
			if (c == 'b')
				bs = (uint32_t)v;
			else
				max = (size_t)v;
			break;
		}
		default:
			fprintf(stderr, "usage: kvr-demo [--block-size N] [--max N] TRACE...\n");
			return c == 'h' ? 0 : 2;
		}
	}
	if (optind >= argc) {
		fprintf(stderr, "usage: kvr-demo [--block-size N] [--max N] TRACE...\n");
		return 2;
	}
	struct trace t = {0};
	char err[512];
	for (int i = optind; i < argc; i++) {
		if (trace_load(&t, argv[i], false, max, err, sizeof(err))) {
			fprintf(stderr, "kvr-demo: %s\n", err);
			trace_free(&t);
			return 1;
		}
	}
	trace_finish(&t);
	if (t.block_size % bs) {
		fprintf(stderr, "kvr-demo: block size %u must divide the trace's %u\n", bs,
		        t.block_size);
		trace_free(&t);
		return 2;
	}
	struct set seen = {0};
	uint64_t blocks = 0, repeated = 0, tokens = 0, max_blocks = 0;
	uint32_t *tok = NULL;
	uint64_t *seq = NULL;
	size_t cap = 0;
	for (size_t i = 0; i < t.n; i++) {
		const struct trace_req *r = &t.reqs[i];
		if (r->input_len > cap) {
			cap = r->input_len;
			uint32_t *nt = realloc(tok, cap * sizeof(*tok));
			if (nt)
				tok = nt;
			uint64_t *ns = realloc(seq, (cap / bs + 1) * sizeof(*seq));
			if (ns)
				seq = ns;
			if (!nt || !ns) {
				fprintf(stderr, "kvr-demo: out of memory\n");
				free(tok);
				free(seq);
				free(seen.slot);
				trace_free(&t);
				return 1;
			}
		}
		trace_tokens(&t, r, tok);
		size_t nb = kvr_hash_blocks(tok, r->input_len, bs, NULL, NULL, seq);
		tokens += r->input_len;
		blocks += nb;
		if (nb > max_blocks)
			max_blocks = nb;
		for (size_t b = 0; b < nb; b++)
			repeated += (uint64_t)set_add(&seen, seq[b]);
	}
	printf("kvr-demo: %zu requests (%zu skipped), trace block size %u, router block size %u\n",
	       t.n, t.n_bad, t.block_size, bs);
	printf("  prompt tokens      %llu (mean %.0f per request)\n", (unsigned long long)tokens,
	       t.n ? (double)tokens / (double)t.n : 0.0);
	printf("  complete blocks    %llu (mean %.1f, max %llu per request)\n",
	       (unsigned long long)blocks, t.n ? (double)blocks / (double)t.n : 0.0,
	       (unsigned long long)max_blocks);
	printf("  distinct prefixes  %zu\n", seen.n);
	printf(
	    "  repeated prefixes  %llu blocks = %.1f%% (hit-rate ceiling of an infinite cache)\n",
	    (unsigned long long)repeated, blocks ? 100.0 * (double)repeated / (double)blocks : 0);
	free(seen.slot);
	free(tok);
	free(seq);
	trace_free(&t);
	return 0;
}
