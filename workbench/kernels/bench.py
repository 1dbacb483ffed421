"""`workbench bench-kernels`: time the Triton MLA kernel on a CUDA GPU against its ceilings.

For each (batch, context, query tokens) shape on a paged bf16 cache (Kimi-K2 layer: 64
heads, L = 512, R = 64, 64-token pages in shuffled order):
* the Triton kernel's median time (`triton.testing.do_bench`, which flushes L2 between runs);
* GB/s and TFLOP/s from FlashMLA's formulas (`triton_mla.mla_bytes` / `mla_flops`, §3.3 of
  reference/triton_mla.md), and GB/s as a fraction of this device's copy bandwidth, measured
  in the same run as 2 * bytes / time of a large device-to-device copy (read + write);
* the PyTorch twin as a comparison, skipped when its fp32 intermediates would not fit the
  budget, and its max |difference| from the kernel as a correctness check;
* FlashInfer's MLA kernel when `flashinfer` imports (optional);
* the time of the largest query-token count relative to one token (verification cost).

The command's options, `--aot` and `--gpu-report` included, are in `workbench/kernels/bench_cli.py`.
"""
from __future__ import annotations

import torch

NEEDS_GPU = ("workbench bench-kernels needs a CUDA GPU with triton; torch sees no CUDA device "
             "here. On CPU the engine runs the PyTorch twin (workbench/kernels/reference.py), "
             "which tests/kernels checks against the Triton kernel under TRITON_INTERPRET=1.")
COPY_BYTES = 1 << 30  # 1 GiB per copy side: far above the 50-60 MB L2 of current GPUs


def _median_ms(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def copy_bandwidth_gbps(device: torch.device) -> float:
    """Device-to-device copy bandwidth: bytes read + bytes written over the median time."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src))
    return 2 * COPY_BYTES / (ms * 1e-3) / 1e9


def _make_case(batch: int, context: int, q_len: int, heads: int, kv_lora: int, rope: int,
               dtype: torch.dtype, page_size: int, device: torch.device) -> dict:
    pages_per_seq = -(-context // page_size)
    gen = torch.Generator(device=device).manual_seed(batch * 7919 + context + q_len)
    cache = torch.randn(batch * pages_per_seq, page_size, kv_lora + rope, generator=gen,
                        device=device, dtype=dtype)
    perm = torch.randperm(batch * pages_per_seq, generator=gen, device=device)
    return dict(
        q_lat=torch.randn(batch, q_len, heads, kv_lora, generator=gen, device=device, dtype=dtype),
        q_pe=torch.randn(batch, q_len, heads, rope, generator=gen, device=device, dtype=dtype),
        cache=cache,
        block_table=perm.view(batch, pages_per_seq).to(torch.int32),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
    )


def _flashinfer_ms(case: dict, sm_scale: float) -> tuple[float | None, str]:
    """FlashInfer MLA (paged, causal for Sq > 1) on the same cache; (None, why) if unusable."""
    try:
        import flashinfer.mla
    except Exception as err:  # not installed, or built for another torch/CUDA
        return None, f"flashinfer not importable ({type(err).__name__})"
    try:
        q_lat, q_pe, cache = case["q_lat"], case["q_pe"], case["cache"]
        batch, q_len, heads, kv_lora = q_lat.shape
        dev, pages = q_lat.device, case["block_table"].shape[1]
        wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(
            torch.empty(128 << 20, dtype=torch.uint8, device=dev))
        qo_indptr = torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32, device=dev)
        kv_indptr = torch.arange(0, (batch + 1) * pages, pages, dtype=torch.int32, device=dev)
        wrapper.plan(qo_indptr, kv_indptr, case["block_table"].flatten(), case["seq_lens"],
                     heads, kv_lora, q_pe.shape[-1], cache.shape[1], q_len > 1, sm_scale,
                     q_lat.dtype, cache.dtype)
        # FlashInfer takes separate c_kv and k_pe page pools; copies made outside the timing
        ckv, kpe = cache[..., :kv_lora].contiguous(), cache[..., kv_lora:].contiguous()
        q_nope = q_lat.reshape(batch * q_len, heads, kv_lora)
        q_rope = q_pe.reshape(batch * q_len, heads, -1)
        return _median_ms(lambda: wrapper.run(q_nope, q_rope, ckv, kpe)), ""
    except Exception as err:
        return None, f"flashinfer failed: {type(err).__name__}: {str(err)[:120]}"


def run(batches=(1, 8, 32, 64), contexts=(1024, 4096, 16384), query_tokens=(1, 4), heads=64,
        kv_lora=512, rope=64, dtype=torch.bfloat16, *, page_size: int = 64,
        twin_budget_bytes: int = 8 << 30) -> dict:
    """Benchmark every shape; returns one JSON-serialisable dict (see the module docstring)."""
    if not torch.cuda.is_available():
        raise RuntimeError(NEEDS_GPU)
    from workbench.kernels.reference import mla_attention_torch
    from workbench.kernels.triton_mla import (default_num_kv_splits, mla_attention_triton,
                                              mla_bytes, mla_flops)

    device = torch.device("cuda")
    elem = torch.empty((), dtype=dtype).element_size()
    sm_scale = (128 + 64) ** -0.5  # any fixed scale: the kernel's cost does not depend on it
    copy_gbps = copy_bandwidth_gbps(device)
    rows = []
    for batch in batches:
        for context in contexts:
            for q_len in query_tokens:
                case = _make_case(batch, context, q_len, heads, kv_lora, rope, dtype, page_size,
                                  device)
                args = (case["q_lat"], case["q_pe"], case["cache"], case["seq_lens"], sm_scale)
                kw = dict(block_table=case["block_table"])
                out, _ = mla_attention_triton(*args, **kw)  # compile outside the timing
                ms = _median_ms(lambda: mla_attention_triton(*args, **kw))
                nbytes = mla_bytes(batch, context, q_len, heads, kv_lora, rope, elem)
                row = dict(batch=batch, context=context, q_len=q_len,
                           num_kv_splits=default_num_kv_splits(
                               batch, q_len, heads, kv_lora, case["block_table"].shape[1]
                               * page_size, dtype, device),
                           triton_us=ms * 1e3, gbps=nbytes / (ms * 1e-3) / 1e9,
                           tflops=mla_flops(batch, context, q_len, heads, kv_lora, rope)
                           / (ms * 1e-3) / 1e12)
                row["copy_bw_fraction"] = row["gbps"] / copy_gbps
                # twin: fp32 kv copy + ~3 fp32 score-sized temporaries
                twin_bytes = 4 * batch * context * (kv_lora + rope) \
                    + 3 * 4 * batch * q_len * heads * context
                if twin_bytes <= twin_budget_bytes:
                    ref, _ = mla_attention_torch(*args, **kw)
                    row["max_abs_err_vs_twin"] = float((out.float() - ref.float()).abs().max())
                    row["twin_us"] = _median_ms(lambda: mla_attention_torch(*args, **kw)) * 1e3
                    del ref
                else:
                    row["twin_us"] = None
                    row["twin_note"] = (f"skipped: needs ~{twin_bytes / 2**30:.1f} GiB of fp32 "
                                        f"temporaries (budget {twin_budget_bytes / 2**30:.0f} GiB)")
                fi_ms, fi_note = _flashinfer_ms(case, sm_scale)
                row["flashinfer_us"] = None if fi_ms is None else fi_ms * 1e3
                if fi_note:
                    row["flashinfer_note"] = fi_note
                rows.append(row)
                del case, out, args, kw
                torch.cuda.empty_cache()
    _add_relative_times(rows, query_tokens)
    return dict(device=torch.cuda.get_device_name(device), dtype=str(dtype).replace("torch.", ""),
                heads=heads, kv_lora=kv_lora, rope=rope, page_size=page_size,
                copy_bandwidth_gbps=copy_gbps, rows=rows)


def _add_relative_times(rows: list[dict], query_tokens) -> None:
    """time(Sq) / time(Sq=1) for the same batch and context (the cost of verifying k+1)."""
    if 1 not in query_tokens:
        return
    one = {(r["batch"], r["context"]): r["triton_us"] for r in rows if r["q_len"] == 1}
    for r in rows:
        r["time_vs_1_token"] = r["triton_us"] / one[(r["batch"], r["context"])]


def format_table(result: dict) -> str:
    """A fixed-width table of `run`'s result, one line per shape."""
    def num(v, fmt):
        return "-" if v is None else format(v, fmt)

    head = (f"{result['device']}  {result['dtype']}  H={result['heads']} L={result['kv_lora']} "
            f"R={result['rope']} page={result['page_size']}  "
            f"copy bandwidth {result['copy_bandwidth_gbps']:.0f} GB/s")
    cols = (f"{'B':>3} {'ctx':>6} {'Sq':>3} {'splits':>6} {'triton us':>10} {'GB/s':>7} "
            f"{'TFLOP/s':>8} {'%copy':>6} {'twin us':>10} {'flashinfer us':>13} "
            f"{'vs Sq=1':>7} {'max err':>8}")
    lines = [head, cols]
    for r in result["rows"]:
        lines.append(
            f"{r['batch']:>3} {r['context']:>6} {r['q_len']:>3} {r['num_kv_splits']:>6} "
            f"{r['triton_us']:>10.1f} {r['gbps']:>7.0f} {r['tflops']:>8.1f} "
            f"{100 * r['copy_bw_fraction']:>5.1f}% {num(r['twin_us'], '10.1f'):>10} "
            f"{num(r['flashinfer_us'], '13.1f'):>13} {num(r.get('time_vs_1_token'), '7.2f'):>7} "
            f"{num(r.get('max_abs_err_vs_twin'), '8.1e'):>8}")
    notes = sorted({r[k] for r in result["rows"] for k in ("twin_note", "flashinfer_note")
                    if r.get(k)})
    return "\n".join(lines + [f"note: {n}" for n in notes])


def int_list(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())
