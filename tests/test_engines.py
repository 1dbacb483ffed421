"""Which verifier hidden states vLLM and SGLang fuse for a draft config, simulated from their source
(`workbench.engine_readings`), for every published config in the repository and every config
the workbench exports: an export must make both engines fuse the states the draft was trained on.

Ids are capture-before (id k = the residual entering layer k). vLLM reads a top-level list, else
(2, L // 2, L - 3); SGLang reads eagle_config's list as "output of layer i" (+1), else the same
default; since sglang#25454 only lists starting at 1 get the +1.
"""
from __future__ import annotations

import json
import logging

import pytest

import workbench as wb
from tests.helpers import EMBEDDED, REPO
from workbench.config import DraftConfig, VerifierConfig, nested_aux_ids
from workbench.engine_readings import config_view, engine_readings, fused_states
from workbench.integrations.vllm import export_config

DATA = REPO / "tests" / "data" / "real"
TORCHSPEC = "zhubohao911__TorchSpec__kimi_k25_eagle3_mla"  # MLA, nested [1, 29, 57], for Kimi-K2.5 (61 layers)
SPECFORGE = "sgl-project__SpecForge__kimi-k2-eagle3"  # MHA, nested [2, 30, 58], for Kimi-K2 (61 layers)
VERIFIERS = {TORCHSPEC: "moonshotai__Kimi-K2.5", SPECFORGE: "moonshotai__Kimi-K2-Instruct"}


def read(name: str) -> dict:
    return json.loads((DATA / f"{name}.config.json").read_text())


def layers(name: str) -> int:
    return VerifierConfig.from_hf(read(name)).num_hidden_layers


def test_the_rules_restated():
    """Each engine's reading of hand-written configs, for a 61-layer verifier."""
    def states(**config):
        return fused_states(config, 61)

    assert states() == {"vllm": (2, 30, 58), "sglang": (2, 30, 58)}  # both defaults, no offset
    nested = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57]}}
    assert states(**nested) == {"vllm": (2, 30, 58), "sglang": (2, 30, 58)}  # vLLM ignores it; SGLang +1
    same_both = dict(nested, eagle_aux_hidden_state_layer_ids=[1, 29, 57])  # main's old export: the list twice
    assert states(**same_both) == {"vllm": (1, 29, 57), "sglang": (2, 30, 58)}  # one layer apart
    first2 = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 30, 58]}}
    assert states(**first2) == {"vllm": (2, 30, 58), "sglang": (3, 31, 59), "sglang#25454": (2, 30, 58)}
    top_only = {"eagle_aux_hidden_state_layer_ids": [3, 31, 59]}  # SGLang never reads the top level's ids ...
    assert states(**top_only) == {"vllm": (3, 31, 59), "sglang": (2, 30, 58)}
    assert engine_readings(top_only, 61)["sglang"].fc_states == 3  # ... but sizes fc from it


def test_main_export_of_the_embedded_draft_fused_other_states_under_sglang():
    """The issue's figure: [2, 4, 5] at the top level and in eagle_config fuses (3, 5, 6) under SGLang."""
    ids = [2, 4, 5]
    old = {"eagle_aux_hidden_state_layer_ids": ids, "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids}}
    assert fused_states(old, 8) == {"vllm": (2, 4, 5), "sglang": (3, 5, 6), "sglang#25454": (2, 4, 5)}


@pytest.mark.parametrize("name, want", [
    (TORCHSPEC, {"vllm": (2, 30, 58), "sglang": (2, 30, 58)}),  # "output of" ids starting at 1: alike
    (SPECFORGE, {"vllm": (2, 30, 58), "sglang": (3, 31, 59), "sglang#25454": (2, 30, 58)}),  # one layer apart
])
def test_published_drafts(name, want):
    assert fused_states(read(name), layers(VERIFIERS[name])) == want


@pytest.mark.parametrize("draft", ["draft", "draft-mha"])
def test_the_embedded_drafts_fuse_the_same_states_under_both(draft):
    config = json.loads((EMBEDDED / draft / "config.json").read_text())
    assert fused_states(config, 8) == {"vllm": (2, 4, 5), "sglang": (2, 4, 5)}


def _trained(name: str) -> tuple[DraftConfig, VerifierConfig]:
    v = VerifierConfig.from_hf(read(VERIFIERS[name]))
    return DraftConfig.from_hf(read(name), name, v.num_hidden_layers), v


@pytest.mark.parametrize("ids", [(2, 30, 58), (1, 29, 57), (5, 20, 40), (2, 3, 4)])
def test_every_export_fuses_the_trained_states_under_every_engine_reading(ids, caplog):
    """export_config of the published MLA draft, trained on `ids` (vLLM's ids): vLLM and SGLang
    capture exactly those; only where the first id is not 2 does sglang#25454 differ, and the
    export says so."""
    dc, vc = _trained(TORCHSPEC)
    dc.aux_layer_ids = ids
    with caplog.at_level(logging.WARNING):
        out = export_config(dc, vc)
    got = fused_states(out, vc.num_hidden_layers)
    assert got["vllm"] == got["sglang"] == ids
    assert out["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in ids]
    if ids[0] == 2:
        assert "sglang#25454" not in got and not any("fuses" in r.getMessage() for r in caplog.records)
    else:
        assert got["sglang#25454"] == tuple(i - 1 for i in ids)
        assert any("sglang#25454 fuses" in r.getMessage() for r in caplog.records)


def test_an_export_with_the_embedding_output_leaves_eagle_config_without_ids(caplog):
    dc, vc = _trained(TORCHSPEC)
    dc.aux_layer_ids = (0, 30, 58)
    assert nested_aux_ids(dc.aux_layer_ids) is None
    with caplog.at_level(logging.WARNING):
        out = export_config(dc, vc)
    assert "eagle_aux_hidden_state_layer_ids" not in out["eagle_config"]
    assert fused_states(out, 61) == {"vllm": (0, 30, 58), "sglang": (2, 30, 58)}
    assert any("sglang fuses the states entering layers [2, 30, 58]" in r.getMessage() for r in caplog.records)


def test_the_embedded_pairs_export_reads_alike(embedded_pair, tmp_path):
    from workbench.integrations.vllm import export_draft

    out = export_draft(embedded_pair, tmp_path / "x")
    config = json.loads((out / "config.json").read_text())
    assert fused_states(config, 8) == {"vllm": (2, 4, 5), "sglang": (2, 4, 5)}
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]


def test_out_of_range_nested_ids_are_no_longer_silent(tmp_path, caplog):
    """[1, 2, 97] in eagle_config: vLLM ignores it (the default loads), SGLang would capture layer 98
    of 8. The loader warns naming both, and the doctor's engine check fails."""
    from workbench.analysis.field_checks import engine_check

    d = tmp_path / "draft"
    d.mkdir()
    for f in (EMBEDDED / "draft").iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    config = json.loads((d / "config.json").read_text())
    config.pop("eagle_aux_hidden_state_layer_ids")
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 2, 97]
    (d / "config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.WARNING):
        pair = wb.load_pair(EMBEDDED / "verifier", d, fast="off")
    assert pair.verifier.aux_layer_ids == (2, 4, 5)
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "sglang captures [2, 3, 98] from eagle_config +1: [98] outside the verifier's layers [0, 7]" in warned
    assert str(d) in warned
    check = engine_check(pair.draft.config, pair.verifier.config)
    assert check.status == "fail" and "[98] outside" in check.detail
    notes = pair.plain[1].load_notes
    assert any(n.endswith("sglang: fuses the states entering layers [2, 3, 98] (outputs of layers [1, 2, 97]; "
                          "eagle_config +1)") for n in notes)


def test_config_view_restates_what_a_loaded_config_had():
    dc, vc = _trained(TORCHSPEC)
    assert fused_states(config_view(dc), 61) == fused_states(read(TORCHSPEC), 61)
    dc, vc = _trained(SPECFORGE)
    assert fused_states(config_view(dc), 61) == fused_states(read(SPECFORGE), 61)


def test_vllm_drops_eagle31_flags_and_sglang_keeps_them():
    config = {"eagle_aux_hidden_state_layer_ids": [2, 4, 5], "eagle_config": {"eagle_aux_hidden_state_layer_ids":
                                                                              [1, 3, 4]},
              "use_aux_norm": True, "norm_output": True}
    r = engine_readings(config, 8)
    assert (r["vllm"].fc_norm, r["vllm"].norm_output, r["sglang"].fc_norm, r["sglang"].norm_output) == (
        False, False, True, True)
    assert any("skips fc_norm" in p for p in r["vllm"].problems) and not r["sglang"].problems
    nbr = engine_readings(dict(config, use_aux_norm=False, norm_output=False, norm_before_residual=True), 8)
    assert not nbr["vllm"].problems and "does not read norm_before_residual" in nbr["sglang"].problems[0]
    with pytest.raises(ValueError, match="num_layers = 0; expected the verifier's num_hidden_layers"):
        engine_readings(config, 0)

