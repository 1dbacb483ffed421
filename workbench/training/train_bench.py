"""Training speed, measured side by side: the reference model as the previous trainer ran it against
the training view (`train_view.TrainVerifier`) that `pretrain` runs, its loss on the CPU kernels
and on torch's operations; and the draft's TTT step (`eagle3.ttt_loss`) with either loss.

    python -m workbench.training.train_bench [batch seq steps rounds]
    python -m workbench.training.train_bench --draft [seq steps rounds]
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import contextlib
import os

from workbench.models import Verifier
from workbench.training.pretrain import init_weights, tiny_kimi_config
from workbench.training.train_view import TrainVerifier


@contextlib.contextmanager
def _torch_losses(on: bool):
    """The training losses on torch's operations (WORKBENCH_TRAIN_KERNELS=0) while `on`."""
    key = "WORKBENCH_TRAIN_KERNELS"
    was = os.environ.get(key)
    if on:
        os.environ[key] = "0"
    try:
        yield
    finally:
        if on and was is None:
            del os.environ[key]
        elif on:
            os.environ[key] = was


def _timed_arms(arms: dict, data: torch.Tensor, steps: int, rounds: int, tokens: int) -> dict[str, list[float]]:
    """Tokens/s of each arm (loss fn, optimizer, torch loss?) per round: a warm-up step, then `steps`
    steps of forward + backward + AdamW, the arms interleaved (reversed every other round)."""
    import time

    rates: dict[str, list[float]] = {n: [] for n in arms}
    for r in range(rounds):
        for name, (loss, opt, plain) in (arms.items() if r % 2 == 0 else reversed(arms.items())):
            with _torch_losses(plain):
                loss(data[0]).backward()  # warm-up step: allocator, oneDNN primitives
                opt.zero_grad(set_to_none=True)
                t = time.perf_counter()
                for s in range(1, steps + 1):
                    loss(data[s]).backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                rates[name].append(steps * tokens / (time.perf_counter() - t))
    return rates


def _summary(rates: dict[str, list[float]]) -> dict:
    import statistics

    med = {n: statistics.median(v) for n, v in rates.items()}
    return {"tokens_per_s": {n: round(v) for n, v in med.items()},
            "spread": {n: [round(min(v)), round(max(v))] for n, v in rates.items()}, "median": med}


def _reference_loss(model: Verifier, batch: torch.Tensor, bf16: bool) -> torch.Tensor:
    """The previous trainer's step: the reference forward, under bf16 autocast when `bf16`."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = model(batch[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())


def bench_training(batch: int = 2, seq: int = 2048, steps: int = 3, rounds: int = 2, seed: int = 0) -> dict:
    """Training tokens/s of the reference model (fp32; bf16 autocast, as the previous trainer ran)
    against this view (fp32; bf16), forward + backward + AdamW on the same random batches, the arms
    interleaved round by round so a busy machine slows them alike. Median over rounds."""
    torch.manual_seed(seed)
    cfg = tiny_kimi_config()
    data = torch.randint(0, cfg.vocab_size, (steps + 1, batch, seq + 1))
    arms = {}
    for name in ("reference fp32", "reference bf16 autocast", "view fp32", "view bf16", "view bf16, torch loss",
                 "view bf16, compiled ops"):
        model = Verifier(cfg)
        init_weights(model, cfg.num_hidden_layers)
        model.train()
        if name.startswith("view"):
            view = TrainVerifier(model, bf16="bf16" in name, compiled=name.endswith("compiled ops"))
            params, loss = [p for _, p in view.trainable()], view.loss
        else:
            params = list(model.parameters())
            loss = (lambda b, m=model, h=name.endswith("autocast"): _reference_loss(m, b, h))  # noqa: E731
        arms[name] = (loss, torch.optim.AdamW(params, lr=1e-4, fused=True), name.endswith("torch loss"))
    out = _summary(_timed_arms(arms, data, steps, rounds, batch * seq))
    med = out.pop("median")
    return {"batch": batch, "seq": seq, "steps": steps, "rounds": rounds, "threads": torch.get_num_threads(), **out,
            "view_bf16_over_reference": {n: round(med["view bf16"] / med[n], 2) for n in med if n.startswith("reference")},
            "kernel_loss_over_torch_loss": round(med["view bf16"] / med["view bf16, torch loss"], 2),
            "compiled_ops_over_eager": round(med["view bf16, compiled ops"] / med["view bf16"], 2)}


def bench_draft_training(seq: int = 2048, steps: int = 2, rounds: int = 2, ttt_steps: int = 4, seed: int = 0) -> dict:
    """The draft's training tokens/s (`eagle3.ttt_loss`: the verifier online, TTT steps, AdamW) with its
    loss on the CPU kernels against torch's operations, and the trainer before the sink attention too
    (torch's loss, SDPA over the explicit TTT mask), one window of `seq` tokens a step, interleaved."""
    from workbench.training.draft_init import draft_config_for, init_draft
    from workbench.training.eagle3 import masked_ttt_heads, trainable_parameters, ttt_heads, ttt_loss

    torch.manual_seed(seed)
    cfg = tiny_kimi_config()
    verifier = Verifier(cfg)
    init_weights(verifier, cfg.num_hidden_layers)
    verifier.eval().requires_grad_(False)
    data = torch.randint(0, cfg.vocab_size, (steps + 1, 1, seq))
    arms = {}
    for name in ("kernel loss", "torch loss", "torch loss, masked attention"):
        dcfg = draft_config_for(cfg, "mla", None)
        draft = init_draft(dcfg, seed=seed)
        draft.share(verifier.model.embed_tokens, verifier.lm_head)
        verifier.aux_layer_ids = dcfg.aux_layer_ids
        heads = masked_ttt_heads if name.endswith("masked attention") else ttt_heads
        loss = (lambda b, d=draft, h=heads: ttt_loss(d, verifier, b, ttt_steps, heads=h)[0])  # noqa: E731
        arms[name] = (loss, torch.optim.AdamW(trainable_parameters(draft), lr=1e-4, fused=True), "torch loss" in name)
    out = _summary(_timed_arms(arms, data, steps, rounds, seq))
    med = out.pop("median")
    return {"seq": seq, "steps": steps, "rounds": rounds, "ttt_steps": ttt_steps, "threads": torch.get_num_threads(),
            **out, "kernel_over_torch": round(med["kernel loss"] / med["torch loss"], 2),
            "sink_over_masked": round(med["torch loss"] / med["torch loss, masked attention"], 2),
            "now_over_before": round(med["kernel loss"] / med["torch loss, masked attention"], 2)}


if __name__ == "__main__":
    # python -m workbench.training.train_bench [batch seq steps rounds]
    import json
    import sys

    if sys.argv[1:2] == ["--draft"]:
        print(json.dumps(bench_draft_training(*map(int, sys.argv[2:5])), indent=1))
    else:
        print(json.dumps(bench_training(*map(int, sys.argv[1:5])), indent=1))
