"""Helpers the tests share: where the repository and the embedded pair are, and small random pairs."""
from __future__ import annotations

import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EMBEDDED = REPO / "assets" / "tiny-kimi"
# Published configs and tensor listings, kept in the repository so a clone tests on its own.
REAL = REPO / "tests" / "data" / "real"


def make_random_pair(out: Path, seed: int = 0, attention: str = "mla", hidden: int = 64, layers: int = 4,
                     vocab: int | None = None, aux_layer_ids=None, max_pos: int = 512) -> tuple[Path, Path]:
    """A small random verifier + draft saved as HF checkpoints, with the embedded tokenizer.

    Weights are random, so the draft is rarely accepted: use it for exactness, not acceptance.
    """
    import torch

    from workbench.models import Verifier
    from workbench.pair import save_model
    from workbench.training.draft_init import draft_config_for, init_draft
    from workbench.training.pretrain import init_weights, tiny_kimi_config

    torch.manual_seed(seed)
    cfg = tiny_kimi_config()
    cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size, cfg.moe_intermediate_size = hidden, layers, 96, 32
    cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim = 48, 32, 16, 8, 16
    cfg.max_position_embeddings = max_pos
    cfg.rope_scaling = dict(cfg.rope_scaling, original_max_position_embeddings=max_pos // 4)
    if vocab:
        cfg.vocab_size = vocab
    v = Verifier(cfg, aux_layer_ids)
    init_weights(v, layers, std=0.08)
    with torch.no_grad():
        for name, b in v.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.3)
    vdir, ddir = out / "verifier", out / "draft"
    save_model(v, vdir)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(EMBEDDED / "verifier" / f, vdir / f)
    save_model(init_draft(draft_config_for(cfg, attention, intermediate_size=128, aux_layer_ids=aux_layer_ids),
                          seed=seed, std=0.08), ddir)
    return vdir, ddir


CHAIN_IDS = [5, 9, 200, 31, 7, 77, 3]


def draft_chain_runs(pair, draft=None, ids=CHAIN_IDS, k: int = 4) -> dict[str, tuple]:
    """The accelerated draft's greedy chain three ways: its one-call chain ("chain": the kernels'
    `run_greedy_chain`), the engine's Python chain pass by pass through the twins' kernels ("passes":
    `greedy_chain` over them) and over the plain draft ("plain"), after a verifier prefill of `ids`:
    name -> (tokens, probs, cache)."""
    import torch

    from workbench.decoding.drafters import greedy_chain

    v, d, plain = pair.verifier, draft or pair.draft, pair.reference().draft
    with torch.inference_mode():
        out = v(torch.tensor([ids]), v.new_cache(64))
        x = torch.tensor([ids[1:] + [42]])
        runs = {}
        for name, chain in (("chain", lambda *a: d.run_greedy_chain(greedy_chain, *a)),
                            ("passes", lambda *a: greedy_chain(d, *a)), ("plain", lambda *a: greedy_chain(plain, *a))):
            cache = d.new_cache(64)
            runs[name] = chain(x, out.aux_hidden_states, cache, k) + (cache,)
    runs["aux"], runs["x"] = out.aux_hidden_states, x
    return runs
