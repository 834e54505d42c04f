/*
 * sync/nats_cloexec.c - FD_CLOEXEC on nats.c's connection socket (why: sync/nats_cloexec.h).
 */
#include "sync/nats_cloexec.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>

struct want {
	struct sockaddr_storage local;
	int peer_port; /* 0: unknown (any) */
};

static int port_of(const struct sockaddr_storage *a)
{
	if (a->ss_family == AF_INET)
		return ntohs(((const struct sockaddr_in *)a)->sin_port);
	if (a->ss_family == AF_INET6)
		return ntohs(((const struct sockaddr_in6 *)a)->sin6_port);
	return -1;
}

static bool same_local(const struct sockaddr_storage *a, const struct sockaddr_storage *w)
{
	if (a->ss_family != w->ss_family || port_of(a) != port_of(w))
		return false;
	if (a->ss_family == AF_INET)
		return ((const struct sockaddr_in *)a)->sin_addr.s_addr ==
		       ((const struct sockaddr_in *)w)->sin_addr.s_addr;
	return memcmp(&((const struct sockaddr_in6 *)a)->sin6_addr,
	              &((const struct sockaddr_in6 *)w)->sin6_addr, sizeof(struct in6_addr)) == 0;
}

/* 1 if fd is the connection's socket and was marked now, else 0. */
static int mark(int fd, const struct want *w)
{
	int fl = fcntl(fd, F_GETFD);
	if (fl < 0 || (fl & FD_CLOEXEC))
		return 0;
	struct sockaddr_storage a;
	socklen_t al = sizeof(a);
	if (getsockname(fd, (struct sockaddr *)&a, &al) != 0 || !same_local(&a, &w->local))
		return 0;
	al = sizeof(a);
	if (w->peer_port &&
	    (getpeername(fd, (struct sockaddr *)&a, &al) != 0 || port_of(&a) != w->peer_port))
		return 0;
	return fcntl(fd, F_SETFD, fl | FD_CLOEXEC) == 0;
}

/* The server's port from nats.c's connected URL ("nats://host:port"), 0 if it does not say. */
static int server_port(natsConnection *nc)
{
	char url[512];
	if (natsConnection_GetConnectedUrl(nc, url, sizeof(url)) != NATS_OK)
		return 0;
	const char *c = strrchr(url, ':');
	char *end = NULL;
	long p = c ? strtol(c + 1, &end, 10) : 0;
	return end && end != c + 1 && p > 0 && p < 65536 ? (int)p : 0;
}

int kvr_nats_cloexec(natsConnection *nc)
{
	char *ip = NULL;
	int port = 0;
	struct want w;
	memset(&w, 0, sizeof(w));
	if (natsConnection_GetLocalIPAndPort(nc, &ip, &port) != NATS_OK || !ip)
		return -1;
	struct sockaddr_in *v4 = (struct sockaddr_in *)&w.local;
	struct sockaddr_in6 *v6 = (struct sockaddr_in6 *)&w.local;
	if (inet_pton(AF_INET, ip, &v4->sin_addr) == 1) {
		v4->sin_family = AF_INET;
		v4->sin_port = htons((uint16_t)port);
	} else if (inet_pton(AF_INET6, ip, &v6->sin6_addr) == 1) {
		v6->sin6_family = AF_INET6;
		v6->sin6_port = htons((uint16_t)port);
	} else {
		free(ip); /* nats.c's allocation (its malloc) */
		return -1;
	}
	free(ip);
	w.peer_port = server_port(nc);
	int n = 0;
	DIR *d = opendir("/proc/self/fd");
	if (d) {
		for (struct dirent *e; (e = readdir(d));)
			if (e->d_name[0] != '.' && atoi(e->d_name) != dirfd(d))
				n += mark(atoi(e->d_name), &w);
		closedir(d);
		return n;
	}
	/* No descriptor to list them with (at RLIMIT_NOFILE, where an attach still works:
	 * test_sync_nats fd_limit) or no /proc: every descriptor is below the soft limit. */
	struct rlimit rl;
	if (getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur > (1u << 16))
		return -1;
	for (int fd = 0; fd < (int)rl.rlim_cur; fd++)
		n += mark(fd, &w);
	return n;
}
