"""The routes, spelled once: the servers add them, /openapi.json describes them, the
proxy counts requests by them."""

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
MODELS_PATH = "/v1/models"
EMBEDDINGS_PATH = "/v1/embeddings"  # answered, with why it is not served
RESPONSES_PATH = "/v1/responses"  # the proxy's only, as are the two below
MESSAGES_PATH = "/v1/messages"
MESSAGES_COUNT_PATH = "/v1/messages/count_tokens"
HEALTH_PATH = "/health"
# The backend's internal token count of a chat body (under /v1, so it takes the internal
# token like the rest): the proxy's Anthropic count_tokens asks it, having no tokenizer.
COUNT_TOKENS_PATH = "/v1/kvroute/count_tokens"
