"""The MLX worker process: HTTP surface, engine thread, prompt-cache store."""
