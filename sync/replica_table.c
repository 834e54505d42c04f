/*
 * sync/replica_table.c - the replica's tables (issue 14): attempt records, the map (origin,
 * origin attempt) -> record of live attempts, the live list, ranks with their journals of
 * finished attempts (what a snapshot replays to rebuild the predicted LRU), and the peer table.
 * Plain single-threaded structures: every function runs with the replica's `mu` held.
 */
#include <string.h>

#include "core/alloc.h"
#include "sync/replica_internal.h"

static size_t hslot(const struct kvr_replica *rep, uint64_t origin, uint64_t attempt)
{
	uint64_t h = (origin * 0x9e3779b97f4a7c15ull) ^ (attempt * 0xc2b2ae3d27d4eb4full);
	h ^= h >> 29;
	return (size_t)(h & (rep->map_cap - 1));
}

struct kvr_rep_rec *kvr_rep_map_find(struct kvr_replica *rep, uint64_t origin, uint64_t attempt)
{
	if (!rep->map_cap)
		return NULL;
	for (struct kvr_rep_rec *x = rep->map[hslot(rep, origin, attempt)]; x; x = x->hnext)
		if (x->origin == origin && x->oattempt == attempt)
			return x;
	return NULL;
}

int kvr_rep_map_insert(struct kvr_replica *rep, struct kvr_rep_rec *x)
{
	if (rep->map_n + 1 > rep->map_cap / 2) {
		size_t nc = rep->map_cap ? rep->map_cap * 2 : 1024;
		struct kvr_rep_rec **nm = kvr_calloc(nc, sizeof(*nm));
		if (!nm)
			return KVR_ENOMEM;
		struct kvr_rep_rec **old = rep->map;
		size_t oc = rep->map_cap;
		rep->map = nm;
		rep->map_cap = nc;
		for (size_t i = 0; i < oc; i++)
			for (struct kvr_rep_rec *y = old[i], *nx; y; y = nx) {
				nx = y->hnext;
				size_t k = hslot(rep, y->origin, y->oattempt);
				y->hnext = nm[k];
				nm[k] = y;
			}
		kvr_free(old, oc * sizeof(*old));
	}
	size_t k = hslot(rep, x->origin, x->oattempt);
	x->hnext = rep->map[k];
	rep->map[k] = x;
	rep->map_n++;
	return 0;
}

void kvr_rep_map_remove(struct kvr_replica *rep, struct kvr_rep_rec *x)
{
	struct kvr_rep_rec **pp = &rep->map[hslot(rep, x->origin, x->oattempt)];
	while (*pp && *pp != x)
		pp = &(*pp)->hnext;
	if (*pp) {
		*pp = x->hnext;
		rep->map_n--;
	}
}

void kvr_rep_live_link(struct kvr_replica *rep, struct kvr_rep_rec *x)
{
	x->next = NULL;
	x->prev = rep->live_tail;
	if (rep->live_tail)
		rep->live_tail->next = x;
	else
		rep->live_head = x;
	rep->live_tail = x;
}

void kvr_rep_live_unlink(struct kvr_replica *rep, struct kvr_rep_rec *x)
{
	if (x->prev)
		x->prev->next = x->next;
	else
		rep->live_head = x->next;
	if (x->next)
		x->next->prev = x->prev;
	else
		rep->live_tail = x->prev;
	x->prev = x->next = NULL;
}

void kvr_rep_rec_free(struct kvr_rep_rec *x)
{
	if (!x)
		return;
	kvr_free(x->out, (size_t)x->out_cap * sizeof(uint32_t));
	kvr_free(x, x->size);
}

/* A record with room for n blocks and tail_n tail tokens (copied from the arguments). */
struct kvr_rep_rec *kvr_rep_rec_new(uint32_t n, uint32_t tail_n)
{
	size_t size = sizeof(struct kvr_rep_rec) + (size_t)n * 8 + (size_t)tail_n * 4;
	struct kvr_rep_rec *x = kvr_alloc(size); /* the arrays are filled by the caller */
	if (!x)
		return NULL;
	memset(x, 0, sizeof(*x));
	x->size = size;
	x->n_blocks = n;
	x->tail_n = tail_n;
	x->blocks = (uint64_t *)(void *)(x + 1);
	x->tail = (uint32_t *)(void *)(x->blocks + n);
	return x;
}

int kvr_rep_rec_reserve_out(struct kvr_rep_rec *x, size_t n)
{
	if (x->n_out + n > KVR_MSG_MAX_BLOCKS)
		return KVR_ERANGE;
	if (x->n_out + n > x->out_cap) {
		size_t nc = x->out_cap ? x->out_cap : 64;
		while (nc < x->n_out + n)
			nc *= 2;
		uint32_t *p = kvr_realloc(x->out, (size_t)x->out_cap * 4, nc * 4);
		if (!p)
			return KVR_ENOMEM;
		x->out = p;
		x->out_cap = (uint32_t)nc;
	}
	return 0;
}

int kvr_rep_rec_append_out(struct kvr_rep_rec *x, const uint32_t *t, size_t n, bool not_final)
{
	if (!n)
		return 0;
	int rc = kvr_rep_rec_reserve_out(x, n);
	if (rc)
		return rc;
	memcpy(x->out + x->n_out, t, n * 4);
	x->n_out += (uint32_t)n;
	x->out_counted = not_final;
	return 0;
}

static bool same_id(struct kvr_rank_id a, struct kvr_rank_id b)
{
	return a.worker_id == b.worker_id && a.dp_rank == b.dp_rank;
}

static struct kvr_rank_id tomb_id(const struct kvr_rep_tomb *t)
{
	return (struct kvr_rank_id){t->worker_id, t->dp_rank};
}

/*
 * The indexes by id, one over the entries (rix) and one over the tombstones (tix): open
 * addressing with linear probing over ix->slot (ix->cap slots, a power of two, at least twice
 * the entries there can be: never more than half full), each slot a position in its table plus
 * one (0: empty); a removal shifts the probe chain back (no tombstones of its own).  Positions,
 * not addresses, so the arrays' reallocations leave them valid.  A lookup (one per attempt end,
 * under mu) walked every entry: 400 ns at 1,024 ranks, 1.7 us at 4,096 (and, before tombstones
 * had a table of their own, an hour of removals too).  The tombstones' lookups walked theirs
 * (a peer's rank change, a re-add, each tombstone forgotten: an hour's churn of 16,384 removals
 * took 4-11 us a lookup, and 65 ms under mu to forget them all at once).  One code for both:
 * each index reads the ids of its own table through `key`.
 */
typedef struct kvr_rank_id (*ix_key)(const struct kvr_replica *rep, size_t pos);

static struct kvr_rank_id rank_key(const struct kvr_replica *rep, size_t pos)
{
	return rep->ranks[pos].id;
}

static struct kvr_rank_id tomb_key(const struct kvr_replica *rep, size_t pos)
{
	return tomb_id(&rep->tombs[pos]);
}

/* splitmix64's finaliser over both fields: worker ids that differ only in high bits (k << 40)
 * spread over a small index too (a multiply and one shift left them all in slot 0). */
static size_t ix_home(struct kvr_rank_id id, size_t cap)
{
	uint64_t h = id.worker_id ^ ((uint64_t)id.dp_rank * 0x9e3779b97f4a7c15ull);
	h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ull;
	h = (h ^ (h >> 27)) * 0x94d049bb133111ebull;
	h ^= h >> 31;
	return (size_t)(h & (cap - 1));
}

/* The slot holding rank id, or SIZE_MAX. */
static size_t ix_slot(const struct kvr_replica *rep, const struct kvr_rep_ix *ix, ix_key key,
                      struct kvr_rank_id id)
{
	if (!ix->cap)
		return SIZE_MAX;
	for (size_t i = ix_home(id, ix->cap);; i = (i + 1) & (ix->cap - 1)) {
		uint32_t v = ix->slot[i];
		if (!v)
			return SIZE_MAX;
		if (same_id(key(rep, v - 1), id))
			return i;
	}
}

static void ix_put(uint32_t *slot, size_t cap, struct kvr_rank_id id, uint32_t v)
{
	size_t i = ix_home(id, cap);
	while (slot[i])
		i = (i + 1) & (cap - 1);
	slot[i] = v;
}

/* ix rebuilt with cap slots (0: none) for the n first of its table: false for memory (the old
 * one kept). */
static bool ix_resize(const struct kvr_replica *rep, struct kvr_rep_ix *ix, ix_key key, size_t n,
                      size_t cap)
{
	uint32_t *nx = NULL;
	if (cap) {
		nx = kvr_calloc(cap, sizeof(*nx));
		if (!nx)
			return false;
		for (size_t i = 0; i < n; i++)
			ix_put(nx, cap, key(rep, i), (uint32_t)i + 1);
	}
	kvr_free(ix->slot, ix->cap * sizeof(*ix->slot));
	ix->slot = nx;
	ix->cap = cap;
	return true;
}

/* Empties slot i, shifting back the entries after it that probed past it. */
static void ix_erase(const struct kvr_replica *rep, struct kvr_rep_ix *ix, ix_key key, size_t i)
{
	const size_t mask = ix->cap - 1;
	for (size_t j = i;;) {
		ix->slot[i] = 0;
		for (;;) {
			j = (j + 1) & mask;
			if (!ix->slot[j])
				return;
			size_t k = ix_home(key(rep, ix->slot[j] - 1), ix->cap);
			/* stays if its home is cyclically in (i, j] */
			if (i <= j ? (i < k && k <= j) : (i < k || k <= j))
				continue;
			ix->slot[i] = ix->slot[j];
			i = j;
			break;
		}
	}
}

/* Forgets the element at ix's slot `slot` of its table of n: returns its position, where the
 * index now finds the table's last element, which the caller moves there. */
static size_t ix_remove(const struct kvr_replica *rep, struct kvr_rep_ix *ix, ix_key key,
                        size_t slot, size_t n)
{
	const size_t i = ix->slot[slot] - 1, last = n - 1;
	ix_erase(rep, ix, key, slot);
	if (i != last)
		ix->slot[ix_slot(rep, ix, key, key(rep, last))] = (uint32_t)i + 1;
	return i;
}

struct kvr_rep_rank *kvr_rep_rank_find(struct kvr_replica *rep, struct kvr_rank_id id)
{
	size_t i = ix_slot(rep, &rep->rix, rank_key, id);
	return i == SIZE_MAX ? NULL : &rep->ranks[rep->rix.slot[i] - 1];
}

struct kvr_rep_tomb *kvr_rep_tomb_find(struct kvr_replica *rep, struct kvr_rank_id id)
{
	size_t i = ix_slot(rep, &rep->tix, tomb_key, id);
	return i == SIZE_MAX ? NULL : &rep->tombs[rep->tix.slot[i] - 1];
}

/* Room for one more of n in *arr (cap entries of size sz, doubling from 16): false for memory,
 * nothing changed. */
static bool room(void **arr, size_t n, size_t *cap, size_t sz)
{
	if (n < *cap)
		return true;
	size_t nc = *cap ? *cap * 2 : 16;
	void *p = kvr_realloc(*arr, *cap * sz, nc * sz);
	if (!p)
		return false;
	*arr = p;
	*cap = nc;
	return true;
}

/* Room for `need` elements in all (doubling from 16); false, nothing changed, for memory. */
static bool reserve(void **arr, size_t need, size_t *cap, size_t sz)
{
	if (need <= *cap)
		return true;
	size_t nc = *cap ? *cap : 16;
	while (nc < need)
		nc *= 2;
	void *p = kvr_realloc(*arr, *cap * sz, nc * sz);
	if (!p)
		return false;
	*arr = p;
	*cap = nc;
	return true;
}

/* Given back as entries go (a quarter full: halved, not below the first 16; none: freed): an
 * hour's churn of tombstones doubled the array, which kept its largest size for good.  Every
 * entry's address changes; callers hold none across a drop (it moves the last one already).
 * Halving may fail for memory: the array is kept as it is. */
static void shrink(void **arr, size_t n, size_t *cap, size_t sz)
{
	if (!n) { /* none left: the tombstones of a table that forgot them all */
		kvr_free(*arr, *cap * sz);
		*arr = NULL;
		*cap = 0;
		return;
	}
	if (*cap <= 16 || n > *cap / 4)
		return;
	size_t nc = *cap / 2;
	void *p = kvr_realloc(*arr, *cap * sz, nc * sz);
	if (p) {
		*arr = p;
		*cap = nc;
	}
}

/* Room for `need` tombstones: in their array, and in their index (at most half full, as the
 * entries').  false for memory: the array may have grown, nothing else changed; the index
 * keeps its room for every tombstone and entry there is (2 x (n_tombs + n_ranks) <= tix.cap),
 * so that a burial of an entry needs no memory. */
static bool tomb_room(struct kvr_replica *rep, size_t need)
{
	if (!reserve((void **)&rep->tombs, need, &rep->tombs_cap, sizeof(*rep->tombs)))
		return false;
	return rep->tix.cap >= 2 * need ||
	       ix_resize(rep, &rep->tix, tomb_key, rep->n_tombs, 2 * rep->tombs_cap);
}

/* The tombstones' array and index given back as they empty (see shrink): the index follows the
 * array down, or keeps its larger size for memory (it serves as well). */
static void tombs_shrink(struct kvr_replica *rep)
{
	shrink((void **)&rep->tombs, rep->n_tombs + rep->n_ranks, &rep->tombs_cap,
	       sizeof(*rep->tombs));
	if (rep->tix.cap > 2 * rep->tombs_cap)
		(void)ix_resize(rep, &rep->tix, tomb_key, rep->n_tombs, 2 * rep->tombs_cap);
}

struct kvr_rep_rank *kvr_rep_rank_get(struct kvr_replica *rep, struct kvr_rank_id id)
{
	struct kvr_rep_rank *e = kvr_rep_rank_find(rep, id);
	if (e)
		return e;
	/* Every entry has its tombstone's room (n_tombs + n_ranks <= tombs_cap), so that burying
	 * it needs no memory: a removal whose tombstone could not be kept must be forgotten at once
	 * (kvr_rep_rank_bury), which raises the floor for every rank to the removal's version, and
	 * a peer's add made a moment before it and still on its way was refused for good. */
	if (!tomb_room(rep, rep->n_tombs + rep->n_ranks + 1) ||
	    !room((void **)&rep->ranks, rep->n_ranks, &rep->ranks_cap, sizeof(*rep->ranks)))
		return NULL;
	if (rep->rix.cap < 2 * rep->ranks_cap &&
	    !ix_resize(rep, &rep->rix, rank_key, rep->n_ranks, 2 * rep->ranks_cap))
		return NULL;
	ix_put(rep->rix.slot, rep->rix.cap, id, (uint32_t)rep->n_ranks + 1);
	e = &rep->ranks[rep->n_ranks++];
	memset(e, 0, sizeof(*e));
	e->id = id;
	e->capacity = KVR_CAPACITY_NONE;
	const struct kvr_rep_tomb *t = kvr_rep_tomb_find(rep, id);
	if (t) { /* the rank is back: the caller sets the version that says so */
		e->jmark = ++rep->jmarks; /* a new life: what was booked before ran on the old */
		e->ver = t->ver;
		e->reset_ver = t->reset_ver;
		e->incarnation = t->incarnation;
		e->mbt = t->mbt;
		kvr_rep_tomb_drop(rep, id);
	}
	return e;
}

void kvr_rep_rank_drop(struct kvr_replica *rep, struct kvr_rank_id id)
{
	size_t slot = ix_slot(rep, &rep->rix, rank_key, id);
	if (slot == SIZE_MAX)
		return;
	kvr_rep_journal_clear(rep, &rep->ranks[rep->rix.slot[slot] - 1]);
	const size_t i = ix_remove(rep, &rep->rix, rank_key, slot, rep->n_ranks);
	rep->ranks[i] = rep->ranks[--rep->n_ranks]; /* the last entry moves into i */
	shrink((void **)&rep->ranks, rep->n_ranks, &rep->ranks_cap, sizeof(*rep->ranks));
	tombs_shrink(rep); /* the room its tombstone held, unless bury used it */
	if (rep->rix.cap > 2 * rep->ranks_cap) /* for memory: the larger one serves */
		(void)ix_resize(rep, &rep->rix, rank_key, rep->n_ranks, 2 * rep->ranks_cap);
}

bool kvr_rep_rank_bury(struct kvr_replica *rep, struct kvr_rank_id id, struct kvr_rep_ver v,
                       uint64_t incarnation, struct kvr_rep_tomb *told)
{
	struct kvr_rep_tomb *t = kvr_rep_tomb_find(rep, id), made = {0};
	const struct kvr_rep_rank *e = kvr_rep_rank_find(rep, id);
	/* An entry's tombstone has its room (kvr_rep_rank_get); one for a rank known here by
	 * nothing needs room beyond the entries' (n_tombs + n_ranks + 1). */
	bool kept = t || e || tomb_room(rep, rep->n_tombs + rep->n_ranks + 1);
	const bool made_here = !t;
	if (!t) {
		if (kept)
			ix_put(rep->tix.slot, rep->tix.cap, id, (uint32_t)rep->n_tombs + 1);
		t = kept ? &rep->tombs[rep->n_tombs++] : &made;
		memset(t, 0, sizeof(*t));
		t->worker_id = id.worker_id;
		t->dp_rank = id.dp_rank;
	}
	if (e) {
		t->incarnation = e->incarnation;
		t->reset_ver = e->reset_ver;
		t->mbt = e->mbt;
	}
	/* The removal's own incarnation, at least: told again (a re-announce, a snapshot) at 0, as
	 * one for a rank never held here was, it is refused by every replica holding the rank at a
	 * later one (kvr_rep_apply_rank), which then kept the rank for good. */
	if (incarnation > t->incarnation)
		t->incarnation = incarnation;
	/* Never older: a peer's removal is buried after its router call, without mu, and an own
	 * removal of the rank may have buried it at a newer version meanwhile; lowered, the
	 * tombstone let an add between the two versions told later bring the rank back. */
	if (made_here || kvr_rep_ver_cmp(v, t->ver) > 0)
		t->ver = v;
	t->removed_ns = kvr_rep_mono_ns();
	if (told)
		*told = *t;
	kvr_rep_rank_drop(rep, id); /* t moves (the tombstones' table may shrink) */
	/* Not kept (no entry here, no memory): nothing here tells the rank's add again, so nothing
	 * needs the floor raised; an older add of it told later is taken, as a replica that never
	 * heard the removal takes it. */
	return kept;
}

void kvr_rep_tomb_drop(struct kvr_replica *rep, struct kvr_rank_id id)
{
	size_t slot = ix_slot(rep, &rep->tix, tomb_key, id);
	if (slot == SIZE_MAX)
		return;
	const size_t i = ix_remove(rep, &rep->tix, tomb_key, slot, rep->n_tombs);
	rep->tombs[i] = rep->tombs[--rep->n_tombs];
	tombs_shrink(rep); /* the entries' tombstones keep their room */
}

/* What record x holds, as kvr_rep_rec_free gives it back.  A journal's records do not change
 * (output is appended to live ones only), so what joined the count leaves it. */
static uint64_t rec_bytes(const struct kvr_rep_rec *x)
{
	return x->size + (uint64_t)x->out_cap * sizeof(*x->out);
}

void kvr_rep_journal_clear(struct kvr_replica *rep, struct kvr_rep_rank *e)
{
	e->jmark = ++rep->jmarks; /* the attempts booked before ran on what goes now */
	for (struct kvr_rep_rec *x = e->jhead, *nx; x; x = nx) {
		nx = x->next;
		rep->jbytes -= rec_bytes(x);
		kvr_rep_rec_free(x);
	}
	e->jhead = e->jtail = NULL;
	e->jblocks = 0;
}

uint64_t kvr_rep_ranks_bytes(const struct kvr_replica *rep)
{
	return (uint64_t)rep->ranks_cap * sizeof(*rep->ranks) +
	       (uint64_t)rep->rix.cap * sizeof(*rep->rix.slot) +
	       (uint64_t)rep->tombs_cap * sizeof(*rep->tombs) +
	       (uint64_t)rep->tix.cap * sizeof(*rep->tix.slot) + rep->jbytes;
}

static uint64_t rec_blocks(const struct kvr_replica *rep, const struct kvr_rep_rec *x)
{
	return x->n_blocks + (x->tail_n + x->n_out) / rep->bs;
}

/* A finished attempt joins its rank's journal (the blocks it leaves in the predicted cache);
 * the oldest go when the journal exceeds its budget.  Takes x (freed if it has no place). */
void kvr_rep_journal_add(struct kvr_replica *rep, struct kvr_rep_rec *x)
{
	struct kvr_rep_rank *e = kvr_rep_rank_find(rep, x->rank);
	/* An attempt booked before the journal's last clear (a reset, a new incarnation, the rank
	 * removed and back) ran on blocks that clear dropped: it joining now would serve joiners
	 * blocks nobody holds.  A peer's end can come after the change (an ABORT a stale-dropped
	 * booking told, with no order against the rank's notes; a change made here), and so can an
	 * own finish, noted after the lease's claim with no order against another thread's change
	 * (test_replica_ranks a_mirror_ended_after_its_ranks_new_life_is_not_journaled_in_it, the
	 * three a_mirror_ended_by_*_made_here and an_own_finish_noted_after_*).  An attempt booked
	 * on the change's side whose mark was read before the change's note came is dropped too: a
	 * prediction missing, never one of blocks nobody holds. */
	if (!e || e->jmark > x->jmark) {
		kvr_rep_rec_free(x);
		return;
	}
	x->fin_no = ++rep->fin_no;
	x->fin_ns = kvr_rep_mono_ns();
	x->next = NULL;
	x->prev = e->jtail;
	if (e->jtail)
		e->jtail->next = x;
	else
		e->jhead = x;
	e->jtail = x;
	e->jblocks += rec_blocks(rep, x);
	rep->jbytes += rec_bytes(x);
	uint64_t budget = rep->c.journal_blocks;
	if (!budget) /* twice the capacity, saturating (2^63 and above wrapped to 0 or a few) */
		budget = !e->capacity || e->capacity == KVR_CAPACITY_NONE ? 65536
		         : e->capacity > UINT64_MAX / 2                   ? UINT64_MAX
		                                                          : 2 * e->capacity;
	while (e->jblocks > budget && e->jhead != e->jtail) {
		struct kvr_rep_rec *o = e->jhead;
		e->jhead = o->next;
		e->jhead->prev = NULL;
		e->jblocks -= rec_blocks(rep, o);
		rep->jbytes -= rec_bytes(o);
		kvr_rep_rec_free(o);
	}
}

struct kvr_rep_peer *kvr_rep_peer_find(struct kvr_replica *rep, uint64_t id)
{
	for (size_t i = 0; i < rep->n_peers; i++)
		if (rep->peers[i].id == id)
			return &rep->peers[i];
	return NULL;
}

/* A peer's entry, made if the table has room.  Full, the entry of the peer gone longest ago
 * (goodbye, or given up: its mirrored attempts are released, and its id's later messages would
 * be a new life anyway) is taken over.  Entries used to be kept for good, so a replica that had
 * heard MAX_PEERS ids in its life (replicas restarted under new ids: 256 restarts) dropped every
 * message of any id after them, for ever (test_replica_epoch
 * peers_gone_make_room_for_new_ones).  Context: the thread handling deliveries (hmu), mu held:
 * the entries' addresses held across an unlock (peer_gone) are this thread's. */
struct kvr_rep_peer *kvr_rep_peer_get(struct kvr_replica *rep, uint64_t id)
{
	struct kvr_rep_peer *p = kvr_rep_peer_find(rep, id);
	if (p)
		return p;
	if (rep->n_peers < MAX_PEERS) {
		p = &rep->peers[rep->n_peers++];
	} else {
		for (size_t i = 0; i < rep->n_peers; i++) {
			struct kvr_rep_peer *q = &rep->peers[i];
			if (!q->alive && (!p || q->lost_ns < p->lost_ns))
				p = q;
		}
		if (!p)
			return NULL; /* MAX_PEERS peers alive at once */
	}
	memset(p, 0, sizeof(*p));
	p->id = id;
	return p;
}
