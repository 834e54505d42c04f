/*
 * sync/nats_cloexec.h - close-on-exec for nats.c's connection socket.
 *
 * nats.c (libnats 3.x) opens its sockets without FD_CLOEXEC and offers no hook to open them
 * otherwise (only a whole external event loop sees the descriptor).  A host that runs a program
 * (system, posix_spawn, fork + exec) while a replica is attached handed it the replica's server
 * connection: after the host died the program kept the connection open, with the replica's
 * snapshot subscription, and the server routed snapshot requests to it until its pings timed
 * out (minutes), so a replica attached meanwhile waited its whole snapshot_timeout_ms
 * (tests/sync/test_sync_nats.c test_spawn).  The socket is found by its addresses and marked
 * once nats.c has connected; a program spawned by another thread during nats.c's connect
 * itself can still inherit it.
 */
#ifndef KVR_SYNC_NATS_CLOEXEC_H
#define KVR_SYNC_NATS_CLOEXEC_H

#include <nats/nats.h>

/* Sets FD_CLOEXEC on the descriptor of nc's current server connection: the TCP socket whose
 * local address is nc's and whose peer port is the connected server's.  Returns how many
 * descriptors it marked (0: none lacked the flag), or -1 when it could not look (nc not
 * connected, no descriptor left to list /proc/self/fd with and a limit too high to walk).
 * Context: any thread; nc connected (right after the connect, in the reconnected callback). */
int kvr_nats_cloexec(natsConnection *nc);

#endif
