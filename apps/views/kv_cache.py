"""KV cache: bytes per token and per sequence for the verifier, the MLA draft and an MHA draft of the same width."""
from pathlib import Path

import pandas as pd
import streamlit as st

from views import charts
from workbench.analysis.kvcache import (KIMI_K2_MLA_DRAFT, KIMI_K2_VERIFIER, bytes_per_token, memory_table,
                                        mha_equivalent)

MHA_TWIN = Path(__file__).resolve().parents[2] / "assets" / "tiny-kimi" / "draft-mha"
KIMI = "Kimi-K2.7-Code (61 layers, 64 heads, kv_lora 512, rope 64, hidden 7168)"  # Kimi-K2's architecture
DTYPES = {"bf16 (2 bytes)": 2, "fp8 (1 byte)": 1, "fp32 (4 bytes)": 4}


@st.cache_resource(show_spinner="Loading the MHA twin draft ...")
def mha_twin(pair_key: str, _pair):
    """The embedded MHA draft on the same verifier (only its cache is used here)."""
    return _pair.with_draft(MHA_TWIN).draft


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

st.subheader("Measured: what the workbench's caches hold")
if pair is None or pair.draft is None:
    st.info("Load a pair with a draft in the sidebar to measure its caches.")
    st.stop()
ctx = st.number_input("Context (tokens)", 1, pair.context_length, min(2048, pair.context_length), key="kv_ctx")
drafts = {f"{pair.draft.attention_kind.upper()} draft (loaded)": pair.draft}
if MHA_TWIN.is_dir() and pair.draft.attention_kind == "mla":
    try:
        drafts["MHA twin (assets/tiny-kimi/draft-mha)"] = mha_twin(st.session_state["pair_key"], pair)
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
