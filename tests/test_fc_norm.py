"""EAGLE-3.1's fc_norm (SGLang's kimi_k25_eagle3.py): one RMSNorm per aux state (width
target_hidden_size, eps rms_norm_eps, `fc_norm.{i}.weight`) before fc, switched on by `fc_norm` or
its older name `use_aux_norm`. The plain model against the formula, the CPU kernels' chain against
the plain model, loading under SGLang's names, export, training and the doctor."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F

import workbench as wb
from tests.helpers import EMBEDDED, draft_chain_runs, make_random_pair
from workbench.config import ConfigError, DraftConfig
from workbench.decoding.drafters import greedy_chain
from workbench.kernels import cpu
from workbench.models import Eagle3Draft
from workbench.pair import save_model
from workbench.variants import REMOVED


def fc_norm_draft_dir(base, out, seed: int = 3, key: str = "fc_norm"):
    """The random draft at `base` with fc_norm switched on (by `key`) and its norms' weights random
    (not 1, so a path that skipped a norm, or used another's weight, would show)."""
    d = wb.load_draft(base, wb.load_verifier(base.parent / "verifier"))
    cfg = d.config
    cfg.fc_norm = True
    new = Eagle3Draft(cfg)
    missing, unexpected = new.load_state_dict(d.state_dict(), strict=False)
    assert sorted(missing) == [f"fc_norm.{i}.weight" for i in range(3)] and not unexpected
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for norm in new.fc_norm:
            norm.weight.copy_(0.5 + torch.rand(norm.weight.shape, generator=g))
    save_model(new, out)
    if key != "fc_norm":
        c = json.loads((out / "config.json").read_text())
        c[key] = c.pop("fc_norm")
        (out / "config.json").write_text(json.dumps(c))
    return out


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fcnorm")
    vdir, ddir = make_random_pair(root, seed=4, layers=4, aux_layer_ids=(1, 2, 3))
    return vdir, ddir, fc_norm_draft_dir(ddir, root / "draft-fcnorm")


def test_config_reads_either_name_and_refuses_a_non_bool():
    base = json.loads((EMBEDDED / "draft" / "config.json").read_text())
    assert not DraftConfig.from_hf(base, num_target_layers=8).fc_norm
    for key in ("fc_norm", "use_aux_norm"):
        c = DraftConfig.from_hf(dict(base, **{key: True}), num_target_layers=8)
        assert c.fc_norm and c.to_hf()["fc_norm"] is True and "use_aux_norm" not in c.to_hf()
    with pytest.raises(ConfigError, match=r"x.json: field 'use_aux_norm' = 'yes'; expected true or false"):
        DraftConfig.from_hf(dict(base, use_aux_norm="yes"), "x.json", num_target_layers=8)


def test_the_plain_model_norms_each_state_before_fc(dirs):
    vdir, _, fdir = dirs
    pair = wb.load_pair(vdir, fdir, fast="off")
    d = pair.draft
    aux = tuple(torch.randn(1, 5, d.config.target_hidden_size) * (i + 1) for i in range(3))
    eps = d.config.rms_norm_eps
    want = F.linear(torch.cat([n.weight * F.rms_norm(h, (h.shape[-1],), eps=eps) for n, h in zip(d.fc_norm, aux)],
                              -1), d.fc.weight)
    with torch.no_grad():
        got = d.combine_hidden_states(aux)
        plain = F.linear(torch.cat(aux, -1), d.fc.weight)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert (got - plain).abs().max() > 1e-2  # the norms change what fc sees


def test_sglang_names_and_use_aux_norm_load(dirs, tmp_path):
    """`fc_norm.{i}.weight` as SGLang loads them (or with a `model.` prefix), under either config key;
    a draft whose config says fc_norm but ships no norms is refused naming the tensors."""
    vdir, ddir, fdir = dirs
    v = wb.load_verifier(vdir)
    want = wb.load_draft(fdir, v).fc_norm[1].weight
    old = fc_norm_draft_dir(ddir, tmp_path / "old", key="use_aux_norm")
    assert torch.equal(wb.load_draft(old, v).fc_norm[1].weight, want)
    from safetensors.torch import load_file, save_file
    prefixed = tmp_path / "prefixed"
    shutil.copytree(fdir, prefixed)
    t = load_file(prefixed / "model.safetensors")
    save_file({("model." + k if k.startswith("fc_norm") else k): x for k, x in t.items()},
              str(prefixed / "model.safetensors"), metadata={"format": "pt"})
    assert torch.equal(wb.load_draft(prefixed, v).fc_norm[1].weight, want)
    bare = tmp_path / "bare"
    shutil.copytree(ddir, bare)
    c = json.loads((bare / "config.json").read_text())
    (bare / "config.json").write_text(json.dumps(dict(c, fc_norm=True)))
    with pytest.raises(Exception, match=r"missing tensor\(s\) 'fc_norm.0.weight'"):
        wb.load_draft(bare, v)


def test_a_plain_eagle3_draft_still_refuses_fc_norm_tensors(dirs, tmp_path):
    """Without the flag, fc_norm weights are unexpected: loading them would be ignoring them."""
    vdir, _, fdir = dirs
    off = tmp_path / "off"
    shutil.copytree(fdir, off)
    c = json.loads((off / "config.json").read_text())
    c.pop("fc_norm")
    (off / "config.json").write_text(json.dumps(c))
    with pytest.raises(Exception, match=r"unexpected tensor\(s\) 'fc_norm.0.weight'"):
        wb.load_draft(off, wb.load_verifier(vdir))


@pytest.mark.skipif(not cpu.available(), reason=f"CPU kernels: {cpu.status()}")
def test_the_kernel_chain_equals_the_plain_model_with_fc_norm(dirs):
    """As tests/kernels' chain test: the one-call chain and the twins' passes bit for bit, fp32 to 1e-5
    against the plain model; fc_norm runs through the RMSNorm twins."""
    from workbench.kernels.cpu_modules import KernelRMSNorm

    vdir, _, fdir = dirs
    for dt in ("float32", "bfloat16"):
        pair = wb.load_pair(vdir, fdir, dtype=dt, fast="cpu")
        d = pair.draft
        assert type(d).__name__ == "KernelEagle3Draft" and all(isinstance(n, KernelRMSNorm) for n in d.fc_norm)
        runs = draft_chain_runs(pair)
        with torch.inference_mode():
            off = pair.variant(draft={"fc_norm": REMOVED}).draft  # the same draft without its norms
            off_cache = off.new_cache(64)
            off.run_greedy_chain(greedy_chain, runs["x"], runs["aux"], off_cache, 4)
        (t1, p1, c1), (t2, p2, c2), (t3, p3, c3) = runs["chain"], runs["passes"], runs["plain"]
        assert torch.equal(t1, t2) and torch.equal(p1, p2) and torch.equal(c1.valid(), c2.valid()), dt
        if dt == "float32":
            assert torch.equal(t1, t3)
            torch.testing.assert_close(p1, p3, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(c1.valid(), c3.valid(), rtol=1e-5, atol=1e-5)
        assert (c1.valid() - off_cache.valid()).abs().max() > 1e-3, dt  # the norms reach the chain


def test_export_keeps_fc_norm_and_reloads_identically(dirs, tmp_path):
    from tests.test_export import check_vllm_draft_dir
    from workbench.integrations.vllm import export_draft

    vdir, _, fdir = dirs
    pair = wb.load_pair(vdir, fdir, fast="off")
    out = export_draft(pair, tmp_path / "x", dtype="float32")
    c = check_vllm_draft_dir(out, pair.verifier.config)
    assert c["fc_norm"] is True
    back = wb.load_pair(vdir, out, fast="off")
    for a, b in zip(back.draft.fc_norm, pair.draft.fc_norm):
        assert torch.equal(a.weight, b.weight)
    aux = tuple(torch.randn(1, 3, 64) for _ in range(3))
    with torch.no_grad():
        assert torch.equal(back.draft.combine_hidden_states(aux), pair.draft.combine_hidden_states(aux))


def test_train_draft_trains_fc_norm(tmp_path):
    """`train-draft --fc-norm`: a fresh EAGLE-3.1 draft of the embedded verifier, a few steps; the
    norms start at 1 and move, and the saved draft loads with them."""
    from workbench.training.eagle3 import main

    out = tmp_path / "d"
    assert main(["--out", str(out), "--fc-norm", "--max-steps", "3", "--batch", "2", "--seq", "32",
                 "--ttt-steps", "2", "--save-every", "3", "--eval-every", "1000", "--intermediate-size", "64",
                 "--lr", "0.01", "--warmup", "1"]) == 0
    c = json.loads((out / "config.json").read_text())
    assert c["fc_norm"] is True
    d = wb.load_draft(out, wb.load_verifier(EMBEDDED / "verifier"))
    moved = [float((n.weight - 1).abs().max()) for n in d.fc_norm]
    assert all(m > 0 for m in moved), moved


def test_the_doctor_shows_fc_norm_and_measures_vllms_reading(dirs):
    from workbench.analysis.doctor import alternatives, static_checks

    vdir, _, fdir = dirs
    pair = wb.load_pair(vdir, fdir, fast="off")
    checks = {c.name: c for c in static_checks(pair)}
    assert "fc_norm: an RMSNorm" in checks["EAGLE-3.1 flags"].detail
    engines = checks["engine readings"]
    assert engines.status == "warn" and "vllm does not apply fc_norm" in engines.detail
    alts = {a.name: a for a in alternatives(pair)}
    vllm = alts["vllm reading [1, 2, 3]"]
    assert "no fc_norm" in vllm.description and vllm.make is not None
    probe = vllm.make()
    assert "fc_norm" not in probe.plain[1]._modules and "fc_norm" in pair.plain[1]._modules


def test_the_compiled_chain_runs_fc_norm(dirs):
    """torch.compile traces combine_hidden_states with the norms inside the chain's one graph: the
    compiled draft proposes what the plain one does (fp32, probabilities to 1e-5)."""
    from workbench.compiled import compile_models

    vdir, _, fdir = dirs
    pair = wb.load_pair(vdir, fdir, fast="off")
    (fast,) = compile_models(pair.draft)
    ids = [5, 9, 200, 31, 7, 77, 3]
    with torch.inference_mode():
        out = pair.verifier(torch.tensor([ids]), pair.verifier.new_cache(64))
        x = torch.tensor([ids[1:] + [42]])
        got = fast.run_greedy_chain(greedy_chain, x, out.aux_hidden_states, fast.new_cache(64), 3)
        want = greedy_chain(pair.draft, x, out.aux_hidden_states, pair.draft.new_cache(64), 3)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
