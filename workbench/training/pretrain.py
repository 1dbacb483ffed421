"""Pretraining the embedded tiny-kimi verifier on Python's standard library (embedded pair only).

A Kimi-K2 in miniature: `deepseek_v3` layout (so transformers and vLLM load it), q_lora set,
a latent cache row of kv_lora + rope = 80 values against 4 heads x (32 + 32) = 256 for MHA,
interleaved YaRN RoPE, sigmoid-routed MoE with a shared expert after one dense layer.
Expert load is balanced DeepSeek-V3's auxiliary-loss-free way: after each step every
expert's `e_score_correction_bias` moves by `bias_update` against its load imbalance.
nanoGPT-style: one straight loop, AdamW, warmup then cosine, a time budget.
"""
from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from workbench.config import VerifierConfig
from workbench.models import Verifier
from workbench.models.moe import MoE
from workbench.training.eagle3 import lr_at


def tiny_kimi_config(vocab_size: int = 8192, bos: int = 0, eos: int = 1) -> VerifierConfig:
    return VerifierConfig(
        model_type="deepseek_v3", vocab_size=vocab_size, hidden_size=256, intermediate_size=512,
        moe_intermediate_size=96, num_hidden_layers=8, num_attention_heads=4, q_lora_rank=96,
        kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
        routed_scaling_factor=1.5, norm_topk_prob=True, first_k_dense_replace=1, rms_norm_eps=1e-6,
        rope_theta=50000.0, rope_interleave=True, max_position_embeddings=2048,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512,
                      "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        bos_token_id=bos, eos_token_id=eos,
    )


def init_weights(model: torch.nn.Module, n_layers: int, std: float = 0.02) -> None:
    """GPT-2 style: N(0, 0.02), residual output projections scaled by 1/sqrt(2 * layers)."""
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or "layernorm" in name:
            torch.nn.init.ones_(p)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            torch.nn.init.normal_(p, 0, std / math.sqrt(2 * n_layers))
        else:
            torch.nn.init.normal_(p, 0, std)


def token_stream(texts: list[str], tokenizer_path: Path, bos: int, eos: int) -> torch.Tensor:
    """Every document as [bos] + ids + [eos], concatenated."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    out: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        out += [bos, *enc.ids, eos]
    return torch.tensor(out, dtype=torch.long)


def batches(stream: torch.Tensor, batch: int, seq: int, rng: random.Random):
    while True:
        starts = [rng.randrange(0, len(stream) - seq - 1) for _ in range(batch)]
        yield torch.stack([stream[s:s + seq + 1] for s in starts])


@torch.no_grad()
def eval_loss(model: Verifier, eval_batches: list[torch.Tensor]) -> float:
    model.eval()
    losses = [F.cross_entropy(model(b[:, :-1]).logits.flatten(0, 1).float(), b[:, 1:].flatten()).item()
              for b in eval_batches]
    model.train()
    return sum(losses) / len(losses)


@dataclass
class PretrainArgs:
    out: Path
    tokenizer: Path
    max_minutes: float = 25.0
    max_steps: int = 100000
    batch: int = 8
    seq: int = 512
    lr: float = 2e-3
    warmup: int = 50
    seed: int = 0
    bias_update: float = 1e-3
    bf16: bool = True
    eval_every: int = 100


def pretrain(args: PretrainArgs, log=print) -> dict:
    # long: the whole training loop reads top to bottom, as nanoGPT's train.py does
    from workbench.pair import save_model
    from workbench.training.corpus import load_split

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    cfg = tiny_kimi_config()
    t0 = time.time()
    train = token_stream(load_split("train"), args.tokenizer, cfg.bos_token_id, cfg.eos_token_id)
    evals = token_stream(load_split("eval"), args.tokenizer, cfg.bos_token_id, cfg.eos_token_id)
    eval_rng = random.Random(1234)
    eval_batches = [next(batches(evals, 8, args.seq, eval_rng)) for _ in range(4)]
    log(f"tokens: train {len(train):,}, eval {len(evals):,} ({time.time() - t0:.0f}s to tokenize)")

    model = Verifier(cfg)
    init_weights(model, cfg.num_hidden_layers)
    model.train()
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    budget = args.max_minutes * 60
    # The step count the budget allows is re-estimated as training goes (a shared machine's speed
    # varies), so the cosine decay ends when the time does.
    total = args.max_steps
    history = []
    start = time.time()
    data = batches(train, args.batch, args.seq, rng)
    step = 0
    while step < total:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, args.lr, args.warmup, floor=0.1)
        b = next(data)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            logits = model(b[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), b[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():  # auxiliary-loss-free balancing (DeepSeek-V3 §2.1.2)
            for m in moes:
                load = m.gate.last_load
                m.gate.e_score_correction_bias += args.bias_update * torch.sign(load.mean() - load)
        step += 1
        elapsed = time.time() - start
        if step >= 10 and step % 10 == 0:
            total = max(step + 1, min(args.max_steps, int(budget / (elapsed / step))))
        if elapsed > budget:
            total = step
        if step % 10 == 0:
            log(f"step {step}/{total} loss {loss.item():.3f} lr {opt.param_groups[0]['lr']:.2e} {elapsed:.0f}s")
        if step % args.eval_every == 0 or step == total:
            ev = eval_loss(model, eval_batches)
            history.append({"step": step, "train_loss": loss.item(), "eval_loss": ev, "seconds": elapsed})
            log(f"eval loss {ev:.3f}")
    model.eval()
    save_model(model, args.out, dtype=torch.bfloat16)
    final = eval_loss(model.to(torch.bfloat16).float(), eval_batches)
    report = {"steps": step, "minutes": (time.time() - start) / 60, "eval_loss_bf16_weights": final,
              "tokens_seen": step * args.batch * args.seq, "history": history, "seed": args.seed,
              "batch": args.batch, "seq": args.seq, "lr": args.lr}
    (Path(args.out) / "pretrain_log.json").write_text(json.dumps(report, indent=1))
    return report
