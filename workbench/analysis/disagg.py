"""Prefill/decode disaggregation, simulated in one process: what crosses between the two instances.

The prefill instance runs the verifier's prompt forward (and, in mode "full", the draft's prompt
pass) and packs what the decode instance needs into a `Handover` of raw bytes, as a KV transport
would carry them; the decode instance builds fresh caches from those bytes and decodes on. Modes:

- "full":      the verifier's KV and the draft's KV (all but the last prompt position's rows);
- "recompute": the verifier's KV and the verifier's aux hidden states at every prompt position, from
               which the decode side re-runs the draft's prompt pass;
- "cold":      the verifier's KV only: the draft starts from the last prompt position and attends
               to nothing before it.

Every mode also carries the first token, the last position's aux states (what the draft fuses to
propose) and the sampler's generator state, so the decode side continues the same random stream.
Verification is untouched, so every mode is lossless; only acceptance and bytes differ.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from workbench.decoding.drafters import EagleDrafter
from workbench.decoding.engine import SpecDecoder, run_one
from workbench.decoding.events import GenerationResult, StepEvent
from workbench.decoding.request import _Emitter, result_of

MODES = ("full", "recompute", "cold")  # what the prefill instance hands over: the draft KV, its input, or nothing


@dataclass
class Packed:
    """A tensor as a transport carries it: its raw bytes, shape and dtype."""

    data: bytes
    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, t: torch.Tensor) -> "Packed":
        t = t.detach().cpu().contiguous()
        raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t  # numpy has no bf16: ship its bits
        return cls(raw.numpy().tobytes(), tuple(t.shape), t.dtype)

    def tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        wire = torch.int16 if self.dtype == torch.bfloat16 else self.dtype
        np_dtype = torch.empty(0, dtype=wire).numpy().dtype
        t = torch.from_numpy(np.frombuffer(self.data, dtype=np_dtype).copy()).reshape(self.shape)
        return (t.view(torch.bfloat16) if self.dtype == torch.bfloat16 else t).to(device)

    @property
    def nbytes(self) -> int:
        return len(self.data)


@dataclass
class Handover:
    """What the prefill instance sends for one request."""

    mode: str
    request: object  # the engine's checked request (prompt ids, budget, stops): metadata, not counted
    first_token: int
    first_event: StepEvent
    verifier_rows: Packed  # [layers, 1, prompt_len, row width]
    last_aux: tuple[Packed, ...]  # each aux layer's state at the last prompt position
    draft_rows: Packed | None = None  # "full": [draft layers, 1, prompt_len - 1, draft row width]
    prompt_aux: tuple[Packed, ...] = ()  # "recompute": each aux layer's states at every prompt position
    generator_state: bytes = b""
    prefill_s: float = 0.0
    bytes_by_part: dict[str, int] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(self.bytes_by_part.values())


def _check(dec: SpecDecoder, mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode = {mode!r}; expected one of {', '.join(MODES)}")
    if not isinstance(dec.proposer, EagleDrafter) or dec.fused is not None:
        raise ValueError("disaggregation needs an EAGLE draft on the unfused step (SpecDecoder(..., fused=False))")


@torch.inference_mode()
def prefill_instance(dec: SpecDecoder, prompt: str | list[int], max_new_tokens: int = 128, mode: str = "full",
                     stop: str | list[str] | None = None, heal: bool = False) -> Handover:
    """The prefill side: the prompt's forward, the first token, and the bytes the decode side needs."""
    _check(dec, mode)
    engine = dec.engine
    dec.submit(prompt, max_new_tokens, stop, heal=heal)
    row = engine.queue.popleft()  # prefilled here, decoded on the other side
    req, cache = row.req, dec.pair.verifier_cache(engine.rows_needed(row.req))
    event, out = engine._prefill(row, cache)
    T = len(req.prompt_ids)
    aux = out.aux_hidden_states  # each [1, T, H]
    h = Handover(mode, req, row.verified[-1], event, Packed.of(cache.valid()), tuple(Packed.of(a[:, -1:]) for a in aux),
                 generator_state=row.generator.get_state().numpy().tobytes(), prefill_s=event.verify_time)
    if mode == "full" and T > 1:  # the draft's prompt pass, as the engine runs it before its first chain
        draft = dec.pair.draft
        dcache = draft.new_cache(T)
        ids = torch.tensor([req.prompt_ids[1:]], device=cache.rows.device)
        draft(ids, draft.combine_hidden_states(tuple(a[:, :-1] for a in aux)), dcache)
        h.draft_rows = Packed.of(dcache.valid())
    if mode == "recompute":
        h.prompt_aux = tuple(Packed.of(a) for a in aux)
    h.bytes_by_part = {"verifier_kv": h.verifier_rows.nbytes, "last_aux": sum(p.nbytes for p in h.last_aux),
                       "draft_kv": h.draft_rows.nbytes if h.draft_rows else 0,
                       "prompt_aux": sum(p.nbytes for p in h.prompt_aux)}
    return h


@torch.inference_mode()
def decode_instance(dec: SpecDecoder, h: Handover) -> GenerationResult:
    """The decode side: caches rebuilt from `h`'s bytes into the engine's slot, then the speculative
    steps, as in one process."""
    _check(dec, h.mode)
    t0, engine, req = time.perf_counter(), dec.engine, h.request
    rid = dec.submit(req.prompt_ids, req.max_new_tokens)
    row = engine.queue.popleft()
    row.req, T = req, len(req.prompt_ids)  # as checked (and healed) on the prefill side
    row.emitter = _Emitter(dec.pair, req)
    row.emitter.add(h.first_token)
    row.verified, row.events = req.prompt_ids + [h.first_token], [h.first_event]
    row.generator.set_state(torch.from_numpy(np.frombuffer(h.generator_state, dtype=np.uint8).copy()))
    if row.emitter.finish is None:
        engine._reserve(engine.rows_needed(req))
        cache = engine.vcache.view(0)
        cache.rows[:, :, :T] = h.verifier_rows.tensor(cache.rows.device)
        cache.length = T
        device = cache.rows.device
        aux = tuple(p.tensor(device) for p in (h.prompt_aux if h.mode == "recompute" else h.last_aux))
        if h.mode == "recompute":
            engine.drafter.admit(0, row, _Prefilled(aux))
        else:  # cold (no rows), or full (no rows either for a one-token prompt)
            engine.drafter.start_at(0, row, T - 1, h.draft_rows.tensor(device) if h.draft_rows is not None else None)
            row.aux = aux
        engine.rows.append(row)
        events = [h.first_event, *run_one(engine, rid)]
    else:
        events = [h.first_event]
    return result_of(events, row.emitter, h.prefill_s + time.perf_counter() - t0, dec.k, dec.acceptance_rule)


@dataclass
class _Prefilled:
    """What `Drafter.admit` reads from a prefill's output: the aux states the draft has not seen yet."""

    aux_hidden_states: tuple[torch.Tensor, ...]
