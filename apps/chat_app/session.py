"""The chat's state and turn logic, with no Gradio: settings, one app's pair and engine, a
conversation, one turn and its race.

`ChatApp` is everything one chat app owns (the pair, its batched engine, the controls' defaults);
`build_demo` takes one, so two apps in one process share nothing. A user's `Conversation` lives in
that user's `gr.State`; `ChatApp.run_turn` answers its last message one step at a time.
"""
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import workbench as wb
from workbench.analysis.protocol import Arm, Measurements, measure

MAX_UI_K = 8  # the slider's range; the engine itself allows up to wb.MAX_K
MAX_NEW_TOKENS = 2048  # the embedded verifier's context; a longer answer ends there (finish 'length')


# ---- settings --------------------------------------------------------------------------------


@dataclass(frozen=True)
class PairSpec:
    """Where the pair comes from; None means the embedded tiny-kimi verifier / draft."""

    verifier: str | None = None
    draft: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    weights: str = "native"  # the CPU kernels' weights: "native", "int8", "int8-b32" (wb.load_pair)


@dataclass(frozen=True)
class Settings:
    """One answer's decoding settings (build them with `make_settings`, which validates)."""

    k: int = 3  # num_speculative_tokens
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    max_new_tokens: int = 64
    seed: int = 0
    use_draft: bool = True  # False: autoregressive decoding with the verifier alone
    heal: bool = True  # token healing: a prompt that ends in "\n" or a space continues as typed
    acceptor: str = "auto"  # "auto" (greedy at T = 0, rejection sampling above), "rejection" or "block"

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


ACCEPTORS = ("auto", "rejection", "block")


def decoder(pair: wb.ModelPair, s: Settings) -> wb.SpecDecoder:
    """The speculative decoder every path of the chat uses for these settings."""
    return wb.SpecDecoder(pair, s.k, s.temperature, s.top_p, seed=s.seed,
                          acceptor=None if s.acceptor == "auto" else s.acceptor)


def _as_int(name: str, value: object, lo: int, hi: int) -> int:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value != int(value) or not lo <= value <= hi:
        raise wb.RequestError(f"{name} = {value!r}; expected an integer in [{lo}, {hi}]")
    return int(value)


def make_settings(k: int | float, temperature: float, top_p: float, max_new_tokens: int | float,
                  seed: int | float | None, use_draft: bool = True, heal: bool = True,
                  acceptor: str = "auto") -> Settings:
    """Settings from raw widget values (sliders may send 3.0 for 3); bad values raise RequestError."""
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature < 0:
        raise wb.RequestError(f"temperature = {temperature!r}; expected a finite number >= 0")
    if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise wb.RequestError(f"top_p = {top_p!r}; expected a number in (0, 1]")
    if acceptor not in ACCEPTORS:
        raise wb.RequestError(f"acceptor = {acceptor!r}; expected one of {', '.join(ACCEPTORS)}")
    return Settings(_as_int("num_speculative_tokens", k, 1, MAX_UI_K), float(temperature), float(top_p),
                    _as_int("max_new_tokens", max_new_tokens, 1, MAX_NEW_TOKENS),
                    _as_int("seed", seed, 0, 2**63 - 1), bool(use_draft), bool(heal), acceptor)


# ---- a conversation --------------------------------------------------------------------------


@dataclass
class Answer:
    """One reply: its steps, and in race mode the autoregressive baseline on the same prompt."""

    prompt: str
    settings: Settings
    events: list[wb.StepEvent] = field(default_factory=list)
    baseline: list[wb.StepEvent] | None = None
    race: Measurements | None = None  # race mode: both ways timed back to back
    rule: str = "none (autoregressive)"  # the acceptance rule, as SpecDecoder names it
    phase: str = "speculative"  # "speculative" | "autoregressive" | "baseline" | "done"

    @property
    def text(self) -> str:
        return "".join(t for e in self.events for t in e.emitted_text)

    @property
    def baseline_text(self) -> str | None:
        return None if self.baseline is None else "".join(t for e in self.baseline for t in e.emitted_text)


@dataclass
class Conversation:
    """Per-user state: chat history as {"role", "content"} dicts and every answer's steps."""

    history: list[dict] = field(default_factory=list)
    answers: list[Answer] = field(default_factory=list)

    def spec_events(self) -> list[wb.StepEvent]:
        return [e for a in self.answers if a.settings.use_draft for e in a.events]

    def autoregressive_events(self) -> list[wb.StepEvent]:
        return [e for a in self.answers for e in (a.baseline or ([] if a.settings.use_draft else a.events))]


# ---- one app: its pair, its engine, its turns ------------------------------------------------


class ChatApp:
    """What one chat app owns: its pair (loaded on first use, then shared read-only by every user of
    this app: the engine owns every KV cache, one slot per request, so users never write into one
    another's rows), the batched engine that serves it with `max_concurrency` rows, and the
    controls' `defaults`. Pass `pair` to serve one already loaded (then `spec` is not read)."""

    def __init__(self, spec: PairSpec = PairSpec(), defaults: Settings = Settings(), max_concurrency: int = 4,
                 pair: wb.ModelPair | None = None) -> None:
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency = {max_concurrency}; expected >= 1")
        self.spec, self.defaults, self.max_concurrency = spec, defaults, max_concurrency
        self._pair, self._server = pair, None
        self._lock = threading.Lock()  # users' handler threads ask for the pair and the engine at once

    def pair(self) -> wb.ModelPair:
        with self._lock:
            if self._pair is None:
                s = self.spec
                self._pair = wb.load_pair(s.verifier, s.draft, device=s.device, dtype=s.dtype, weights=s.weights)
            return self._pair

    def server(self) -> wb.BatchServer:
        """The app's one batched engine (started on first use): every answer and API call is a row of it."""
        pair = self.pair()
        with self._lock:
            if self._server is None:
                self._server = wb.BatchServer(pair, MAX_UI_K, self.max_concurrency)
            return self._server

    def close(self) -> None:
        """Stop the engine's thread (the next answer starts a new one)."""
        with self._lock:
            server, self._server = self._server, None
        if server is not None:
            server.close()

    def submit(self, prompt: str, s: Settings) -> wb.Ticket:
        """One answer as a row of the batched engine: k proposals a step, or none (k = 0: plain
        decoding) without the draft. Bad settings raise here, before anything runs."""
        return self.server().submit(prompt, max_new_tokens=s.max_new_tokens, k=s.k if s.use_draft else 0,
                                    temperature=s.temperature, top_p=s.top_p, seed=s.seed, heal=s.heal,
                                    acceptor=None if s.acceptor == "auto" else s.acceptor)

    def run_turn(self, conv: Conversation, s: Settings, race: bool = False) -> Iterator[Answer]:
        """Answer the last user message; yield the growing answer after every step (and each phase).

        Errors before the first step (bad prompt, too long for the context) leave `conv` unchanged.
        """
        pair = self.pair()
        prompt = pair.tokenizer.format_prompt(conv.history)
        answer = Answer(prompt, s, phase="speculative" if s.use_draft else "autoregressive")
        ticket = self.submit(prompt, s)
        answer.rule = ticket.rule
        for ev in ticket.events():
            if not answer.events:
                conv.answers.append(answer)
                conv.history.append({"role": "assistant", "content": ""})
            answer.events.append(ev)
            conv.history[-1]["content"] = answer.text
            yield answer
        if race and s.use_draft:
            answer.phase = "baseline"
            yield answer
            answer.race = race_arms(pair, prompt, s)
            answer.baseline = answer.race.results["autoregressive"][0][0].events
        answer.phase = "done"
        yield answer

    def api_result(self, prompt: str, s: Settings) -> wb.GenerationResult:
        """The API endpoint's generation: the same prompt formatting and engine as the chat."""
        text = self.pair().tokenizer.format_prompt([{"role": "user", "content": prompt}])
        return self.submit(text, s).result()


def _autoregressive(pair: wb.ModelPair, prompt: str, s: Settings) -> wb.GenerationResult:
    return wb.generate_autoregressive(pair, prompt, s.max_new_tokens, s.temperature, s.top_p, seed=s.seed,
                                      heal=s.heal)


def race_arms(pair: wb.ModelPair, prompt: str, s: Settings) -> Measurements:
    """Both ways on this prompt, timed as the sweep times them (the pair is warm from the answer)."""
    dec = decoder(pair, s)
    arms = [Arm("autoregressive", 0, lambda p: _autoregressive(pair, p, s)),
            Arm("speculative", s.k, lambda p: dec.generate(p, s.max_new_tokens, heal=s.heal))]
    return measure(arms, [prompt], repeats=1, warmup=False)
