"""Speculative decoding on top of the engine: step plans, proposers (the DFlash draft, prompt lookup),
acceptance, commit, and the governor that picks each step's plan."""
