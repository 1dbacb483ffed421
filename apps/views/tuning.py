"""Tuning: measure accept length, decode speed and speedup over k, and pick the k to serve with."""
import json

import pandas as pd
import streamlit as st

from views import charts
from views.prompt_sets import pick_prompts
from workbench.analysis.sweep import run_sweep


@st.cache_data(show_spinner=False, max_entries=32)
def sweep(pair_key: str, prompts: tuple, ks: tuple, temperatures: tuple, max_new_tokens: int, seed: int,
          repeats: int, rates: tuple | None, _pair):
    """Cached on the inputs (the pair by its directories; `_pair` is not hashed).

    The progress bar is created in here, not passed in: Streamlit replays the elements a cached
    function drew on a cache hit, which only works for blocks the function created itself.
    """
    bar = st.progress(0.0, text="starting")
    result = run_sweep(_pair, list(prompts), ks=list(ks), temperatures=list(temperatures),
                       max_new_tokens=max_new_tokens, seed=seed, repeats=repeats,
                       synthetic_rates=list(rates) if rates else None,
                       progress=lambda i, n, s: bar.progress(i / n, text=s))
    bar.empty()
    return result


def parse_rates(text: str) -> tuple | None:
    """The synthetic rates box: comma-separated unconditional rates; bad input stops the page with why."""
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        st.error(f"Synthetic rates = {text!r}: expected comma-separated numbers in [0, 1], e.g. 0.9,0.8,0.7")
        st.stop()


st.title("Tuning: which k?")
pair, lock = st.session_state.get("pair"), st.session_state.get("timing_lock")
if pair is None or pair.draft is None:
    st.error("This page needs a verifier and a draft; load a pair in the sidebar.")
    st.stop()

prompts = pick_prompts("tune")
c1, c2, c3, c4 = st.columns(4)
temperatures = c1.multiselect("Temperatures", [0.0, 0.3, 0.7, 1.0], default=[0.0], key="tune_temps")
max_new = c2.number_input("max_new_tokens", 2, 1024, 32, key="tune_max_new")
seed = c3.number_input("Seed", 0, 2**31 - 1, 0, key="tune_seed")
repeats = c4.number_input("Repeats", 1, 20, 2, key="tune_repeats",
                          help="timed passes over the prompts, after an untimed warm-up of every arm")
source = st.radio("Acceptance", ["The draft", "Synthetic rates"], horizontal=True, key="tune_acceptance",
                  help="Synthetic: accept each position with a given rate (vLLM's rejection_sample_method "
                       "'synthetic'): this machine's cost curve for a draft of that quality, not lossless")
rates = parse_rates(st.text_input("Unconditional rates per position", "0.9,0.8,0.7", key="tune_rates")) \
    if source == "Synthetic rates" else None
k_lo, k_hi = st.session_state["k_bounds"]
st.caption(f"k = {k_lo}..{k_hi} (sidebar), each against the autoregressive baseline, interleaved per prompt.")

if st.button("Run sweep", type="primary", key="tune_run", disabled=not temperatures):
    try:
        with st.spinner("measuring (or waiting for another session's sweep to finish)"), lock:
            result = sweep(st.session_state["pair_key"], tuple(prompts), tuple(range(k_lo, k_hi + 1)),
                           tuple(sorted(temperatures)), int(max_new), int(seed), int(repeats), rates, pair)
        st.session_state["tune_result"] = (st.session_state["pair_key"], result)
    except ValueError as e:  # synthetic rates out of range, too many for k, ...
        st.error(str(e))
        st.stop()
key, result = st.session_state.get("tune_result", (None, None))
if result is None or key != st.session_state["pair_key"]:  # nothing yet, or measured on another pair
    st.info("Pick prompts and settings, then press **Run sweep**.")
    st.stop()

t = st.selectbox("Temperature shown", result.temperatures, key="tune_show_t") if len(result.temperatures) > 1 \
    else result.temperatures[0]
rec = result.recommendation(t)
st.caption(f"{result.num_prompts} prompts x {result.repeats} repeats · acceptance: {result.acceptance} · "
           f"rule: {result.acceptance_rules[t]}")
if rec.set_aside:
    st.error("Measurement errors, left out: " + "; ".join(f"k={p.k}: {p.error}" for p in result.points
                                                            if p.temperature == t and p.error))
# an undecided run, or one whose evidence is mostly looping text, says so before any figure
(st.success if rec.decided and not rec.mostly_loops else st.warning)(rec.reason)
best = result.point(t, rec.k)
m1, m2, m3, m4, m5 = st.columns(5)
m1.metric("Fastest measured k" if not rec.decided else "Recommended k", "0 (no speculation)" if rec.k == 0 else rec.k)
m2.metric("Its speedup [95%]", f"{best.speedup.median:.2f}x", f"[{best.speedup.lo:.2f}, {best.speedup.hi:.2f}]",
          delta_color="off", delta_arrow="off")
m3.metric("Step-cost model's best k", rec.model_k, "agrees" if rec.agrees else "does not agree",
          delta_color="off", delta_arrow="off")
m4.metric("Autoregressive (decode)", f"{result.point(t, 0).tokens_per_s.median:.1f} tok/s")
m5.metric("Its accept length", f"{best.accept_length:.2f}",
          f"clean {'n/a' if best.accept_length_clean is None else f'{best.accept_length_clean:.2f}'}, "
          f"{best.degenerate} of {result.num_prompts} loop", delta_color="off", delta_arrow="off",
          help="Clean: over the continuations that do not loop (fewer than 30% of their 6-grams repeat an "
               "earlier one). A loop is the easiest text a draft ever sees.")

st.table(pd.DataFrame([{"k": p.k, "accept length": f"{p.accept_length:.3f}",
                        "clean accept length": "n/a" if p.accept_length_clean is None
                        else f"{p.accept_length_clean:.3f}",
                        "loops": f"{p.degenerate}/{result.num_prompts}",
                        "tokens/s [95%]": str(p.tokens_per_s), "speedup [95%]": str(p.speedup),
                        "model": "" if p.model_speedup is None else f"{p.model_speedup:.2f}",
                        "bound": f"{p.bound:.2f}", "prefill ms": f"{p.prefill_ms:.1f}"}
                       for p in result.points if p.temperature == t]))

a, b = st.columns(2)
a.plotly_chart(charts.accept_length_fig(result), key="tune_fig_accept")
b.plotly_chart(charts.throughput_fig(result), key="tune_fig_tps")
st.plotly_chart(charts.speedup_fig(result, t), key="tune_fig_speedup")
st.caption("Measured: decode-only speedup, median and 95% bootstrap interval over prompts x repeats. Model: "
           "E(k) / (t_verify(k+1)/t_decode + k c_draft + host work), each term measured in this run; its band "
           "is a bootstrap too, and past the measured ks it extrapolates.")
k_show = st.selectbox("k for the per-position charts", result.ks, index=len(result.ks) - 1, key="tune_show_k")
a, b = st.columns(2)
a.plotly_chart(charts.per_position_fig(result.point(t, k_show)), key="tune_fig_pos")
b.plotly_chart(charts.histogram_fig(result.point(t, k_show)), key="tune_fig_hist")

st.subheader("For vLLM")
o = rec.outputs  # for the recommended k, or the fastest speculative one when plain decoding was faster
if o["note"]:
    st.info(o["note"].capitalize() + ".")
st.markdown(f"`--speculative-config` for k = {o['k']}:")
st.code(json.dumps(o["speculative_config"]), language="json")
st.markdown("This pair's acceptance, replayed at a deployment's own speed (synthetic acceptance):")
st.code(json.dumps(o["synthetic_acceptance"]), language="json")
st.markdown("Per-request spec-decode metrics in vLLM's form (`acceptance_histogram[j]`: steps that accepted "
            "exactly j draft tokens), pooled over the prompts:")
st.code(json.dumps(o["spec_decode_metrics"]), language="json")

frame = pd.DataFrame(result.rows())
st.dataframe(frame, key="tune_table")
d1, d2 = st.columns(2)
d1.download_button("Download CSV", frame.to_csv(index=False), "sweep.csv", "text/csv", key="tune_csv")
d2.download_button("Download JSON", json.dumps(result.to_dict(), indent=1), "sweep.json", "application/json",
                   key="tune_json")
