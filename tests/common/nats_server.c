/*
 * tests/common/nats_server.c - see nats_server.h.  Shared by tests/sync/test_sync_nats.c and
 * perf/bench_sync.c.
 */
#include "nats_server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static pid_t server_pid;
static int port = -1;
static char url[64];
static const char *conf;

void kvr_test_nats_conf(const char *path)
{
	conf = path;
}

int kvr_test_free_port(void)
{
	int fd = socket(AF_INET, SOCK_STREAM, 0);
	struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
	socklen_t l = sizeof(a);
	int p = -1;
	if (fd >= 0 && !bind(fd, (struct sockaddr *)&a, sizeof(a)) &&
	    !getsockname(fd, (struct sockaddr *)&a, &l))
		p = ntohs(a.sin_port);
	if (fd >= 0)
		close(fd);
	return p;
}

static bool server_up(void)
{
	int fd = socket(AF_INET, SOCK_STREAM, 0);
	struct sockaddr_in a = {.sin_family = AF_INET,
	                        .sin_port = htons((uint16_t)port),
	                        .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
	bool ok = fd >= 0 && connect(fd, (struct sockaddr *)&a, sizeof(a)) == 0;
	if (fd >= 0)
		close(fd);
	return ok;
}

bool kvr_test_nats_installed(void)
{
	return system("command -v nats-server >/dev/null 2>&1") == 0;
}

int kvr_test_nats_start(void)
{
	if (port < 0) {
		port = kvr_test_free_port();
		if (port < 0)
			return -1;
		snprintf(url, sizeof(url), "nats://127.0.0.1:%d", port);
	}
	char ps[16];
	snprintf(ps, sizeof(ps), "%d", port);
	server_pid = fork();
	if (server_pid < 0)
		return -1;
	if (server_pid == 0) {
		prctl(PR_SET_PDEATHSIG, SIGKILL); /* the server goes with us, even on a crash */
		/* KVR_TEST_NATS_LOG=path: the server's output goes there (e.g. with
		 * GODEBUG=gctrace=1, when its garbage collector is suspected of a latency tail). */
		const char *log = getenv("KVR_TEST_NATS_LOG");
		int dn = log && *log ? open(log, O_WRONLY | O_CREAT | O_APPEND, 0644) : -1;
		if (dn < 0)
			dn = open("/dev/null", O_WRONLY);
		dup2(dn, 1);
		dup2(dn, 2);
		if (conf) /* -p after -c: the port on the command line wins */
			execlp("nats-server", "nats-server", "-c", conf, "-a", "127.0.0.1", "-p",
			       ps, (char *)NULL);
		else
			execlp("nats-server", "nats-server", "-a", "127.0.0.1", "-p", ps,
			       (char *)NULL);
		_exit(127);
	}
	for (int i = 0; i < 300; i++) {
		if (server_up())
			return 0;
		struct timespec ts = {0, 20000000L};
		nanosleep(&ts, NULL);
	}
	kvr_test_nats_stop();
	return -1;
}

void kvr_test_nats_stop(void)
{
	if (server_pid > 0) {
		kill(server_pid, SIGKILL);
		waitpid(server_pid, NULL, 0);
		server_pid = 0;
	}
}

const char *kvr_test_nats_url(void)
{
	return url;
}
