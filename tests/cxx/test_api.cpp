// The public header from C++: compiles as C++17, links the shared library only, calls the API.
#include <kvrouter.h>

#include <cstdio>
#include <cstring>
#include <vector>

static int failures;
#define CHECK(cond)                                                                                \
	do {                                                                                       \
		if (!(cond)) {                                                                     \
			std::fprintf(stderr, "FAIL %s:%d: %s\n", __FILE__, __LINE__, #cond);       \
			failures++;                                                                \
		}                                                                                  \
	} while (0)

int main()
{
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
	kvr_config_init(&cfg);
	CHECK(kvr_router_create(&cfg, &r) == KVR_OK && r != nullptr);
	kvr_router_destroy(r);
	std::printf("cxx_api: %d failures\n", failures);
	return failures ? 1 : 0;
}
