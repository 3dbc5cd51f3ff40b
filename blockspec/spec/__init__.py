"""DFlash speculative-decoding pieces: draft configuration, drafting and verification."""
