"""server package: the OpenAI-compatible HTTP front end."""
