"""kvroute: KV-cache-aware routing for MLX servers."""
__version__ = "0.1.0"
