/* Configuration defaults, validation, router create/destroy, errors, clock. */
#include <criterion/criterion.h>
#include <math.h>
#include <string.h>

#include "kvrouter.h"

Test(config, defaults_documented)
{
	struct kvr_config c;
	memset(&c, 0xab, sizeof(c));
	kvr_config_init(&c);
	cr_assert_eq(c.block_size, 16);
	cr_assert_eq(c.n_shards, 0);
	cr_assert_null(c.cpu_list);
	cr_assert_eq(c.mode, KVR_MODE_APPROX_LRU);
	cr_assert_float_eq(c.overlap_credit, 1.0, 1e-12);
	cr_assert_float_eq(c.prefill_load_scale, 1.0, 1e-12);
	cr_assert_float_eq(c.temperature, 0.0, 1e-12);
	cr_assert_eq(c.ttl_ns, 120000000000ull);
	cr_assert_eq(c.lease_scan_interval_ns, 120000000000ull);
	cr_assert_float_eq(c.queue_threshold, 0.0, 1e-12);
	cr_assert_eq(c.queue_policy, KVR_QUEUE_FCFS);
	cr_assert_eq(c.queue_capacity, 4096);
	cr_assert_eq(c.max_ranks, 4096);
	cr_assert_eq(c.n_cpus, 0);
	cr_assert_eq(c.seed, 0x6b76726f75746572ull);
	cr_assert_null(c.now_ns);
	cr_assert_null(c.clock_ctx);
	cr_assert_eq(c.lane_capacity, 4095);
	cr_assert_eq(c.lane_soft_depth, 127);
	cr_assert_eq(c.maint_every_tasks, 64);
	cr_assert_eq(c.maint_every_ns, 200000);
	cr_assert_eq(c.shard_idle_spin_ns, 50000, "50 us, as documented (the runtime agrees)");
	cr_assert_eq(c.sync_booking, false);
	cr_assert_eq(c.booking_lazy_ns, 250000, "250 us, as documented");
	cr_assert_eq(c.expected_prefill_ns, 0);
	cr_assert_eq(c.events_max_blocks, 2097152, "2^21, as documented");
	cr_assert_null(c.on_admit);
	cr_assert_null(c.on_event_gap);
	cr_assert_null(c.callback_ctx);
	cr_assert_eq(kvr_config_validate(&c), 0);
	/* The router keeps them (n_shards resolved to the shards it started). */
	struct kvr_router *r;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	struct kvr_config g;
	cr_assert_eq(kvr_router_get_config(r, &g), 0);
	cr_assert_gt(g.n_shards, 0);
	cr_assert_eq(g.shard_idle_spin_ns, 50000);
	cr_assert_eq(g.lane_capacity, 4095);
	cr_assert_eq(g.lane_soft_depth, 127);
	cr_assert_eq(g.seed, c.seed);
	kvr_router_destroy(r);
	kvr_config_init(NULL); /* no-op, no crash */
}

Test(config, impossible_values_rejected)
{
	struct kvr_config c;
#define BAD(field, val, code)                                                                      \
	do {                                                                                       \
		kvr_config_init(&c);                                                               \
		c.field = val;                                                                     \
		cr_assert_eq(kvr_config_validate(&c), code, #field " = " #val);                    \
		struct kvr_router *r = (struct kvr_router *)0x1;                                   \
		cr_assert_eq(kvr_router_create(&c, &r), code);                                     \
		cr_assert_null(r);                                                                 \
	} while (0)
	BAD(block_size, 0, KVR_ERANGE);
	BAD(block_size, 65537, KVR_ERANGE);
	BAD(n_shards, 1000, KVR_ERANGE);
	BAD(n_cpus, 2, KVR_EINVAL);
	BAD(mode, (enum kvr_mode)7, KVR_EINVAL);
	BAD(overlap_credit, -1.0, KVR_EINVAL);
	BAD(prefill_load_scale, NAN, KVR_EINVAL);
	BAD(temperature, INFINITY, KVR_EINVAL);
	BAD(ttl_ns, 0, KVR_EINVAL);
	BAD(lease_scan_interval_ns, 0, KVR_EINVAL);
	BAD(queue_policy, (enum kvr_queue_policy)9, KVR_EINVAL);
	BAD(queue_capacity, 0, KVR_ERANGE);
	BAD(max_ranks, 0, KVR_ERANGE);
	BAD(events_max_blocks, 0, KVR_ERANGE);
	BAD(max_ranks, 70000, KVR_ERANGE);
	BAD(lane_capacity, 1, KVR_ERANGE);
	BAD(lane_capacity, (1u << 22) + 1, KVR_ERANGE);
	BAD(lane_soft_depth, (1u << 22) + 1, KVR_ERANGE);
	BAD(booking_lazy_ns, 1000001, KVR_ERANGE);
	BAD(maint_every_tasks, 0, KVR_EINVAL);
	BAD(maint_every_ns, 0, KVR_EINVAL);
	cr_assert_eq(kvr_config_validate(NULL), KVR_EINVAL);
}

Test(config, bad_cpu_list)
{
	struct kvr_config c;
	kvr_config_init(&c);
	int cpus[2] = {0, -3};
	c.cpu_list = cpus;
	c.n_cpus = 2;
	cr_assert_eq(kvr_config_validate(&c), KVR_ERANGE);
	cpus[1] = 4096;
	cr_assert_eq(kvr_config_validate(&c), KVR_ERANGE, "cpu ids are 0..4095");
	cpus[1] = 4095;
	cr_assert_eq(kvr_config_validate(&c), 0);
}

static uint64_t fake_now;
static uint64_t fake_clock(void *ctx)
{
	return *(uint64_t *)ctx;
}

Test(router, create_destroy_and_clock)
{
	struct kvr_router *r = NULL;
	cr_assert_eq(kvr_router_create(NULL, &r), 0);
	cr_assert_not_null(r);
	cr_assert_gt(kvr_router_now(r), 0);
	kvr_router_destroy(r);
	kvr_router_destroy(NULL);

	struct kvr_config c;
	kvr_config_init(&c);
	c.now_ns = fake_clock;
	c.clock_ctx = &fake_now;
	fake_now = 42;
	cr_assert_eq(kvr_router_create(&c, &r), 0);
	cr_assert_eq(kvr_router_now(r), 42);
	fake_now = 1000;
	cr_assert_eq(kvr_router_now(r), 1000);
	struct kvr_config got;
	cr_assert_eq(kvr_router_get_config(r, &got), 0);
	cr_assert_eq(got.block_size, 16);
	cr_assert_eq(kvr_router_get_config(r, NULL), KVR_EINVAL);
	kvr_router_destroy(r);
	cr_assert_eq(kvr_router_create(&c, NULL), KVR_EINVAL);
}

Test(errors, every_code_has_a_message)
{
	for (int code = 0; code >= -10; code--) {
		const char *m = kvr_strerror(code);
		cr_assert_not_null(m);
		cr_assert_str_neq(m, "unknown error", "code %d", code);
	}
	cr_assert_str_eq(kvr_strerror(-999), "unknown error");
	cr_assert_str_eq(kvr_strerror(5), "unknown error");
	cr_assert_str_eq(kvr_version(), KVR_VERSION_STRING);
}
