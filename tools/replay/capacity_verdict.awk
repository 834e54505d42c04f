# tools/replay/capacity_verdict.awk - tools/quickstart.sh's capacity-sweep verdict line from a
# kvr-replay --sweep blocks=... CSV: approx_lru minus approx_ttl block hit rate (events beside)
# at each capacity.  Columns are found by name in the header (blocks,policy,status,...,
# hit_rate,...); a replay that failed (status "error", hit_rate empty) prints "failed", not 0.
#   usage: awk -F, -v t=LABEL -f capacity_verdict.awk capacity.csv
function cell(c, p) { return ((c, p) in hit) ? sprintf("%.1f", hit[c, p]) : "failed" }
NR == 1 {
	for (i = 1; i <= NF; i++)
		col[$i] = i
	if (!col["blocks"] || !col["policy"] || !col["status"] || !col["hit_rate"]) {
		print "capacity_verdict.awk: " FILENAME ": unexpected header: " $0 > "/dev/stderr"
		bad = 1
		exit 1
	}
	next
}
{
	c = $col["blocks"]
	p = $col["policy"]
	if (!(c in seen)) {
		seen[c] = 1
		cap[++n] = c
	}
	if ($col["status"] == "ok" && $col["hit_rate"] != "")
		hit[c, p] = 100 * $col["hit_rate"]
}
END {
	if (bad)
		exit 1
	printf "verdict [%s, capacity sweep]: block hit rate approx_lru vs approx_ttl (events):", t
	for (i = 1; i <= n; i++) {
		c = cap[i]
		a = cell(c, "approx_lru")
		b = cell(c, "approx_ttl")
		d = (a == "failed" || b == "failed") ? "n/a" : sprintf("%+.1f", hit[c, "approx_lru"] - hit[c, "approx_ttl"])
		printf "%s %s blocks %s vs %s %% (%s), LRU %s points", (i > 1 ? ";" : ""), c, a, b, cell(c, "events"), d
	}
	printf "\n"
}
