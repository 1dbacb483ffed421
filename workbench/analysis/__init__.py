"""Numbers about speculative decoding: acceptance metrics, the goodput model, KV-cache bytes.

Everything here is plain arithmetic over the engine's `StepEvent`s or over configs, so the
CLI, the apps and the notebooks report the same figures.
"""
