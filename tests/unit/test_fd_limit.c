/*
 * tests/unit/test_fd_limit.c - a KV event feed created in a process at its file-descriptor limit
 * (RLIMIT_NOFILE, a busy server's EMFILE): an error, never an abort.
 *
 * In a forked child per case, with an events-mode router already running, the limit is set to
 * leave `spare` descriptor numbers free (spare = 0..24), then the
 * child creates a feed, adds an endpoint, removes it and destroys everything.  Each step may fail
 * with a code and a detail; the child must exit normally.
 *
 * Before: ZeroMQ starts its I/O thread at the feed's first socket, and its poller calls abort()
 * when epoll_create1 fails ("Too many open files (src/epoll.cpp:65)"): with 1-3 spare
 * descriptors kvr_feed_create killed the process (SIGABRT).  Now kvr_feed_create first makes
 * sure the descriptors ZeroMQ's start takes are there (sync/feed.c, spare_fds) and returns
 * KVR_ENOMEM with a detail naming the limit when they are not.
 *
 * Exit 0 pass, 1 fail.
 */
#include <dirent.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "tests/common/exit_check.h"

/* The smallest limit that leaves exactly `spare` descriptor numbers free below it (a new
 * descriptor takes the lowest free number; those open above the limit stay usable). */
static int limit_for(int spare)
{
	static char open_fd[4096];
	memset(open_fd, 0, sizeof(open_fd));
	DIR *d = opendir("/proc/self/fd");
	CHECK(d, "opendir /proc/self/fd: %s", strerror(errno));
	for (struct dirent *e; (e = readdir(d));) {
		int fd = atoi(e->d_name);
		if (e->d_name[0] != '.' && fd != dirfd(d) && fd < (int)sizeof(open_fd))
			open_fd[fd] = 1;
	}
	closedir(d);
	int n = 0;
	while (n < (int)sizeof(open_fd) && (open_fd[n] || spare-- > 0))
		n++;
	return n;
}

static int run_case(void *arg)
{
	int spare = (int)(intptr_t)arg;
	struct kvr_config c;
	kvr_config_init(&c);
	c.mode = KVR_MODE_EVENTS;
	c.n_shards = 1;
	struct kvr_router *r = NULL;
	CHECK(kvr_router_create(&c, &r) == 0, "kvr_router_create: %s", kvr_last_error());
	CHECK(kvr_rank_add(r, (struct kvr_rank_id){0, 0}, 1, KVR_CAPACITY_NONE, 0) == 0,
	      "kvr_rank_add: %s", kvr_last_error());
	struct rlimit lim = {.rlim_cur = (rlim_t)limit_for(spare)};
	struct rlimit old;
	CHECK(getrlimit(RLIMIT_NOFILE, &old) == 0, "getrlimit");
	lim.rlim_max = old.rlim_max;
	CHECK(setrlimit(RLIMIT_NOFILE, &lim) == 0, "setrlimit: %s", strerror(errno));
	struct kvr_feed *f = NULL;
	int rc = kvr_feed_create(r, NULL, &f);
	if (rc == 0) {
		struct kvr_feed_endpoint ep = {.endpoint = "tcp://127.0.0.1:1"};
		uint32_t id = 0;
		int arc = kvr_feed_add(f, &ep, &id);
		/* Not KVR_EINVAL: the address is good (it was reported as refused). */
		CHECK(arc == 0 || arc == KVR_ENOMEM, "kvr_feed_add: %d (%s)", arc,
		      kvr_last_error());
		CHECK(arc == 0 || strstr(kvr_last_error(), "RLIMIT_NOFILE"),
		      "kvr_feed_add's detail: %s", kvr_last_error());
		if (arc != 0)
			printf("spare %2d: kvr_feed_add %s\n", spare, kvr_last_error());
		if (arc == 0)
			CHECK(kvr_feed_remove(f, id) == 0, "kvr_feed_remove: %s", kvr_last_error());
		kvr_feed_destroy(f);
	} else {
		CHECK(rc == KVR_ENOMEM && f == NULL, "kvr_feed_create: %d (%s)", rc,
		      kvr_last_error());
		CHECK(strstr(kvr_last_error(), "descriptor") != NULL ||
		          strstr(kvr_last_error(), "ZeroMQ") != NULL,
		      "kvr_feed_create's detail: %s", kvr_last_error());
	}
	CHECK(setrlimit(RLIMIT_NOFILE, &old) == 0, "setrlimit back");
	kvr_router_destroy(r);
	printf("spare %2d: kvr_feed_create %s\n", spare, rc == 0 ? "ok" : kvr_last_error());
	fflush(stdout);
	return 0;
}

int main(void)
{
	int bad = 0;
	for (int spare = 0; spare <= 24; spare++) {
		int st = kvr_test_run_child(run_case, (void *)(intptr_t)spare);
		if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
			fprintf(stderr, "spare %d: child %s %d\n", spare,
			        WIFSIGNALED(st) ? "killed by signal" : "exited",
			        WIFSIGNALED(st) ? WTERMSIG(st) : WEXITSTATUS(st));
			bad++;
		}
	}
	printf("fd_limit: %d of 25 cases failed\n", bad);
	return bad ? 1 : 0;
}
