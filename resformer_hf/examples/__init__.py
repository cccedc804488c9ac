"""Runnable examples (`python -m resformer_hf.examples.<name>`), shipped with the package so they match its API."""
