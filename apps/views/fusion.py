"""Fusion: what each verifier aux layer contributes to the draft's fused state, and to acceptance."""
import json

import pandas as pd
import streamlit as st

from views import charts
from views.prompt_sets import pick_prompts
from workbench.analysis.fusion import ABLATION_MODES, CONVENTION, ablation_study, inspect_fusion

st.title("Fusion layer inspector")
pair = st.session_state.get("pair")
if pair is None or pair.draft is None or not hasattr(pair.draft, "fc"):
    st.error("This page needs an EAGLE-3 draft with an fc fusion layer; load a pair in the sidebar.")
    st.stop()
cfg = pair.draft.config
st.caption(f"aux layer ids {list(pair.verifier.aux_layer_ids)} of a {pair.verifier.config.num_hidden_layers}-layer "
           f"verifier ({CONVENTION}); norm_before_residual {cfg.norm_before_residual}, norm_output "
           f"{pair.draft.norm_output}; fc {pair.draft.fc.in_features} → {pair.draft.fc.out_features}")

prompts = pick_prompts("fusion", default_n=1)
c1, c2 = st.columns(2)
k = c1.number_input("k", 1, 8, 3, key="fusion_k")
max_new = c2.number_input("max_new_tokens", 1, 512, 24, key="fusion_max_new")
key = (st.session_state["pair_key"], prompts[0], int(k), int(max_new))

if st.button("Inspect the first prompt", type="primary", key="fusion_run"):
    with st.spinner("generating and reading the fused states"):
        st.session_state["fusion_report"] = (key, inspect_fusion(pair, prompts[0], int(max_new), int(k)))
stored_key, report = st.session_state.get("fusion_report", (None, None))
if report is not None and stored_key == key:
    names = [charts.source_label(s, layer) for s, layer in enumerate(report.aux_layer_ids)]
    cols = st.columns(len(names) + 1)
    loop = report.loop  # a looping continuation's accept length is the easiest a draft ever gets
    cols[0].metric("Accept length", f"{report.accept_length:.3f}",
                   f"loops from token {loop['loop_start']}: no clean figure" if loop["degenerate"]
                   else f"clean {report.accept_length:.3f}, no loop", delta_color="off", delta_arrow="off")
    for col, name, share in zip(cols[1:], names, report.mean_shares):
        col.metric(f"Mean share, {name}", f"{share:.3f}")
    st.plotly_chart(charts.shares_fig(report), key="fusion_fig_shares")
    a, b = st.columns(2)
    a.plotly_chart(charts.block_norms_fig(report), key="fusion_fig_norms")
    b.plotly_chart(charts.per_token_lines_fig(report, report.rms, "RMS of each captured aux state", "RMS"),
                   key="fusion_fig_rms")
    if report.cosine is not None:
        st.plotly_chart(charts.per_token_lines_fig(report, report.cosine, "cos(fused state, h_s)", "cosine"),
                        key="fusion_fig_cos")
    rel = report.relation
    st.subheader("Shares and acceptance, token by token")
    st.caption(f"{len(rel.accepted)} judged proposals, {sum(rel.accepted)} accepted; shares are those of the fused "
               "state at the position before each proposal.")
    st.dataframe(pd.DataFrame({"source": names, "mean share (accepted)": rel.mean_share_accepted,
                               "mean share (rejected)": rel.mean_share_rejected,
                               "correlation with acceptance": rel.correlation}), key="fusion_relation")
    st.download_button("Download JSON", json.dumps(report.to_dict()), "fusion.json", "application/json",
                       key="fusion_json")

st.subheader("Ablation")
modes = st.multiselect("Modes", list(ABLATION_MODES), default=list(ABLATION_MODES), key="fusion_modes")
st.caption("zero: the source's state replaced by zeros; shuffle: by the same source's state at another token. "
           "Greedy accept length over the chosen prompts, each source in turn.")
if st.button("Run ablation", key="fusion_ablate", disabled=not modes):
    bar = st.progress(0.0, text="waiting for the model")
    st.session_state["fusion_ablation"] = (key, ablation_study(
        pair, prompts, int(k), int(max_new), modes=modes, progress=lambda i, n, s: bar.progress(i / n, text=s)))
    bar.empty()
stored_key, ablation = st.session_state.get("fusion_ablation", (None, None))
if ablation is not None and stored_key[0] == key[0]:
    st.plotly_chart(charts.ablation_fig(ablation), key="fusion_fig_ablation")
    st.text(ablation.summary())
