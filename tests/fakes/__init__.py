"""Stand-ins allowed by the project: the OpenAI-compatible test upstream and a server runner."""
