"""The prepared GPU run; see `__main__.py`."""
