/*
 * tools/json_line.h - the line of a value inside JSON text, for messages about input that
 * parsed but says something wrong: jansson keeps no positions in the values it returns, so a
 * session file's bad request was reported at line 1 (tools/trace.c).
 *
 * The text is scanned again, down the path that led to the value; it must be what jansson
 * accepted (one JSON value, with whitespace around it), but nothing is read past len whatever
 * it holds.
 */
#ifndef KVR_TOOLS_JSON_LINE_H
#define KVR_TOOLS_JSON_LINE_H

#include <stddef.h>

/* One step down: the member named key of an object (the last of that name: jansson keeps the
 * last), or with key NULL the element idx of an array. */
struct json_step {
	const char *key;
	size_t idx;
};

/* The line (from 1) where the value reached from text's top value by steps[0..n) starts; where
 * a step finds nothing (a missing member, an index past the end, a scalar), the line of the
 * last value reached.  text (len bytes) and steps are borrowed. */
size_t json_line(const char *text, size_t len, const struct json_step *steps, size_t n);

#endif /* KVR_TOOLS_JSON_LINE_H */
