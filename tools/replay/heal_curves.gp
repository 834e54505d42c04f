# Healing curves (issue 15), drawn by tools/replay/heal_curves.sh: dir holds the .dat files
# (one block per policy: events, approx_lru, +feedback, +watermark; columns x, own hit %,
# MAE blocks, exact %, all-arrivals hit %, lowest and highest own hit %, seeds, kept % of the
# no-error hit rate; means over the seeds), out is the SVG to write, seeds the seeds used.
set terminal svg size 1500,1150 dynamic font 'sans,11' background rgb 'white'
set output out
set datafile separator whitespace
set grid
set multiplot layout 3,3 title "Self-healing predictions in kvr-replay: Mooncake conversation sample, 8 ranks; means over seeds ".seeds
cl = dir.'/foreign_clients.dat'; rt = dir.'/foreign_router.dat'; sf = dir.'/foreign_self.dat'
cp = dir.'/capacity.dat'
names = "events approx\\_lru approx\\_lru+feedback approx\\_lru+watermark"
# Colours: events grey, approx_lru red, +feedback orange, +watermark blue.
c(i) = i == 0 ? 0x777777 : i == 1 ? 0xd62728 : i == 2 ? 0xff9f1c : 0x1f77b4
do for [row=1:2] {
	f = row == 1 ? cl : rt
	who = row == 1 ? 'cache-unaware clients (random rank)' : 'another approx\_lru router (unseen)'
	set xlabel 'foreign traffic (share of arrivals)'
	set key bottom left box opaque font ',9'
	set ylabel "hit rate of this router's requests (%)"
	set title 'foreign traffic from '.who
	plot for [i=0:3] f index i using 1:2 with linespoints lw 2 pt 7 lc rgb c(i) title word(names, i+1), \
	     sf index 'approx_lru' using 1:2 with lines lw 2 dt 2 lc rgb 'black' title 'approx\_lru, no error (self)'
	set ylabel 'kept: % of the no-error hit rate, same requests'
	set title 'hit rate kept, '.who
	plot for [i=0:3] f index i using 1:9 with linespoints lw 2 pt 7 lc rgb c(i) title word(names, i+1), \
	     95 with lines lw 1 dt 2 lc rgb 'black' title 'goal: 95 %'
	set key top left
	set ylabel 'prediction error, MAE (blocks)'
	set title 'prediction error, '.who
	plot for [i=0:3] f index i using 1:3 with linespoints lw 2 pt 7 lc rgb c(i) title word(names, i+1)
}
set xlabel 'registered capacity (x the engine blocks)'
set key bottom center box opaque font ',9'
set ylabel 'hit rate (%)'
set title 'capacity registered wrong'
plot for [i=0:3] cp index i using 1:2 with linespoints lw 2 pt 7 lc rgb c(i) title word(names, i+1)
set ylabel 'kept: % of approx\_lru at 1x'
set title 'hit rate kept, capacity'
plot for [i=0:3] cp index i using 1:9 with linespoints lw 2 pt 7 lc rgb c(i) title word(names, i+1), \
     95 with lines lw 1 dt 2 lc rgb 'black' title 'goal: 95 %'
set key top center
set ylabel 'prediction error, MAE (blocks)'
set title 'prediction error, capacity'
plot for [i=0:3] cp index i using 1:3 with linespoints lw 2 pt 7 lc rgb c(i) title word(names, i+1)
unset multiplot
