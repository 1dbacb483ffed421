"""The verifier's pretraining pipeline: the training view computes the reference model's math, a
run stopped and resumed lands on the same weights as one that never stopped, and bits per byte
is what its definition says."""
from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from tests.helpers import EMBEDDED
from workbench.models import Verifier
from workbench.training.lm_eval import bits_per_byte, token_byte_lengths
from workbench.training.pretrain import PretrainArgs, init_weights, pretrain, tiny_kimi_config
from workbench.training.train_view import TrainVerifier

TOKENIZER = EMBEDDED / "verifier"


def small_verifier(seed: int = 0) -> Verifier:
    torch.manual_seed(seed)
    cfg = tiny_kimi_config()
    cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size, cfg.moe_intermediate_size = 64, 3, 96, 32
    cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim = 48, 32, 16, 8, 16
    model = Verifier(cfg)
    init_weights(model, cfg.num_hidden_layers, std=0.1)  # large enough that routing and attention matter
    return model


def test_the_training_view_computes_the_reference_logits():
    model = small_verifier().eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 96))
    ref = model(ids).logits
    assert (TrainVerifier(model, bf16=False)(ids) - ref).abs().max().item() <= 2e-4
    got = TrainVerifier(model, bf16=True)(ids).float()
    # bf16 rounding, not another function: small errors almost everywhere (a token whose two best
    # experts nearly tie may route differently in bf16, so the maximum is not bounded tightly).
    assert (got - ref).abs().mean().item() <= 0.02
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.95


@pytest.mark.parametrize("kernels", ["1", "0"], ids=["cpu-kernel", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_chunked_loss_is_cross_entropy_and_its_gradient(kernels, dtype, monkeypatch):
    """`LinearCrossEntropy` (chunked, its gradient formed in the forward; on the CPU kernels the
    loss and gradient of each row are one call) against autograd through F.cross_entropy, over more
    tokens than a chunk so that a partial chunk is included."""
    import torch.nn.functional as F

    from workbench.kernels import cpu
    from workbench.training.train_view import LinearCrossEntropy

    if kernels == "1" and not cpu.available():
        pytest.skip(f"the CPU kernels do not run here: {cpu.status()}")
    monkeypatch.setenv("WORKBENCH_TRAIN_KERNELS", kernels)
    torch.manual_seed(0)
    n = LinearCrossEntropy.CHUNK + 300
    h = torch.randn(n, 64).to(dtype).requires_grad_()
    w = (torch.randn(500, 64) * 0.2).requires_grad_()
    target = torch.randint(0, 500, (n,))
    loss = LinearCrossEntropy.apply(h, w, target)
    loss.backward()
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = F.cross_entropy(F.linear(h2, w2.to(dtype)).float(), target)
    ref.backward()
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # bf16: logits and gradients rounded to bf16
    assert loss.item() == pytest.approx(ref.item(), rel=tol)
    assert torch.allclose(h.grad.float(), h2.grad.float(), rtol=tol, atol=tol * h2.grad.abs().max().item())
    assert torch.allclose(w.grad, w2.grad, rtol=tol, atol=tol * w2.grad.abs().max().item())


def test_the_cross_entropy_kernel_flags_broken_rows_and_refuses_bad_targets():
    from workbench.kernels import cpu

    if not cpu.available():
        pytest.skip(f"the CPU kernels do not run here: {cpu.status()}")
    logits = torch.randn(3, 40)
    logits[1, 7] = float("nan")
    logits[2] = float("-inf")
    before = logits.clone()
    losses = cpu.xent_grad_(logits, torch.tensor([3, 4, 5]), 1.0)
    assert math.isfinite(losses[0]) and math.isnan(losses[1]) and math.isnan(losses[2])
    assert torch.equal(logits[2], before[2]) and torch.isnan(logits[1, 7])  # left as they were
    assert logits[0].sum().abs().item() < 1e-5 and logits[0, 3] < 0  # softmax - onehot sums to 0
    with pytest.raises(IndexError, match="outside"):
        cpu.xent_grad_(torch.randn(2, 40), torch.tensor([0, 40]), 1.0)


@pytest.mark.slow  # torch.compile
def test_the_compiled_ops_train_as_the_eager_ones():
    """`TrainVerifier(compiled=True)`: the norms as a compiled graph. In fp32 the eager view's
    loss and gradients; in bf16 as close to the fp32 gradients as the eager bf16 view (a fused graph
    rounds to bf16 once where the eager ops round after each step, and a token whose experts nearly
    tie may route differently either way)."""
    model = small_verifier().train()
    ids = torch.randint(0, model.config.vocab_size, (2, 97), generator=torch.Generator().manual_seed(1))
    got = {}
    for bf16, compiled in ((False, False), (False, True), (True, False), (True, True)):
        view = TrainVerifier(model, bf16=bf16, compiled=compiled)
        loss = view.loss(ids)
        loss.backward()
        got[bf16, compiled] = (loss.item(), torch.cat([p.grad.flatten() for _, p in view.trainable()]))
        model.zero_grad(set_to_none=True)
    (l32, g32), (l32c, g32c) = got[False, False], got[False, True]
    assert l32c == pytest.approx(l32, rel=1e-6)
    torch.testing.assert_close(g32c, g32, rtol=1e-4, atol=1e-5 * g32.abs().max().item())

    def error(g):
        return ((g - g32).norm() / g32.norm()).item()

    (l16, g16), (l16c, g16c) = got[True, False], got[True, True]
    assert l16c == pytest.approx(l32, rel=2e-3) and error(g16c) <= 1.2 * error(g16) + 1e-3


def test_write_back_puts_the_trained_experts_into_the_reference_layout():
    model = small_verifier().train()
    view = TrainVerifier(model, bf16=False)
    opt = torch.optim.SGD([p for _, p in view.trainable()], lr=0.5)
    ids = torch.randint(0, model.config.vocab_size, (2, 33))
    view.loss(ids).backward()
    opt.step()
    stacked = next(iter(view.experts.values())).w_gate.detach().clone()
    view.write_back()
    first_moe = next(layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts"))
    assert torch.equal(first_moe.experts[3].gate_proj.weight, stacked[3])
    model.eval()
    assert torch.allclose(TrainVerifier(model, bf16=False)(ids[:, :-1]), model(ids[:, :-1]).logits, atol=2e-4)


def _corpus(tmp: Path) -> Path:
    """A small corpus in the built layout, from the project's own source (train) and tests (eval)."""
    root = Path(__file__).resolve().parent.parent
    tmp.mkdir(parents=True, exist_ok=True)
    for split, paths in (("train", sorted((root / "workbench").rglob("*.py"))[:40]),
                         ("eval", sorted((root / "tests").glob("test_*.py"))[:6])):
        with (tmp / f"{split}.jsonl").open("w") as f:
            for p in paths:
                f.write(json.dumps({"package": "workbench" if split == "train" else "tests", "version": "0",
                                    "license": "Apache-2.0", "path": p.name, "text": p.read_text()}) + "\n")
    return tmp


def _args(tmp: Path, corpus: Path, **kw) -> PretrainArgs:
    base = dict(out=tmp, corpus=corpus, tokenizer=TOKENIZER, batch=2, seq=64, lr=3e-3, warmup=2,
                eval_every=1000, eval_windows=2, threads=1, max_minutes=60)
    return PretrainArgs(**{**base, **kw})


@pytest.mark.slow
def test_a_resumed_run_equals_one_that_never_stopped(tmp_path, monkeypatch):
    """Six steps straight, against three steps, a checkpoint, and three more resumed from it: the same
    weights bit for bit, so a run may span sittings without changing what it computes."""
    import workbench.training.pretrain as pt

    corpus = _corpus(tmp_path / "corpus")
    monkeypatch.setattr(pt, "tiny_kimi_config", lambda vocab_size: small_verifier().config)
    straight = pretrain(_args(tmp_path / "a", corpus, max_steps=6), log=lambda s: None)
    # The same schedule, stopped after 3 steps: a resumed run keeps its total (6), so the learning
    # rates match step for step.
    first = pretrain(_args(tmp_path / "b", corpus, max_steps=6, max_minutes=0.0), log=lambda s: None)
    assert first["steps"] == 1  # a zero budget stops after one step
    state = json.loads((tmp_path / "b" / "checkpoint" / "state.json").read_text())
    state["total"] = 6
    (tmp_path / "b" / "checkpoint" / "state.json").write_text(json.dumps(state))
    resumed = pretrain(_args(tmp_path / "b", corpus, max_steps=6, resume=True), log=lambda s: None)
    assert straight["steps"] == resumed["steps"] == 6
    assert [s["mode"] for s in resumed["segments"]] == ["scratch", "resume"]
    from safetensors.torch import load_file

    a = load_file(str(tmp_path / "a" / "checkpoint" / "model.safetensors"))
    b = load_file(str(tmp_path / "b" / "checkpoint" / "model.safetensors"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert straight["eval_bpb_bf16_weights"] == resumed["eval_bpb_bf16_weights"]
    assert (tmp_path / "a" / "final" / "tokenizer.json").is_file()
    # A warm restart from the committed weights continues the run's record: every segment is listed.
    warm = pretrain(_args(tmp_path / "c", corpus, max_steps=2, init=tmp_path / "b" / "final"), log=lambda s: None)
    assert [s["mode"] for s in warm["segments"]] == ["scratch", "resume", "warm restart"]
    assert warm["segments"][-1]["init"] == str(tmp_path / "b" / "final")
    from workbench.kernels import cpu

    assert warm["segments"][-1]["loss"] == ("cpu kernel" if cpu.available() else "torch")  # the log names the path
    assert warm["tokens_seen"] == sum(s["tokens"] for s in resumed["segments"]) + 2 * 2 * 64


@pytest.mark.slow
def test_a_schedule_in_steps_spans_sittings(tmp_path, monkeypatch):
    """`schedule_steps`: a sitting whose time runs out stops with the schedule where it was, and
    resuming finishes the same cosine: the weights of a run that never stopped."""
    import workbench.training.pretrain as pt
    from safetensors.torch import load_file

    corpus = _corpus(tmp_path / "corpus")
    monkeypatch.setattr(pt, "tiny_kimi_config", lambda vocab_size: small_verifier().config)
    straight = pretrain(_args(tmp_path / "a", corpus, schedule_steps=5), log=lambda s: None)
    cut = pretrain(_args(tmp_path / "b", corpus, schedule_steps=5, max_minutes=0.0), log=lambda s: None)
    state = json.loads((tmp_path / "b" / "checkpoint" / "state.json").read_text())
    assert cut["steps"] == state["step"] == 1 and state["total"] == 5 and state["spans"]
    with pytest.raises(ValueError, match="peaks at lr 0.003"):
        pretrain(_args(tmp_path / "b", corpus, resume=True, lr=1e-3), log=lambda s: None)
    resumed = pretrain(_args(tmp_path / "b", corpus, resume=True), log=lambda s: None)
    assert straight["steps"] == resumed["steps"] == 5
    a = load_file(str(tmp_path / "a" / "checkpoint" / "model.safetensors"))
    b = load_file(str(tmp_path / "b" / "checkpoint" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="schedule_steps = 0"):
        pretrain(_args(tmp_path / "bad", corpus, schedule_steps=0), log=lambda s: None)


@pytest.mark.slow
def test_two_processes_train_as_one_with_both_batches(tmp_path, monkeypatch):
    """Data-parallel: 2 processes of 1 window a step land on the weights of 1 process with 2 windows
    a step (the same windows, the gradients averaged; fp32, so only the sums' order differs), and
    the log counts both processes' tokens."""
    import workbench.training.pretrain as pt
    from safetensors.torch import load_file

    corpus = _corpus(tmp_path / "corpus")
    monkeypatch.setattr(pt, "tiny_kimi_config", lambda vocab_size: small_verifier().config)
    one = pretrain(_args(tmp_path / "one", corpus, batch=2, max_steps=3, bf16=False), log=lambda s: None)
    two = pretrain(_args(tmp_path / "two", corpus, batch=1, procs=2, max_steps=3, bf16=False), log=lambda s: None)
    assert one["steps"] == two["steps"] == 3 and two["segment"]["procs"] == 2
    assert one["tokens_seen"] == two["tokens_seen"] == 3 * 2 * 64
    a = load_file(str(tmp_path / "one" / "checkpoint" / "model.safetensors"))
    b = load_file(str(tmp_path / "two" / "checkpoint" / "model.safetensors"))
    assert a.keys() == b.keys()
    start = small_verifier().state_dict()
    moved = max((a[k] - start[k]).abs().max().item() for k in a if k in start)
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert moved > 1e-3 and worst < 1e-5, (moved, worst)  # trained, and the same training
    with pytest.raises(ValueError, match="procs = 0"):
        pretrain(_args(tmp_path / "bad", corpus, procs=0), log=lambda s: None)


def test_bits_per_byte_of_a_uniform_model_is_log2_vocab_over_bytes():
    tok = Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))
    lengths = token_byte_lengths(tok)
    assert lengths[0] == lengths[1] == 0  # <|bos|>, <|eos|> stand for no bytes
    ids = tok.encode("def f(x):\n    return x + 1\n", add_special_tokens=False).ids
    assert sum(lengths[i] for i in ids) == len(b"def f(x):\n    return x + 1\n")
    vocab = tok.get_vocab_size()
    window = torch.tensor([[0, *ids]])
    bpb = bits_per_byte(lambda x: torch.zeros(1, x.shape[1], vocab), [window], lengths, buckets=((0, 256),))
    expected = len(ids) * math.log2(vocab) / sum(lengths[i] for i in ids)
    assert bpb["0-256"] == pytest.approx(expected, rel=1e-3)


def test_a_corpus_without_its_files_is_refused_by_name(tmp_path):
    with pytest.raises(FileNotFoundError, match="train.jsonl"):
        pretrain(_args(tmp_path / "run", tmp_path / "nothing"), log=lambda s: None)


@pytest.mark.slow  # compiles the view's ops
def test_the_training_speed_bench_runs_every_arm_side_by_side():
    import os

    from workbench.training.train_bench import bench_draft_training, bench_training

    before = os.environ.get("WORKBENCH_TRAIN_KERNELS")
    out = bench_training(batch=1, seq=32, steps=1, rounds=2)
    assert set(out["tokens_per_s"]) == {"reference fp32", "reference bf16 autocast", "view fp32", "view bf16",
                                        "view bf16, torch loss", "view bf16, compiled ops"}
    assert all(v > 0 for v in out["tokens_per_s"].values())
    assert all(lo <= out["tokens_per_s"][n] <= hi for n, (lo, hi) in out["spread"].items())
    assert set(out["view_bf16_over_reference"]) == {"reference fp32", "reference bf16 autocast"}
    assert out["kernel_loss_over_torch_loss"] > 0 and out["compiled_ops_over_eager"] > 0
    draft = bench_draft_training(seq=32, steps=1, rounds=2, ttt_steps=2)
    assert set(draft["tokens_per_s"]) == {"kernel loss", "torch loss", "torch loss, masked attention"}
    assert draft["kernel_over_torch"] > 0 and draft["sink_over_masked"] > 0 and draft["now_over_before"] > 0
    assert os.environ.get("WORKBENCH_TRAIN_KERNELS") == before  # each arm's setting is put back


def test_the_verifier_report_card(tmp_path):
    """verifier_eval on a small saved verifier with the chat tokenizer: bits per byte from a file's
    start, the loop verdict of each greedy continuation, and chat answers through the template."""
    import shutil

    from workbench.pair import save_model
    from workbench.training.verifier_eval import evaluate, held_out_prompts

    vdir = tmp_path / "verifier"
    save_model(small_verifier(), vdir)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(__file__).resolve().parent.parent / "assets" / "corpus" / "tokenizer" / f, vdir / f)
    report = evaluate(vdir, _corpus(tmp_path / "corpus"), windows=2, prompts=3, seq=256)
    assert list(report["bits_per_byte"]) == ["0-256"] and 0 < report["bits_per_byte"]["0-256"] < 20
    loops = report["loops"]
    assert loops["prompts"] == len(loops["rows"]) == 3 and loops["loops"] == sum(r["degenerate"] for r in loops["rows"])
    assert loops["truth_loops"] == sum(r["truth_degenerate"] for r in loops["rows"])
    # the reference is the file's own text after the docstring: the prompt and it are one stretch of a file
    texts = [json.loads(line)["text"] for line in (tmp_path / "corpus" / "eval.jsonl").read_text().splitlines()]
    for q in held_out_prompts(tmp_path / "corpus", 3):
        assert q["truth"].startswith("\n") and any(q["prompt"] + q["truth"] in t for t in texts)
    assert len(report["chat"]) == 3 and all(isinstance(c["answer"], str) for c in report["chat"])
    assert not (vdir / "tokens").exists()  # nothing written into the checkpoint


def test_the_embedded_verifier_loads_and_chats_in_kimis_format():
    """The chat verifier (assets/tiny-kimi/verifier, the embedded default): a real
    checkpoint of the same family, its tokenizer's chat markers single tokens, its template Kimi's
    layout, and generation_config ending a turn at <|im_end|>."""
    import json

    from workbench.pair import generation_eos_ids, load_verifier
    from workbench.tokenizer import Tokenizer

    vdir = EMBEDDED / "verifier"
    model = load_verifier(vdir, dtype=torch.float32)
    cfg = model.config
    assert (cfg.model_type, cfg.topk_method, cfg.rope_interleave, cfg.max_position_embeddings) == \
        ("deepseek_v3", "noaux_tc", True, 2048) and cfg.rope_scaling["type"] == "yarn"
    tok = Tokenizer.from_dir(vdir)
    text = tok.format_prompt([{"role": "user", "content": "Write f."}])
    assert text.endswith("<|im_user|>user<|im_middle|>Write f.<|im_end|><|im_assistant|>assistant<|im_middle|>")
    ids = tok.encode(text)
    im_end = tok.encode("<|im_end|>")
    assert len(im_end) == 1 and im_end[0] in ids and im_end[0] in generation_eos_ids(vdir)
    log = json.loads((vdir / "pretrain_log.json").read_text())
    assert log["segments"] and all(s["tokens"] > 0 for s in log["segments"])
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits
    assert torch.isfinite(logits).all()
