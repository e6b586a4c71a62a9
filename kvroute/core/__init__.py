"""What every process shares: the prefix-key scheme, the Redis key names and client, the
registry, the models' states, units. Imports neither mlx (at import time) nor a server."""
