// The chunks of a reroute's per-chunk occurrence counts (counts[chunk][E], chunk = flat id
// index / CHUNK): written by reroute_count (reroute.cu) or, for the ids an update counts,
// by gather_loads (balancer.cu); read by reroute_assign.
#define CHUNK 1024
