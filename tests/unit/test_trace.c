/* The trace reader: both formats, errors with file and line, --skip-bad, deterministic tokens. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tools/trace.h"

static int load(struct trace *t, const char *s, bool skip, char *err)
{
	return trace_load_mem(t, "mem", s, strlen(s), skip, 0, err, 256);
}

Test(trace, mooncake_lines)
{
	struct trace t = {0};
	char err[256];
	const char *s = "{\"timestamp\": 1000, \"input_length\": 600, \"output_length\": 5, "
	                "\"hash_ids\": [7, 8]}\n"
	                "{\"timestamp\": 0, \"input_length\": 512, \"output_length\": 1, "
	                "\"hash_ids\": [7]}\n";
	cr_assert_eq(load(&t, s, false, err), 0, "%s", err);
	trace_finish(&t);
	cr_assert_eq(t.n, 2);
	cr_assert_eq(t.block_size, 512);
	cr_assert_float_eq(t.reqs[0].arrival_s, 0.0, 1e-9); /* sorted by arrival */
	cr_assert_eq(t.reqs[1].n_ids, 2);
	uint32_t a[600], b[512];
	trace_tokens(&t, &t.reqs[1], a);
	trace_tokens(&t, &t.reqs[0], b);
	cr_assert_eq(memcmp(a, b, sizeof(b)), 0, "equal ids give equal tokens");
	trace_free(&t);
}

Test(trace, errors_name_the_line)
{
	struct trace t = {0};
	char err[256];
	const char *s = "{\"timestamp\": 0, \"input_length\": 512, \"output_length\": 1, "
	                "\"hash_ids\": [7]}\n"
	                "{\"timestamp\": 0, \"input_length\": 5000, \"output_length\": 1, "
	                "\"hash_ids\": [7]}\n"
	                "not json\n";
	cr_assert_eq(load(&t, s, false, err), -1);
	cr_assert(strstr(err, "mem:2:") != NULL, "%s", err);
	trace_free(&t);
	struct trace u = {0};
	cr_assert_eq(load(&u, s, true, err), 0);
	cr_assert_eq(u.n, 1);
	cr_assert_eq(u.n_bad, 2);
	trace_free(&u);
}

Test(trace, session_with_subagent)
{
	struct trace t = {0};
	char err[256];
	const char *s =
	    "{\"block_size\": 64, \"requests\": ["
	    "{\"t\": 2.0, \"type\": \"n\", \"in\": 130, \"out\": 3, \"hash_ids\": [1, 2]},"
	    "{\"t\": 1.0, \"type\": \"subagent\", \"requests\": ["
	    "{\"t\": 0.5, \"in\": 64, \"out\": 2, \"hash_ids\": [1]}]}]}";
	cr_assert_eq(load(&t, s, false, err), 0, "%s", err);
	trace_finish(&t);
	cr_assert_eq(t.n, 2);
	cr_assert_eq(t.block_size, 64);
	cr_assert_float_eq(t.reqs[0].arrival_s, 1.5, 1e-9);
	cr_assert_float_eq(t.reqs[1].arrival_s, 2.0, 1e-9);
	trace_free(&t);
}

Test(trace, session_namespaces_and_block_size_mismatch)
{
	struct trace t = {0};
	char err[256];
	const char *s = "{\"block_size\": 64, \"requests\": [{\"t\": 0, \"in\": 64, \"out\": 1, "
	                "\"hash_ids\": [1]}]}";
	cr_assert_eq(load(&t, s, false, err), 0);
	cr_assert_eq(load(&t, s, false, err), 0);
	trace_finish(&t);
	cr_assert_neq(t.reqs[0].ids[0], t.reqs[1].ids[0], "sessions do not share ids");
	const char *m = "{\"timestamp\": 0, \"input_length\": 512, \"output_length\": 1, "
	                "\"hash_ids\": [7]}\n";
	cr_assert_eq(load(&t, m, false, err), -1);
	cr_assert(strstr(err, "block size") != NULL, "%s", err);
	trace_free(&t);
	struct trace e = {0};
	cr_assert_eq(trace_load_mem(&e, "empty", "", 0, false, 0, err, 256), -1);
	cr_assert_eq(trace_load(&e, "/nonexistent/x.jsonl", false, 0, err, 256), -1);
	cr_assert(strstr(err, "/nonexistent/x.jsonl") != NULL);
	/* A directory given for a file: named as such, not "empty file". */
	cr_assert_eq(trace_load(&e, "/", false, 0, err, 256), -1);
	cr_assert(strstr(err, "directory") != NULL, "%s", err);
	trace_free(&e);
}

/* An id of 2^48 or more was masked to 48 bits: 2^48 + 5 hit the cached 5 of the line above. */
Test(trace, ids_past_48_bits_are_refused)
{
	struct trace t = {0};
	char err[256];
	const char *s = "{\"timestamp\": 0, \"input_length\": 512, \"output_length\": 1, "
	                "\"hash_ids\": [5]}\n"
	                "{\"timestamp\": 1, \"input_length\": 512, \"output_length\": 1, "
	                "\"hash_ids\": [281474976710661]}\n"
	                "{\"timestamp\": 2, \"input_length\": 512, \"output_length\": 1, "
	                "\"hash_ids\": [281474976710655]}\n";
	cr_assert_eq(load(&t, s, false, err), -1);
	cr_assert(strstr(err, "mem:2:") && strstr(err, "281474976710661"), "%s", err);
	trace_free(&t);
	struct trace u = {0};
	cr_assert_eq(load(&u, s, true, err), 0, "%s", err);
	trace_finish(&u);
	cr_assert_eq(u.n, 2);
	cr_assert_eq(u.n_bad, 1);
	cr_assert_neq(u.reqs[0].ids[0], u.reqs[1].ids[0]);
	trace_free(&u);
	const char *sess = "{\"block_size\": 64, \"requests\": [{\"t\": 0, \"in\": 64, \"out\": 1, "
	                   "\"hash_ids\": [281474976710656]}]}";
	struct trace v = {0};
	cr_assert_eq(load(&v, sess, false, err), -1);
	cr_assert(strstr(err, "281474976710656") != NULL, "%s", err);
	trace_free(&v);
}

/* The file index sat above the ids with no bound: file 65,536 shared file 0's ids. */
Test(trace, file_count_is_bounded)
{
	struct trace t = {0};
	char err[256];
	const char *s = "{\"block_size\": 64, \"requests\": [{\"t\": 0, \"in\": 64, \"out\": 1, "
	                "\"hash_ids\": [1]}]}";
	size_t i = 0;
	while (i <= 16384 && load(&t, s, false, err) == 0)
		i++;
	cr_assert_eq(i, 16384, "%zu files loaded", i);
	cr_assert(strstr(err, "too many trace files") != NULL, "%s", err);
	trace_finish(&t);
	for (size_t k = 1; k < t.n; k++)
		cr_assert_neq(t.reqs[k].ids[0], t.reqs[k - 1].ids[0]);
	trace_free(&t);
}

/* A truncated session file was read as Mooncake lines: it set the trace's block size to 512, so
 * the good session files around it were refused for block size, even under --skip-bad. */
Test(trace, a_broken_session_file_is_one)
{
	const char *good = "{\"block_size\": 64, \"requests\": [{\"t\": 0, \"in\": 64, "
	                   "\"out\": 1, \"hash_ids\": [1]}]}";
	const char *cut = "{\"block_size\": 64, \"requests\": [{\"t\": 0, \"in\": 64, \"out";
	const char *pretty_cut = "{\n  \"block_size\": 64,\n  \"requests\": [\n";
	const char *bad_lines = "not json\n{\"timestamp\": 0}\n";
	char err[256];
	struct trace t = {0};
	cr_assert_eq(load(&t, cut, false, err), -1);
	cr_assert(strstr(err, "mem:1: bad session file") != NULL, "%s", err);
	cr_assert_eq(t.block_size, 0);
	cr_assert_eq(load(&t, pretty_cut, false, err), -1);
	cr_assert(strstr(err, "bad session file") != NULL, "%s", err);
	trace_free(&t);
	for (int order = 0; order < 2; order++) {
		struct trace u = {0};
		if (order == 0) {
			cr_assert_eq(load(&u, good, true, err), 0, "%s", err);
			cr_assert_str_empty(err);
		}
		cr_assert_eq(load(&u, cut, true, err), 0, "%s", err);
		cr_assert(strstr(err, "bad session file, skipped") != NULL, "%s", err);
		cr_assert_eq(load(&u, pretty_cut, true, err), 0, "%s", err);
		cr_assert_eq(load(&u, bad_lines, true, err), 0, "%s", err);
		if (order == 1)
			cr_assert_eq(load(&u, good, true, err), 0, "%s", err);
		cr_assert_eq(u.block_size, 64);
		cr_assert_eq(u.n, 1);
		cr_assert_eq(u.n_bad, 4);
		trace_free(&u);
	}
}

/* Two session objects back to back were read as the first alone, silently. */
Test(trace, content_after_the_session_object_is_malformed)
{
	const char *two = "{\"block_size\": 64, \"requests\": [{\"t\": 0, \"in\": 64, "
	                  "\"out\": 1, \"hash_ids\": [1]}]}"
	                  "{\"block_size\": 64, \"requests\": [{\"t\": 1, \"in\": 64, "
	                  "\"out\": 1, \"hash_ids\": [2]}]}";
	const char *trailing_blank = "{\"block_size\": 64, \"requests\": [{\"t\": 0, \"in\": 64, "
	                             "\"out\": 1, \"hash_ids\": [1]}]}\n\n  \n";
	char err[256];
	struct trace t = {0};
	cr_assert_eq(load(&t, two, false, err), -1);
	cr_assert(strstr(err, "content after the session object") != NULL, "%s", err);
	cr_assert_eq(t.n, 0);
	cr_assert_eq(load(&t, two, true, err), 0, "%s", err);
	cr_assert(strstr(err, "skipped") != NULL, "%s", err);
	cr_assert_eq(t.n, 0);
	cr_assert_eq(t.n_bad, 1);
	cr_assert_eq(load(&t, trailing_blank, false, err), 0, "%s", err);
	cr_assert_eq(t.n, 1);
	trace_free(&t);
}

/* The tokens past a request's last id were keyed by uid << 20 | block index: block 2^20 + k of
 * request u keyed as block k of u + 1, so two requests with the same 2^20 ids (uids 0 and 1) had
 * the same partial last block, a cache hit the trace does not hold. */
Test(trace, tails_past_block_2_20_stay_distinct)
{
	size_t nids = (size_t)1 << 20, cap = nids * 4 + 256, len = 0;
	char *s = malloc(cap);
	cr_assert_not_null(s);
	len += (size_t)snprintf(s + len, cap - len, "{\"block_size\": 2, \"requests\": [");
	for (int r = 0; r < 2; r++) {
		len += (size_t)snprintf(s + len, cap - len,
		                        "%s{\"t\": %d, \"in\": %zu, \"out\": 1, \"hash_ids\": [",
		                        r ? ", " : "", r, 2 * nids + 1);
		for (size_t i = 0; i < nids; i++) {
			s[len++] = i ? ',' : ' ';
			s[len++] = '7';
		}
		len += (size_t)snprintf(s + len, cap - len, "]}");
	}
	len += (size_t)snprintf(s + len, cap - len, "]}");
	struct trace t = {0};
	char err[256];
	cr_assert_eq(trace_load_mem(&t, "mem", s, len, false, 0, err, sizeof(err)), 0, "%s", err);
	free(s);
	trace_finish(&t);
	cr_assert_eq(t.n, 2);
	uint32_t *a = malloc((2 * nids + 1) * sizeof(*a)), *b = malloc((2 * nids + 1) * sizeof(*b));
	cr_assert(a && b);
	trace_tokens(&t, &t.reqs[0], a);
	trace_tokens(&t, &t.reqs[1], b);
	cr_assert_eq(memcmp(a, b, 2 * nids * sizeof(*a)), 0, "equal ids give equal tokens");
	cr_assert_neq(a[2 * nids], b[2 * nids],
	              "the partial block at index 2^20 is each request's own");
	free(a);
	free(b);
	trace_free(&t);
}

/* A fault found in a session file's parsed values (a bad request, its ids, the block size) was
 * reported at line 1 whatever its line: jansson's values keep no position, so the text is
 * scanned again down the path to the fault.  The request is named too (a one-line file). */
Test(trace, session_errors_name_the_line_of_the_entry)
{
	static const struct {
		const char *text, *want;
	} cases[] = {
	    /* a subagent's request, line 8 */
	    {"{\n  \"block_size\": 64,\n  \"requests\": [\n"
	     "    {\"t\": 0, \"in\": 64, \"out\": 1, \"hash_ids\": [1]},\n"
	     "    {\"t\": 1, \"in\": 64, \"out\": 1, \"hash_ids\": [1]},\n"
	     "    {\"t\": 2, \"type\": \"subagent\", \"requests\": [\n"
	     "      {\"t\": 0, \"in\": 64, \"out\": 1, \"hash_ids\": [1]},\n"
	     "      {\"t\": 1, \"in\": 0, \"out\": 1, \"hash_ids\": []}\n"
	     "    ]}\n  ]\n}\n",
	     "mem:8: bad session file: requests[2].requests[1]: missing or bad \"in\""},
	    /* the member at fault, on its own line; an id past 48 bits */
	    {"{\"block_size\": 64, \"requests\": [{\"t\": 0, \"in\": 64, \"out\": 1,\n"
	     "\"hash_ids\": [1]}, {\"t\": 1,\n\"in\": 64,\n\"out\": 1,\n"
	     "\"hash_ids\":\n[281474976710656]}]}",
	     "mem:6: bad session file: requests[1]: hash id 281474976710656"},
	    /* a key spelt with an escape (a key given twice is malformed: a_key_given_twice) */
	    {"{\"block_size\": 64,\n\"requ\\u0065sts\": [\n"
	     "{\"t\": 0, \"in\": 64, \"out\": 1, \"hash_ids\": [1]},\n{\"t\": -1}]}",
	     "mem:4: bad session file: requests[1]: missing or bad \"t\""},
	    /* not an array: the member's line */
	    {"{\"block_size\": 64,\n\n\"requests\": {}}", "mem:3: bad session file: \"requests\""},
	    {"\n\n{\"requests\": [],\n\"block_size\": 0}",
	     "mem:4: bad session file: missing or bad"},
	    /* one line: line 1, and the request named */
	    {"{\"block_size\": 64, \"requests\": [{\"t\": 0, \"in\": 64, \"out\": 1, "
	     "\"hash_ids\": [1]}, {\"t\": 0, \"in\": 64, \"out\": 1, \"hash_ids\": [1, 2]}]}",
	     "mem:1: bad session file: requests[1]: len(hash_ids)"},
	};
	char err[256];
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		struct trace t = {0};
		cr_assert_eq(load(&t, cases[i].text, false, err), -1, "case %zu", i);
		cr_assert(strstr(err, cases[i].want) != NULL, "case %zu: '%s', want '%s'", i, err,
		          cases[i].want);
		cr_assert_eq(load(&t, cases[i].text, true, err), 0, "case %zu", i);
		cr_assert(strstr(err, "bad session file, skipped") != NULL, "case %zu: %s", i, err);
		trace_free(&t);
	}
	/* A block size other than the trace's: the line of "block_size". */
	struct trace t = {0};
	cr_assert_eq(load(&t,
	                  "{\"block_size\": 64, \"requests\": [{\"t\": 0, \"in\": 64, \"out\": 1, "
	                  "\"hash_ids\": [1]}]}",
	                  false, err),
	             0, "%s", err);
	cr_assert_eq(load(&t, "{\n\"requests\": [],\n\n\"block_size\": 32}", false, err), -1);
	cr_assert(strstr(err, "mem:4: block size 32 differs") != NULL, "%s", err);
	trace_free(&t);
}

/* A key given twice is malformed: jansson kept the last value without a word, so a line with
 * "timestamp" twice was replayed at one of them, whichever came last. */
Test(trace, a_key_given_twice_is_malformed)
{
	struct trace t = {0};
	char err[256];
	const char *lines = "{\"timestamp\": 0, \"input_length\": 512, \"output_length\": 1, "
	                    "\"hash_ids\": [7]}\n"
	                    "{\"timestamp\": 0, \"input_length\": 512, \"output_length\": 1, "
	                    "\"hash_ids\": [7], \"timestamp\": 9000}\n";
	cr_assert_eq(load(&t, lines, false, err), -1);
	cr_assert(strstr(err, "mem:2: ") && strstr(err, "duplicate"), "%s", err);
	trace_free(&t);
	const char *session =
	    "{\"block_size\": 16,\n"
	    " \"requests\": [{\"t\": 0, \"in\": 16, \"out\": 1, \"hash_ids\": [1]},\n"
	    "  {\"t\": 1, \"in\": 16, \"in\": 32, \"out\": 1, \"hash_ids\": [1]}]}\n";
	cr_assert_eq(load(&t, session, false, err), -1);
	cr_assert(strstr(err, "mem:3: ") && strstr(err, "duplicate"), "%s", err);
	trace_free(&t);
}
