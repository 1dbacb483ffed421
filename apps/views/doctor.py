"""Doctor: static checks and acceptance probes for a silently misconfigured draft/verifier pairing."""
import json

import pandas as pd
import streamlit as st

from views import charts
from views.prompt_sets import pick_prompts
from workbench.analysis.doctor import MARGIN_ABS, MARGIN_REL, MIN_ACCEPT, NOISE_Z, diagnose, static_checks

st.title("Pairing doctor")
pair = st.session_state.get("pair")
if pair is None:
    st.error("Load a pair in the sidebar first.")
    st.stop()

st.subheader("Static checks")
checks = static_checks(pair)
st.dataframe(pd.DataFrame([{"status": c.status.upper(), "check": c.name, "detail": c.detail} for c in checks]),
             key="doctor_checks", hide_index=True, height=36 * (len(checks) + 1) + 2)  # every row, no scrolling
failed = [c.name for c in checks if c.status == "fail"]
if failed:
    st.error("Static checks failed: " + ", ".join(failed))
if pair.draft is None:
    st.stop()

st.subheader("Acceptance probes")
st.caption(f"Greedy accept length of the configured pairing and of each alternative (aux ids ±1, RoPE pairing, "
           f"pre/post-norm feedback, own vs verifier embedding). An alternative is flagged when it beats the "
           f"configured one by more than {MARGIN_ABS} and {MARGIN_REL:.0%} *and* a paired test over the same "
           f"positions gives z > {NOISE_Z:g} (first proposals at every position of prompts and output, "
           f"teacher-forced). A configured accept length below {MIN_ACCEPT} means the draft is dead. Each accept "
           "length comes with the one over the continuations that do not loop (fewer than 30% of their 6-grams "
           "repeat an earlier one) and the loop count: a loop is the easiest text a draft ever sees.")
prompts = pick_prompts("doctor")
c1, c2 = st.columns(2)
k = c1.number_input("k", 1, 8, 3, key="doctor_k")
max_new = c2.number_input("max_new_tokens", 1, 512, 32, key="doctor_max_new")
if st.button("Run the probes", type="primary", key="doctor_run"):
    bar = st.progress(0.0, text="waiting for the model")
    report = diagnose(pair, prompts, k=int(k), max_new_tokens=int(max_new),
                      progress=lambda i, n, s: bar.progress(i / n, text=s))
    bar.empty()
    st.session_state["doctor_report"] = (st.session_state["pair_key"], report)
key, report = st.session_state.get("doctor_report", (None, None))
if report is None or key != st.session_state["pair_key"]:
    st.stop()

for c in report.checks:
    if c.name == "prompts" and c.status == "warn":
        st.warning(c.detail)
conf = report.configured
if report.ok:
    st.success(f"No problems found: configured accept length {conf.accept_length:.3f} "
               f"({conf.loops_text(report.num_prompts)}) and no alternative does clearly better.")
else:
    st.error("Problems found:\n\n" + "\n".join(f"- {f}" for f in report.flags))
st.plotly_chart(charts.probes_fig(report), key="doctor_fig_probes")
st.dataframe(pd.DataFrame([{"probe": p.name, "accept length": p.accept_length,
                            "clean accept length": p.accept_length_clean,
                            "loops": "" if p.accept_length is None else f"{p.degenerate}/{report.num_prompts}",
                            "delta": p.delta,
                            "first proposals": p.first_proposal_rate, "z": p.z, "paired on": p.test,
                            "flagged": p.flagged, "skipped": p.skipped or "", "what it tests": p.description}
                           for p in [report.configured, *report.probes]]), key="doctor_probes", hide_index=True)
st.download_button("Download JSON", json.dumps(report.to_dict(), indent=1), "doctor.json", "application/json",
                   key="doctor_json")
