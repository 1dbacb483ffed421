"""Live server: poll a vLLM or SGLang server's /metrics and chart speculative decoding per interval."""
import streamlit as st

from views import charts
from workbench.integrations.vllm import MetricsTracker, ScrapeError, scrape

st.title("Live vLLM / SGLang")
st.caption("vLLM's counters (vllm:spec_decode_num_drafts / num_draft_tokens / num_accepted_tokens / "
           "num_accepted_tokens_per_pos) are cumulative; each point here is the interval between two polls. "
           "SGLang (--enable-metrics) is read from sglang:spec_verify_calls_total, generation_tokens_total and "
           "num_requests_total (accepted = generated - requests - verifies; counted as requests finish, no "
           "per-position counter) beside its sglang:spec_accept_length gauge.")
c1, c2, c3 = st.columns([3, 2, 1])
url = c1.text_input("Server or /metrics URL", "http://127.0.0.1:8000/metrics", key="live_url").strip()
model = c2.text_input("Model name (optional filter)", "", key="live_model").strip()
every = c3.number_input("Every (s)", 1, 120, 5, key="live_every")
auto = st.toggle("Auto-refresh", value=True, key="live_auto")

if st.session_state.get("live_target") != (url, model):  # a new server: start a new series
    st.session_state["live_target"] = (url, model)
    st.session_state["live_tracker"] = MetricsTracker(max_samples=720)


@st.fragment(run_every=int(every) if auto else None)
def live() -> None:
    tracker: MetricsTracker = st.session_state["live_tracker"]
    st.button("Poll now", key="live_poll")  # a click reruns this fragment, which polls
    try:
        counters = scrape(url, timeout=2.0, model_name=model or None)
    except ScrapeError as e:
        st.error(f"Cannot read metrics: {e}")
        return
    except RuntimeError as e:  # prometheus_client missing: parse_spec_metrics says how to install it
        st.error(str(e))
        return
    if not counters.has_spec:
        st.warning(f"{url} answers, but exposes no vllm:spec_decode_* counters nor sglang:spec_* metrics"
                   + (f" for model {model!r}" if model else "")
                   + ": is speculative decoding enabled (vLLM --speculative-config, SGLang --speculative-algorithm "
                     "with --enable-metrics), and has a request run yet?")
        return
    tracker.add(counters)
    total = counters.rates()
    m1, m2, m3, m4 = st.columns(4)
    m1.metric("Accept length since start", f"{total['accept_length']:.3f}", "clean: unknown", delta_color="off",
              delta_arrow="off", help="vLLM's counters carry no text, so looping outputs (the easiest text a draft "
                                      "sees) cannot be set apart here: this figure may be inflated by loops. "
                                      "`workbench bench` on the same prompts gives the clean figure.")
    m2.metric("Draft acceptance rate since start", f"{total['draft_acceptance_rate']:.1%}")
    m3.metric("Drafts since start", f"{counters.num_drafts:,}")
    m4.metric("Counters", counters.version.upper() + (" (drafts derived)" if counters.drafts_derived else ""))
    if counters.engine_accept_length is not None:
        st.caption(f"SGLang's own gauge sglang:spec_accept_length (its last logged batch): "
                   f"{counters.engine_accept_length:.3f}")
    if not tracker.intervals:
        st.info("First sample taken; the per-interval charts start with the next poll.")
        return
    latest = tracker.latest
    if latest.reset:
        st.warning("A counter went down: the server restarted during the last interval.")
    cols = st.columns(2)
    for i, fig in enumerate(charts.live_figs(tracker)):
        cols[i % 2].plotly_chart(fig, key=f"live_fig_{i}")
    st.caption(f"{len(tracker.intervals)} intervals; the last: {latest.num_drafts} drafts, "
               f"{latest.num_accepted_tokens} accepted of {latest.num_draft_tokens} drafted in {latest.dt:.1f} s")


live()
