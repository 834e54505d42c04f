// The public header from C++: compiles as C++17, links the shared library only (as README's
// pkg-config line does), calls the API.  Also a C++ program's own new and delete, on two threads,
// with a router alive: the link line once put jemalloc's operator new (Debian's libjemalloc
// exports the C++ operators) ahead of libstdc++'s while the program's free stayed glibc's, and
// jemalloc's operator delete calls free, so the first std::string or std::vector freed aborted
// with "free(): invalid pointer".
#include <kvrouter.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

static int failures;
#define CHECK(cond)                                                                                \
	do {                                                                                       \
		if (!(cond)) {                                                                     \
			std::fprintf(stderr, "FAIL %s:%d: %s\n", __FILE__, __LINE__, #cond);       \
			failures++;                                                                \
		}                                                                                  \
	} while (0)

// new/delete of many sizes (jemalloc's size classes, small to huge), arrays, and malloc/free
// beside them; returns a checksum so nothing is optimised away.
static size_t churn(unsigned seed)
{
	size_t sum = 0;
	for (unsigned i = 0; i < 2000; i++) {
		size_t n = 1 + (size_t)((seed * 2654435761u + i * 40503u) %
		                        (i % 97 == 0 ? 3u << 20 : 5000u));
		std::string s(n, 'x');
		std::vector<char> v(n / 2 + 1, 'y');
		std::unique_ptr<int[]> a(new int[n / 8 + 1]());
		std::unique_ptr<std::string> p(new std::string(s.substr(0, n / 3)));
		void *m = std::malloc(n);
		CHECK(m != nullptr);
		std::memset(m, 1, n);
		std::free(m);
		sum += s.size() + v.size() + (size_t)a[0] + p->size();
	}
	return sum;
}

int main()
{
	{
		kvr_router *r0 = nullptr;
		CHECK(kvr_router_create(nullptr, &r0) == KVR_OK);
		size_t a = 0, b = 0;
		std::thread t([&a] { a = churn(1); });
		b = churn(2);
		t.join();
		CHECK(a > 0 && b > 0);
		kvr_router_destroy(r0);
	}
	std::vector<uint32_t> tok = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
	std::vector<uint64_t> local(3), seq(3);
	CHECK(kvr_hash_blocks(tok.data(), tok.size(), 4, nullptr, local.data(), seq.data()) == 3);
	CHECK(seq[2] == 12583592247330656132ull);
	size_t nb = 0;
	CHECK(kvr_hash_extend(&seq[0], tok.data() + 4, 8, 4, nullptr, nullptr, local.data(), &nb) ==
	      KVR_OK);
	CHECK(nb == 2 && local[1] == seq[2]);

	kvr_config cfg;
	kvr_config_init(&cfg);
	cfg.block_size = 0;
	kvr_router *r = nullptr;
	CHECK(kvr_router_create(&cfg, &r) == KVR_ERANGE);
	CHECK(std::strcmp(kvr_strerror(KVR_ERANGE), "value out of range") == 0);
	CHECK(std::strcmp(kvr_last_error(),
	                  "kvr_router_create: config.block_size 0 is out of range [1, 65536]") ==
	      0);
	kvr_config_init(&cfg);
	cfg.n_shards = 2;
	CHECK(kvr_router_create(&cfg, &r) == KVR_OK && r != nullptr);
	// Embed a router and route: the second request for the same prompt goes to the same rank
	// and sees its whole prefix cached.
	for (uint64_t w = 0; w < 4; w++)
		CHECK(kvr_rank_add(r, kvr_rank_id{w, 0}, 1, 10000, 8192) == KVR_OK);
	std::vector<uint32_t> prompt(1000);
	for (size_t i = 0; i < prompt.size(); i++)
		prompt[i] = static_cast<uint32_t>(i * 31);
	kvr_request req;
	kvr_request_init(&req);
	req.tokens = prompt.data();
	req.n_tokens = prompt.size();
	kvr_decision a{}, b{};
	CHECK(kvr_route(r, &req, &a) == KVR_OK && a.status == KVR_DECIDED && a.attempt != 0);
	CHECK(kvr_request_finish(r, a.attempt) == KVR_OK);
	// Bookings are posted to the shards (sync_booking off): let them land first.
	CHECK(kvr_router_sync(r, 5000) == KVR_OK);
	CHECK(kvr_route(r, &req, &b) == KVR_OK);
	CHECK(b.rank.worker_id == a.rank.worker_id && b.overlap_blocks == 62);
	CHECK(kvr_request_output(r, b.attempt, prompt.data(), 40) == KVR_OK);
	CHECK(kvr_request_output_ex(r, b.attempt, prompt.data(), 3, 0) == KVR_OK);
	CHECK(kvr_request_output_ex(r, b.attempt, prompt.data(), 1, KVR_OUTPUT_FINAL) == KVR_OK);
	CHECK(kvr_request_abort(r, b.attempt) == KVR_OK);
	CHECK(kvr_request_abort(r, b.attempt) == KVR_ESTALE);
	std::vector<char> text(1 << 16);
	size_t len = 0;
	CHECK(kvr_metrics_render(r, text.data(), text.size(), &len) == KVR_OK);
	CHECK(std::strstr(text.data(), "kvr_routes_total 2") != nullptr);
	// The KV event feed: only on an events-mode router; an endpoint nobody serves yet is fine
	// (ZeroMQ connects in the background).  KVR_ENOTSUP in a build without zmq.
	kvr_feed_config fc;
	kvr_feed_config_init(&fc);
	kvr_feed *feed = nullptr;
	int frc = kvr_feed_create(r, &fc, &feed);
	CHECK(frc == KVR_EINVAL || frc == KVR_ENOTSUP);
	kvr_router_destroy(r);
	kvr_config_init(&cfg);
	cfg.mode = KVR_MODE_EVENTS;
	cfg.n_shards = 1;
	CHECK(kvr_router_create(&cfg, &r) == KVR_OK);
	frc = kvr_feed_create(r, &fc, &feed);
	CHECK(frc == KVR_OK || frc == KVR_ENOTSUP);
	if (frc == KVR_OK) {
		kvr_feed_endpoint ep{};
		ep.endpoint = "tcp://127.0.0.1:9";
		ep.worker_id = 1;
		ep.dp_rank = KVR_FEED_DP_FROM_BATCH;
		uint32_t id = 0;
		CHECK(kvr_feed_add(feed, &ep, &id) == KVR_OK);
		kvr_feed_stats st{};
		CHECK(kvr_feed_get_stats(feed, id, &st) == KVR_OK && st.batches == 0);
		CHECK(kvr_feed_get_stats(feed, KVR_FEED_ALL, &st) == KVR_OK);
		size_t n = 1;
		CHECK(kvr_feed_other_medium_blocks(feed, id, 0, nullptr, 0, &n) == KVR_OK &&
		      n == 0);
		ep.endpoint = "bogus://x";
		CHECK(kvr_feed_add(feed, &ep, nullptr) == KVR_EINVAL);
		CHECK(kvr_feed_remove(feed, id) == KVR_OK);
		CHECK(kvr_feed_remove(feed, id) == KVR_ENOENT);
	}
	kvr_feed_destroy(feed);
	kvr_router_destroy(r);
	std::printf("cxx_api: %d failures\n", failures);
	return failures ? 1 : 0;
}
