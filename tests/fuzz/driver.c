/* Runs a libFuzzer target over corpus files without libFuzzer, so the corpus is a regression
 * test in every build (gcc, ASan, TSan).  usage: driver FILE... */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int main(int argc, char **argv)
{
	int n = 0;
	for (int i = 1; i < argc; i++) {
		FILE *f = fopen(argv[i], "rb");
		if (!f) {
			fprintf(stderr, "driver: cannot open %s\n", argv[i]);
			return 1;
		}
		fseek(f, 0, SEEK_END);
		long len = ftell(f);
		rewind(f);
		uint8_t *buf = malloc(len > 0 ? (size_t)len : 1);
		if (!buf || fread(buf, 1, (size_t)len, f) != (size_t)len) {
			fprintf(stderr, "driver: cannot read %s\n", argv[i]);
			return 1;
		}
		fclose(f);
		LLVMFuzzerTestOneInput(buf, (size_t)len);
		free(buf);
		n++;
	}
	printf("driver: %d inputs ran\n", n);
	return 0;
}
