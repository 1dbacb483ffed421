"""Plotly figures for the dashboard pages: plain functions from library results to figures.

Not a page; kept apart so each page file reads as widgets -> library call -> figures.
"""
from __future__ import annotations

import plotly.graph_objects as go

SOURCE_NAMES = ("low", "mid", "high")


def _layout(fig: go.Figure, title: str, x: str, y: str) -> go.Figure:
    fig.update_layout(title=title, xaxis_title=x, yaxis_title=y, height=340, margin=dict(l=40, r=10, t=50, b=40),
                      legend=dict(orientation="h", y=-0.25))
    if x in ("k", "draft position", "accepted"):  # integer axes
        fig.update_xaxes(dtick=1)
    return fig


def source_label(i: int, layer: int) -> str:
    name = SOURCE_NAMES[i] if i < len(SOURCE_NAMES) else f"#{i}"
    return f"{name} (layer {layer})"


# ---- tuning ---------------------------------------------------------------------------------


def accept_length_fig(result) -> go.Figure:
    fig = go.Figure()
    for t in result.temperatures:
        pts = [p for p in result.points if p.temperature == t and p.k > 0]
        fig.add_scatter(x=[p.k for p in pts], y=[p.accept_length for p in pts], mode="lines+markers", name=f"T={t}",
                        hovertext=[f"{p.degenerate} of {result.num_prompts} continuations loop" for p in pts])
        # the clean figure beside the raw one: loops are the easiest text a draft sees (a gap where all loop)
        fig.add_scatter(x=[p.k for p in pts], y=[p.accept_length_clean for p in pts], mode="lines+markers",
                        name=f"T={t}, clean (no loops)", line=dict(dash="dash"))
    fig.add_scatter(x=result.ks, y=[k + 1 for k in result.ks], mode="lines", name="ceiling k+1",
                    line=dict(dash="dot", color="gray"))
    return _layout(fig, "Accept length (1 + accepted / drafts), all and clean", "k", "tokens per verifier step")


def _bars(intervals) -> dict:
    """Plotly error bars from `protocol.Interval`s (median, lo, hi)."""
    return dict(type="data", symmetric=False, array=[i.hi - i.median for i in intervals],
                arrayminus=[i.median - i.lo for i in intervals])


def throughput_fig(result) -> go.Figure:
    fig = go.Figure()
    for t in result.temperatures:
        pts = [p for p in result.points if p.temperature == t]
        fig.add_scatter(x=[p.k for p in pts], y=[p.tokens_per_s.median for p in pts], mode="lines+markers",
                        error_y=_bars([p.tokens_per_s for p in pts]), name=f"T={t}")
    return _layout(fig, "Decode tokens/s, 95% interval (k = 0 is autoregressive)", "k", "tokens/s")


def speedup_fig(result, temperature: float) -> go.Figure:
    """Measured speedups with their intervals, the step-cost model with its band, and physics' bound."""
    pts = [p for p in result.points if p.temperature == temperature]
    curve = result.models[temperature]
    fig = go.Figure()
    ks = curve.ks
    fig.add_scatter(x=ks + ks[::-1], y=[curve.hi[k] for k in ks] + [curve.lo[k] for k in ks[::-1]], mode="lines",
                    fill="toself",
                    line=dict(width=0), fillcolor="rgba(99,110,250,0.15)", name="model, 95% band", hoverinfo="skip")
    fig.add_scatter(x=ks, y=[curve.speedup[k] for k in ks], mode="lines", name="step-cost model",
                    line=dict(dash="dash"))
    fig.add_scatter(x=[p.k for p in pts], y=[p.speedup.median for p in pts], mode="markers",
                    error_y=_bars([p.speedup for p in pts]), name="measured", marker=dict(size=10))
    spec = [p for p in pts if p.k]
    fig.add_scatter(x=[p.k for p in spec], y=[p.bound for p in spec], mode="markers", name="bound (physics)",
                    marker=dict(symbol="line-ew-open", size=16, color="gray"))
    bad = [p for p in spec if p.error]
    if bad:
        fig.add_scatter(x=[p.k for p in bad], y=[p.speedup.median for p in bad], mode="markers",
                        name="measurement error", marker=dict(symbol="x", size=14, color="red"))
    rec = result.recommendation(temperature)
    fig.add_vline(x=rec.k, line=dict(color="green", dash="dot"),
                  annotation_text=f"{'recommended' if rec.decided else 'fastest'} k={rec.k}",
                  annotation_position="bottom right")
    return _layout(fig, f"Speedup vs autoregressive (T={temperature})", "k", "x autoregressive")


def pd_fig(frame) -> go.Figure:
    """Accept length per hand-over mode, for each draft and prompt set (a `pd_study` table)."""
    fig = go.Figure()
    for (draft, prompts), g in frame.groupby(["draft", "prompts"], sort=False):
        fig.add_bar(x=g["mode"], y=g["accept_length"], name=f"{draft.upper()}, {prompts} prompts")
    fig.update_layout(barmode="group")
    return _layout(fig, "Accept length by hand-over mode", "mode", "tokens per verifier step")


def per_position_fig(point) -> go.Figure:
    s = point.stats
    pos = list(range(1, len(s.per_position_acceptance) + 1))
    fig = go.Figure()
    fig.add_bar(x=pos, y=s.per_position_acceptance, name="unconditional (vLLM: per_pos / drafts)")
    fig.add_bar(x=pos, y=s.conditional_acceptance, name="conditional (EAGLE's alpha)")
    fig.update_yaxes(range=[0, 1])
    return _layout(fig, f"Per-position acceptance at k={point.k}", "draft position", "rate")


def histogram_fig(point) -> go.Figure:
    h = point.stats.accepted_length_histogram
    fig = go.Figure(go.Bar(x=list(range(len(h))), y=h, name="steps"))
    return _layout(fig, f"Accepted proposals per step at k={point.k}", "accepted", "steps")


# ---- fusion ---------------------------------------------------------------------------------


def shares_fig(report) -> go.Figure:
    x = list(range(len(report.tokens)))
    fig = go.Figure()
    for s, layer in enumerate(report.aux_layer_ids):
        fig.add_bar(x=x, y=[r[s] for r in report.shares], name=source_label(s, layer),
                    hovertext=[repr(t) for t in report.token_texts])
    fig.update_layout(barmode="stack")
    fig.add_vline(x=report.num_prompt_tokens - 0.5, line=dict(color="black", dash="dot"),
                  annotation_text="generated →")
    return _layout(fig, "Norm share ||W_s h_s|| / Σ ||W_s h_s|| per token", "token", "share")


def per_token_lines_fig(report, values: list[list[float]], title: str, y: str) -> go.Figure:
    fig = go.Figure()
    for s, layer in enumerate(report.aux_layer_ids):
        fig.add_scatter(x=list(range(len(values))), y=[r[s] for r in values], mode="lines",
                        name=source_label(s, layer), hovertext=[repr(t) for t in report.token_texts])
    return _layout(fig, title, "token", y)


def block_norms_fig(report) -> go.Figure:
    names = [source_label(s, layer) for s, layer in enumerate(report.aux_layer_ids)]
    fig = go.Figure(go.Bar(x=names, y=report.block_norms))
    return _layout(fig, "fc block norms ||W_s||_F", "aux source", "Frobenius norm")


def ablation_fig(ablation) -> go.Figure:
    fig = go.Figure()
    for mode in dict.fromkeys(e.mode for e in ablation.entries):
        es = [e for e in ablation.entries if e.mode == mode]
        fig.add_bar(x=[source_label(e.source, e.layer_id) for e in es], y=[e.accept_length for e in es], name=mode)
    fig.add_hline(y=ablation.baseline, line=dict(dash="dash"), annotation_text=f"intact {ablation.baseline:.3f}")
    return _layout(fig, f"Accept length with one source ablated (k={ablation.k})", "aux source", "accept length")


# ---- doctor ---------------------------------------------------------------------------------


def probes_fig(report) -> go.Figure:
    ran = [p for p in [report.configured, *report.probes] if p.accept_length is not None]
    colors = ["#1f77b4" if p.name == "configured" else ("#d62728" if p.flagged else "#7f7f7f") for p in ran]
    fig = go.Figure(go.Bar(x=[p.name for p in ran], y=[p.accept_length for p in ran], marker_color=colors,
                           hovertext=[f"{p.description} ({p.loops_text(report.num_prompts)})" for p in ran]))
    return _layout(fig, f"Greedy accept length, configured vs alternatives (k={report.k})", "", "accept length")


# ---- KV cache -------------------------------------------------------------------------------


def kv_fig(rows: list[dict], batch: int) -> go.Figure:
    sel = [r for r in rows if r["batch"] == batch]
    ctx = [r["context"] for r in sel]
    fig = go.Figure()
    for col, name in (("verifier_bytes", "verifier"), ("draft_bytes", "MLA draft"), ("mha_draft_bytes", "MHA draft")):
        fig.add_bar(x=[f"{c:,}" for c in ctx], y=[r[col] / 2**30 for r in sel], name=name)
    fig.update_xaxes(type="category")
    return _layout(fig, f"KV-cache GiB at batch {batch}", "context (tokens)", "GiB")


# ---- live vLLM ------------------------------------------------------------------------------


def live_figs(tracker) -> list[go.Figure]:
    """Per-interval accept length, per-position acceptance, draft acceptance rate, throughput."""
    ivs = tracker.intervals
    t0 = ivs[0].t0
    x = [iv.t1 - t0 for iv in ivs]
    idle = [iv.num_drafts == 0 for iv in ivs]  # nothing drafted: rates are undefined, leave a gap

    def gap(values):
        return [None if i else v for v, i in zip(values, idle)]

    al = go.Figure(go.Scatter(x=x, y=gap([iv.accept_length for iv in ivs]), mode="lines+markers"))
    pos = go.Figure()
    k = max((len(iv.per_position_acceptance) for iv in ivs), default=0)
    for i in range(k):
        pos.add_scatter(x=x, y=gap([iv.per_position_acceptance[i] if i < len(iv.per_position_acceptance) else None
                                    for iv in ivs]), mode="lines+markers", name=f"position {i}")
    rate = go.Figure(go.Scatter(x=x, y=gap([iv.draft_acceptance_rate for iv in ivs]), mode="lines+markers"))
    tput = go.Figure()
    tput.add_scatter(x=x, y=[iv.accepted_throughput for iv in ivs], mode="lines+markers", name="accepted")
    tput.add_scatter(x=x, y=[iv.drafted_throughput for iv in ivs], mode="lines+markers", name="drafted")
    return [_layout(al, "Mean acceptance length per interval", "seconds", "1 + accepted / drafts"),
            _layout(pos, "Per-position acceptance (per_pos / drafts)", "seconds", "rate"),
            _layout(rate, "Draft acceptance rate (accepted / drafted)", "seconds", "rate"),
            _layout(tput, "Draft tokens per second", "seconds", "tokens/s")]


# ---- batching -------------------------------------------------------------------------------


def speedup_heatmap(result, title: str = "Speedup over plain decoding at the same batch size") -> go.Figure:
    """Speedup over batch size B (rows) x k (columns), each cell labelled "1.23x": from a `BatchSweepResult`
    (its points' median speedups) or from rows of dicts with "B", "k" and "speedup" (the GPU model's table)."""
    cells = {(p.batch_size, p.k): p.speedup.median for p in result.points} if hasattr(result, "points") \
        else {(r["B"], r["k"]): r["speedup"] for r in result}
    bs, ks = sorted({b for b, _ in cells}), sorted({k for _, k in cells})
    z = [[cells.get((b, k)) for k in ks] for b in bs]
    fig = go.Figure(go.Heatmap(z=z, x=[str(k) for k in ks], y=[str(b) for b in bs], zmid=1.0, colorscale="RdBu",
                               text=[["" if v is None else f"{v:.2f}x" for v in row] for row in z],
                               texttemplate="%{text}", hovertemplate="B=%{y}, k=%{x}: %{text}<extra></extra>"))
    fig.update_xaxes(type="category")
    fig.update_yaxes(type="category", autorange="reversed")
    return _layout(fig, title, "k (0: plain decoding)", "batch size B")


def batch_throughput_fig(result) -> go.Figure:
    """Aggregate decode tokens/s against the batch size, one line per k, with 95% intervals."""
    fig = go.Figure()
    for k in [0, *result.ks]:
        pts = sorted((p for p in result.points if p.k == k), key=lambda p: p.batch_size)
        fig.add_scatter(x=[p.batch_size for p in pts], y=[p.tokens_per_s.median for p in pts], mode="lines+markers",
                        error_y=_bars([p.tokens_per_s for p in pts]), name="autoregressive" if k == 0 else f"k={k}")
    fig.update_xaxes(type="log", tickvals=result.batch_sizes)
    return _layout(fig, "Aggregate decode tokens/s, 95% interval", "batch size B", "tokens/s")
