/* libFuzzer target: the trace parser (outside input) must never crash, leak or read out of
 * bounds, whatever the bytes; a parse that succeeds must produce consistent requests. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "tools/trace.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct trace t = {0};
	char err[256];
	int rc = trace_load_mem(&t, "fuzz", data, size, size & 1, 1000, err, sizeof(err));
	if (rc == 0) {
		trace_finish(&t);
		for (size_t i = 0; i < t.n; i++) {
			const struct trace_req *r = &t.reqs[i];
			if (r->input_len > (1u << 16))
				continue; /* keep each run fast */
			uint32_t *tok = malloc((size_t)r->input_len * sizeof(*tok) + 4);
			if (!tok)
				abort();
			trace_tokens(&t, r, tok);
			free(tok);
		}
	}
	trace_free(&t);
	return 0;
}
