"""The agent APIs (OpenAI Responses, Anthropic Messages), carried by the chat path: each
translates its request into a chat body, routes it through the gateway, and turns the
backend's chat answer back into its own."""
