"""Tuning: measure accept length, tokens/s and speedup over k, and pick the k to serve with."""
import json

import pandas as pd
import streamlit as st

from views import charts
from views.prompt_sets import pick_prompts
from workbench.analysis.sweep import run_sweep


@st.cache_data(show_spinner=False, max_entries=32)
def sweep(pair_key: str, prompts: tuple, ks: tuple, temperatures: tuple, max_new_tokens: int, seed: int, _pair):
    """Cached on the inputs (the pair by its directories; `_pair` is not hashed).

    The progress bar is created in here, not passed in: Streamlit replays the elements a cached
    function drew on a cache hit, which only works for blocks the function created itself.
    """
    bar = st.progress(0.0, text="starting")
    result = run_sweep(_pair, list(prompts), ks=list(ks), temperatures=list(temperatures),
                       max_new_tokens=max_new_tokens, seed=seed, progress=lambda i, n, s: bar.progress(i / n, text=s))
    bar.empty()
    return result


st.title("Tuning: which k?")
pair, lock = st.session_state.get("pair"), st.session_state.get("timing_lock")
if pair is None or pair.draft is None:
    st.error("This page needs a verifier and a draft; load a pair in the sidebar.")
    st.stop()

prompts = pick_prompts("tune")
c1, c2, c3 = st.columns(3)
temperatures = c1.multiselect("Temperatures", [0.0, 0.3, 0.7, 1.0], default=[0.0], key="tune_temps")
max_new = c2.number_input("max_new_tokens", 1, 1024, 32, key="tune_max_new")
seed = c3.number_input("Seed", 0, 2**31 - 1, 0, key="tune_seed")
k_lo, k_hi = st.session_state["k_bounds"]
st.caption(f"k = {k_lo}..{k_hi} (sidebar), each against the autoregressive baseline on the same prompts.")

if st.button("Run sweep", type="primary", key="tune_run", disabled=not temperatures):
    with st.spinner("measuring (or waiting for another session's generation to finish)"), lock:
        result = sweep(st.session_state["pair_key"], tuple(prompts), tuple(range(k_lo, k_hi + 1)),
                       tuple(sorted(temperatures)), int(max_new), int(seed), pair)
    st.session_state["tune_result"] = (st.session_state["pair_key"], result)
key, result = st.session_state.get("tune_result", (None, None))
if result is None or key != st.session_state["pair_key"]:  # nothing yet, or measured on another pair
    st.info("Pick prompts and settings, then press **Run sweep**.")
    st.stop()

t = st.selectbox("Temperature shown", result.temperatures, key="tune_show_t") if len(result.temperatures) > 1 \
    else result.temperatures[0]
try:
    rec = result.recommendation(t)
except ValueError as e:
    rec = None
    st.warning(str(e))
m1, m2, m3 = st.columns(3)
m1.metric("Recommended k (goodput model)", "-" if rec is None else ("0 (no speculation)" if rec.k == 0 else rec.k))
best = max((p for p in result.points if p.temperature == t), key=lambda p: p.tokens_per_s)
m2.metric("Fastest measured k", f"{best.k}", f"{best.tokens_per_s:.1f} tok/s", delta_color="off", delta_arrow="off")
m3.metric("Autoregressive", f"{result.point(t, 0).tokens_per_s:.1f} tok/s")
if rec is not None:
    (st.success if rec.agrees else st.warning)(f"**Recommended k = {rec.k}.** {rec.reason}")

a, b = st.columns(2)
a.plotly_chart(charts.accept_length_fig(result), key="tune_fig_accept")
b.plotly_chart(charts.throughput_fig(result), key="tune_fig_tps")
if rec is not None:
    st.plotly_chart(charts.speedup_fig(result, t, rec), key="tune_fig_speedup")
    st.caption("The model's unit is one verifier step of the speculative run (it charges a (k+1)-token verify "
               "like a 1-token step); measured speedups are against the real autoregressive step.")
k_show = st.selectbox("k for the per-position charts", result.ks, index=len(result.ks) - 1, key="tune_show_k")
a, b = st.columns(2)
a.plotly_chart(charts.per_position_fig(result.point(t, k_show)), key="tune_fig_pos")
b.plotly_chart(charts.histogram_fig(result.point(t, k_show)), key="tune_fig_hist")

frame = pd.DataFrame(result.rows())
st.dataframe(frame, key="tune_table")
d1, d2 = st.columns(2)
d1.download_button("Download CSV", frame.to_csv(index=False), "sweep.csv", "text/csv", key="tune_csv")
d2.download_button("Download JSON", json.dumps(result.to_dict(), indent=1), "sweep.json", "application/json",
                   key="tune_json")
