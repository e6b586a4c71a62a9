"""What counts as a cached request in latency figures (TTFT cached vs cold).

Every chat prompt shares its template's opening tokens with earlier ones, so
"any cached token" would call nearly every request cached. A request counts as
cached when at least half of its prompt came from the prompt cache.
"""

CACHED_FRACTION = 0.5


def is_cache_hit(cached_tokens: int, prompt_tokens: int) -> bool:
    return prompt_tokens > 0 and cached_tokens >= CACHED_FRACTION * prompt_tokens
