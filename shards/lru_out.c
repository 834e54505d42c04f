/*
 * shards/lru_out.c - the output buffers of the predicted cache's commands (struct kvr_lru_out,
 * shards/lru.h): stored ranges and evicted runs, grown by the library, reused across commands.
 */
#include <string.h>

#include "core/alloc.h"
#include "kvrouter.h"
#include "shards/lru.h"

void kvr_lru_out_init(struct kvr_lru_out *out)
{
	memset(out, 0, sizeof(*out));
}

void kvr_lru_out_fini(struct kvr_lru_out *out)
{
	if (!out)
		return;
	kvr_free(out->stored, out->cap_stored_runs * sizeof(*out->stored));
	kvr_free(out->evicted_seq, out->cap_evicted * sizeof(uint64_t));
	kvr_free(out->evicted_run_len, out->cap_evicted_runs * sizeof(uint32_t));
	kvr_lru_out_init(out);
}

void kvr_lru_out_reset(struct kvr_lru_out *out)
{
	out->n_stored_runs = 0;
	out->n_stored = 0;
	out->n_evicted = 0;
	out->n_evicted_runs = 0;
	out->cleared = false;
}

int kvr_lru_out_reserve(struct kvr_lru_out *out, size_t stored_runs, size_t evicted)
{
	if (kvr_grow((void **)&out->stored, &out->cap_stored_runs, out->n_stored_runs + stored_runs,
	             sizeof(*out->stored)) ||
	    kvr_grow((void **)&out->evicted_seq, &out->cap_evicted, out->n_evicted + evicted,
	             sizeof(uint64_t)) ||
	    kvr_grow((void **)&out->evicted_run_len, &out->cap_evicted_runs,
	             out->n_evicted_runs + evicted, sizeof(uint32_t)))
		return KVR_ENOMEM;
	return 0;
}

void kvr_lru_out_stored(struct kvr_lru_out *out, uint32_t first, uint32_t n)
{
	if (n == 0)
		return;
	out->n_stored += n;
	if (out->n_stored_runs > 0) {
		struct kvr_lru_range *last = &out->stored[out->n_stored_runs - 1];
		if (last->first + last->n == first) {
			last->n += n;
			return;
		}
	}
	out->stored[out->n_stored_runs++] = (struct kvr_lru_range){.first = first, .n = n};
}

void kvr_lru_out_evicted_run(struct kvr_lru_out *out, const uint64_t *seq, size_t n)
{
	if (n == 0)
		return;
	memcpy(out->evicted_seq + out->n_evicted, seq, n * sizeof(uint64_t));
	out->n_evicted += n;
	out->evicted_run_len[out->n_evicted_runs++] = (uint32_t)n;
}
