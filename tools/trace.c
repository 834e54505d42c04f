/* tools/trace.c - see trace.h.  JSON is parsed with jansson (a well-kept library). */
#include "tools/trace.h"
#include "tools/json_line.h"

#include <assert.h>
#include <errno.h>
#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void seterr(char *err, size_t len, const char *fmt, ...)
{
	if (!err || !len)
		return;
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(err, len, fmt, ap);
	va_end(ap);
}

/* A request's id, namespaced: the file index above ID_BITS bits of the trace's own id.  The file
 * index stays below 2^14 so bits 62 and 63 stay clear: trace_tokens keys a prompt's blocks past
 * its last id with bit 63 set and trace_output_token keys output with bit 62, so no namespaced
 * id can meet either. */
#define ID_BITS   48
#define MAX_FILES (1u << 14)
/* A request's prompt and output, tokens, and the requests of one trace, at most: tail_key's
 * layout depends on both bounds. */
#define TOKENS_MAX (1u << 30)
#define REQS_MAX   (1ull << 33)

static int push_ids(struct trace *t, json_t *arr, size_t *off, uint32_t *n, uint32_t session,
                    char *why, size_t whylen)
{
	size_t k = json_array_size(arr);
	if (t->id_len + k > t->id_cap) {
		size_t nc = t->id_cap ? t->id_cap * 2 : 1 << 16;
		while (nc < t->id_len + k)
			nc *= 2;
		uint64_t *p = realloc(t->id_pool, nc * sizeof(*p));
		if (!p)
			return -2;
		t->id_pool = p;
		t->id_cap = nc;
	}
	*off = t->id_len;
	for (size_t i = 0; i < k; i++) {
		json_t *v = json_array_get(arr, i);
		if (!json_is_integer(v) || json_integer_value(v) < 0) {
			snprintf(why, whylen, "hash_ids must be non-negative integers");
			return -1;
		}
		/* Masking a larger id to ID_BITS made it alias a smaller one: a hit that the trace
		 * does not hold (2^48 + 5 read as 5). */
		uint64_t id = (uint64_t)json_integer_value(v);
		if (id >> ID_BITS) {
			snprintf(why, whylen, "hash id %llu does not fit in %d bits",
			         (unsigned long long)id, ID_BITS);
			return -1;
		}
		t->id_pool[t->id_len + i] = ((uint64_t)session << ID_BITS) | id;
	}
	t->id_len += k;
	*n = (uint32_t)k;
	return 0;
}

#define WHY_LEN 96 /* a message about one id */

static struct trace_req *new_req(struct trace *t)
{
	if (t->n == t->cap) {
		size_t nc = t->cap ? t->cap * 2 : 1024;
		struct trace_req *p = realloc(t->reqs, nc * sizeof(*p));
		if (!p)
			return NULL;
		t->reqs = p;
		t->cap = nc;
	}
	struct trace_req *r = &t->reqs[t->n];
	memset(r, 0, sizeof(*r));
	return r;
}

/* Appends the request whose blocks are the JSON array ids.  Returns 0, -1 malformed (*why set,
 * pointing into idwhy when about an id), -2 out of memory; on error t->n is unchanged. */
static int add_req(struct trace *t, json_t *ids, double arrival_s, uint64_t in, uint64_t out,
                   uint32_t session, const char **why, char *idwhy)
{
	if ((uint64_t)t->n >= REQS_MAX)
		return *why = "more than 2^33 requests in one trace", -1;
	struct trace_req *r = new_req(t);
	if (!r)
		return -2;
	size_t off;
	int rc = push_ids(t, ids, &off, &r->n_ids, session, idwhy, WHY_LEN);
	if (rc)
		return rc == -1 ? (*why = idwhy, -1) : rc;
	r->arrival_s = arrival_s;
	r->input_len = (uint32_t)in;
	r->output_len = (uint32_t)out;
	r->session = session;
	r->ids = (const uint64_t *)(uintptr_t)off; /* resolved in trace_finish */
	r->uid = t->n;
	t->n++;
	return 0;
}

static int get_uint(json_t *o, const char *key, uint64_t max, uint64_t *out)
{
	json_t *v = json_object_get(o, key);
	if (!json_is_integer(v) || json_integer_value(v) < 0 ||
	    (uint64_t)json_integer_value(v) > max)
		return -1;
	*out = (uint64_t)json_integer_value(v);
	return 0;
}

static int get_num(json_t *o, const char *key, double *out)
{
	json_t *v = json_object_get(o, key);
	if (!json_is_number(v))
		return -1;
	*out = json_number_value(v);
	return *out >= 0 ? 0 : -1;
}

#define MOONCAKE_BLOCK 512

/* One Mooncake line.  Returns 0, -1 malformed (why set), -2 out of memory, -3 the trace's block
 * size is another (from a session file before). */
static int mooncake_line(struct trace *t, json_t *o, uint32_t session, const char **why,
                         char *idwhy)
{
	uint64_t ts, in, out;
	json_t *ids = json_object_get(o, "hash_ids");
	if (!json_is_object(o))
		return *why = "not a JSON object", -1;
	if (get_uint(o, "timestamp", UINT64_MAX >> 1, &ts))
		return *why = "missing or bad \"timestamp\"", -1;
	if (get_uint(o, "input_length", TOKENS_MAX, &in) || in == 0)
		return *why = "missing or bad \"input_length\"", -1;
	if (get_uint(o, "output_length", TOKENS_MAX, &out))
		return *why = "missing or bad \"output_length\"", -1;
	if (!json_is_array(ids))
		return *why = "missing or bad \"hash_ids\"", -1;
	if (json_array_size(ids) != (in + MOONCAKE_BLOCK - 1) / MOONCAKE_BLOCK)
		return *why = "len(hash_ids) != ceil(input_length / 512)", -1;
	if (t->block_size && t->block_size != MOONCAKE_BLOCK)
		return -3;
	return add_req(t, ids, (double)ts / 1000.0, in, out, session, why, idwhy);
}

/* Where in a session file a fault is: the steps from the top object to it (json_line.h), for
 * the message's line, which jansson's values do not keep.  Nesting stops at depth 8: at most
 * "requests", then an index and "requests" per level, then an index and a member. */
#define WHERE_MAX 24
struct where {
	struct json_step s[WHERE_MAX];
	size_t n;
};

/* w: request i of the array at w->s[0..np), its member field (NULL: the request itself). */
static void at(struct where *w, size_t np, size_t i, const char *field)
{
	w->s[np] = (struct json_step){.idx = i};
	w->s[np + 1] = (struct json_step){.key = field};
	w->n = np + 1 + (field != NULL);
}

/* The requests of the array reqs, which w->s[0..w->n) leads to; on -1 w says where the fault is. */
static int session_reqs(struct trace *t, json_t *reqs, uint32_t bs, double base, uint32_t session,
                        int depth, struct where *w, const char **why, char *idwhy)
{
	if (!json_is_array(reqs))
		return *why = "\"requests\" is not an array", -1;
	if (depth > 8)
		return *why = "subagents nested too deep", -1;
	const size_t np = w->n;
	assert(np + 2 <= WHERE_MAX);
	size_t i;
	json_t *q;
	json_array_foreach(reqs, i, q)
	{
		double ts;
		uint64_t in, out;
		if (!json_is_object(q))
			return at(w, np, i, NULL), *why = "request is not an object", -1;
		if (get_num(q, "t", &ts))
			return at(w, np, i, "t"), *why = "missing or bad \"t\"", -1;
		json_t *type = json_object_get(q, "type");
		if (json_is_string(type) && strcmp(json_string_value(type), "subagent") == 0 &&
		    json_object_get(q, "requests")) {
			at(w, np, i, "requests");
			int rc = session_reqs(t, json_object_get(q, "requests"), bs, base + ts,
			                      session, depth + 1, w, why, idwhy);
			if (rc)
				return rc;
			w->n = np;
			continue;
		}
		if (get_uint(q, "in", TOKENS_MAX, &in) || in == 0)
			return at(w, np, i, "in"), *why = "missing or bad \"in\"", -1;
		if (get_uint(q, "out", TOKENS_MAX, &out))
			return at(w, np, i, "out"), *why = "missing or bad \"out\"", -1;
		json_t *ids = json_object_get(q, "hash_ids");
		if (!json_is_array(ids))
			return at(w, np, i, "hash_ids"), *why = "missing or bad \"hash_ids\"", -1;
		if (json_array_size(ids) != in / bs)
			return at(w, np, i, "hash_ids"),
			       *why = "len(hash_ids) != floor(in / block_size)", -1;
		int rc = add_req(t, ids, base + ts, in, out, session, why, idwhy);
		if (rc == -1)
			return at(w, np, i, "hash_ids"), -1;
		if (rc)
			return rc;
	}
	return 0;
}

/* "requests[3].requests[0]": the request w names, for a message ("" when w names none). */
static void where_text(const struct where *w, char *buf, size_t len)
{
	size_t last = 0, k = 0;
	for (size_t i = 0; i < w->n; i++)
		if (!w->s[i].key)
			last = i + 1;
	buf[0] = '\0';
	for (size_t i = 0; i < last && k < len; i++) {
		int m = w->s[i].key ? snprintf(buf + k, len - k, "%s%s", i ? "." : "", w->s[i].key)
		                    : snprintf(buf + k, len - k, "[%zu]", w->s[i].idx);
		k += m > 0 ? (size_t)m : 0;
	}
}

/* Whether f (rewound here) is a session file, from its first non-blank line: a line that holds
 * an object with "requests", or the start of a JSON value that goes on past it (a pretty-printed
 * session, or a truncated one).  Anything else is JSON lines, one record a line.  Parsing the
 * whole file first and reading whatever failed as lines took a broken session file for Mooncake
 * lines: a message about line 1's JSON, and a trace block size of 512 that then rejected the
 * good session files loaded with it, even under skip_bad. */
static bool is_session(FILE *f)
{
	char *line = NULL;
	size_t cap = 0;
	ssize_t len;
	bool session = false;
	while ((len = getline(&line, &cap, f)) >= 0) {
		size_t k = 0;
		while (k < (size_t)len &&
		       (line[k] == ' ' || line[k] == '\n' || line[k] == '\r' || line[k] == '\t'))
			k++;
		if (k == (size_t)len)
			continue;
		json_error_t je;
		json_t *o = json_loadb(line, (size_t)len, JSON_DISABLE_EOF_CHECK, &je);
		session = o ? json_is_object(o) && json_object_get(o, "requests") != NULL
		            : json_error_code(&je) == json_error_premature_end_of_input;
		json_decref(o);
		break;
	}
	free(line);
	rewind(f);
	return session;
}

/* f's whole content (f left open), NUL-terminated, its length in *len; NULL on a read error
 * (errno set) or out of memory (errno ENOMEM). */
static char *slurp(FILE *f, size_t *len)
{
	size_t cap = 1 << 16, n = 0;
	char *buf = malloc(cap);
	while (buf) {
		n += fread(buf + n, 1, cap - n - 1, f);
		if (ferror(f)) {
			int e = errno;
			free(buf);
			errno = e;
			return NULL;
		}
		if (feof(f)) {
			buf[n] = '\0';
			*len = n;
			return buf;
		}
		char *b = cap <= SIZE_MAX / 2 ? realloc(buf, cap * 2) : NULL;
		if (!b)
			free(buf);
		buf = b;
		cap *= 2;
	}
	errno = ENOMEM;
	return NULL;
}

/* One session file (f closed here).  A malformed one is skipped whole under skip_bad (its
 * requests depend on each other), counted in n_bad and said in err; it sets no block size.
 * The text is kept until the message is written: a fault found in the parsed values (a bad
 * request, a block size) is looked for in it again for its line (json_line.h), which the
 * message said was 1 whatever the line. */
static int load_session(struct trace *t, FILE *f, const char *path, uint32_t session, bool skip_bad,
                        size_t max_reqs, char *err, size_t errlen)
{
	size_t len = 0;
	char *text = slurp(f, &len);
	int e = errno;
	fclose(f);
	if (!text) {
		seterr(err, errlen, "%s: %s", path, strerror(e));
		return -1;
	}
	/* The object must be all the file holds: a file of two sessions back to back was read as
	 * its first, silently. */
	json_error_t je;
	/* A key given twice is malformed: jansson would keep the last value without a word. */
	json_t *whole = json_loadb(text, len, JSON_REJECT_DUPLICATES, &je);
	char idwhy[WHY_LEN], entry[160] = "";
	const char *why = NULL;
	struct where w = {.n = 0};
	size_t line = 0; /* 0: from w */
	int rc = -1;
	uint64_t bs = 0;
	size_t before = t->n, ids_before = t->id_len;
	if (!whole) {
		why = json_error_code(&je) == json_error_end_of_input_expected
		          ? "content after the session object"
		          : je.text;
		line = je.line > 0 ? (size_t)je.line : 1;
	} else if (!json_is_object(whole) || !json_object_get(whole, "requests")) {
		why = "not a session object (with \"requests\")";
	} else if (get_uint(whole, "block_size", 1u << 20, &bs) || bs == 0) {
		why = "missing or bad \"block_size\"";
		w.s[w.n++] = (struct json_step){.key = "block_size"};
	} else if (t->block_size && t->block_size != bs) {
		json_decref(whole);
		w.s[w.n++] = (struct json_step){.key = "block_size"};
		seterr(err, errlen, "%s:%zu: block size %llu differs from the trace's %u", path,
		       json_line(text, len, w.s, w.n), (unsigned long long)bs, t->block_size);
		free(text);
		return -1;
	} else {
		w.s[w.n++] = (struct json_step){.key = "requests"};
		rc = session_reqs(t, json_object_get(whole, "requests"), (uint32_t)bs, 0.0, session,
		                  0, &w, &why, idwhy);
	}
	json_decref(whole);
	if (rc == -2) {
		free(text);
		t->n = before;
		t->id_len = ids_before;
		seterr(err, errlen, "%s: out of memory", path);
		return -1;
	}
	if (rc) {
		if (!line)
			line = json_line(text, len, w.s, w.n);
		free(text);
		where_text(&w, entry, sizeof(entry) - 2);
		if (entry[0])
			strcat(entry, ": ");
		t->n = before;
		t->id_len = ids_before;
		if (!skip_bad) {
			seterr(err, errlen, "%s:%zu: bad session file: %s%s", path, line, entry,
			       why);
			return -1;
		}
		t->n_bad++;
		seterr(err, errlen, "%s:%zu: bad session file, skipped: %s%s", path, line, entry,
		       why);
		return 0;
	}
	free(text);
	t->block_size = (uint32_t)bs;
	if (max_reqs && t->n > max_reqs)
		t->n = max_reqs;
	return 0;
}

/* Mooncake JSON lines (f closed here).  The trace's block size becomes 512 with the first
 * record taken: a file whose every line was skipped sets none. */
static int load_lines(struct trace *t, FILE *f, const char *path, uint32_t session, bool skip_bad,
                      size_t max_reqs, char *err, size_t errlen)
{
	char idwhy[WHY_LEN];
	char *line = NULL;
	size_t cap = 0;
	ssize_t len;
	size_t lineno = 0;
	int ret = 0;
	while ((len = getline(&line, &cap, f)) >= 0) {
		lineno++;
		if (max_reqs && t->n >= max_reqs)
			break;
		size_t k = 0;
		while (k < (size_t)len &&
		       (line[k] == ' ' || line[k] == '\n' || line[k] == '\r' || line[k] == '\t'))
			k++;
		if (k == (size_t)len)
			continue;
		const char *why = NULL;
		json_error_t je;
		json_t *o = json_loadb(line, (size_t)len, JSON_REJECT_DUPLICATES, &je);
		int rc;
		if (!o) {
			why = je.text;
			rc = -1;
		} else {
			rc = mooncake_line(t, o, session, &why, idwhy);
		}
		json_decref(o);
		if (rc == -2) {
			seterr(err, errlen, "%s:%zu: out of memory", path, lineno);
			ret = -1;
			break;
		}
		if (rc == -3) {
			seterr(err, errlen,
			       "%s:%zu: Mooncake block size %u differs from the trace's %u", path,
			       lineno, MOONCAKE_BLOCK, t->block_size);
			ret = -1;
			break;
		}
		if (rc == -1) {
			if (!skip_bad) {
				seterr(err, errlen, "%s:%zu: %s", path, lineno, why);
				ret = -1;
				break;
			}
			t->n_bad++;
			continue;
		}
		t->block_size = MOONCAKE_BLOCK;
	}
	/* getline's -1 is an end or a read error: a trace cut short by one was replayed as if it
	 * ended there. */
	if (ret == 0 && ferror(f)) {
		seterr(err, errlen, "%s:%zu: %s", path, lineno + 1, strerror(errno));
		ret = -1;
	}
	free(line);
	fclose(f);
	return ret;
}

/* Parses one file's content from f (closed here); path names it in messages. */
static int load_stream(struct trace *t, FILE *f, const char *path, bool skip_bad, size_t max_reqs,
                       char *err, size_t errlen)
{
	if (err && errlen)
		err[0] = '\0';
	int c;
	while ((c = fgetc(f)) == ' ' || c == '\n' || c == '\r' || c == '\t')
		;
	/* Each file's ids get the file's index above them: past MAX_FILES they would collide. */
	if (t->n_sessions >= MAX_FILES) {
		fclose(f);
		seterr(err, errlen, "%s: too many trace files (%u at most)", path, MAX_FILES);
		return -1;
	}
	uint32_t session = t->n_sessions++;
	if (c == EOF) {
		/* A read error (a directory: EISDIR) was reported as an empty file. */
		int e = ferror(f) ? errno : 0;
		fclose(f);
		if (e)
			seterr(err, errlen, "%s: %s", path, strerror(e));
		else
			seterr(err, errlen, "%s:1: empty file", path);
		return -1;
	}
	rewind(f);
	if (is_session(f))
		return load_session(t, f, path, session, skip_bad, max_reqs, err, errlen);
	return load_lines(t, f, path, session, skip_bad, max_reqs, err, errlen);
}

int trace_load(struct trace *t, const char *path, bool skip_bad, size_t max_reqs, char *err,
               size_t errlen)
{
	FILE *f = fopen(path, "r");
	if (!f) {
		seterr(err, errlen, "%s: %s", path, strerror(errno));
		return -1;
	}
	return load_stream(t, f, path, skip_bad, max_reqs, err, errlen);
}

int trace_load_mem(struct trace *t, const char *name, const void *data, size_t len, bool skip_bad,
                   size_t max_reqs, char *err, size_t errlen)
{
	if (len == 0) {
		seterr(err, errlen, "%s:1: empty file", name);
		return -1;
	}
	FILE *f = fmemopen((void *)(uintptr_t)data, len, "r");
	if (!f) {
		seterr(err, errlen, "%s: %s", name, strerror(errno));
		return -1;
	}
	return load_stream(t, f, name, skip_bad, max_reqs, err, errlen);
}

static int by_arrival(const void *a, const void *b)
{
	const struct trace_req *x = a, *y = b;
	if (x->arrival_s != y->arrival_s)
		return x->arrival_s < y->arrival_s ? -1 : 1;
	return x->uid < y->uid ? -1 : x->uid > y->uid;
}

void trace_finish(struct trace *t)
{
	for (size_t i = 0; i < t->n; i++) /* (no pool when no request has ids: NULL + 0 is UB) */
		t->reqs[i].ids =
		    t->id_pool ? t->id_pool + (size_t)(uintptr_t)t->reqs[i].ids : t->reqs[i].ids;
	if (t->n > 1) /* reqs is NULL without requests: qsort's pointer is nonnull (UBSan) */
		qsort(t->reqs, t->n, sizeof(*t->reqs), by_arrival);
}

void trace_free(struct trace *t)
{
	free(t->reqs);
	free(t->id_pool);
	memset(t, 0, sizeof(*t));
}

static inline uint64_t mix64(uint64_t x)
{
	x ^= x >> 30;
	x *= 0xbf58476d1ce4e5b9ull;
	x ^= x >> 27;
	x *= 0x94d049bb133111ebull;
	x ^= x >> 31;
	return x;
}

/* A prompt block past the request's last id (a session file's partial last block) gets tokens
 * of its own, keyed by (uid, block index b) with bit 63 set: b's low 20 bits below the uid, its
 * high bits above it (bits 53-62).  With b ORed whole above the uid's shift, as it was, block
 * 2^20 + k of request u keyed as block k of request u + 1, and two requests with the same 2^20
 * ids (uids 2j and 2j + 1) had equal tails: a cache hit the trace does not hold.  Injective since
 * b < 2^30 (prompts of TOKENS_MAX tokens at most) and uid < 2^33 (REQS_MAX); a key with b below
 * 2^20 is what it was, so no replay of a trace that never reaches it changes. */
static uint64_t tail_key(uint64_t uid, uint32_t b)
{
	return (1ull << 63) | ((uint64_t)(b >> 20) << 53) | (uid << 20) | (b & 0xfffffu);
}

void trace_tokens(const struct trace *t, const struct trace_req *r, uint32_t *out)
{
	uint32_t bs = t->block_size;
	for (uint32_t i = 0; i < r->input_len; i++) {
		uint32_t b = i / bs;
		uint64_t key = b < r->n_ids ? r->ids[b] : tail_key(r->uid, b);
		out[i] = (uint32_t)(mix64(key * 0x9e3779b97f4a7c15ull + (i % bs)) & 0x7fffffff);
	}
}

uint32_t trace_output_token(const struct trace_req *r, uint32_t i)
{
	return (uint32_t)(mix64(((1ull << 62) | r->uid) * 0x9e3779b97f4a7c15ull + i) & 0x7fffffff);
}
