"""Batching: speculation under load, over batch size x k; the schedule for vLLM; the GPU model; adaptive k."""
import json

import pandas as pd
import streamlit as st

from views import charts
from views.prompt_sets import pick_prompts
from workbench.analysis.batching import compare_policies, default_policies, run_batch_sweep
from workbench.batch_schedule import ScheduleError, read_schedule


@st.cache_data(show_spinner=False, max_entries=16)
def sweep(pair_key: str, prompts: tuple, batch_sizes: tuple, ks: tuple, max_new_tokens: int, repeats: int, _pair):
    """Cached on the inputs (`_pair` unhashed); the progress bar is created in here (see tuning.py)."""
    bar = st.progress(0.0, text="starting")
    result = run_batch_sweep(_pair, list(prompts), list(batch_sizes), list(ks), max_new_tokens, repeats,
                             progress=lambda i, n, s: bar.progress(i / n, text=s))
    bar.empty()
    return result


@st.cache_data(show_spinner=False, max_entries=16)
def adaptive(pair_key: str, prompts: tuple, batch_size: int, ks: tuple, costs_key: tuple, max_new_tokens: int,
             repeats: int, _costs, _pair):
    """Both adaptive policies and every static k, cached on the inputs and the sweep's step costs."""
    bar = st.progress(0.0, text="starting")
    out = compare_policies(_pair, list(prompts), default_policies(_costs, max(ks)), list(ks), batch_size,
                           max_new_tokens, repeats, progress=lambda i, n, s: bar.progress(i / n, text=s))
    bar.empty()
    return out


def full(n: int, b: int) -> int:
    """The requests in full groups of b (what the comparison with the baseline covers)."""
    return n // b * b


st.title("Batching: does speculation pay under load?")
pair, lock = st.session_state.get("pair"), st.session_state.get("timing_lock")
if pair is None or pair.draft is None:
    st.error("This page needs a verifier and a draft; load a pair in the sidebar.")
    st.stop()

prompts = pick_prompts("batch", default_n=16, default_set="code.jsonl")  # enough for the largest default B
c1, c2, c3 = st.columns(3)
sizes = c1.multiselect("Batch sizes", [1, 2, 4, 8, 16], default=[1, 2, 4, 8], key="batch_sizes")
max_new = c2.number_input("max_new_tokens", 2, 1024, 32, key="batch_max_new")
repeats = c3.number_input("Repeats", 1, 20, 2, key="batch_repeats", help="timed passes, after an untimed warm-up")
k_lo, k_hi = st.session_state["k_bounds"]
st.caption(f"k = {k_lo}..{k_hi} (sidebar) against plain decoding batched the same way (k = 0); prompts go in "
           "groups of B, so the largest B needs at least that many prompts.")
if st.button("Run batch sweep", type="primary", key="batch_run", disabled=not sizes):
    try:
        with st.spinner("measuring (or waiting for another session's measurement to finish)"), lock:
            result = sweep(st.session_state["pair_key"], tuple(prompts), tuple(sorted(sizes)),
                           tuple(range(k_lo, k_hi + 1)), int(max_new), int(repeats), pair)
        st.session_state["batch_result"] = (st.session_state["pair_key"], result)
        st.session_state.pop("batch_adaptive", None)  # measured against another sweep's step costs
    except ValueError as e:  # fewer prompts than the largest batch size, ...
        st.error(str(e))
        st.stop()
key, result = st.session_state.get("batch_result", (None, None))
if result is None or key != st.session_state["pair_key"]:
    st.info("Pick prompts and batch sizes, then press **Run batch sweep** (the adaptive-k comparison below "
            "needs a sweep first: it decides with the sweep's step costs).")
    st.stop()

best, cross = result.best_k(), result.crossover()
st.caption(f"{result.num_prompts} prompts x {result.repeats} repeats, max_new_tokens {result.max_new_tokens}; "
           "measured on this machine's CPU.")
for p in result.points:
    if p.error:
        st.error(f"B = {p.batch_size}, k = {p.k}: {p.error}")
if looping := result.rests_on_loops():
    st.warning(f"At B = {looping} the best k was measured on mostly looping continuations (more than half "
               "loop: 30% or more of their 6-grams repeat an earlier one): its evidence is looping text, the "
               "easiest a draft ever sees. Measure on prompts that do not loop before serving with it.")
cols = st.columns(len(best) + 1)
cols[0].metric("Crossover", f"B = {cross['overall']}" if cross["overall"] else "none",
               f"speculation stops paying from B = {cross['overall']}" if cross["overall"]
               else f"still pays at B = {max(result.batch_sizes)}", delta_color="off", delta_arrow="off")
for col, (b, k) in zip(cols[1:], best.items()):
    col.metric(f"Best k at B = {b}", k, "no speculation" if k == 0 else None, delta_color="off", delta_arrow="off")
a, b = st.columns(2)
a.plotly_chart(charts.speedup_heatmap(result), key="batch_fig_heat")
b.plotly_chart(charts.batch_throughput_fig(result), key="batch_fig_tps")
MiB = 2**20
st.dataframe(pd.DataFrame([{
    "B": p.batch_size, "k": p.k, "tok/s [95%]": str(p.tokens_per_s), "per-request tok/s": p.per_request_tokens_per_s,
    "speedup [95%]": str(p.speedup), "accept length": p.accept_length, "clean accept length": p.accept_length_clean,
    "loops": f"{p.degenerate}/{p.num_requests}", "mean rows per step": p.occupancy,
    "cache MiB": sum(p.cache_bytes.values()) / MiB, "cache MiB (hand)": sum(p.cache_bytes_hand.values()) / MiB,
    "identical outputs": "baseline" if p.k == 0 else f"{p.matches_baseline}/{full(result.num_prompts, p.batch_size)}"}
    for p in result.points]).round({"per-request tok/s": 1, "accept length": 3, "clean accept length": 3,
                                     "mean rows per step": 2, "cache MiB": 3,
                                     "cache MiB (hand)": 3}), key="batch_table", hide_index=True)

st.subheader("For vLLM")
sched = result.schedule()
st.markdown(f"`num_speculative_tokens_per_batch_size` (the fastest k at each measured B, with "
            f"`num_speculative_tokens` = {sched.num_speculative_tokens}), map and list syntax:")
a, b = st.columns(2)
a.code(json.dumps(sched.to_map()), language="json")
b.code(json.dumps(sched.to_list()), language="json")
mine = st.text_area("Check your own schedule (either syntax)", "", key="batch_schedule_in",
                    placeholder='{"1-16": 2, "17-64": 1, "65-4096": 0}  or  [[1, 16, 2], [17, 64, 1], [65, 4096, 0]]')
if mine.strip():
    try:
        yours = read_schedule(mine, sched.num_speculative_tokens)
        st.table(pd.DataFrame({"B": result.batch_sizes, "your k": [yours.k_for(b) for b in result.batch_sizes],
                               "measured best k": [best[b] for b in result.batch_sizes]}))
    except ScheduleError as e:
        st.error(str(e))

st.subheader("The GPU case, a model")
gpu = result.gpu
feasible = [r for r in gpu["table"] if r["B"] <= gpu["max_batch"]]
st.caption("Beside the CPU measurement above, the GPU case as a model of Kimi-K2 and its MLA draft: " + gpu["summary"])
a, b = st.columns(2)
a.plotly_chart(charts.speedup_heatmap(feasible, "Model: speedup on H200 x8 (feasible B)"), key="batch_fig_gpu")
b.metric("Model's crossover", f"B = {gpu['crossover']}" if gpu["crossover"] else "none",
         None if gpu["crossover"] else f"pays at every feasible B, 1..{gpu['max_batch']}", delta_color="off",
         delta_arrow="off", help="Past the largest feasible B the latent cache no longer fits beside the weights.")
tops = {r["B"]: r for r in feasible if r["k"] == gpu["best_k"][r["B"]]}
b.table(pd.DataFrame([{"B": bb, "model's best k": r["k"], "speedup": f"{r['speedup']:.2f}x", "bound": r["bound"]}
                      for bb, r in tops.items()]))

st.subheader("Adaptive k")
ab = int(st.number_input("Batch size", 1, 16, 1, key="batch_adaptive_b"))
if st.button("Compare adaptive k with static k", key="batch_adaptive_run"):
    if len(prompts) < ab:
        st.error(f"{len(prompts)} prompts for batch size {ab}; expected at least one full batch of prompts")
    else:
        try:
            costs = result.step_costs()  # raises on a cost that is not finite
            with st.spinner("measuring"), lock:
                st.session_state["batch_adaptive"] = adaptive(st.session_state["pair_key"], tuple(prompts), ab,
                                                              tuple(result.ks), tuple(sorted(costs.points.items())),
                                                              result.max_new_tokens, result.repeats, costs, pair)
        except ValueError as e:
            st.error(str(e))
cmp = st.session_state.get("batch_adaptive")
if cmp:
    st.caption(f"B = {cmp['batch_size']}, {cmp['num_prompts']} prompts x {cmp['repeats']} repeats; best static: "
               f"{cmp['best_static']}; the policies decide with this sweep's step costs.")
    st.dataframe(pd.DataFrame([{
        "name": r.name, "tok/s [95%]": str(r.tokens_per_s), "speedup": str(r.speedup),
        "accept length": round(r.accept_length, 3),
        "clean accept length": None if r.accept_length_clean is None else round(r.accept_length_clean, 3),
        "loops": f"{r.degenerate}/{full(cmp['num_prompts'], cmp['batch_size'])}", "mean k": round(r.mean_k, 2),
        "minus best static [95%]": "" if r.vs_best_static is None else str(r.vs_best_static),
        "identical outputs": f"{r.matches_baseline}/{full(cmp['num_prompts'], cmp['batch_size'])}"}
        for r in cmp["results"].values()]), key="batch_policy_table", hide_index=True)

frame = pd.DataFrame(result.rows())
d1, d2 = st.columns(2)
d1.download_button("Download CSV", frame.to_csv(index=False), "batch_sweep.csv", "text/csv", key="batch_csv")
d2.download_button("Download JSON", json.dumps(result.to_dict(), indent=1), "batch_sweep.json", "application/json",
                   key="batch_json")
