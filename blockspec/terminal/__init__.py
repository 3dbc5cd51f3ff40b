"""The terminal: `blockspec generate` (one streamed answer) and `blockspec chat` (a conversation)."""
