"""Pretraining the embedded tiny-kimi verifier on a permissive Python corpus (the embedded pair only).

A Kimi-K2 in miniature: `deepseek_v3` layout (so transformers and vLLM load it), q_lora set,
a latent cache row of kv_lora + rope = 80 values against 4 heads x (32 + 32) = 256 for MHA,
interleaved YaRN RoPE, sigmoid-routed MoE with a shared expert after one dense layer.
Expert load is balanced DeepSeek-V3's auxiliary-loss-free way: after each step every
expert's `e_score_correction_bias` moves by `bias_update` against its load imbalance.

nanoGPT-style: one straight loop, AdamW, warmup then cosine, a time budget. It trains the
`TrainVerifier` view (stacked experts, causal SDPA, bf16 matmuls) and saves the reference layout.
A run is a sequence of segments: each writes a resumable checkpoint (weights and AdamW moments in
safetensors, the step and data position in JSON) into `out/`, and `--resume` continues it; a new
sitting that has only committed bf16 weights starts a fresh schedule from them with `--init`
(a warm restart). Every segment is logged in `out/pretrain_log.json`.

`procs` > 1 trains data-parallel over that many processes (torch.distributed over gloo, one per
core): every process draws the same step's windows from one shared generator, takes its own
`batch` of them and its gradients are averaged before the update, so N processes compute what one
process with N x `batch` windows a step would, up to the order of the sums.
"""
from __future__ import annotations

import json
import math
import os
import platform
import random
import shutil
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from workbench.config import VerifierConfig
from workbench.models import Verifier
from workbench.training.eagle3 import lr_at
from workbench.training.lm_eval import BUCKETS, bits_per_byte, eval_windows, token_byte_lengths
from workbench.training.token_data import TokenData
from workbench.training.train_view import TrainVerifier, train_kernels


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


@dataclass
class PretrainArgs:
    out: Path
    corpus: Path  # a built corpus: train.jsonl, eval.jsonl, optionally chat_train.jsonl
    tokenizer: Path  # a directory with tokenizer.json (copied next to the weights)
    init: Path | None = None  # warm restart from saved weights (a fresh schedule)
    resume: bool = False  # continue out/'s checkpoint: weights, moments, step, data position
    max_minutes: float = 25.0
    max_steps: int = 1_000_000
    batch: int = 4
    seq: int = 2048
    lr: float = 2e-3
    warmup: int = 50
    floor: float = 0.1  # the cosine ends at floor * lr
    seed: int = 0
    bias_update: float = 1e-3
    bf16: bool = True
    compiled: bool = False  # the view's norms as a torch.compile graph (`train_view.Ops`)
    eval_every: int = 100
    eval_windows: int = 16
    save_every_minutes: float = 10.0
    threads: int | None = None
    procs: int = 1  # data-parallel processes (each with `threads` threads and `batch` windows a step)
    schedule_steps: int | None = None  # one cosine over this many steps across sittings (see `pretrain`)


@dataclass
class RunState:
    """What a segment hands the next one besides the weights and moments."""
    step: int = 0
    total: int = 0
    rng: list = field(default_factory=list)
    segments: list = field(default_factory=list)
    history: list = field(default_factory=list)
    spans: bool = False  # the schedule was set in steps and outlives a sitting's time budget


def _optim_state(opt: torch.optim.Optimizer, named: list[tuple[str, torch.nn.Parameter]]) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in named:
        st = opt.state.get(p, {})
        for key in ("exp_avg", "exp_avg_sq", "step"):
            if key in st:
                out[f"{name}::{key}"] = st[key].detach().reshape(-1) if key == "step" else st[key].detach()
    return out


def _load_optim_state(opt: torch.optim.Optimizer, named: list[tuple[str, torch.nn.Parameter]],
                      tensors: dict[str, torch.Tensor]) -> None:
    for name, p in named:
        if f"{name}::exp_avg" in tensors:
            opt.state[p] = {"exp_avg": tensors[f"{name}::exp_avg"].clone(),
                            "exp_avg_sq": tensors[f"{name}::exp_avg_sq"].clone(),
                            "step": tensors[f"{name}::step"].reshape(()).clone()}


def save_checkpoint(view: TrainVerifier, opt: torch.optim.Optimizer, state: RunState, out: Path) -> None:
    """Reference weights in fp32 + AdamW moments (safetensors) + the run state (JSON), written
    beside the old ones and renamed into place, so a kill mid-save leaves the last good checkpoint."""
    from safetensors.torch import save_file

    from workbench.pair import save_model

    tmp = out / "checkpoint.tmp"
    save_model(view.write_back(), tmp, dtype=torch.float32)
    save_file(_optim_state(opt, view.trainable()), str(tmp / "optimizer.safetensors"))
    (tmp / "state.json").write_text(json.dumps(asdict(state), indent=1))
    final, old = out / "checkpoint", out / "checkpoint.old"
    shutil.rmtree(old, ignore_errors=True)  # left by a kill between the two renames below
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def pretrain(args: PretrainArgs, log=print) -> dict:
    """Train as `args` says; returns the report also written to out/pretrain_log.json.

    The learning rate warms up, then follows a cosine to `floor` x `lr` over the schedule's steps.
    By default a segment sizes its schedule to its own time budget. With `schedule_steps` the
    schedule has that many steps and outlives the sitting: the segment stops when its time is up
    with the schedule where it was, and `resume` continues it (weights, moments, data, schedule)."""
    if isinstance(args.procs, bool) or not isinstance(args.procs, int) or args.procs < 1:
        raise ValueError(f"procs = {args.procs!r}; expected an integer >= 1")
    if args.schedule_steps is not None and (args.resume or args.schedule_steps < 1):
        raise ValueError(f"schedule_steps = {args.schedule_steps!r}; expected an integer >= 1 for a new "
                         "schedule (a resumed run keeps its own)")
    if args.procs == 1:
        return _train(args, log, 0, 1)
    import torch.multiprocessing as mp

    with socket.socket() as s:  # a free port for the processes' rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # fork: the children share what the parent imported (and a test's patches); the CPU holds no CUDA state
    mp.start_processes(_rank, args=(args, log, args.procs, port), nprocs=args.procs, join=True, start_method="fork")
    return json.loads((Path(args.out) / "pretrain_log.json").read_text())


def _rank(rank: int, args: PretrainArgs, log, world: int, port: int) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        _train(args, log if rank == 0 else (lambda _: None), rank, world)
    finally:
        dist.destroy_process_group()


def _mean_over_ranks(tensors: list[torch.Tensor], world: int) -> None:
    """Each tensor replaced in place by its mean over the processes (one flat all-reduce)."""
    import torch.distributed as dist

    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat)
    flat /= world
    at = 0
    for t in tensors:
        t.copy_(flat[at:at + t.numel()].view_as(t))
        at += t.numel()


def _train(args: PretrainArgs, log, rank: int, world: int) -> dict:
    # long: the whole training loop reads top to bottom, as nanoGPT's train.py does
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    from workbench.pair import load_verifier, save_model

    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tok_path = Path(args.tokenizer)
    tok_file = tok_path / "tokenizer.json" if tok_path.is_dir() else tok_path
    tokenizer = Tokenizer.from_file(str(tok_file))
    torch.manual_seed(args.seed)

    t0 = time.time()
    data = TokenData.build(Path(args.corpus), tokenizer, cache=out / "tokens", seed=args.seed, log=log)
    log(f"tokens: train {data.train_tokens:,}, eval {data.eval_tokens:,} ({time.time() - t0:.0f}s)")
    byte_len = token_byte_lengths(tokenizer)
    windows = eval_windows(data, args.seq, args.eval_windows)

    ckpt = out / "checkpoint"
    state = RunState()
    if args.resume:
        if not (ckpt / "state.json").is_file():
            raise FileNotFoundError(f"{ckpt}/state.json: no checkpoint to resume; expected a run started with --out {out}")
        model = load_verifier(ckpt, dtype=torch.float32)
        state = RunState(**json.loads((ckpt / "state.json").read_text()))
        was = state.segments[-1].get("lr") if state.segments else None
        if state.spans and was is not None and was != args.lr:
            raise ValueError(f"{ckpt}/state.json: this run's schedule peaks at lr {was}; resuming it with "
                             f"lr = {args.lr} would change it mid-way (pass --lr {was})")
    elif args.init is not None:
        model = load_verifier(args.init, dtype=torch.float32)
        # The weights' own record (beside them, or in their run folder): a warm restart continues it,
        # so a run spanning sittings lists every segment.
        logs = [Path(args.init) / "pretrain_log.json", Path(args.init).parent / "pretrain_log.json"]
        earlier = next((json.loads(f.read_text()) for f in logs if f.is_file()), {})
        state.segments, state.history = list(earlier.get("segments", [])), list(earlier.get("history", []))
    else:
        cfg = tiny_kimi_config(vocab_size=tokenizer.get_vocab_size())
        model = Verifier(cfg)
        init_weights(model, cfg.num_hidden_layers)
    model.train()
    view = TrainVerifier(model, bf16=args.bf16, compiled=args.compiled)
    named = view.trainable()
    decay = [p for n, p in named if p.dim() >= 2]
    no_decay = [p for n, p in named if p.dim() < 2]
    # fused: one C++ pass over each parameter (foreach's several ops per step took ~3x as long here)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=True)
    if args.resume:
        _load_optim_state(opt, named, load_file(str(ckpt / "optimizer.safetensors")))
    rng = random.Random(args.seed)
    if state.rng:
        rng.setstate((state.rng[0], tuple(state.rng[1]), state.rng[2]))

    budget = args.max_minutes * 60
    # A fresh schedule sizes its cosine to the time budget (re-estimated as training goes, since a
    # shared machine's speed varies) unless set in steps; a resumed one keeps the total it had.
    if not args.resume:
        state.spans = args.schedule_steps is not None
    fixed_total = (args.resume and state.total > 0) or state.spans
    total = state.total if args.resume and state.total > 0 else (args.schedule_steps or args.max_steps)
    first = step = state.step
    stop = total  # where this segment ends: the schedule's end, or where its time ran out
    start = last_save = time.time()
    segment = {"start_step": first, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "mode": "resume" if args.resume else ("warm restart" if args.init else "scratch"),
               **({"init": str(args.init)} if args.init else {}),
               "threads": torch.get_num_threads(), "procs": world, "cpu": _cpu_name(), "batch": args.batch,
               "seq": args.seq, "lr": args.lr, "bf16": args.bf16,
               "loss": "cpu kernel" if train_kernels(torch.zeros(1)) else "torch",  # which path made the loss
               "compiled": args.compiled}
    tokens_a_step = args.batch * world * args.seq
    while step < stop:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, args.lr, args.warmup, floor=args.floor)
        batch = data.sample(args.batch * world, args.seq, rng)[rank * args.batch:(rank + 1) * args.batch]
        loss = view.loss(batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        loads = [m.gate.last_load for m in view.moes()]
        if world > 1:  # the step's mean gradient, loss and expert loads over every process's windows
            for _, p in named:
                if p.grad is None:  # unused here, maybe not elsewhere: its share of the mean is zero
                    p.grad = torch.zeros_like(p)
            loss = loss.detach().clone()
            _mean_over_ranks([p.grad for _, p in named] + [loss] + loads, world)
        torch.nn.utils.clip_grad_norm_([p for _, p in named], 1.0)
        opt.step()
        with torch.no_grad():  # auxiliary-loss-free balancing (DeepSeek-V3 §2.1.2)
            for m, load in zip(view.moes(), loads):
                m.gate.e_score_correction_bias += args.bias_update * torch.sign(load.mean() - load)
        step += 1
        elapsed = time.time() - start
        done = step - first
        if not fixed_total and done >= 10 and done % 10 == 0:
            total = stop = max(step + 1, min(args.max_steps, first + int(budget / (elapsed / done))))
        if elapsed > budget:  # a schedule that spans sittings stays where it is
            stop = step
            total = total if state.spans else step
        if world > 1:  # the first process's clock decides for all
            import torch.distributed as dist

            decided = torch.tensor([total, stop])
            dist.broadcast(decided, 0)
            total, stop = decided.tolist()
        if done % 10 == 0:
            log(f"step {step}/{total} loss {loss.item():.3f} lr {opt.param_groups[0]['lr']:.2e} "
                f"{done * tokens_a_step / elapsed:.0f} tok/s {elapsed:.0f}s")
        if rank == 0 and (step % args.eval_every == 0 or step == stop):
            bpb = bits_per_byte(lambda ids: view(ids), windows, byte_len)
            state.history.append({"step": step, "train_loss": loss.item(), "eval_bpb": bpb, "seconds": elapsed,
                                  "segment": len(state.segments)})
            log(f"eval bits/byte {json.dumps(bpb)}")
        if rank == 0 and (time.time() - last_save > args.save_every_minutes * 60 or step == stop):
            state.step, state.total = step, total
            state.rng = list(rng.getstate())
            save_checkpoint(view, opt, state, out)
            last_save = time.time()
    if rank:  # the others' weights are the first's
        return {}
    minutes = (time.time() - start) / 60
    segment.update(end_step=step, minutes=round(minutes, 2), tokens=(step - first) * tokens_a_step,
                   tokens_per_s=round((step - first) * tokens_a_step / max(1e-9, minutes * 60)))
    state.segments.append(segment)
    state.step, state.total, state.rng = step, total, list(rng.getstate())
    save_checkpoint(view, opt, state, out)

    model = view.write_back().eval()
    save_model(model, out / "final", dtype=torch.bfloat16)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        src = tok_file.parent / f
        if src.is_file():
            (out / "final" / f).write_bytes(src.read_bytes())
    bf16_weights = model.to(torch.bfloat16).float()
    final = bits_per_byte(lambda ids: bf16_weights(ids).logits, windows, byte_len)
    report = {"steps": step, "segment": segment, "eval_bpb_bf16_weights": final, "buckets": BUCKETS,
              "tokens_seen": sum(s["tokens"] for s in state.segments), "segments": state.segments,
              "history": state.history, "seed": args.seed}
    (out / "pretrain_log.json").write_text(json.dumps(report, indent=1))
    return report

