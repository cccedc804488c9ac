"""The prepared GPU run (issue 40); see `__main__.py`."""
