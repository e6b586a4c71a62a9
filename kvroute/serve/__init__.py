"""`kvroute serve`: the supervisor of one machine's Redis, backends and proxy, its
models loaded on demand, and the memory accounting that decides what fits."""
