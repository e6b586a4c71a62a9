"""The front proxy: OpenAI surface and cache-aware routing."""
