/*
 * tools/replay/chains.h - the replay's record of block chains: sequence hash -> (parent
 * sequence hash, local hash), for every block hash the replay has seen, so a chain of the
 * simulator's cached set can be handed back to a policy as local hashes (tools/replay/agree.c),
 * and a generic seq -> value map (replay_default_blocks).  Open addressing, linear probing,
 * grown at half full; sequence hash 0 is stored as 1 (0 marks an empty slot).
 *
 * Context: single-threaded (the replay's thread).
 */
#ifndef KVR_TOOLS_REPLAY_CHAINS_H
#define KVR_TOOLS_REPLAY_CHAINS_H

#include <stddef.h>
#include <stdint.h>

struct replay_chain_ent {
	uint64_t seq, parent, local; /* seq 0 = empty slot (seq 0 is remapped to 1) */
};

struct replay_chains {
	struct replay_chain_ent *e;
	size_t cap, n;
};

/* Records seq -> (parent, local); an existing entry is kept.  Returns 0 or KVR_ENOMEM (the map
 * is unchanged then). */
int replay_chains_put(struct replay_chains *m, uint64_t seq, uint64_t parent, uint64_t local);

/* The entry of seq (writable: callers may update parent), or NULL. */
struct replay_chain_ent *replay_chains_get(struct replay_chains *m, uint64_t seq);

/* Frees the table; m is empty after (NULL-safe). */
void replay_chains_free(struct replay_chains *m);

#endif /* KVR_TOOLS_REPLAY_CHAINS_H */
