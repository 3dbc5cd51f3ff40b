"""OpenAI-compatible serving: `create_app(llm)` builds the FastAPI app; `blockspec serve` runs it."""
