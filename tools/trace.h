/*
 * tools/trace.h - loads public request traces whose prompts are lists of block hash ids, and
 * turns each id into a deterministic run of token ids (equal ids -> equal tokens), so the router
 * hashes real token sequences with its own block size.
 *
 * Formats (detected from the first non-blank line: a session file's is an object with "requests"
 * or the start of one that goes on past it; anything else is JSON lines):
 *  - Mooncake JSON lines: {"timestamp" ms, "input_length", "output_length", "hash_ids"}; block 512.
 *  - Coding-agent session files: one JSON object {"block_size", "requests": [{"t" s, "in", "out",
 *    "hash_ids", "type"}]}; a request of type "subagent" nests "requests" whose t is relative to
 *    its own.  Ids are local to a session: each file gets its own id namespace.
 * Ids are below 2^48 (a larger one is malformed input, not masked into a smaller one), and a
 * trace has at most 16,384 files: each namespaced id is the file's index above the id's 48 bits.
 * A request has at most 2^30 prompt and 2^30 output tokens, a trace at most 2^33 requests: the
 * tokens past a request's last id are keyed by both (trace.c, tail_key).
 */
#ifndef KVR_TOOLS_TRACE_H
#define KVR_TOOLS_TRACE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct trace_req {
	double arrival_s;    /* seconds from trace start */
	uint32_t input_len;  /* prompt tokens */
	uint32_t output_len; /* output tokens */
	uint32_t n_ids;      /* block ids (trace block size each) */
	uint32_t session;    /* file index (its id namespace) */
	uint64_t uid;        /* unique per request, seeds tokens past the last id */
	const uint64_t *ids; /* namespaced ids, owned by the trace */
};

struct trace {
	struct trace_req *reqs; /* sorted by arrival (stable) */
	size_t n;
	uint32_t block_size; /* the trace's block size (tokens per id) */
	size_t n_bad;        /* malformed entries skipped (skip_bad) */
	uint32_t n_sessions; /* files loaded: each is an id namespace */
	/* owned storage */
	uint64_t *id_pool;
	size_t id_len, id_cap;
	size_t cap;
};

/* Loads and appends one file.  Every file of one trace must have the same block size; a file
 * that contributes no request (every entry skipped) sets none.
 * Returns 0, or -1 with a message "FILE:LINE: why" in err (in a session file, LINE is where the
 * value at fault starts, and why names its request: "requests[2].requests[1]: ...").  With
 * skip_bad, malformed entries are counted in t->n_bad and skipped instead: a Mooncake line
 * alone, a session file whole (its requests depend on each other), which err then names on the
 * 0 return ("" otherwise: the caller shows it, the skip being the file's whole content).
 * max_reqs > 0 stops after that many requests. */
int trace_load(struct trace *t, const char *path, bool skip_bad, size_t max_reqs, char *err,
               size_t errlen);
/* The same from memory (data borrowed); name is used in messages.  For the fuzzer and tests. */
int trace_load_mem(struct trace *t, const char *name, const void *data, size_t len, bool skip_bad,
                   size_t max_reqs, char *err, size_t errlen);
/* Sorts by arrival (stable) and resolves id pointers; call once after the last load. */
void trace_finish(struct trace *t);
void trace_free(struct trace *t);

/* Writes the request's input_len prompt tokens into out (caller sizes it input_len). */
void trace_tokens(const struct trace *t, const struct trace_req *r, uint32_t *out);
/* Token i of the output of request r (deterministic, unique to the request). */
uint32_t trace_output_token(const struct trace_req *r, uint32_t i);

#endif
