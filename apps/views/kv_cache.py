"""KV cache: bytes per token and per sequence for the verifier, the MLA draft and an MHA draft of the same width."""
from pathlib import Path

import pandas as pd
import streamlit as st

import json

from views import charts
from views.prompt_sets import PROMPTS_DIR
from workbench.analysis.kvcache import (HANDOVER_MODES, KIMI_K2_MLA_DRAFT, KIMI_K2_VERIFIER, bytes_per_token,
                                        handover_bytes, memory_table, mha_equivalent)
from workbench.analysis.context import load_documents
from workbench.analysis.pd import document_cuts, pd_study, role_mismatches
from workbench.cli import parse_prompts
from workbench.analysis.vllm_keys import speculative_config

MHA_TWIN = Path(__file__).resolve().parents[2] / "assets" / "tiny-kimi" / "draft-mha"
KIMI = "Kimi-K2.7-Code (61 layers, 64 heads, kv_lora 512, rope 64, hidden 7168)"  # Kimi-K2's architecture
DTYPES = {"bf16 (2 bytes)": 2, "fp8 (1 byte)": 1, "fp32 (4 bytes)": 4}


@st.cache_resource(show_spinner="Loading the MHA twin draft ...")
def mha_twin(pair_key: str, _pair):
    """The embedded MHA draft on the same verifier, as a pair."""
    return _pair.with_draft(MHA_TWIN)


@st.cache_data(show_spinner="Prefilling, handing over and decoding every prompt in every mode ...", max_entries=8)
def measure_pd(pair_key: str, n: int, long_tokens: int, max_new: int, _pairs: dict) -> dict:
    """`pd_study` on the first n code prompts and on n long ones, cut from long held-out documents
    (cached on the inputs; `_pairs` not hashed)."""
    prompts = parse_prompts((PROMPTS_DIR / "code.jsonl").read_text(), "assets/prompts/code.jsonl")[:n]
    first = next(iter(_pairs.values()))
    docs = [d["text"] for d in load_documents()]
    sets = {"short": prompts, f"long-{long_tokens}": document_cuts(first, docs, long_tokens, n)}
    return pd_study(_pairs, sets, k=3, max_new_tokens=max_new).to_dict()


def pd_panel(vcfg, dcfg, nb: int, pair) -> None:
    """Prefill/decode disaggregation: bytes per request by mode and draft kind, acceptance by mode, and the
    check that both roles run the same speculative config."""
    st.subheader("Prefill/decode disaggregation")
    st.caption("What the prefill instance hands the decode instance per request: the verifier's KV and the last "
               "position's aux states always; the draft's KV too (full), or the aux states of every prompt "
               "position so the decode side re-runs the draft's prompt pass (recompute), or neither (cold).")
    plen = int(st.number_input("Prompt tokens", 1, 10_000_000, 4096, key="pd_len"))
    rows = []
    for kind, d in (("MLA draft", dcfg), ("MHA draft", mha_equivalent(dcfg))):
        for mode in HANDOVER_MODES:
            b = handover_bytes(vcfg, d, plen, mode, nb)
            rows.append({"draft": kind, "mode": mode, "total": fmt(b["total"]), "verifier KV": fmt(b["verifier_kv"]),
                         "draft KV": fmt(b["draft_kv"]), "aux states": fmt(b["last_aux"] + b["prompt_aux"]),
                         "page layouts": b["page_layouts"]})
    st.table(pd.DataFrame(rows))
    if pair is not None and pair.draft is not None and pair.draft.attention_kind == "mla" and MHA_TWIN.is_dir():
        c1, c2, c3 = st.columns(3)
        n = int(c1.number_input("Prompts", 1, 16, 4, key="pd_n"))
        long_tokens = int(c2.number_input("Long prompt tokens", 16, pair.context_length - 64,
                                          min(1024, pair.context_length - 64), key="pd_long"))
        max_new = int(c3.number_input("New tokens", 2, 64, 32, key="pd_new"))
        if st.button("Measure acceptance by mode", key="pd_run"):
            pairs = {"mla": pair, "mha": mha_twin(st.session_state["pair_key"], pair)}
            st.session_state["pd_result"] = measure_pd(st.session_state["pair_key"], n, long_tokens, max_new, pairs)
        result = st.session_state.get("pd_result")
        if result:
            frame = pd.DataFrame(result["results"])
            st.dataframe(frame, key="pd_table", hide_index=True)
            st.plotly_chart(charts.pd_fig(frame), key="pd_fig")
    st.markdown("**Both roles must run the same speculative config** (k, draft, aux ids):")
    default = dict(speculative_config(pair.draft_dir if pair is not None and pair.draft_dir else "draft", 3),
                   eagle_aux_hidden_state_layer_ids=list(dcfg.aux_layer_ids))
    r1, r2 = st.columns(2)
    texts = (r1.text_area("Prefill role", json.dumps(default), key="pd_prefill_cfg"),
             r2.text_area("Decode role", json.dumps(default), key="pd_decode_cfg"))
    try:
        bad = role_mismatches(*(json.loads(t) for t in texts))
    except ValueError as e:  # json.JSONDecodeError is a ValueError
        st.error(f"Could not read a role's config: {e}")
        return
    if bad:
        st.error("Mismatch between the roles: " + "; ".join(bad))
    else:
        st.success("Both roles run the same speculative config.")


def fmt(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


st.title("KV cache: MLA vs MHA draft")
pair = st.session_state.get("pair")
presets = {KIMI: (KIMI_K2_VERIFIER, KIMI_K2_MLA_DRAFT)}
if pair is not None and pair.draft is not None and pair.draft.config.attention == "mla":
    presets["Loaded pair"] = (pair.verifier.config, pair.draft.config)
name = st.selectbox("Configs", list(presets), key="kv_preset")
dtype = st.selectbox("Cache dtype", list(DTYPES), key="kv_dtype")
vcfg, dcfg = presets[name]
nb = DTYPES[dtype]
v_tok, d_tok, m_tok = bytes_per_token(vcfg, nb), bytes_per_token(dcfg, nb), bytes_per_token(mha_equivalent(dcfg), nb)
c1, c2, c3 = st.columns(3)
plain = dict(delta_color="off", delta_arrow="off")  # the deltas are notes, not changes
c1.metric("Verifier, per token", fmt(v_tok), f"{vcfg.num_hidden_layers} layers x {vcfg.cache_row} values", **plain)
c2.metric("MLA draft, per token", fmt(d_tok), f"1 layer x {dcfg.cache_row} values", **plain)
c3.metric("MHA draft, per token", fmt(m_tok), f"{m_tok / d_tok:.1f}x the MLA draft", **plain)

b1, b2 = st.columns(2)
batches = b1.multiselect("Batch sizes", [1, 8, 32, 64, 128], default=[1, 8, 64], key="kv_batches")
contexts = b2.multiselect("Contexts", [1024, 4096, 16384, 32768, 131072], default=[4096, 32768, 131072],
                          key="kv_contexts")
if batches and contexts:
    rows = memory_table(vcfg, dcfg, tuple(sorted(batches)), tuple(sorted(contexts)), nb)
    table = pd.DataFrame([{"batch": r["batch"], "context": r["context"], "verifier": fmt(r["verifier_bytes"]),
                           "MLA draft": fmt(r["draft_bytes"]), "MHA draft": fmt(r["mha_draft_bytes"]),
                           "MLA draft share": f"{r['draft_share']:.2%}",
                           "MHA draft share": f"{r['mha_draft_share']:.2%}"}
                          for r in rows])
    st.dataframe(table, key="kv_table", hide_index=True)
    st.plotly_chart(charts.kv_fig(rows, max(batches)), key="kv_fig")

pd_panel(vcfg, dcfg, nb, pair)

st.subheader("Measured: what the workbench's caches hold")
if pair is None or pair.draft is None:
    st.info("Load a pair with a draft in the sidebar to measure its caches.")
    st.stop()
ctx = st.number_input("Context (tokens)", 1, pair.context_length, min(2048, pair.context_length), key="kv_ctx")
drafts = {f"{pair.draft.attention_kind.upper()} draft (loaded)": pair.draft}
if MHA_TWIN.is_dir() and pair.draft.attention_kind == "mla":
    try:
        drafts["MHA twin (assets/tiny-kimi/draft-mha)"] = mha_twin(st.session_state["pair_key"], pair).draft
    except (ValueError, OSError) as e:  # a twin that does not fit a user-chosen verifier
        st.caption(f"MHA twin not loaded: {e}")
measured = []
for label, cache, cfg in [("verifier", pair.verifier.new_cache(int(ctx)), pair.verifier.config),
                          *[(lbl, d.new_cache(int(ctx)), d.config) for lbl, d in drafts.items()]]:
    expected = bytes_per_token(cfg, cache.rows.element_size())
    measured.append({"cache": label, "dtype": str(cache.rows.dtype).removeprefix("torch."),
                     "bytes per token": cache.bytes_per_token, "from the config": expected,
                     "allocated": fmt(cache.nbytes_allocated), "matches": cache.bytes_per_token == expected})
    del cache
st.dataframe(pd.DataFrame(measured), key="kv_measured", hide_index=True)
