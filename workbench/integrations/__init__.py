"""Hand-offs to serving engines (vLLM, SGLang): serve commands, offline runs, `/metrics` scraping,
and what each engine reads of a draft's config (`engines`).

Engines are optional dependencies and are imported only inside the functions that use them.
"""
