/* tools/json_line.c - see json_line.h.  A skipping scanner: strings (with escapes), objects and
 * arrays by depth, scalars up to a delimiter; keys compared as jansson decodes them. */
#include "tools/json_line.h"

#include <jansson.h>
#include <stdbool.h>
#include <string.h>

struct scan {
	const char *p, *end;
};

static void ws(struct scan *s)
{
	while (s->p < s->end && (*s->p == ' ' || *s->p == '\t' || *s->p == '\n' || *s->p == '\r'))
		s->p++;
}

/* At a '"': past the closing one. */
static void skip_string(struct scan *s)
{
	s->p++;
	while (s->p < s->end && *s->p != '"')
		s->p += *s->p == '\\' && s->p + 1 < s->end ? 2 : 1;
	if (s->p < s->end)
		s->p++;
}

static void skip_value(struct scan *s)
{
	if (s->p >= s->end)
		return;
	if (*s->p == '"') {
		skip_string(s);
		return;
	}
	if (*s->p != '{' && *s->p != '[') {
		while (s->p < s->end && !strchr(",:]} \t\r\n", *s->p))
			s->p++;
		return;
	}
	size_t depth = 0;
	while (s->p < s->end) {
		char c = *s->p;
		if (c == '"') {
			skip_string(s);
			continue;
		}
		s->p++;
		if (c == '{' || c == '[')
			depth++;
		else if ((c == '}' || c == ']') && --depth == 0)
			return;
	}
}

/* Whether the string token [k, e) (quotes included) decodes to key. */
static bool key_is(const char *k, const char *e, const char *key)
{
	size_t n = (size_t)(e - k), kl = strlen(key);
	if (n < 2)
		return false;
	if (!memchr(k, '\\', n)) /* no escape: the bytes between the quotes are the key */
		return n - 2 == kl && memcmp(k + 1, key, kl) == 0;
	json_error_t je;
	json_t *v = json_loadb(k, n, JSON_DECODE_ANY, &je);
	bool eq = json_is_string(v) && json_string_length(v) == kl &&
	          memcmp(json_string_value(v), key, kl) == 0;
	json_decref(v);
	return eq;
}

/* s at an object or array: s at the value step names, true; false (s unchanged) if none. */
static bool step(struct scan *s, const struct json_step *st)
{
	struct scan c = *s;
	const char *found = NULL;
	if (st->key && c.p < c.end && *c.p == '{') {
		c.p++;
		for (;;) {
			ws(&c);
			if (c.p >= c.end || *c.p != '"')
				break;
			const char *k = c.p;
			skip_string(&c);
			const char *ke = c.p;
			ws(&c);
			if (c.p >= c.end || *c.p != ':')
				break;
			c.p++;
			ws(&c);
			if (key_is(k, ke, st->key))
				found = c.p;
			skip_value(&c);
			ws(&c);
			if (c.p >= c.end || *c.p != ',')
				break;
			c.p++;
		}
	} else if (!st->key && c.p < c.end && *c.p == '[') {
		c.p++;
		for (size_t i = 0;; i++) {
			ws(&c);
			if (c.p >= c.end || *c.p == ']')
				break;
			if (i == st->idx) {
				found = c.p;
				break;
			}
			skip_value(&c);
			ws(&c);
			if (c.p >= c.end || *c.p != ',')
				break;
			c.p++;
		}
	}
	if (!found)
		return false;
	s->p = found;
	return true;
}

size_t json_line(const char *text, size_t len, const struct json_step *steps, size_t n)
{
	struct scan s = {text, text + len};
	ws(&s);
	for (size_t i = 0; i < n && step(&s, &steps[i]); i++)
		;
	size_t line = 1;
	for (const char *q = text; q < s.p; q++)
		line += *q == '\n';
	return line;
}
