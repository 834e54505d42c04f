/* The calling thread's error detail (core/error.c, kvr_last_error). */
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>

#include "core/error.h"
#include "kvrouter.h"

static bool valid_utf8(const unsigned char *s)
{
	while (*s) {
		int n = *s < 0x80             ? 0
		        : (*s & 0xe0) == 0xc0 ? 1
		        : (*s & 0xf0) == 0xe0 ? 2
		        : (*s & 0xf8) == 0xf0 ? 3
		                              : -1;
		if (n < 0)
			return false;
		s++;
		for (int i = 0; i < n; i++, s++)
			if ((*s & 0xc0) != 0x80)
				return false;
	}
	return true;
}

Test(error, short_detail_is_kept_whole)
{
	cr_assert_eq(kvr_fail(KVR_EINVAL, "f: x %d is bad", 3), KVR_EINVAL);
	cr_assert_str_eq(kvr_last_error(), "f: x 3 is bad");
	char s[KVR_ERROR_DETAIL_MAX];
	memset(s, 'a', sizeof(s) - 1);
	s[sizeof(s) - 1] = '\0';
	kvr_fail(KVR_EINVAL, "%s", s); /* exactly 255 bytes: fits */
	cr_assert_str_eq(kvr_last_error(), s);
}

/* A detail that quotes a long user string (a servers list, an endpoint) kept its first 255
 * bytes: what was wrong, said at the end, was cut off ("config.servers \"nats://host00...,nats:/"
 * for a list of 33 URLs, never "lists 33 URLs; 1 to 32").  Now the start and the end are kept,
 * " ... " between. */
Test(error, long_detail_keeps_its_start_and_end)
{
	char servers[2048] = "";
	for (int i = 0; i < 33; i++)
		snprintf(servers + strlen(servers), sizeof(servers) - strlen(servers),
		         "%snats://host%02d.example:4222", i ? "," : "", i);
	kvr_fail(KVR_EINVAL, "%s: config.servers \"%s\" lists %d URLs; 1 to %d", "kvr_sync_attach",
	         servers, 33, 32);
	const char *d = kvr_last_error();
	cr_assert_leq(strlen(d), KVR_ERROR_DETAIL_MAX - 1);
	cr_assert(strncmp(d, "kvr_sync_attach: config.servers \"nats://host00", 46) == 0, "%s", d);
	cr_assert(strstr(d, " ... "), "%s", d);
	const char *end = "\" lists 33 URLs; 1 to 32";
	cr_assert_str_eq(d + strlen(d) - strlen(end), end, "%s", d);
}

/* Cut between characters: a detail quoting a UTF-8 string stays valid UTF-8 whatever the
 * alignment of the cut (it was cut inside a character: bindings that decode it raised). */
Test(error, long_detail_is_cut_between_characters)
{
	for (int pad = 0; pad < 8; pad++) {
		static char s[8192];
		size_t n = 0, want = pad < 4 ? 600 : 5000; /* 5000: past the formatting room */
		for (int i = 0; i < pad % 4; i++)
			s[n++] = 'x';
		while (n < want) {
			memcpy(s + n, "\xc3\xa9\xe2\x82\xac", 5); /* e-acute, euro sign */
			n += 5;
		}
		s[n] = '\0';
		kvr_fail(KVR_EINVAL, "f: endpoint \"%s\" is refused", s);
		const char *d = kvr_last_error();
		cr_assert(valid_utf8((const unsigned char *)d), "pad %d", pad);
		cr_assert_leq(strlen(d), KVR_ERROR_DETAIL_MAX - 1);
		if (pad < 4)
			cr_assert(strstr(d, "\" is refused"), "pad %d: %s", pad, d);
	}
}

/* Through the public API: a servers list of 33 URLs (checked before any connection). */
Test(error, sync_attach_servers_detail_says_what_is_wrong)
{
	struct kvr_router *r;
	cr_assert_eq(kvr_router_create(NULL, &r), 0);
	char servers[2048] = "";
	for (int i = 0; i < 33; i++)
		snprintf(servers + strlen(servers), sizeof(servers) - strlen(servers),
		         "%snats://host%02d.example:4222", i ? "," : "", i);
	struct kvr_sync_config c;
	kvr_sync_config_init(&c);
	c.servers = servers;
	c.replica_id = 1;
	struct kvr_sync *s;
	int rc = kvr_sync_attach(r, &c, &s);
	if (rc != KVR_ENOTSUP) {
		cr_assert_eq(rc, KVR_EINVAL);
		cr_assert(strstr(kvr_last_error(), "33 URLs"), "%s", kvr_last_error());
	}
	kvr_router_destroy(r);
}
