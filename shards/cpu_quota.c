/*
 * shards/cpu_quota.c - the CPU limit of the process's cgroups (see cpu_quota.h).
 *
 * Where the files are: /proc/self/mountinfo names the cgroup file systems (a cgroup2 mount; a
 * cgroup v1 mount whose super options include the "cpu" controller), each with the path inside
 * the hierarchy it shows (its root); /proc/self/cgroup names the process's cgroup in each
 * hierarchy ("0::/path" for v2, "N:cpu,cpuacct:/path" for v1).  The process's directory is the
 * mount point plus that path less the mount's root.  Where the path is not under the root (a
 * container without a cgroup namespace sees the host's path and a mount of its own cgroup), the
 * mount point itself is the process's cgroup.  The limit is the smallest along the path up to
 * the mount point: a pod's limit sits on the pod's cgroup, above the container's.
 *
 * Hand-written, not libcgroup: libcgroup reads and writes any controller's files for cgroup
 * administration, but finding the calling process's effective CPU limit is not in its API (it
 * would still be this walk), and it would be one more shared library for every embedder.
 * Read with stdio (getline: mountinfo lines with overlay options run to kilobytes); nothing
 * kept, nothing of the library's allocator used.
 */
#include "shards/cpu_quota.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *kvr_cpu_quota_root = "";

/* A hierarchy that may hold a CPU limit: where it is mounted and the path it shows there. */
struct mount {
	bool found;
	char point[PATH_MAX];
	char root[PATH_MAX];
};

/* Copies a mountinfo field, decoding the octal escapes the kernel writes for space, tab,
 * newline and backslash (\040 ...).  False if it does not fit. */
static bool unescape(char *dst, size_t cap, const char *src)
{
	size_t n = 0;
	for (const char *s = src; *s; n++) {
		if (n + 1 >= cap)
			return false;
		if (s[0] == '\\' && s[1] >= '0' && s[1] <= '3' && s[2] >= '0' && s[2] <= '7' &&
		    s[3] >= '0' && s[3] <= '7') {
			dst[n] = (char)((s[1] - '0') * 64 + (s[2] - '0') * 8 + (s[3] - '0'));
			s += 4;
		} else {
			dst[n] = *s++;
		}
	}
	dst[n] = 0;
	return true;
}

/* True if the comma-separated list holds name exactly ("cpu", not "cpuset" or "cpuacct"). */
static bool has_item(const char *list, const char *name)
{
	size_t len = strlen(name);
	for (const char *p = list; p && *p;) {
		const char *end = strchr(p, ',');
		size_t n = end ? (size_t)(end - p) : strlen(p);
		if (n == len && !memcmp(p, name, len))
			return true;
		p = end ? end + 1 : NULL;
	}
	return false;
}

static FILE *open_at(const char *root, const char *path)
{
	char full[PATH_MAX];
	int n = snprintf(full, sizeof(full), "%s%s", root, path);
	if (n < 0 || (size_t)n >= sizeof(full))
		return NULL;
	return fopen(full, "re");
}

/* mountinfo: "id parent maj:min root point options [optional...] - fstype source super". */
static void find_mounts(const char *root, struct mount *v1, struct mount *v2)
{
	FILE *f = open_at(root, "/proc/self/mountinfo");
	if (!f)
		return;
	char *line = NULL;
	size_t cap = 0;
	while (getline(&line, &cap, f) > 0) {
		char *tok[64], *save = NULL;
		int n = 0;
		for (char *t = strtok_r(line, " \n", &save); t && n < 64;
		     t = strtok_r(NULL, " \n", &save))
			tok[n++] = t;
		int dash = -1;
		for (int i = 6; i < n; i++)
			if (!strcmp(tok[i], "-")) {
				dash = i;
				break;
			}
		if (dash < 0 || dash + 3 >= n)
			continue;
		const char *fstype = tok[dash + 1], *super = tok[dash + 3];
		struct mount *m = NULL;
		if (!strcmp(fstype, "cgroup2"))
			m = v2;
		else if (!strcmp(fstype, "cgroup") && has_item(super, "cpu"))
			m = v1;
		if (!m || m->found) /* the first mount of a hierarchy, as the kernel lists them */
			continue;
		if (unescape(m->root, sizeof(m->root), tok[3]) &&
		    unescape(m->point, sizeof(m->point), tok[4]))
			m->found = true;
	}
	free(line);
	fclose(f);
}

/* /proc/self/cgroup: the process's path in the v1 hierarchy holding "cpu" and in v2 ("0::"). */
static void find_paths(const char *root, char *p1, char *p2, size_t cap)
{
	p1[0] = p2[0] = 0;
	FILE *f = open_at(root, "/proc/self/cgroup");
	if (!f)
		return;
	char *line = NULL;
	size_t lcap = 0;
	ssize_t len;
	while ((len = getline(&line, &lcap, f)) > 0) {
		if (line[len - 1] == '\n')
			line[--len] = 0;
		char *c1 = strchr(line, ':');
		char *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
		if (!c2 || strlen(c2 + 1) >= cap || c2[1] != '/')
			continue;
		*c2 = 0;
		if (!strcmp(line, "0:") && c1 + 1 == c2)
			strcpy(p2, c2 + 1);
		else if (has_item(c1 + 1, "cpu"))
			strcpy(p1, c2 + 1);
	}
	free(line);
	fclose(f);
}

/* Reads up to two unsigned numbers from root + dir + "/" + file; "max" reads as 0.  Returns
 * how many were read. */
static int read_nums(const char *root, const char *dir, const char *file, long long *a,
                     long long *b)
{
	char path[PATH_MAX];
	int n = snprintf(path, sizeof(path), "%s%s/%s", root, dir, file);
	if (n < 0 || (size_t)n >= sizeof(path))
		return 0;
	FILE *f = fopen(path, "re");
	if (!f)
		return 0;
	char buf[128] = "";
	bool ok = fgets(buf, sizeof(buf), f) != NULL;
	fclose(f);
	if (!ok)
		return 0;
	char *p = buf, *end;
	long long v[2];
	int got = 0;
	while (got < 2) {
		while (*p == ' ' || *p == '\t')
			p++;
		if (!strncmp(p, "max", 3) && (p[3] == ' ' || p[3] == '\n' || !p[3])) {
			v[got++] = 0;
			p += 3;
			continue;
		}
		errno = 0;
		long long x = strtoll(p, &end, 10);
		if (end == p || errno)
			break;
		v[got++] = x;
		p = end;
	}
	if (got > 0)
		*a = v[0];
	if (got > 1)
		*b = v[1];
	return got;
}

/* The smallest limit (CPUs, fractional) from dir up to the mount point; 0 if none. */
static double walk(const char *root, const struct mount *m, const char *cg, bool v2)
{
	char dir[PATH_MAX];
	size_t rl = strlen(m->root);
	const char *rel = "";
	if (!strcmp(m->root, "/"))
		rel = cg;
	else if (!strncmp(cg, m->root, rl) && (cg[rl] == '/' || cg[rl] == 0))
		rel = cg + rl;
	if (!strcmp(rel, "/"))
		rel = "";
	int n = strcmp(m->point, "/") ? snprintf(dir, sizeof(dir), "%s%s", m->point, rel)
	                              : snprintf(dir, sizeof(dir), "%s", rel[0] ? rel : "/");
	if (n < 0 || (size_t)n >= sizeof(dir))
		return 0;
	const size_t stop = strlen(m->point);
	double best = 0;
	for (;;) {
		long long quota = 0, period = 0;
		double lim = 0;
		if (v2) {
			if (read_nums(root, dir, "cpu.max", &quota, &period) == 2 && quota > 0 &&
			    period > 0)
				lim = (double)quota / (double)period;
		} else if (read_nums(root, dir, "cpu.cfs_quota_us", &quota, &period) == 1 &&
		           quota > 0 &&
		           read_nums(root, dir, "cpu.cfs_period_us", &period, &period) == 1 &&
		           period > 0) {
			lim = (double)quota / (double)period;
		}
		if (lim > 0 && (best == 0 || lim < best))
			best = lim;
		if (strlen(dir) <= stop)
			break;
		char *slash = strrchr(dir, '/');
		if (!slash)
			break;
		slash[slash == dir] = 0; /* "/a" -> "/" (a mount at "/"), "/m/a" -> "/m" */
		if (strlen(dir) < stop)
			break;
	}
	return best;
}

/* What one reading needs: ~20 KiB of paths, on the heap rather than the caller's stack (a
 * router may be created on a fiber's small stack). */
struct scan {
	struct mount m1, m2;
	char p1[PATH_MAX], p2[PATH_MAX];
};

uint32_t kvr_cpu_quota_at(const char *root)
{
	if (!root)
		return 0;
	/* libc's calloc, as stdio's own buffers: freed before returning, never the library's
	 * (its allocation failures are the router's to report; here one only means no limit
	 * found). */
	struct scan *sc = calloc(1, sizeof(*sc));
	if (!sc)
		return 0;
	double best = 0;
	find_mounts(root, &sc->m1, &sc->m2);
	if (sc->m1.found || sc->m2.found)
		find_paths(root, sc->p1, sc->p2, sizeof(sc->p1));
	if (sc->m1.found && sc->p1[0])
		best = walk(root, &sc->m1, sc->p1, false);
	if (sc->m2.found && sc->p2[0]) {
		double l = walk(root, &sc->m2, sc->p2, true);
		if (l > 0 && (best == 0 || l < best))
			best = l;
	}
	free(sc);
	if (best <= 0)
		return 0;
	double c = ceil(best);
	return c >= (double)UINT32_MAX ? UINT32_MAX : (uint32_t)c;
}
