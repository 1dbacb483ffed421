"""What vLLM and SGLang each make of an EAGLE-3 draft's config.json: which verifier hidden states
they capture and fuse, and which EAGLE-3.1 flags they apply. Restated from their source (no engine
is imported); every id here is in vLLM's capture-before convention: id k = the residual stream
entering verifier layer k (= the output of layer k - 1).

vLLM (`get_eagle3_aux_layers_from_config`, `deepseek_eagle3.py` as of late 2026):
- the ids are a top-level, non-empty `eagle_aux_hidden_state_layer_ids`, else the verifier's
  default (2, L // 2, L - 3); `eagle_config` is never read;
- fc is sized for 3 states; `fc_norm` / `use_aux_norm` and `norm_output` are not read: the
  `fc_norm.{i}.weight` tensors are skipped in silence and the pre-norm state is fed back.

SGLang (`kimi_k25_eagle3.py`, the targets' `set_eagle3_layers_to_capture`):
- the model runner reads only `eagle_config.eagle_aux_hidden_state_layer_ids`, as "output of
  layer i", and captures i + 1; without them, the target's default (2, L // 2, L - 3), no offset;
- since sgl-project/sglang#25454 (2026-05) DeepSeek-V2/V3 targets add the 1 only when the first
  id is 1, taking other lists as capture-before ("sglang#25454" below); an export whose nested
  ids start at 1 reads the same under both;
- fc is sized for as many states as eagle_config lists (else the top-level list, else 3);
  `fc_norm` (or `use_aux_norm`) and `norm_output` are applied; vLLM's `norm_before_residual` is not.

`engine_readings(config, L)` gives each engine's `Reading`; `fused_states` the layer ids alone;
`problems` what goes wrong where, which the loader logs and the doctor's "engine readings" check shows.
"""
from __future__ import annotations

from dataclasses import dataclass, field

AUX_IDS_KEY = "eagle_aux_hidden_state_layer_ids"


@dataclass(frozen=True)
class Reading:
    """One engine's reading of a draft config against an L-layer verifier."""

    engine: str
    ids: tuple[int, ...]  # capture-before ids the verifier captures (may be out of range: see problems)
    source: str  # where they came from: "top-level" | "eagle_config +1" | "eagle_config as written" | "default"
    fc_states: int  # how many aux states the engine sizes fc for
    fc_norm: bool  # whether it applies the per-state norms before fc
    norm_output: bool  # whether it feeds back the post-norm state
    problems: tuple[str, ...] = field(default=())

    def describe(self) -> str:
        outputs = ", ".join(str(i - 1) for i in self.ids)
        flags = [f for f, on in (("fc_norm", self.fc_norm), ("norm_output", self.norm_output)) if on]
        return (f"{self.engine}: fuses the states entering layers {list(self.ids)} (outputs of layers [{outputs}]; "
                f"{self.source}){'; ' + ', '.join(flags) if flags else ''}")


def _ids(value) -> tuple[int, ...] | None:
    """A list of int layer ids, or None for absent / null / [] / anything else an engine would skip."""
    if isinstance(value, (list, tuple)) and value and all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        return tuple(value)
    return None


def default_ids(num_layers: int) -> tuple[int, int, int]:
    """The verifier's default in both engines, unclamped as they compute it."""
    return 2, num_layers // 2, num_layers - 3


def _range_problems(engine: str, ids: tuple[int, ...], num_layers: int, what: str) -> list[str]:
    bad = [i for i in ids if not 0 <= i < num_layers]
    if not bad:
        return []
    return [f"{engine} captures {list(ids)} from {what}: {bad} outside the verifier's layers [0, {num_layers - 1}], "
            f"so it collects fewer than {len(ids)} states and fc fails or fuses the wrong ones"]


def _flags(config: dict) -> tuple[bool, bool]:
    return bool(config.get("fc_norm") or config.get("use_aux_norm")), bool(config.get("norm_output"))


def vllm_reading(config: dict, num_layers: int) -> Reading:
    top = _ids(config.get(AUX_IDS_KEY))
    ids, source = (top, "top-level") if top is not None else (default_ids(num_layers), "default")
    problems = _range_problems("vllm", ids, num_layers, source)
    if len(ids) != 3:
        problems.append(f"vllm sizes fc for 3 states; the top-level list names {len(ids)}")
    fc_norm, norm_output = _flags(config)
    if fc_norm:
        problems.append("vllm's Eagle3DeepseekV2ForCausalLM has no fc_norm: it skips fc_norm.{i}.weight in silence "
                        "and fuses the states un-normed")
    if norm_output:
        problems.append("vllm does not read norm_output: it feeds back the pre-norm state")
    return Reading("vllm", ids, source, 3, False, False, tuple(problems))


def sglang_reading(config: dict, num_layers: int, since_25454: bool = False) -> Reading:
    """SGLang's reading; `since_25454`: the rule that adds 1 only when the first nested id is 1."""
    engine = "sglang#25454" if since_25454 else "sglang"
    eagle = config.get("eagle_config") if isinstance(config.get("eagle_config"), dict) else {}
    nested, top = _ids(eagle.get(AUX_IDS_KEY)), _ids(config.get(AUX_IDS_KEY))
    if nested is None:
        ids, source = default_ids(num_layers), "default"
    else:
        shift = 0 if since_25454 and nested[0] != 1 else 1
        ids, source = tuple(i + shift for i in nested), "eagle_config" + (" +1" if shift else " as written")
    fc_states = len(nested or top or (0, 0, 0))
    problems = _range_problems(engine, ids, num_layers, source)
    if fc_states != len(ids):
        problems.append(f"{engine} sizes fc for {fc_states} states but captures {len(ids)}")
    fc_norm, norm_output = _flags(config)
    if config.get("norm_before_residual"):
        problems.append(f"{engine}'s MLA draft layer does not read norm_before_residual: its residual is the "
                        f"un-normed state")
    return Reading(engine, ids, source, fc_states, fc_norm, norm_output, tuple(problems))


def engine_readings(config: dict, num_layers: int) -> dict[str, Reading]:
    """vLLM's and SGLang's readings of a draft config.json (a dict) for an L-layer verifier, as
    {"vllm", "sglang"} and, only where it captures other layers than the +1 rule (SGLang before
    #25454, and after it for lists starting at 1), "sglang#25454"."""
    if not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers = {num_layers!r}; expected the verifier's num_hidden_layers (>= 1)")
    out = {"vllm": vllm_reading(config, num_layers), "sglang": sglang_reading(config, num_layers)}
    newer = sglang_reading(config, num_layers, since_25454=True)
    if newer.ids != out["sglang"].ids:
        out["sglang#25454"] = newer
    return out


def fused_states(config: dict, num_layers: int) -> dict[str, tuple[int, ...]]:
    """engine -> the capture-before layer ids it fuses."""
    return {name: r.ids for name, r in engine_readings(config, num_layers).items()}


def config_view(draft_config) -> dict:
    """The keys of a loaded `DraftConfig` that the engines read, as its config.json had them."""
    view: dict = {"eagle_config": {}}
    if draft_config.aux_ids_source == "top-level":
        view[AUX_IDS_KEY] = list(draft_config.aux_layer_ids)
    nested = draft_config.eagle_config_aux_ids
    if nested is None and draft_config.aux_ids_source == "eagle_config":
        nested = draft_config.aux_layer_ids  # read with no verifier depth known: the nested ids were taken
    if nested is not None:
        view["eagle_config"][AUX_IDS_KEY] = list(nested)
    view["fc_norm"], view["norm_output"] = draft_config.fc_norm, draft_config.norm_output
    view["norm_before_residual"] = draft_config.norm_before_residual
    return view


def disagreements(readings: dict[str, Reading], trained: tuple[int, ...] | None = None,
                  fc_norm: bool = False, norm_output: bool = False) -> list[str]:
    """Where engines fuse other states than each other (or than `trained`, the ids the draft was
    trained on), or drop EAGLE-3.1 flags the draft was trained with: one line each."""
    lines = []
    base = trained if trained is not None else readings["vllm"].ids
    for r in readings.values():
        if r.ids == base:
            pass
        elif trained is not None:
            lines.append(f"{r.engine} fuses the states entering layers {list(r.ids)} ({r.source}), the draft was "
                         f"trained on {list(base)}: under {r.engine} it runs on other hidden states")
        else:
            lines.append(f"{r.engine} fuses the states entering layers {list(r.ids)} ({r.source}), vllm "
                         f"{list(base)}: the two engines run the draft on different hidden states")
        if fc_norm and not r.fc_norm:
            lines.append(f"{r.engine} does not apply fc_norm: the draft was trained with it")
        if norm_output and not r.norm_output:
            lines.append(f"{r.engine} feeds back the pre-norm state: the draft was trained with norm_output")
    return lines


def problems(readings: dict[str, Reading], fc_norm: bool = False, norm_output: bool = False) -> list[str]:
    """Every reading's own problems, then where the engines disagree (`disagreements`), once each."""
    found = [p for r in readings.values() for p in r.problems] + disagreements(readings, None, fc_norm, norm_output)
    return list(dict.fromkeys(found))


def cannot_run(lines: list[str]) -> bool:
    """Whether one of `problems`' lines says an engine cannot run the draft at all (layers it lacks,
    an fc of another width), rather than runs it differently."""
    return any("outside the verifier's layers" in p or "sizes fc for" in p for p in lines)
