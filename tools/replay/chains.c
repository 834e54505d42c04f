/*
 * tools/replay/chains.c - the replay's block-chain map (see chains.h).
 */
#include "tools/replay/chains.h"

#include <stdlib.h>

#include "kvrouter.h"

static uint64_t key_of(uint64_t h)
{
	return h ? h : 1;
}

static size_t slot_of(uint64_t k, size_t cap)
{
	return (size_t)((k * 0x9e3779b97f4a7c15ull) >> 17) & (cap - 1);
}

int replay_chains_put(struct replay_chains *m, uint64_t seq, uint64_t parent, uint64_t local)
{
	if ((m->n + 1) * 2 > m->cap) {
		size_t nc = m->cap ? m->cap * 2 : 1 << 14;
		struct replay_chain_ent *ne = calloc(nc, sizeof(*ne));
		if (!ne)
			return KVR_ENOMEM;
		for (size_t i = 0; i < m->cap; i++) {
			if (!m->e[i].seq)
				continue;
			size_t j = slot_of(m->e[i].seq, nc);
			while (ne[j].seq)
				j = (j + 1) & (nc - 1);
			ne[j] = m->e[i];
		}
		free(m->e);
		m->e = ne;
		m->cap = nc;
	}
	uint64_t k = key_of(seq);
	size_t j = slot_of(k, m->cap);
	while (m->e[j].seq) {
		if (m->e[j].seq == k)
			return 0;
		j = (j + 1) & (m->cap - 1);
	}
	m->e[j] = (struct replay_chain_ent){k, parent, local};
	m->n++;
	return 0;
}

struct replay_chain_ent *replay_chains_get(struct replay_chains *m, uint64_t seq)
{
	if (!m->cap)
		return NULL;
	uint64_t k = key_of(seq);
	size_t j = slot_of(k, m->cap);
	while (m->e[j].seq) {
		if (m->e[j].seq == k)
			return &m->e[j];
		j = (j + 1) & (m->cap - 1);
	}
	return NULL;
}

void replay_chains_free(struct replay_chains *m)
{
	if (!m)
		return;
	free(m->e);
	m->e = NULL;
	m->cap = m->n = 0;
}
