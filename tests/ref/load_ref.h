/*
 * tests/ref/load_ref.h - the per-block reference load tracker (tests/ref/load_ref.c), the
 * oracle of tests/unit/test_load.c.  Same contract as shards/load.h, functions ref_load_*.
 * Context (all functions): the owning thread; no locks, no atomics.
 */
#ifndef KVR_TESTS_REF_LOAD_REF_H
#define KVR_TESTS_REF_LOAD_REF_H

#include <stddef.h>
#include <stdint.h>

#include "shards/load.h"

struct ref_load;

int ref_load_create(uint64_t expected_prefill_ns, struct ref_load **out);
void ref_load_destroy(struct ref_load *load);
int ref_load_add(struct ref_load *load, uint64_t attempt, const uint64_t *seq, size_t n,
                 uint64_t prefill_tokens, uint64_t now);
int ref_load_prefill_done(struct ref_load *load, uint64_t attempt);
int ref_load_add_output(struct ref_load *load, uint64_t attempt, const uint64_t *seq, size_t n);
int ref_load_finish(struct ref_load *load, uint64_t attempt);
uint64_t ref_load_prefill_tokens(const struct ref_load *load, uint64_t now);
int ref_load_potential(const struct ref_load *load, const uint64_t *seq, size_t n,
                       uint64_t uncached_tokens, uint64_t now, struct kvr_load_potential *out);
void ref_load_stats(const struct ref_load *load, struct kvr_load_stats *st);

#endif /* KVR_TESTS_REF_LOAD_REF_H */
