/*
 * tests/unit/test_cpu_quota.c - the default shard count stops at the cgroups' CPU quota
 * (shards/cpu_quota.c), and a given cpu_list gives one shard per CPU listed.
 *
 * Most cases build a fake tree (proc/self/mountinfo, proc/self/cgroup and the cgroup files under
 * the mount points) in a temporary directory and read it through kvr_cpu_quota_at: cgroup v2, v1
 * (the hybrid layout of Debian and Docker hosts), a container's view of its own cgroup, a limit
 * on an ancestor (a pod's), escaped mount points, kilobyte lines, malformed files.  One case
 * creates a real cgroup with a 1-CPU quota and runs a router in it (skipped where the cgroup file
 * system cannot be written: not root, a read-only mount).
 *
 * Before: the default was one shard per CPU of the affinity mask whatever the quota (64 shard
 * threads sharing a 2-CPU pod's quota on a 64-CPU host), and a cpu_list with n_shards 0 gave one
 * shard.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvrouter.h"
#include "shards/cpu_quota.h"

static char tree[64];

static void mkdirs(const char *path)
{
	char buf[4096];
	snprintf(buf, sizeof(buf), "%s", path);
	for (char *p = buf + 1; *p; p++)
		if (*p == '/') {
			*p = 0;
			mkdir(buf, 0755);
			*p = '/';
		}
	mkdir(buf, 0755);
}

/* Writes content to tree + path, making its directories. */
static void put(const char *path, const char *content)
{
	char full[4096];
	snprintf(full, sizeof(full), "%s%s", tree, path);
	char dir[4096];
	snprintf(dir, sizeof(dir), "%s", full);
	*strrchr(dir, '/') = 0;
	mkdirs(dir);
	FILE *f = fopen(full, "w");
	cr_assert_not_null(f, "%s: %s", full, strerror(errno));
	fputs(content, f);
	fclose(f);
}

static void setup(void)
{
	snprintf(tree, sizeof(tree), "/tmp/kvr_cpu_quota_XXXXXX");
	cr_assert_not_null(mkdtemp(tree));
}

static void teardown(void)
{
	char cmd[128];
	snprintf(cmd, sizeof(cmd), "rm -rf '%s'", tree);
	cr_assert_eq(system(cmd), 0);
}

TestSuite(cpu_quota, .init = setup, .fini = teardown);

#define V2_MOUNT                                                                                   \
	"30 1 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec - cgroup2 cgroup2 rw,nsdelegate\n"

/* Kubernetes on cgroup v2: the pod's limit sits above the container's cgroup. */
Test(cpu_quota, v2_limit_on_an_ancestor)
{
	put("/proc/self/mountinfo", "22 1 8:1 / / rw - ext4 /dev/sda1 rw\n" V2_MOUNT);
	put("/proc/self/cgroup", "0::/kubepods/pod1/ctr\n");
	put("/sys/fs/cgroup/kubepods/pod1/ctr/cpu.max", "max 100000\n");
	put("/sys/fs/cgroup/kubepods/pod1/cpu.max", "150000 100000\n");
	put("/sys/fs/cgroup/kubepods/cpu.max", "max 100000\n");
	put("/sys/fs/cgroup/cpu.max", "max 100000\n");
	cr_assert_eq(kvr_cpu_quota_at(tree), 2); /* 1.5 CPUs, rounded up */
	/* The smaller of two limits on the path, wherever it is. */
	put("/sys/fs/cgroup/kubepods/pod1/ctr/cpu.max", "400000 100000\n");
	put("/sys/fs/cgroup/kubepods/cpu.max", "50000 100000\n");
	cr_assert_eq(kvr_cpu_quota_at(tree), 1);
}

Test(cpu_quota, v2_no_limit)
{
	put("/proc/self/mountinfo", V2_MOUNT);
	put("/proc/self/cgroup", "0::/user.slice/session-1.scope\n");
	put("/sys/fs/cgroup/user.slice/session-1.scope/cpu.max", "max 100000\n");
	put("/sys/fs/cgroup/user.slice/cpu.max", "max 100000\n");
	cr_assert_eq(kvr_cpu_quota_at(tree), 0);
	/* No cpu.max files at all (the cpu controller not enabled): no limit either. */
	put("/proc/self/cgroup", "0::/other\n");
	cr_assert_eq(kvr_cpu_quota_at(tree), 0);
}

/* Debian 11 / older Docker hosts: v1 controllers, cpu and cpuacct co-mounted, cpuset apart, and
 * an unused v2 hierarchy. */
Test(cpu_quota, v1_hybrid)
{
	put("/proc/self/mountinfo",
	    "25 24 0:22 / /sys/fs/cgroup rw - tmpfs tmpfs rw,mode=755\n"
	    "26 25 0:23 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n"
	    "30 25 0:27 / /sys/fs/cgroup/cpuset rw shared:12 - cgroup cgroup rw,cpuset\n"
	    "31 25 0:28 / /sys/fs/cgroup/cpu,cpuacct rw shared:13 - cgroup cgroup "
	    "rw,cpu,cpuacct\n");
	put("/proc/self/cgroup", "5:cpuset:/docker/abc\n"
	                         "4:cpu,cpuacct:/docker/abc\n"
	                         "0::/docker/abc\n");
	put("/sys/fs/cgroup/cpuset/docker/abc/cpu.cfs_quota_us", "100000\n"); /* not cpu's */
	put("/sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "250000\n");
	put("/sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000\n");
	put("/sys/fs/cgroup/cpu,cpuacct/docker/cpu.cfs_quota_us", "-1\n");
	put("/sys/fs/cgroup/cpu,cpuacct/docker/cpu.cfs_period_us", "100000\n");
	cr_assert_eq(kvr_cpu_quota_at(tree), 3);
	put("/sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "-1\n");
	cr_assert_eq(kvr_cpu_quota_at(tree), 0);
	/* cpuset's hierarchy alone (no "cpu" controller mounted): nothing to read. */
	put("/proc/self/mountinfo",
	    "30 25 0:27 / /sys/fs/cgroup/cpuset rw - cgroup cgroup rw,cpuset\n");
	cr_assert_eq(kvr_cpu_quota_at(tree), 0);
}

/* Inside a container without a cgroup namespace: the mount shows the container's own cgroup
 * (root /docker/abc) and /proc/self/cgroup the host's path. */
Test(cpu_quota, v1_container_view)
{
	put("/proc/self/mountinfo",
	    "800 790 0:28 /docker/abc /sys/fs/cgroup/cpu ro,nosuid master:13 - cgroup cgroup "
	    "rw,cpu\n");
	put("/proc/self/cgroup", "4:cpu:/docker/abc\n");
	put("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "50000\n");
	put("/sys/fs/cgroup/cpu/cpu.cfs_period_us", "100000\n");
	cr_assert_eq(kvr_cpu_quota_at(tree), 1); /* half a CPU: one shard */
	/* A path outside the mount's root (a cgroup namespace shows "/"): the mount point. */
	put("/proc/self/cgroup", "4:cpu:/\n");
	cr_assert_eq(kvr_cpu_quota_at(tree), 1);
}

Test(cpu_quota, escaped_mount_point_and_long_lines)
{
	char *big = malloc(20000);
	cr_assert_not_null(big);
	int n = snprintf(big, 20000,
	                 "40 1 0:50 / /var/lib/docker/overlay2/x/merged rw - overlay "
	                 "overlay rw,lowerdir=");
	while (n < 19000)
		n += snprintf(big + n, (size_t)(20000 - n), "/var/lib/docker/overlay2/l/ABCDEFGH:");
	snprintf(big + n, (size_t)(20000 - n),
	         ",upperdir=/u,workdir=/w\n"
	         "41 1 0:26 / /sys/fs/my\\040cgroup rw - cgroup2 cgroup2 rw\n");
	put("/proc/self/mountinfo", big);
	free(big);
	put("/proc/self/cgroup", "0::/a\n");
	put("/sys/fs/my cgroup/a/cpu.max", "300000 100000\n");
	cr_assert_eq(kvr_cpu_quota_at(tree), 3);
}

Test(cpu_quota, malformed_and_missing)
{
	cr_assert_eq(kvr_cpu_quota_at(NULL), 0);
	cr_assert_eq(kvr_cpu_quota_at(tree), 0); /* no proc files */
	cr_assert_eq(kvr_cpu_quota_at("/nonexistent/kvr"), 0);
	put("/proc/self/mountinfo", "garbage\n\n30 1 0:26 / /sys/fs/cgroup rw cgroup2\n"
	                            "- - -\n" V2_MOUNT);
	put("/proc/self/cgroup", "nonsense\n0:\n1:cpu:relative\n0::/a\n");
	put("/sys/fs/cgroup/a/cpu.max", "abc 100000\n");
	cr_assert_eq(kvr_cpu_quota_at(tree), 0);
	put("/sys/fs/cgroup/a/cpu.max", "100000 0\n");
	cr_assert_eq(kvr_cpu_quota_at(tree), 0);
	put("/sys/fs/cgroup/a/cpu.max", "-5 100000\n");
	cr_assert_eq(kvr_cpu_quota_at(tree), 0);
	put("/sys/fs/cgroup/a/cpu.max", "");
	cr_assert_eq(kvr_cpu_quota_at(tree), 0);
	put("/sys/fs/cgroup/a/cpu.max", "9223372036854775807 1\n");
	cr_assert_eq(kvr_cpu_quota_at(tree), UINT32_MAX);
	put("/sys/fs/cgroup/a/cpu.max", "1 100000\n"); /* a sliver of a CPU: one */
	cr_assert_eq(kvr_cpu_quota_at(tree), 1);
}

static uint32_t router_shards(const int *cpus, size_t n_cpus)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.cpu_list = cpus;
	c.n_cpus = n_cpus;
	struct kvr_router *r = NULL;
	cr_assert_eq(kvr_router_create(&c, &r), 0, "%s", kvr_last_error());
	struct kvr_config got;
	cr_assert_eq(kvr_router_get_config(r, &got), 0);
	kvr_router_destroy(r);
	return got.n_shards;
}

static uint32_t affinity_cpus(void)
{
	cpu_set_t set;
	cr_assert_eq(sched_getaffinity(0, sizeof(set), &set), 0);
	return (uint32_t)CPU_COUNT(&set);
}

/* The router's default: one shard per CPU listed or in the mask, no more than the quota. */
Test(cpu_quota, router_default_shards)
{
	static const int cpus[3] = {0, 0, 0};
	put("/proc/self/mountinfo", V2_MOUNT);
	put("/proc/self/cgroup", "0::/a\n");
	put("/sys/fs/cgroup/a/cpu.max", "max 100000\n");
	kvr_cpu_quota_root = tree;
	cr_assert_eq(router_shards(NULL, 0), affinity_cpus());
	cr_assert_eq(router_shards(cpus, 3), 3); /* before: 1 */
	put("/sys/fs/cgroup/a/cpu.max", "100000 100000\n");
	cr_assert_eq(router_shards(NULL, 0), 1);
	cr_assert_eq(router_shards(cpus, 3), 1);
	put("/sys/fs/cgroup/a/cpu.max", "200000 100000\n");
	cr_assert_eq(router_shards(cpus, 3), 2);
	kvr_cpu_quota_root = "";
}

/* The machine's own cgroup file system: a child in a new cgroup with a 1-CPU quota. */
static bool write_file(const char *path, const char *s)
{
	FILE *f = fopen(path, "w");
	if (!f)
		return false;
	bool ok = fputs(s, f) >= 0;
	return fclose(f) == 0 && ok;
}

Test(cpu_quota, real_cgroup)
{
	char dir[256], file[300];
	bool v2 = false;
	snprintf(dir, sizeof(dir), "/sys/fs/cgroup/cpu/kvr_cpu_quota_%d", (int)getpid());
	if (mkdir(dir, 0755) != 0) {
		/* A pure v2 host: a child of the root cgroup, where the cpu controller is on. */
		snprintf(dir, sizeof(dir), "/sys/fs/cgroup/kvr_cpu_quota_%d", (int)getpid());
		v2 = true;
		if (mkdir(dir, 0755) != 0)
			cr_skip_test("cannot create a cgroup here (%s): not root, or read-only",
			             strerror(errno));
	}
	bool ok;
	if (v2) {
		snprintf(file, sizeof(file), "%s/cpu.max", dir);
		ok = write_file(file, "100000 100000");
	} else {
		snprintf(file, sizeof(file), "%s/cpu.cfs_quota_us", dir);
		ok = write_file(file, "100000");
	}
	if (!ok) {
		rmdir(dir);
		cr_skip_test("cannot set a CPU quota on %s", dir);
	}
	pid_t pid = fork();
	cr_assert_geq(pid, 0);
	if (pid == 0) {
		char procs[300], me[32];
		snprintf(procs, sizeof(procs), "%s/cgroup.procs", dir);
		snprintf(me, sizeof(me), "%d", (int)getpid());
		if (!write_file(procs, me))
			_exit(3);
		if (kvr_cpu_quota_at("") != 1)
			_exit(4);
		struct kvr_config c;
		kvr_config_init(&c);
		struct kvr_router *r = NULL;
		if (kvr_router_create(&c, &r) != 0)
			_exit(5);
		struct kvr_config got;
		kvr_router_get_config(r, &got);
		kvr_router_destroy(r);
		_exit(got.n_shards == 1 ? 0 : 6);
	}
	int st = 0;
	cr_assert_eq(waitpid(pid, &st, 0), pid);
	rmdir(dir);
	cr_assert(WIFEXITED(st), "child died (status %d)", st);
	if (WEXITSTATUS(st) == 3)
		cr_skip_test("could not move a process into %s", dir);
	cr_assert_eq(WEXITSTATUS(st), 0,
	             "child exit %d: 4 = the quota read back was not 1, 5 = create failed, 6 = the "
	             "default was not one shard",
	             WEXITSTATUS(st));
}
