"""Training speed, measured side by side: the reference model as the previous trainer ran it against
the training view (`train_view.TrainVerifier`) that `pretrain` runs.

    python -m workbench.training.train_bench [batch seq steps rounds]
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from workbench.models import Verifier
from workbench.training.pretrain import init_weights, tiny_kimi_config
from workbench.training.train_view import TrainVerifier


def _reference_loss(model: Verifier, batch: torch.Tensor, bf16: bool) -> torch.Tensor:
    """The previous trainer's step: the reference forward, under bf16 autocast when `bf16`."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = model(batch[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())


def bench_training(batch: int = 2, seq: int = 2048, steps: int = 3, rounds: int = 2, seed: int = 0) -> dict:
    """Training tokens/s of the reference model (fp32; bf16 autocast, as the previous trainer ran)
    against this view (fp32; bf16), forward + backward + AdamW on the same random batches, the arms
    interleaved round by round so a busy machine slows them alike. Median over rounds."""
    import statistics
    import time

    torch.manual_seed(seed)
    cfg = tiny_kimi_config()
    data = torch.randint(0, cfg.vocab_size, (steps + 1, batch, seq + 1))
    arms = {}
    for name in ("reference fp32", "reference bf16 autocast", "view fp32", "view bf16"):
        model = Verifier(cfg)
        init_weights(model, cfg.num_hidden_layers)
        model.train()
        if name.startswith("view"):
            view = TrainVerifier(model, bf16=name.endswith("bf16"))
            params, loss = [p for _, p in view.trainable()], view.loss
        else:
            params = list(model.parameters())
            loss = (lambda b, m=model, h=name.endswith("autocast"): _reference_loss(m, b, h))  # noqa: E731
        arms[name] = (loss, torch.optim.AdamW(params, lr=1e-4, fused=True))  # as the trainers run it
    rates: dict[str, list[float]] = {n: [] for n in arms}
    for r in range(rounds):
        for name, (loss, opt) in (arms.items() if r % 2 == 0 else reversed(arms.items())):
            loss(data[0]).backward()  # warm-up step: allocator, oneDNN primitives
            opt.zero_grad(set_to_none=True)
            t = time.perf_counter()
            for s in range(1, steps + 1):
                loss(data[s]).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            rates[name].append(steps * batch * seq / (time.perf_counter() - t))
    med = {n: statistics.median(v) for n, v in rates.items()}
    return {"batch": batch, "seq": seq, "steps": steps, "rounds": rounds, "threads": torch.get_num_threads(),
            "tokens_per_s": {n: round(v) for n, v in med.items()},
            "spread": {n: [round(min(v)), round(max(v))] for n, v in rates.items()},
            "view_bf16_over_reference": {n: round(med["view bf16"] / med[n], 2) for n in med if n.startswith("reference")}}


if __name__ == "__main__":
    # python -m workbench.training.train_bench [batch seq steps rounds]
    import json
    import sys

    print(json.dumps(bench_training(*map(int, sys.argv[1:5])), indent=1))
