"""The trainer's TTT loss (`workbench.training.eagle3.ttt_loss`) against the draft's own forward.

Step 0 of training-time test is the draft's ordinary pass over the window, with the verifier's aux
states: its loss is the cross-entropy of that pass's logits at position t against the verifier's
distribution for token t + 1, over the positions that have one, and its accuracy the share of them
whose argmax is the verifier's. Later steps feed the draft's own states back (EAGLE-3's TTT)."""
from __future__ import annotations

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
