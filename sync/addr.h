/*
 * sync/addr.h - the port of a "host:port" address, checked before libzmq or nats.c sees it:
 * both take the port's digits modulo 2^16 (or up to the first non-digit) and connect to that
 * port without a word ("h:99999" is port 34463), so a typo reaches another service.
 */
#ifndef KVR_SYNC_ADDR_H
#define KVR_SYNC_ADDR_H

#include <stdbool.h>

/* Whether address [a, end) ("host", "host:port", "[v6]:port") has no port or a decimal one in
 * lo..65535, or '*' when star.  Context: any thread. */
static inline bool kvr_addr_port_ok(const char *a, const char *end, unsigned lo, bool star)
{
	if (a < end && *a == '[') /* an IPv6 literal: the port follows its ']' */
		while (a < end && *a != ']')
			a++;
	const char *c = NULL;
	for (const char *p = a; p < end; p++)
		if (*p == ':')
			c = p;
	if (!c)
		return true;
	const char *d = c + 1;
	if (star && end - d == 1 && *d == '*')
		return true;
	if (d == end || end - d > 5)
		return false;
	unsigned v = 0;
	for (; d < end; d++) {
		if (*d < '0' || *d > '9')
			return false;
		v = v * 10 + (unsigned)(*d - '0');
	}
	return v >= lo && v <= 65535;
}

#endif
