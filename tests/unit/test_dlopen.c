/*
 * tests/unit/test_dlopen.c - the shared library loaded at run time, as a plugin host or a
 * foreign-function interface (Python's ctypes, an nginx or Envoy module) loads it.
 *
 * A plain program that links neither kvrouter nor jemalloc: it dlopens libkvrouter.so (argv[1]),
 * routes on a thread of its own, reads the metrics, destroys the router and dlcloses the library
 * while that thread is still alive; then the thread exits (its thread-local destructors, the
 * library's and liburcu-bp's, run after the dlclose), the process forks (the library's fork
 * handlers), and the library is opened and used a second time.
 *
 * argv[2] is the allocator the metrics must name: "libc" in a plain process, "jemalloc" when the
 * test runs with libjemalloc.so.2 preloaded (meson registers both).  Before, the dlopen itself
 * failed ("libjemalloc.so.2: cannot allocate memory in static TLS block": the library depended on
 * jemalloc, whose initial-exec thread-locals do not fit glibc's reserve for libraries loaded after
 * startup), and a library that could be opened (built without jemalloc) was unmapped by the
 * dlclose and the thread's exit crashed in its destructors.
 *
 * Exit 0 pass, 1 fail.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/common/exit_check.h"
#include "kvrouter.h"

/* The calls used, resolved from the handle (typed from the header's declarations). */
struct api {
	__typeof__(kvr_config_init) *config_init;
	__typeof__(kvr_router_create) *router_create;
	__typeof__(kvr_router_destroy) *router_destroy;
	__typeof__(kvr_rank_add) *rank_add;
	__typeof__(kvr_request_init) *request_init;
	__typeof__(kvr_route) *route;
	__typeof__(kvr_request_finish) *finish;
	__typeof__(kvr_router_sync) *router_sync;
	__typeof__(kvr_metrics_render) *metrics_render;
	__typeof__(kvr_last_error) *last_error;
};

static void *sym(void *h, const char *name)
{
	void *p = dlsym(h, name);
	CHECK(p, "dlsym %s: %s", name, dlerror());
	return p;
}

static void *open_api(const char *path, struct api *a)
{
	void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	CHECK(h, "dlopen %s: %s", path, dlerror());
	*(void **)&a->config_init = sym(h, "kvr_config_init");
	*(void **)&a->router_create = sym(h, "kvr_router_create");
	*(void **)&a->router_destroy = sym(h, "kvr_router_destroy");
	*(void **)&a->rank_add = sym(h, "kvr_rank_add");
	*(void **)&a->request_init = sym(h, "kvr_request_init");
	*(void **)&a->route = sym(h, "kvr_route");
	*(void **)&a->finish = sym(h, "kvr_request_finish");
	*(void **)&a->router_sync = sym(h, "kvr_router_sync");
	*(void **)&a->metrics_render = sym(h, "kvr_metrics_render");
	*(void **)&a->last_error = sym(h, "kvr_last_error");
	return h;
}

static struct kvr_router *make_router(const struct api *a)
{
	struct kvr_config cfg;
	a->config_init(&cfg);
	cfg.n_shards = 1;
	struct kvr_router *r = NULL;
	int rc = a->router_create(&cfg, &r);
	CHECK(rc == 0, "kvr_router_create: %d (%s)", rc, a->last_error());
	for (uint32_t w = 0; w < 4; w++) {
		struct kvr_rank_id id = {.worker_id = w, .dp_rank = 0};
		rc = a->rank_add(r, id, 1, 4096, 8192);
		CHECK(rc == 0, "kvr_rank_add: %d (%s)", rc, a->last_error());
	}
	return r;
}

/* Routes and finishes n prompts sharing a prefix. */
static void route_some(const struct api *a, struct kvr_router *r, int n)
{
	uint32_t tok[512];
	for (int i = 0; i < n; i++) {
		for (int t = 0; t < 512; t++)
			tok[t] = t < 256 ? (uint32_t)t : (uint32_t)(i * 1000 + t);
		struct kvr_request q;
		a->request_init(&q);
		q.tokens = tok;
		q.n_tokens = 512;
		struct kvr_decision d;
		int rc = a->route(r, &q, &d);
		CHECK(rc == 0, "kvr_route: %d (%s)", rc, a->last_error());
		rc = a->finish(r, d.attempt);
		CHECK(rc == 0, "kvr_request_finish: %d (%s)", rc, a->last_error());
	}
}

static struct {
	pthread_mutex_t mu;
	pthread_cond_t cv;
	int phase; /* 0 routing, 1 routed, 2 library closed: exit */
	const struct api *api;
	struct kvr_router *r;
} sh = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, NULL, NULL};

static void set_phase(int p)
{
	pthread_mutex_lock(&sh.mu);
	sh.phase = p;
	pthread_cond_broadcast(&sh.cv);
	pthread_mutex_unlock(&sh.mu);
}

static void wait_phase(int p)
{
	pthread_mutex_lock(&sh.mu);
	while (sh.phase < p)
		pthread_cond_wait(&sh.cv, &sh.mu);
	pthread_mutex_unlock(&sh.mu);
}

/* A frontend thread: routes, then outlives the library's dlclose. */
static void *frontend(void *arg)
{
	(void)arg;
	route_some(sh.api, sh.r, 200);
	set_phase(1);
	wait_phase(2);
	return NULL; /* the library's and liburcu-bp's thread-local destructors run now */
}

static void check_allocator(const struct api *a, struct kvr_router *r, const char *want)
{
	/* The text grows while the shards count (a digit more here and there): ask again. */
	size_t need = 0;
	char *buf = NULL;
	int rc;
	do {
		(void)a->metrics_render(r, NULL, 0, &need);
		CHECK(need > 0, "kvr_metrics_render gave no size");
		free(buf);
		buf = malloc(need + 4096);
		CHECK(buf, "malloc");
		rc = a->metrics_render(r, buf, need + 4096, NULL);
	} while (rc == KVR_ERANGE);
	CHECK(rc == 0, "kvr_metrics_render: %d (%s)", rc, a->last_error());
	char line[64];
	snprintf(line, sizeof(line), "kvr_allocator{name=\"%s\"} 1\n", want);
	const char *at = strstr(buf, "kvr_allocator{");
	CHECK(at && strncmp(at, line, strlen(line)) == 0, "metrics: want %.*s, got %.60s",
	      (int)strlen(line) - 1, line, at ? at : "(no kvr_allocator line)");
	free(buf);
}

int main(int argc, char **argv)
{
	CHECK(argc == 3, "usage: test_dlopen LIBKVROUTER.so libc|jemalloc");
	const char *path = argv[1], *want = argv[2];
	bool preloaded = dlopen("libjemalloc.so.2", RTLD_NOW | RTLD_NOLOAD) != NULL;
	CHECK(preloaded == (strcmp(want, "jemalloc") == 0),
	      "jemalloc %s in this process, but the test expects %s", preloaded ? "is" : "is not",
	      want);

	/* First load: a router used from another thread, destroyed, the library closed under it. */
	struct api a;
	void *h = open_api(path, &a);
	sh.api = &a;
	sh.r = make_router(&a);
	pthread_t th;
	CHECK(pthread_create(&th, NULL, frontend, NULL) == 0, "pthread_create");
	wait_phase(1);
	route_some(&a, sh.r, 50);
	CHECK(a.router_sync(sh.r, 10000) == 0, "kvr_router_sync: %s", a.last_error());
	check_allocator(&a, sh.r, want);
	a.router_destroy(sh.r);
	CHECK(dlclose(h) == 0, "dlclose: %s", dlerror());
	set_phase(2);
	CHECK(pthread_join(th, NULL) == 0, "pthread_join");

	/* The fork handlers the first router registered. */
	pid_t pid = fork();
	CHECK(pid >= 0, "fork");
	if (pid == 0)
		_exit(0);
	int st = 0;
	CHECK(waitpid(pid, &st, 0) == pid && WIFEXITED(st) && WEXITSTATUS(st) == 0,
	      "child status %d", st);

	/* Second load in the same process. */
	struct api b;
	h = open_api(path, &b);
	struct kvr_router *r = make_router(&b);
	route_some(&b, r, 100);
	check_allocator(&b, r, want);
	b.router_destroy(r);
	CHECK(dlclose(h) == 0, "dlclose: %s", dlerror());
	printf("test_dlopen: ok (allocator %s)\n", want);
	return 0;
}
