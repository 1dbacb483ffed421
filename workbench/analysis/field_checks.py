"""Static checks for what breaks EAGLE-3 drafts in the field, read from the configs alone.

Each of these has shipped in a public draft and failed silently (accept length near 1) or
crashed serving in vLLM or SGLang:

- the draft's `rope_theta` / `rope_scaling` / `max_position_embeddings` not the verifier's
  (trainer defaults such as Llama's 1e6 base, a YaRN block copied from another model, or no
  `max_position_embeddings` at all, which DeepseekV3Config - how vLLM reads kimi_k2 - fills
  with 4096), and prompts longer than the draft's positions (NeMo RL PR #3960);
- an MLA draft whose `model_type` the engines do not build as MLA: vLLM's
  `SpeculativeConfig.hf_config_override` turns deepseek_v3 into deepseek_mtp (an MTP head, not
  EAGLE-3), and a type outside vLLM's `is_deepseek_mla` list gets no MLA cache;
- aux ids nested in `eagle_config` that vLLM never reads (it takes a top-level
  `eagle_aux_hidden_state_layer_ids`, else (2, L // 2, L - 3)): SpecForge/TorchSpec's
  [1, 29, 57] ("output of layer i") happen to be vLLM's (2, 30, 58); other ids are not.

- engines that read one config differently (`workbench.engine_readings`): SGLang reads
  eagle_config's ids as "output of layer i" where vLLM reads the top level as capture-before, and
  vLLM's MLA draft class applies no EAGLE-3.1 `fc_norm` / `norm_output`.

`field_checks(pair)` is what the doctor's `static_checks` adds; `aux_id_readings` gives the
doctor's probes the layer ids each reading of a draft config implies.
"""
from __future__ import annotations

from dataclasses import dataclass

from workbench.config import DraftConfig, VerifierConfig
from workbench.engine_readings import cannot_run, config_view, engine_readings, problems

# vLLM's ModelConfig.is_deepseek_mla model types (the arch-config convertor, 2026 versions).
MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_mtp", "kimi_k2", "kimi_linear",
                   "longcat_flash", "pangu_ultra_moe", "pangu_ultra_moe_mtp", "glm_moe_dsa")
# ... of which SpeculativeConfig.hf_config_override rewrites these to deepseek_mtp (DeepSeekMTPModel).
MTP_REWRITTEN = ("deepseek_v3", "deepseek_v32", "glm_moe_dsa")
DEFAULT_MAX_POSITIONS = 4096  # transformers' DeepseekV3Config default, what a config without the field gets


@dataclass
class Check:
    """One line of the doctor's report."""

    name: str
    status: str  # "ok" | "warn" | "fail" | "info"
    detail: str


def _check(name: str, status: str, detail: str) -> Check:
    return Check(name, status, detail)


def rope_check(draft: DraftConfig, verifier: VerifierConfig):
    """rope_theta and rope_scaling equal to the verifier's (a difference is legal only if the draft
    was trained so; a copied trainer default is the common field case)."""
    stated = "rope_theta" not in draft.unstated
    diffs = []
    if draft.rope_theta != verifier.rope_theta:
        diffs.append(f"rope_theta {draft.rope_theta:g}{'' if stated else ' (not stated)'} vs the verifier's "
                     f"{verifier.rope_theta:g}")
    if (draft.rope_scaling or None) != (verifier.rope_scaling or None):
        ours, theirs = draft.rope_scaling or {}, verifier.rope_scaling or {}
        keys = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
        diffs.append("rope_scaling " + ", ".join(f"{k} {ours.get(k)!r} vs {theirs.get(k)!r}" for k in keys))
    if not diffs:
        return _check("rope vs verifier", "ok",
                      f"rope_theta {draft.rope_theta:g} and rope_scaling equal the verifier's")
    return _check("rope vs verifier", "warn", "; ".join(diffs) + ": unless the draft was trained with these, it "
                  "rotates positions unlike its training and acceptance drops silently (workbench export-vllm "
                  "writes the verifier's)")


def draft_positions(draft: DraftConfig) -> int:
    """The positions the draft's config gives it (DeepseekV3Config's 4096 when it states none)."""
    return DEFAULT_MAX_POSITIONS if "max_position_embeddings" in draft.unstated else draft.max_position_embeddings


def positions_check(draft: DraftConfig, verifier: VerifierConfig):
    n, want = draft_positions(draft), verifier.max_position_embeddings
    if "max_position_embeddings" in draft.unstated:
        return _check("draft max_position_embeddings", "warn",
                      f"config.json states none: engines read {DEFAULT_MAX_POSITIONS} (DeepseekV3Config's default), "
                      f"the verifier has {want}; expected the verifier's value written out")
    if n != want:
        return _check("draft max_position_embeddings", "warn" if n < want else "info",
                      f"draft {n}, verifier {want}; expected the verifier's (vLLM sizes the draft's positions "
                      f"from its own config)")
    return _check("draft max_position_embeddings", "ok", f"{n}, the verifier's")


def prompt_length_check(draft: DraftConfig, prompt_tokens: int):
    """Whether a prompt of `prompt_tokens` (plus what is generated after it) stays within the draft's positions."""
    n = draft_positions(draft)
    if prompt_tokens <= n:
        return _check("prompt length", "ok", f"{prompt_tokens} tokens fit the draft's {n} positions")
    return _check("prompt length", "warn", f"{prompt_tokens} tokens exceed the draft's {n} positions: past position "
                  f"{n} its RoPE leaves the range it was built for and acceptance collapses (NeMo RL PR #3960)")


def model_type_check(draft: DraftConfig):
    mt = draft.model_type
    if draft.attention != "mla":
        return _check("draft model_type", "info", f"{mt!r} ({draft.architecture}, MHA): not an MLA cache")
    if mt in MTP_REWRITTEN:
        return _check("draft model_type", "fail",
                      f"{mt!r}: vLLM's SpeculativeConfig.hf_config_override rewrites it to deepseek_mtp "
                      f"(DeepSeekMTPModel), so the draft does not load as {draft.architecture}; expected 'kimi_k2' "
                      f"as the published Kimi MLA drafts (workbench export-vllm writes it)")
    if mt not in MLA_MODEL_TYPES:
        return _check("draft model_type", "fail",
                      f"{mt!r}: not a model type vLLM treats as MLA ({', '.join(MLA_MODEL_TYPES)}), so the draft's "
                      f"cache is not laid out as [c_kv | k_pe]; expected 'kimi_k2'")
    return _check("draft model_type", "ok", f"{mt!r}: built as MLA, not rewritten to an MTP head")


def aux_id_readings(draft_config: DraftConfig, verifier_config: VerifierConfig) -> dict[str, tuple[int, ...]]:
    """The verifier layer ids each reading of the draft's config implies, in vLLM's capture-before
    convention (id k = the residual entering layer k):

    - "vllm": what vLLM captures (top-level ids, else (2, L // 2, L - 3)), which `load_draft` uses;
    - "eagle_config": eagle_config's ids as written, read as capture-before;
    - "eagle_config+1": the same ids read as "output of layer i" (SpecForge/TorchSpec), i.e. +1.
    Without nested ids, both nested readings start from the vLLM ids. Readings that leave the
    verifier's layers [0, L - 1] are left out.
    """
    vllm = tuple(draft_config.aux_layer_ids)
    nested = tuple(draft_config.nested_aux_layer_ids or vllm)
    out = {"vllm": vllm, "eagle_config": nested, "eagle_config+1": tuple(i + 1 for i in nested)}
    n = verifier_config.num_hidden_layers
    return {k: ids for k, ids in out.items() if all(0 <= i < n for i in ids)}


def aux_ids_check(draft: DraftConfig, verifier: VerifierConfig):
    vllm, nested = list(draft.aux_layer_ids), draft.nested_aux_layer_ids
    if nested is None:
        return _check("nested aux ids", "ok", f"{vllm} ({draft.aux_ids_source}); eagle_config agrees or names none")
    nested = list(nested)
    if [i + 1 for i in nested] == vllm and draft.aux_ids_source == "top-level":
        return _check("nested aux ids", "ok", f"eagle_config names {nested}, the top level {vllm}: the same states, "
                      f"as 'output of layer i' (SGLang, trainers) and capture-before (vLLM)")
    if [i + 1 for i in nested] == vllm:
        return _check("nested aux ids", "info",
                      f"eagle_config names {nested}, vLLM captures {vllm} ({draft.aux_ids_source}): the same states "
                      f"if the trainer wrote 'output of layer i' (SpecForge/TorchSpec), as ids starting at 1 suggest")
    return _check("nested aux ids", "warn",
                  f"eagle_config names {nested}, but vLLM captures {vllm} ({draft.aux_ids_source}) and never reads "
                  f"eagle_config: if the draft was trained on {nested}, it fuses other states and accept length "
                  f"falls to ~1; expected the trained ids at the top level (workbench export-vllm writes both)")


def engine_check(draft: DraftConfig, verifier: VerifierConfig):
    """Which states vLLM and SGLang would fuse for this config; fail where an engine captures layers
    the verifier lacks, warn where engines disagree or drop an EAGLE-3.1 flag the draft has."""
    readings = engine_readings(config_view(draft), verifier.num_hidden_layers)
    found = problems(readings, draft.fc_norm, draft.norm_output)
    detail = "; ".join(r.describe() for r in readings.values())
    if found:
        detail += " - " + "; ".join(found)
    return _check("engine readings", "fail" if cannot_run(found) else "warn" if found else "ok", detail)


def eagle31_check(draft: DraftConfig):
    on = [f for f, v in (("fc_norm", draft.fc_norm), ("norm_output", draft.norm_output)) if v]
    if not on:
        return _check("EAGLE-3.1 flags", "info", "fc_norm off, norm_output off: a plain EAGLE-3 draft")
    what = {"fc_norm": f"fc_norm: an RMSNorm (eps {draft.rms_norm_eps:g}) on each of the "
                       f"{len(draft.aux_layer_ids)} aux states before fc",
            "norm_output": "norm_output: the post-norm state is fed back between draft steps"}
    return _check("EAGLE-3.1 flags", "info", "; ".join(what[f] for f in on) + " (SGLang applies both; vLLM's "
                  "Eagle3DeepseekV2ForCausalLM neither)")


def field_checks(pair, prompt_tokens: int | None = None) -> list:
    """Every check above for a loaded pair; `prompt_tokens` defaults to the longest prompt the engine admits."""
    d, v = pair.draft, pair.verifier
    if d is None:
        return []
    dc, vc = d.config, v.config
    n = prompt_tokens if prompt_tokens is not None else vc.max_position_embeddings
    return [rope_check(dc, vc), positions_check(dc, vc), prompt_length_check(dc, n), model_type_check(dc),
            aux_ids_check(dc, vc), engine_check(dc, vc), eagle31_check(dc)]
