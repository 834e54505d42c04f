/*
 * shards/cpu_quota.h - how many CPUs' worth of time the process's cgroups let it use.
 *
 * A container limited to 2 CPUs of time (Kubernetes `resources.limits.cpu: 2`, a CFS quota) on a
 * 64-CPU host still sees 64 CPUs in its affinity mask.  One shard per CPU of the mask then starts
 * 64 shard threads that share 2 CPUs of quota: the kernel throttles the whole process (its
 * frontends too) for the rest of each period once they have spent it, and bookings wait behind
 * 63 other shards' turns.  The default shard count therefore also stops at the quota (as the JVM's
 * availableProcessors and Go's GOMAXPROCS do).
 */
#ifndef KVR_SHARDS_CPU_QUOTA_H
#define KVR_SHARDS_CPU_QUOTA_H

#include <stdint.h>

/*
 * The CPU limit of the calling process's cgroups, rounded up to whole CPUs: the smallest quota /
 * period along its cgroup's path up to the hierarchy's mount (cgroup v2 `cpu.max`, v1
 * `cpu.cfs_quota_us` / `cpu.cfs_period_us`, whichever the process's cgroup has; both: the smaller).
 * 0 when no limit is set or none could be read (no cgroup file system, files missing or
 * malformed).  root prefixes every path read ("" in the library: /proc/self/mountinfo,
 * /proc/self/cgroup and the cgroup files under the mount points they name; a directory holding
 * such a tree in tests).  Context: any thread; reads a few small files, allocates nothing of the
 * library's.
 */
uint32_t kvr_cpu_quota_at(const char *root);

/* The root kvr_shards_create's default reads through: "" (the machine's), or a test's tree. */
extern const char *kvr_cpu_quota_root;

#endif
