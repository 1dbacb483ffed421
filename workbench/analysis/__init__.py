"""Numbers about speculative decoding: acceptance metrics, the timing protocol and step-cost
model, KV-cache bytes.

Everything here is plain arithmetic over the engine's `StepEvent`s or over configs, so the
CLI, the apps and the notebooks report the same figures.
"""
