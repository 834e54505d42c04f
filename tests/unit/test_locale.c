/*
 * tests/unit/test_locale.c - kvr_metrics_render under a locale whose decimal point is a comma.
 *
 * A program that calls setlocale(LC_ALL, "") (a C++ one through std::locale::global too) in a
 * de_DE, fr_FR or ru_RU environment has printf write "0,5".  Prometheus' text format takes
 * only "0.5": the histograms' le="..." bounds and the _sum values came out as "1,6e-08" and
 * "0,000123", and a scrape of the whole page failed.  The render now formats under the C
 * locale whatever the process's is.
 * The locale comes from the system (de_DE.UTF-8), else is built here with localedef into a
 * scratch LOCPATH; without either (no `locales` data) the test is skipped (77).
 * A plain program: exit 0 pass, 1 fail, 77 skipped.
 */
#include <locale.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvrouter.h"

/* The scratch LOCPATH built below, removed at exit (its locale is 2.9 MB). */
static char dir[] = "/tmp/kvr_locale_XXXXXX";
static bool built;

static void remove_built(void)
{
	char cmd[64];
	snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
	if (built && system(cmd) != 0)
		fprintf(stderr, "test_locale: could not remove %s\n", dir);
}

static int comma_locale(void)
{
	static const char *names[] = {"de_DE.UTF-8", "de_DE.utf8", "fr_FR.UTF-8", "ru_RU.UTF-8"};
	for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
		if (setlocale(LC_ALL, names[i]))
			return 0;
	if (!mkdtemp(dir))
		return -1;
	built = true;
	atexit(remove_built);
	char cmd[256];
	snprintf(cmd, sizeof(cmd), "localedef -i de_DE -f UTF-8 %s/de_DE.UTF-8 >/dev/null 2>&1",
	         dir);
	int rc = system(cmd);
	if (rc != 0 && rc != 256) /* 1: built, with warnings */
		return -1;
	setenv("LOCPATH", dir, 1);
	return setlocale(LC_ALL, "de_DE.UTF-8") ? 0 : -1;
}

int main(void)
{
	if (comma_locale() != 0 || strcmp(localeconv()->decimal_point, ",") != 0) {
		printf("test_locale: no locale with a decimal comma here, skipped\n");
		return 77;
	}
	char probe[32];
	snprintf(probe, sizeof(probe), "%.1f", 0.5);
	printf("test_locale: %s, printf(\"%%.1f\", 0.5) gives \"%s\"\n", setlocale(LC_ALL, NULL),
	       probe);
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_shards = 1;
	struct kvr_router *r;
	if (kvr_router_create(&c, &r) != 0)
		return 1;
	int failures = 0;
	if (kvr_rank_add(r, (struct kvr_rank_id){1, 0}, 1, 10000, 0) != 0)
		failures++;
	static uint32_t tok[4096];
	for (unsigned k = 0; k < 64; k++) {
		for (unsigned i = 0; i < 4096; i++)
			tok[i] = i * 7 + k;
		struct kvr_request q;
		kvr_request_init(&q);
		q.tokens = tok;
		q.n_tokens = 4096;
		struct kvr_decision d;
		if (kvr_route(r, &q, &d) != 0 || kvr_request_finish(r, d.attempt) != 0)
			failures++;
	}
	kvr_router_sync(r, 10000);
	size_t len = 0;
	kvr_metrics_render(r, NULL, 0, &len);
	char *buf = malloc(len + 1);
	if (!buf || kvr_metrics_render(r, buf, len + 1, &len) != 0)
		return 1;
	/* Every sample line: its value (after the last space) and any le="..." bound must be
	 * numbers in the C locale's form. */
	unsigned lines = 0, fractions = 0;
	for (char *line = strtok(buf, "\n"); line; line = strtok(NULL, "\n")) {
		if (line[0] == '#')
			continue;
		lines++;
		const char *v = strrchr(line, ' ');
		const char *le = strstr(line, "le=\"");
		if (!v || strchr(v, ',') ||
		    (le && strchr(le, ',') && strchr(le, ',') < strchr(le + 4, '"'))) {
			fprintf(stderr, "FAIL: not a Prometheus number: %s\n", line);
			failures++;
		}
		if (strchr(v ? v : "", '.') || (le && strchr(le, '.')))
			fractions++;
	}
	free(buf);
	kvr_router_destroy(r);
	if (fractions == 0) {
		fprintf(stderr, "FAIL: no fractional number in %u lines: the test checks nothing\n",
		        lines);
		failures++;
	}
	printf("test_locale: %u sample lines, %u with a fraction, %d bad\n", lines, fractions,
	       failures);
	return failures != 0;
}
