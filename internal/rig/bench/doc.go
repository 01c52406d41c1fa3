// Package bench measures kafkapg end to end — producer → broker → processor → Postgres — against
// hand-written loops that run the same SQL on the same records in the same run, so the figures
// are ratios that survive a noisy shared machine. Run it with `make bench`. It has no code
// outside its tests.
package bench
