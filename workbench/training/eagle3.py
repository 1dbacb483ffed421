"""Online EAGLE-3 training with training-time test (TTT), for any verifier the workbench loads.

Per batch (eagle3_mla.md §6): the frozen verifier runs once without gradients and gives the
three aux states and its next-token distribution (online: fresh targets every batch). The
draft then unrolls `ttt_steps` times, as it will run at inference:
    h = fc(aux);  ids_0 = tokens shifted left by one (position t gets token t+1)
    step i: pre = layer(embed(ids_i), h, positions t + i, TTT attention); logits = lm_head(norm(pre))
            target = the verifier's distribution at position t + i + 1;  h = pre;  ids_{i+1} = shift(ids_i)
EAGLE-3.1 (`--fc-norm`, `--norm-output`): fc(concat(fc_norm_j(aux_j))), and h = norm(pre) fed back.
TTT attention: at step i, query t sees the step-0 keys j <= t (causal) and its own keys from
steps 1..i at the same index t (the diagonal), which is exactly what a draft step sees in the
cache at inference. Loss = sum_i 0.8^i soft cross-entropy against the verifier; AdamW, linear
warmup then cosine decay, gradient clipping. The embedding and lm_head are the verifier's and
stay frozen; the fc fusion (and its fc_norm), the decoder layer and the final norm train.
Checkpoints are safetensors plus a JSON state, so resuming never unpickles anything.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from workbench.models import Eagle3Draft, Verifier
from workbench.models.mla import MLAttention, attend_heads
from workbench.training.train_view import train_kernels

STEP_DECAY = 0.8


@functools.lru_cache(maxsize=16)  # every training step asks for the same few (seq, step) masks
def ttt_mask(seq: int, step: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[S, S*(step+1)] bool: query t sees step-0 keys j <= t and key t of every later step."""
    q = torch.arange(seq, device=device)[:, None]
    kv = torch.arange(seq * (step + 1), device=device)[None, :]
    return torch.where(kv < seq, kv <= q, (kv - q) % seq == 0)


def ttt_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, scale: float, causal=False) -> torch.Tensor:
    """`ttt_mask`'s attention without the mask: q [B,N,S,D] over k [B,N,(i+1)S,D], v [B,N,(i+1)S,Dv]
    (the rows of TTT steps 0..i), exactly (gradients too); mask and causal are ignored.

    Step 0's keys are causal, so they take SDPA's fused causal kernel. Each later step adds one key
    to each query (its own position), so their scores d_j are a product each, their log-sum-exp m,
    and their softmax's average value u. In the fused call a sink key, visible to every query,
    stands for all of them: its score is m (a last dimension that only q and the sink carry), so the
    softmax's normaliser is the masked one, and its weight w is the later keys' share: out = (the
    call's values) + w u. A masked [S, (i+1)S] attention computes every one of its scores; this
    computes half of step 0's."""
    B, N, S, D = q.shape
    steps, Dv = k.shape[2] // S - 1, v.shape[-1]
    if steps == 0:
        return attend_heads(q, k, v, None, scale, causal=True)
    kd, vd = k[:, :, S:].unflatten(2, (steps, S)), v[:, :, S:].unflatten(2, (steps, S))  # [B,N,i,S,*]
    d = torch.einsum("bnsd,bnjsd->bnsj", q, kd) * scale  # [B, N, S, i]
    u = torch.einsum("bnsj,bnjsv->bnsv", d.softmax(-1), vd)
    W = max(D, Dv) + 1  # one head size for q, k and v (the fused kernel's), the sink's column last
    zero = q.new_zeros(B, N, 1, W)
    sink = F.pad(zero[..., 1:], (0, 1), value=1.0)  # [0 ... 0 1]
    qa = torch.cat([zero, torch.cat([F.pad(q, (0, W - 1 - D)), (d.logsumexp(-1) / scale)[..., None]], -1)], 2)
    ka = torch.cat([sink, F.pad(k[:, :, :S], (0, W - D))], 2)
    va = torch.cat([sink, F.pad(v[:, :, :S], (0, W - Dv))], 2)
    # row 0 is a query that sees only the sink (dropped); row t + 1 sees the sink and keys 0..t
    o = F.scaled_dot_product_attention(qa, ka, va, is_causal=True, scale=scale)[:, :, 1:]
    return o[..., :Dv] + o[..., -1:] * u


def masked_ttt_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, scale: float,
                     causal=False) -> torch.Tensor:
    """`ttt_heads`'s reference: SDPA with the explicit `ttt_mask` (every score computed, then masked)."""
    S = q.shape[2]
    return attend_heads(q, k, v, ttt_mask(S, k.shape[2] // S - 1, str(q.device))[None, None], scale)


def ttt_attend(attn, x: torch.Tensor, positions: torch.Tensor, rows: list[torch.Tensor],
               heads=ttt_heads) -> torch.Tensor:
    """Attention of step len(rows) over the rows of every step so far (MLA or MHA draft layer), with
    `ttt_mask`'s pattern (`heads`: `ttt_heads`, or its masked reference)."""
    if isinstance(attn, MLAttention):
        q_nope, q_pe, new = attn.project(x, positions)
        rows.append(new)
        o = attn.attend_naive(q_nope, q_pe, torch.cat(rows, 1), None, heads=heads)
    else:
        q, new = attn.project(x, positions)
        rows.append(new)
        o = attn.attend(q, torch.cat(rows, 1), None, heads=heads)
    return attn.o_proj(o)


def shift_left(x: torch.Tensor, fill: int | float = 0) -> torch.Tensor:
    return torch.cat([x[:, 1:], torch.full_like(x[:, :1], fill)], dim=1)


@dataclass
class StepMetrics:
    loss: float
    losses: list[float]
    accuracy: list[float]  # per TTT position: draft argmax == verifier argmax

    @property
    def simulated_accept_length(self) -> float:
        """1 + sum_i prod_{j<=i} acc_j: vLLM's accept length if per-position hits were independent."""
        total, run = 1.0, 1.0
        for a in self.accuracy:
            run *= a
            total += run
        return total


def ttt_loss(draft: Eagle3Draft, verifier: Verifier, ids: torch.Tensor, ttt_steps: int,
             loss_mask: torch.Tensor | None = None, heads=ttt_heads) -> tuple[torch.Tensor, StepMetrics]:
    """The weighted TTT loss for a batch of token windows ids [B, S] (targets from the verifier, online);
    `heads` the attention's pattern (`ttt_heads`, or `masked_ttt_heads`, its reference)."""
    B, S = ids.shape
    with torch.no_grad():
        out = verifier(ids)
        target = out.logits.float().softmax(-1)  # [B, S, V]: the verifier's next-token distribution
        target_ids = target.argmax(-1)  # [B, S]: its greedy token (the accuracy's reference)
        aux = tuple(a.to(draft.fc.weight.dtype) for a in out.aux_hidden_states)
    valid = torch.ones(B, S, device=ids.device) if loss_mask is None else loss_mask.float()
    kernels = train_kernels(target)
    h = draft.combine_hidden_states(aux)
    embed, lm_head = draft.part("embed_tokens"), draft.part("lm_head")
    layer = draft.layers[0]
    rows: list[torch.Tensor] = []
    step_ids = shift_left(ids)
    total = torch.zeros((), device=ids.device)
    losses, accs = [], []
    for i in range(ttt_steps):
        positions = (torch.arange(S, device=ids.device) + i)[None]
        pre = layer.block(embed(step_ids), h, lambda x: ttt_attend(layer.self_attn, x, positions, rows, heads))
        post = draft.norm(pre)
        # position t of step i predicts token t + i + 1: the last i + 1 positions have no target
        n = S - i - 1
        logits = draft.compute_logits(post[:, :n]).float()
        mask = valid[:, i + 1:]
        denom = mask.sum().clamp_min(1)
        if kernels is not None:  # the loss, its gradient and the argmaxes of each row in one call
            V = logits.shape[-1]
            loss_i, top = SoftCrossEntropy.apply(logits.reshape(-1, V), target[:, i + 1:].reshape(-1, V),
                                                 (mask / denom).reshape(-1))
            top = top.view(B, n)
        else:
            ce = -(target[:, i + 1:] * logits.log_softmax(-1).clamp_min(-1e4)).sum(-1)  # -inf outside the draft vocab
            loss_i, top = (ce * mask).sum() / denom, logits.argmax(-1)
        total = total + STEP_DECAY ** i * loss_i
        losses.append(float(loss_i.detach()))
        accs.append(float(((top == target_ids[:, i + 1:]).float() * mask).sum() / denom))
        h = post if draft.norm_output else pre  # what inference feeds back (EAGLE-3.1: the post-norm state)
        step_ids = shift_left(step_ids)
    return total, StepMetrics(float(total.detach()), losses, accs)


class SoftCrossEntropy(torch.autograd.Function):
    """sum_t w_t * -sum_v p_tv clamp(log_softmax(x_t)_v, -1e4) over fp32 logits [T, V], target
    probabilities [T, V] and row weights [T], with the rows' argmaxes: one call of the CPU kernels
    (`cpu.soft_xent_grad`) reads each row while it is in cache and forms the gradient at once,
    where log_softmax, the clamp, the product and their backward made a pass over [T, V] each."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, weights: torch.Tensor):
        from workbench.kernels import cpu

        losses, grad, top = cpu.soft_xent_grad(logits, target, weights)
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(top)
        return (losses * weights).sum(), top

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor, _):
        (grad,) = ctx.saved_tensors
        return grad * grad_out, None, None


def lr_at(step: int, total: int, peak: float, warmup: int, floor: float = 0.05) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def trainable_parameters(draft: Eagle3Draft) -> list[torch.nn.Parameter]:
    """fc, the decoder layer and the final norm; never the (shared, frozen) embedding or lm_head."""
    return [p for n, p in draft.named_parameters() if not n.startswith(("embed_tokens", "lm_head"))]


@dataclass
class TrainArgs:
    out: str
    ttt_steps: int = 4
    batch: int = 8
    seq: int = 256
    lr: float = 3e-3
    warmup: int = 30
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    max_steps: int = 100000
    max_minutes: float = 20.0
    seed: int = 0
    save_every: int = 100
    eval_every: int = 100


@dataclass
class TrainState:
    step: int = 0
    total: int = 0
    seconds: float = 0.0
    history: list[dict] = field(default_factory=list)


def _optimizer_tensors(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> dict[str, torch.Tensor]:
    out = {}
    for i, p in enumerate(params):
        st = opt.state.get(p, {})
        for key in ("exp_avg", "exp_avg_sq"):
            if key in st:
                out[f"{i}.{key}"] = st[key]
        if "step" in st:
            out[f"{i}.step"] = torch.as_tensor(st["step"], dtype=torch.float32).reshape(1)
    return out


def save_checkpoint(draft: Eagle3Draft, opt, params, state: TrainState, out: Path, args: TrainArgs) -> None:
    from workbench.checkpoint import save_state
    from workbench.pair import save_model

    save_model(draft, out)
    tensors = _optimizer_tensors(opt, params)
    if tensors:
        opt_dir = out / "optimizer"
        save_state(tensors, opt_dir)
    (out / "trainer_state.json").write_text(json.dumps({"state": asdict(state), "args": asdict(args)}, indent=1))


def load_checkpoint(draft: Eagle3Draft, out: Path,
                    args: TrainArgs) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer, TrainState]:
    """The draft's weights from `out` (new Parameter objects), then an optimizer over those with the
    saved moments and step counts, and the run's state. An optimizer made before the weights were
    loaded would hold the replaced parameters: it would step them, and the draft would not train."""
    from workbench.checkpoint import SafetensorsReader, draft_name, load_state

    load_state(draft, SafetensorsReader(out), rename=draft_name, optional=["d2t"] if hasattr(draft, "d2t") else [])
    params = trainable_parameters(draft)
    opt = _optimizer(params, args)
    opt_dir = out / "optimizer"
    if opt_dir.exists():
        reader = SafetensorsReader(opt_dir)
        for i, p in enumerate(params):
            if f"{i}.exp_avg" in reader:
                opt.state[p] = {"exp_avg": reader.get(f"{i}.exp_avg").to(p.device),
                                "exp_avg_sq": reader.get(f"{i}.exp_avg_sq").to(p.device),
                                "step": reader.get(f"{i}.step")[0].to(p.device, torch.float32)}  # fused: on its device
    saved = json.loads((out / "trainer_state.json").read_text())["state"]
    return params, opt, TrainState(**saved)


def _optimizer(params: list[torch.nn.Parameter], args: TrainArgs) -> torch.optim.Optimizer:
    """AdamW, fused: one C++ pass over each parameter (foreach's several ops a step took ~3x as long here)."""
    return torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95), fused=True)


def batch_at(stream: torch.Tensor, step: int, batch: int, seq: int, seed: int) -> torch.Tensor:
    """The windows of step `step`: a function of (seed, step) only, so a resumed run sees the same data."""
    rng = random.Random(seed * 1_000_003 + step)
    starts = [rng.randrange(0, len(stream) - seq) for _ in range(batch)]
    return torch.stack([stream[s:s + seq] for s in starts])


def train(draft: Eagle3Draft, verifier: Verifier, stream: torch.Tensor, args: TrainArgs, resume: bool = False,
          log=print, progress: bool = True) -> TrainState:
    """Train `draft` against `verifier` on windows of the token `stream`; checkpoints land in args.out."""
    out = Path(args.out)
    device = verifier.device
    torch.manual_seed(args.seed)
    verifier.eval().requires_grad_(False)
    if resume and (out / "trainer_state.json").exists():
        params, opt, state = load_checkpoint(draft, out, args)
        log(f"resumed from {out} at step {state.step}")
    else:
        params = trainable_parameters(draft)
        opt, state = _optimizer(params, args), TrainState(total=args.max_steps)
    draft.train()
    budget = args.max_minutes * 60
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=state.total, initial=state.step, file=sys.stderr, desc="train-draft", dynamic_ncols=True)
    start = time.time() - state.seconds
    while state.step < state.total:
        for g in opt.param_groups:
            g["lr"] = lr_at(state.step, state.total, args.lr, args.warmup)
        ids = batch_at(stream, state.step, args.batch, args.seq, args.seed).to(device)
        loss, m = ttt_loss(draft, verifier, ids, args.ttt_steps)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
        opt.step()
        state.step += 1
        state.seconds = time.time() - start
        if args.max_minutes and state.step >= 10 and state.step % 10 == 0:  # re-plan the cosine to end on time
            state.total = max(state.step + 1, min(args.max_steps, int(budget / (state.seconds / state.step))))
        if args.max_minutes and state.seconds > budget:
            state.total = state.step
        if bar is not None:
            bar.total = state.total
            bar.set_postfix(loss=f"{m.loss:.3f}", acc0=f"{m.accuracy[0]:.2f}", sim_al=f"{m.simulated_accept_length:.2f}")
            bar.update(1)
        if state.step % args.eval_every == 0 or state.step == state.total or state.step == 1:
            state.history.append({"step": state.step, "seconds": round(state.seconds, 1), "loss": m.loss,
                                  "losses": m.losses, "accuracy": m.accuracy,
                                  "simulated_accept_length": m.simulated_accept_length,
                                  "lr": opt.param_groups[0]["lr"]})
            log(f"step {state.step}/{state.total} loss {m.loss:.3f} acc {[round(a, 3) for a in m.accuracy]} "
                f"sim_AL {m.simulated_accept_length:.2f}")
        if state.step % args.save_every == 0 or state.step == state.total:
            save_checkpoint(draft, opt, params, state, out, args)
    if bar is not None:
        bar.close()
    draft.eval()
    return state


def corpus_stream(tokenizer, data: str = "stdlib", split: str = "train") -> torch.Tensor:
    """Token stream of the training text: the stdlib corpus, or a JSONL file of {"text": ...}."""
    if data == "stdlib":
        from workbench.training.corpus import load_split

        texts = load_split(split)
    else:
        texts = []
        for i, line in enumerate(Path(data).read_text().splitlines(), 1):
            if line.strip():
                obj = json.loads(line)
                if isinstance(obj, dict) and isinstance(obj.get("ids"), list):  # token ids, used as they are
                    texts.append(obj["ids"])
                elif isinstance(obj, dict) and isinstance(obj.get("text"), str):
                    texts.append(obj["text"])
                else:
                    raise ValueError(f"{data}:{i}: fields 'ids' and 'text' missing; expected "
                                     "{\"text\": ...} or {\"ids\": [...]} per line")
    ids: list[int] = []
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    for t in texts:
        body = t if isinstance(t, list) else tokenizer.encode(t)
        ids += ([bos] if bos is not None else []) + body + ([eos] if eos is not None else [])
    return torch.tensor(ids, dtype=torch.long)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="workbench train-draft", description="online EAGLE-3 (TTT) training")
    ap.add_argument("--verifier", help="verifier dir (default: the embedded tiny-kimi verifier)")
    ap.add_argument("--out", required=True, help="draft output dir (checkpoints land here; --resume continues)")
    ap.add_argument("--init", help="start from this draft dir instead of a fresh one")
    ap.add_argument("--attention", default="mla", choices=["mla", "mha"])
    ap.add_argument("--intermediate-size", type=int, default=None)
    ap.add_argument("--fc-norm", action="store_true",
                    help="EAGLE-3.1: an RMSNorm on each aux state before fc (fc_norm.{i}.weight, trained)")
    ap.add_argument("--norm-output", action="store_true",
                    help="EAGLE-3.1: feed the post-norm state back between draft steps")
    ap.add_argument("--data", default="stdlib",
                    help="'stdlib', or a JSONL file of {\"text\": ...} or {\"ids\": [...]} "
                         "(e.g. from python -m workbench.training.regenerate)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--resume", action="store_true")
    for f in TrainArgs.__dataclass_fields__.values():
        if f.name != "out":
            ap.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    a = ap.parse_args(argv)
    from workbench.pair import EMBEDDED, load_draft, load_verifier
    from workbench.tokenizer import Tokenizer
    from workbench.training.draft_init import draft_config_for, init_draft

    vdir = Path(a.verifier) if a.verifier else EMBEDDED / "verifier"
    verifier = load_verifier(vdir, device=a.device, dtype="float32")
    if a.init:
        draft = load_draft(a.init, verifier).float()
        if (a.fc_norm and not draft.config.fc_norm) or (a.norm_output and not draft.config.norm_output):
            raise SystemExit(f"workbench train-draft: --init {a.init} has fc_norm = {draft.config.fc_norm}, "
                             f"norm_output = {draft.config.norm_output}; --fc-norm / --norm-output shape a fresh "
                             f"draft only (drop --init, or the flags)")
    else:
        cfg = draft_config_for(verifier.config, a.attention, a.intermediate_size, fc_norm=a.fc_norm,
                               norm_output=a.norm_output)
        draft = init_draft(cfg, seed=a.seed).to(a.device)
        draft.share(verifier.model.embed_tokens, verifier.lm_head)
        verifier.aux_layer_ids = cfg.aux_layer_ids
    stream = corpus_stream(Tokenizer.from_dir(vdir), a.data)
    args = TrainArgs(out=a.out, **{k: getattr(a, k) for k in TrainArgs.__dataclass_fields__ if k != "out"})
    state = train(draft, verifier, stream, args, resume=a.resume, log=lambda s: print(s, file=sys.stderr))
    print(json.dumps({"out": a.out, "steps": state.step, "minutes": round(state.seconds / 60, 2),
                      "last": state.history[-1] if state.history else None}))
    return 0
