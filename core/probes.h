/*
 * core/probes.h - USDT probes (provider "kvrouter") for perf, bpftrace and SystemTap.
 *
 * A probe compiles to one nop and a note in .note.stapsdt; it costs nothing until a tracer
 * attaches.  List them with `perf list sdt_kvrouter:*` after `perf buildid-cache --add
 * libkvrouter.so` (see README).  Without <sys/sdt.h> (meson -Dusdt=disabled) they vanish.
 *
 *   route_begin(request_id, n_blocks)             route_end(request_id, rank_slot, overlap, rc)
 *   match(n_blocks, n_ranks_matched, best_score)  admit(rank_slot, attempt, stored, evicted)
 *   evict(rank_slot, n_hashes)                    lease_expire(rank_slot, attempt)
 */
#ifndef KVR_CORE_PROBES_H
#define KVR_CORE_PROBES_H

#ifdef KVR_HAVE_SDT
#include <sys/sdt.h>
#define KVR_PROBE2(name, a, b)       STAP_PROBE2(kvrouter, name, a, b)
#define KVR_PROBE3(name, a, b, c)    STAP_PROBE3(kvrouter, name, a, b, c)
#define KVR_PROBE4(name, a, b, c, d) STAP_PROBE4(kvrouter, name, a, b, c, d)
#else
#define KVR_PROBE2(name, a, b)       ((void)(a), (void)(b))
#define KVR_PROBE3(name, a, b, c)    ((void)(a), (void)(b), (void)(c))
#define KVR_PROBE4(name, a, b, c, d) ((void)(a), (void)(b), (void)(c), (void)(d))
#endif

#endif
