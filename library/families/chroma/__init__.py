"""Chroma: FLUX.1-schnell's transformer with its modulation replaced by one small approximator; T5 only."""
