/*
 * tests/common/nats_server.h - a throwaway nats-server for the replica sync tests and benchmarks
 * (issue 14): started on a free 127.0.0.1 port, killed with its parent (PR_SET_PDEATHSIG), so a
 * crashed or killed run leaves no server behind.  One server per process.
 */
#ifndef KVR_TESTS_COMMON_NATS_SERVER_H
#define KVR_TESTS_COMMON_NATS_SERVER_H

#include <stdbool.h>

/* Whether a nats-server binary is on PATH (tests exit 77 without one).  Context: any thread. */
bool kvr_test_nats_installed(void);

/* Picks a free loopback port (first call) and starts nats-server on it; waits until it accepts
 * connections (up to 6 s).  A later call after kvr_test_nats_stop restarts it on the same port.
 * Returns 0 or -1.  Context: the main thread, before the NATS library starts threads that must
 * not be forked. */
int kvr_test_nats_start(void);

/* The next kvr_test_nats_start's server reads this configuration file (users, permissions;
 * NULL: none, the default); its address and port stay the helper's.  The path must outlive
 * that start.  Context: the main thread. */
void kvr_test_nats_conf(const char *path);

/* A free loopback TCP port (for a second server of a test's own), or -1. */
int kvr_test_free_port(void);

/* Kills the server (SIGKILL) and reaps it.  No-op when none runs.  Context: the main thread. */
void kvr_test_nats_stop(void);

/* "nats://127.0.0.1:PORT" of the server (valid after the first start). */
const char *kvr_test_nats_url(void);

#endif
