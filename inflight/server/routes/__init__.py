"""The server's routes, one router per API: OpenAI, Anthropic, and operations."""
