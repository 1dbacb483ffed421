"""Hand-offs to serving engines (vLLM): serve commands, offline runs and `/metrics` scraping.

Engines are optional dependencies and are imported only inside the functions that use them.
"""
