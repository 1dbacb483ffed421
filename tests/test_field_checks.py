"""workbench.analysis.field_checks: each check on a config that passes it and on one that breaks as
drafts have in the field, the aux-id readings the doctor's probes will use, and the hook into
the doctor's static checks. (The public drafts themselves: tests/test_real_artefacts.py.)"""
from __future__ import annotations

import copy

import pytest

import workbench as wb
from tests.test_config import K25_DRAFT, KIMI_K25
from workbench.analysis import field_checks as fc
from workbench.analysis.doctor import static_checks
from workbench.config import DraftConfig, VerifierConfig

VERIFIER = VerifierConfig.from_hf(copy.deepcopy(KIMI_K25))


def draft(**changes) -> DraftConfig:
    """The public K2.5 MLA draft (nested [2, 30, 58], everything the verifier's), with changes to its config.json."""
    d = copy.deepcopy(K25_DRAFT)
    d.update(changes)
    return DraftConfig.from_hf(d, "draft/config.json", VERIFIER.num_hidden_layers)


def test_a_matching_draft_passes_every_check():
    d = draft()
    assert [c.status for c in (fc.rope_check(d, VERIFIER), fc.positions_check(d, VERIFIER),
                               fc.prompt_length_check(d, 262144), fc.model_type_check(d),
                               fc.aux_ids_check(d, VERIFIER))] == ["ok"] * 5


def test_rope_differences_are_named():
    c = fc.rope_check(draft(rope_theta=1e6), VERIFIER)
    assert c.status == "warn" and "rope_theta 1e+06 vs the verifier's 50000" in c.detail
    scaling = dict(K25_DRAFT["rope_scaling"], factor=32.0)
    c = fc.rope_check(draft(rope_scaling=scaling), VERIFIER)
    assert c.status == "warn" and "rope_scaling factor 32.0 vs 64.0" in c.detail
    d = copy.deepcopy(K25_DRAFT)
    del d["rope_theta"]
    c = fc.rope_check(DraftConfig.from_hf(d, num_target_layers=61), VERIFIER)
    assert c.status == "warn" and "rope_theta 10000 (not stated)" in c.detail


def test_positions_and_prompt_length():
    d = copy.deepcopy(K25_DRAFT)
    del d["max_position_embeddings"]
    unstated = DraftConfig.from_hf(d, num_target_layers=61)
    c = fc.positions_check(unstated, VERIFIER)
    assert c.status == "warn" and "states none: engines read 4096" in c.detail
    assert fc.draft_positions(unstated) == 4096
    assert fc.prompt_length_check(unstated, 4096).status == "ok"
    c = fc.prompt_length_check(unstated, 4097)
    assert c.status == "warn" and "4097 tokens exceed the draft's 4096 positions" in c.detail and "#3960" in c.detail
    short = fc.positions_check(draft(max_position_embeddings=131072), VERIFIER)
    assert short.status == "warn" and "draft 131072, verifier 262144" in short.detail


@pytest.mark.parametrize("model_type, status, fragment", [
    ("kimi_k2", "ok", "built as MLA"),
    ("deepseek_v2", "ok", "built as MLA"),
    ("deepseek_v3", "fail", "rewrites it to deepseek_mtp (DeepSeekMTPModel)"),
    ("llama", "fail", "not a model type vLLM treats as MLA"),
])
def test_model_type(model_type, status, fragment):
    c = fc.model_type_check(draft(model_type=model_type))
    assert c.status == status and fragment in c.detail


def test_nested_aux_ids_against_vllms():
    nested = {"eagle_aux_hidden_state_layer_ids": [1, 29, 57], "use_aux_hidden_state": True}
    assert fc.aux_ids_check(draft(eagle_config=nested), VERIFIER).status == "info"  # output-of-layer: the same states
    other = dict(nested, eagle_aux_hidden_state_layer_ids=[3, 20, 40])
    c = fc.aux_ids_check(draft(eagle_config=other), VERIFIER)
    assert c.status == "warn" and "eagle_config names [3, 20, 40], but vLLM captures [2, 30, 58] (default)" in c.detail
    top = draft(eagle_config=other, eagle_aux_hidden_state_layer_ids=[3, 20, 40])
    assert fc.aux_ids_check(top, VERIFIER).status == "ok"


def test_aux_id_readings():
    d = draft(eagle_config={"eagle_aux_hidden_state_layer_ids": [3, 20, 40]})
    assert fc.aux_id_readings(d, VERIFIER) == {"vllm": (2, 30, 58), "eagle_config": (3, 20, 40),
                                               "eagle_config+1": (4, 21, 41)}
    last = draft(eagle_aux_hidden_state_layer_ids=[2, 30, 60], eagle_config={})  # +1 reads layer 61 of 0..60: left out
    assert fc.aux_id_readings(last, VERIFIER) == {"vllm": (2, 30, 60), "eagle_config": (2, 30, 60)}


def test_doctor_static_checks_include_the_field_checks(embedded_pair):
    names = {c.name: c for c in static_checks(embedded_pair)}
    for name in ("rope vs verifier", "draft max_position_embeddings", "prompt length", "draft model_type",
                 "nested aux ids"):
        assert names[name].status == "ok", names[name]
    cfg = embedded_pair.draft.config
    try:  # the embedded draft as it shipped before kimi_k2: vLLM would build an MTP head from it
        cfg.model_type = "deepseek_v3"
        bad = {c.name: c for c in static_checks(embedded_pair)}["draft model_type"]
    finally:
        cfg.model_type = "kimi_k2"
    assert bad.status == "fail" and "deepseek_mtp" in bad.detail
    assert fc.field_checks(wb.ModelPair(embedded_pair.verifier, None, None, "v", None)) == []
