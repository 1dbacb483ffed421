"""workbench: EAGLE-3 speculative decoding with an MLA draft, made visible.

    import workbench as wb
    pair = wb.load_pair()                                   # the embedded tiny-kimi pair
    dec = wb.SpecDecoder(pair, num_speculative_tokens=3)
    for ev in dec.stream("def fib(n):", max_new_tokens=64): ...
    wb.BatchDecoder(pair, 3, max_batch_size=8).generate_many(prompts)   # many requests at once
"""
from workbench.analysis.degeneracy import accept_split, detect_loop
from workbench.cache import ContextLengthError, KVCache
from workbench.checkpoint import CheckpointError
from workbench.config import ConfigError, DraftConfig, VerifierConfig
from workbench.analysis.costmodel import StepCosts
from workbench.decoding.adaptive import Compose, ConfidenceStop, GoodputEMA, ScheduleK, StaticK
from workbench.decoding.batch import BatchDecoder
from workbench.decoding.engine import MAX_K, RequestError, SpecDecoder, generate_autoregressive
from workbench.decoding.events import GenerationResult, GenerationStats, StepEvent
from workbench.decoding.drafters import Drafter, EagleDrafter, NgramDrafter, Proposal
from workbench.decoding.serving import BatchServer, Ticket
from workbench.decoding.stats import compute_stats
from workbench.decoding.sampling import (GreedyAcceptor, RejectionAcceptor, SamplingError, SamplingParams,
                                         probs_from_logits)
from workbench.models import Eagle3Draft, Verifier, VerifierOutput
from workbench.pair import ModelPair, PairingError, check_pairing, load_draft, load_pair, load_verifier, save_model

__all__ = [
    "BatchDecoder", "BatchServer", "Compose", "ConfidenceStop", "GoodputEMA", "ScheduleK", "StaticK", "StepCosts",
    "Ticket", "CheckpointError", "ConfigError", "ContextLengthError", "Drafter", "DraftConfig", "Eagle3Draft", "EagleDrafter",
    "GenerationResult", "GenerationStats", "GreedyAcceptor", "KVCache", "MAX_K", "ModelPair", "NgramDrafter",
    "PairingError", "Proposal", "RejectionAcceptor", "RequestError", "SamplingError", "SamplingParams",
    "SpecDecoder", "StepEvent", "Verifier", "VerifierConfig", "VerifierOutput", "accept_split", "check_pairing",
    "compute_stats", "detect_loop",
    "generate_autoregressive", "load_draft", "load_pair", "load_verifier", "probs_from_logits", "save_model",
]
