"""Opt-in runtime changes to loaded models (absorbed MLA decoding)."""
