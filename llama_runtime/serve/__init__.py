"""`make serve`: the OpenAI-compatible HTTP app, its request parsing, tool calls, the worker
that owns the session, and the chat page."""
