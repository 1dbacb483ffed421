"""The trainer's TTT loss (`workbench.training.eagle3.ttt_loss`) against the draft's own forward.

Step 0 of training-time test is the draft's ordinary pass over the window, with the verifier's aux
states: its loss is the cross-entropy of that pass's logits at position t against the verifier's
distribution for token t + 1, over the positions that have one, and its accuracy the share of them
whose argmax is the verifier's. Later steps feed the draft's own states back (EAGLE-3's TTT)."""
from __future__ import annotations

import json
import math

import pytest
import torch

import workbench as wb
from tests.helpers import EMBEDDED
from workbench.training.eagle3 import STEP_DECAY, shift_left, ttt_loss


@pytest.mark.parametrize("draft_dir", [None, "draft-mha"], ids=["mla", "mha"])
def test_ttt_step_0_is_the_drafts_forward_scored_against_the_verifier(draft_dir):
    pair = wb.load_pair(dtype="float32", fast="off")
    if draft_dir:
        pair = pair.with_draft(str(EMBEDDED / draft_dir))
    v, d = pair.verifier, pair.draft
    ids = torch.tensor([pair.encode("def mean(xs):\n    return sum(xs) / len(xs)\n\nclass Point:\n    x: int\n")])
    S = ids.shape[1]
    valid = torch.ones(1, S)
    valid[0, :5] = 0  # a masked prompt
    with torch.no_grad():
        total, metrics = ttt_loss(d, v, ids, ttt_steps=2, loss_mask=valid)
        out = v(ids)
        target = out.logits.float().softmax(-1)
        post, _ = d(shift_left(ids), d.combine_hidden_states(out.aux_hidden_states))
        logits = d.compute_logits(post).float()
    ce = -(target[0, 1:] * logits[0, :-1].log_softmax(-1).clamp_min(-1e4)).sum(-1)
    m = valid[0, 1:]
    assert metrics.losses[0] == pytest.approx(float((ce * m).sum() / m.sum()), rel=1e-5)
    hits = (logits[0, :-1].argmax(-1) == target[0, 1:].argmax(-1)).float()
    assert metrics.accuracy[0] == pytest.approx(float((hits * m).sum() / m.sum()), rel=1e-6)
    assert float(total) == pytest.approx(metrics.losses[0] + STEP_DECAY * metrics.losses[1], rel=1e-5)
    assert len(metrics.losses) == 2 and metrics.losses[1] > 0


def test_a_resumed_draft_run_trains_and_continues_its_adamw_moments(tmp_path):
    """`train-draft --resume`: the draft's weights go on changing, and the fused AdamW takes back each
    parameter's moments and step count and goes on counting. (An optimizer made before the weights
    were loaded stepped the replaced parameters: the step stayed at 2 and the draft did not move.)"""
    from workbench.checkpoint import SafetensorsReader
    from workbench.training.eagle3 import main

    out = tmp_path / "d"
    common = ["--out", str(out), "--batch", "1", "--seq", "32", "--ttt-steps", "2", "--eval-every", "1000",
              "--intermediate-size", "64", "--lr", "0.01", "--warmup", "1"]
    assert main(common + ["--max-steps", "2", "--save-every", "2"]) == 0
    first = SafetensorsReader(out / "optimizer")
    moments, weights = first.get("0.exp_avg").clone(), SafetensorsReader(out).get("fc.weight").clone()
    assert float(first.get("0.step")[0]) == 2
    saved = json.loads((out / "trainer_state.json").read_text())
    saved["state"]["total"] = 4  # as a run of 4 steps cut off after its checkpoint at step 2 would have left it
    (out / "trainer_state.json").write_text(json.dumps(saved))
    assert main(common + ["--max-steps", "4", "--save-every", "4", "--resume"]) == 0
    assert json.loads((out / "trainer_state.json").read_text())["state"]["step"] == 4
    then = SafetensorsReader(out / "optimizer")
    assert float(then.get("0.step")[0]) == 4 and not torch.equal(then.get("0.exp_avg"), moments)
    assert not torch.equal(SafetensorsReader(out).get("fc.weight"), weights)


@pytest.mark.parametrize("draft_dir", [None, "draft-mha"], ids=["mla-reduced-vocab", "mha"])
def test_the_kernel_loss_equals_the_torch_loss(draft_dir, monkeypatch):
    """The TTT loss on the CPU kernels (`SoftCrossEntropy`: loss, gradient and argmaxes in one call a
    row) against torch's log_softmax, clamp and product: the same losses, accuracies and gradients,
    with a masked prompt and the embedded draft's reduced vocabulary (-inf logits outside it)."""
    from workbench.kernels import cpu
    from workbench.training.eagle3 import trainable_parameters

    if not cpu.available():
        pytest.skip(f"the CPU kernels do not run here: {cpu.status()}")
    pair = wb.load_pair(dtype="float32", fast="off")
    if draft_dir:
        pair = pair.with_draft(str(EMBEDDED / draft_dir))
    v, d = pair.verifier, pair.draft
    ids = torch.tensor([pair.encode("def mean(xs):\n    return sum(xs) / len(xs)\n\nclass Point:\n    x: int\n" * 2)] * 2)
    valid = torch.ones(ids.shape)
    valid[0, :5] = 0
    params = trainable_parameters(d)
    got = {}
    for kernels in ("1", "0"):
        monkeypatch.setenv("WORKBENCH_TRAIN_KERNELS", kernels)
        for p in params:
            p.grad = None
        total, metrics = ttt_loss(d, v, ids, ttt_steps=3, loss_mask=valid)
        total.backward()
        got[kernels] = (total.item(), metrics.losses, metrics.accuracy, [p.grad.clone() for p in params])
    (t1, l1, a1, g1), (t0, l0, a0, g0) = got["1"], got["0"]
    assert t1 == pytest.approx(t0, rel=1e-6) and l1 == pytest.approx(l0, rel=1e-6) and a1 == a0
    for x, y in zip(g1, g0):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-6 * y.abs().max().item())


def test_the_soft_cross_entropy_kernel_zeroes_a_broken_rows_gradient():
    from workbench.kernels import cpu

    if not cpu.available():
        pytest.skip(f"the CPU kernels do not run here: {cpu.status()}")
    logits = torch.randn(3, 50)
    logits[1, 3] = float("nan")
    logits[2, 10:] = float("-inf")  # a reduced vocabulary: finite, with -inf outside
    target = torch.softmax(torch.randn(3, 50), -1)
    losses, grad, top = cpu.soft_xent_grad(logits, target, torch.tensor([1.0, 1.0, 0.5]))
    assert math.isnan(losses[1]) and torch.equal(grad[1], torch.zeros(50))
    want = -(target[2] * logits[2].log_softmax(-1).clamp_min(-1e4)).sum()
    assert losses[2].item() == pytest.approx(want.item(), rel=1e-6)
    assert torch.equal(grad[2, 10:], torch.zeros(40)) and top.tolist()[::2] == [int(logits[0].argmax()),
                                                                               int(logits[2].argmax())]


@pytest.mark.parametrize("steps", [0, 1, 3])
@pytest.mark.parametrize("D, Dv", [(48, 32), (16, 16)], ids=["mla-heads", "mha-heads"])
def test_the_sink_attention_is_the_ttt_masks_attention(steps, D, Dv):
    """`ttt_heads` (causal fused kernel, later steps' diagonal keys folded in through a sink key)
    against SDPA with the explicit `ttt_mask`: the same outputs and gradients, to fp64 rounding."""
    from workbench.models.mla import attend_heads
    from workbench.training.eagle3 import ttt_heads, ttt_mask

    g = torch.Generator().manual_seed(steps * 100 + D)
    S = 37

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()

    q, k, v = rand(2, 3, S, D), rand(2, 3, S * (steps + 1), D), rand(2, 3, S * (steps + 1), Dv)
    got = ttt_heads(q, k, v, None, 0.3)
    want = attend_heads(q, k, v, ttt_mask(S, steps)[None, None], 0.3)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    out = torch.randn(got.shape, generator=g, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), out), torch.autograd.grad(want, (q, k, v), out)):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11)


def test_the_loss_with_the_sink_attention_is_the_masked_ones():
    """`ttt_loss` end to end with `ttt_heads` against `masked_ttt_heads`: the same losses and gradients."""
    from workbench.training.eagle3 import masked_ttt_heads, trainable_parameters

    pair = wb.load_pair(dtype="float32", fast="off")
    v, d = pair.verifier, pair.draft
    ids = torch.tensor([pair.encode("def mean(xs):\n    return sum(xs) / len(xs)\n" * 3)])
    params = trainable_parameters(d)
    got = []
    for heads in ({}, {"heads": masked_ttt_heads}):
        for p in params:
            p.grad = None
        total, metrics = ttt_loss(d, v, ids, ttt_steps=4, **heads)
        total.backward()
        got.append((metrics.losses, [p.grad.clone() for p in params]))
    assert got[0][0] == pytest.approx(got[1][0], rel=1e-5)
    for a, b in zip(got[0][1], got[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6 * b.abs().max().item())
