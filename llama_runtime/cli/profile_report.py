"""The `make profile` breakdown: where a generation's time went, per device call and host op."""
from __future__ import annotations

from cpu_kernels import native_cpu, threads
from llama_base import q4nx


def isa_line() -> str:
    """The CPU kernels' ISA class: the simulated device's kernels and, on any device, the host
    ops; a profile taken on one class says little about another."""
    return f"CPU kernels: {native_cpu.isa()} (of {', '.join(native_cpu.supported_isas() + [native_cpu.TORCH])}; {native_cpu.ENV_ISA} picks)"


def stream_ahead_line() -> str | None:
    """How far ahead the decode GEMVs read their weights (the one knob of their memory stream a
    user may turn, LLAMA_NPU_STREAM_AHEAD) and with which prefetch hint (the CPU's maker picks
    it); None without the native kernels."""
    ahead = native_cpu.stream_ahead()
    if not ahead:
        return None
    how = f"set by {native_cpu.ENV_AHEAD}" if native_cpu.ahead_from_env() else f"the default; {native_cpu.ENV_AHEAD} sets it"
    return f"decode GEMVs prefetch {ahead / 1024:g} KiB ahead ({how}), hint {native_cpu.stream_hint().upper()}"


def q4nx_line(isa: str) -> str:
    """Which of Q4NX's CPU contracts class `isa`'s kernels compute: the class decides, and the
    two differ in perplexity (docs/explain.md, "The format"), so a profile names it."""
    width = "one byte" if native_cpu.q4nx_activation_bytes(isa) == q4nx.NARROW else "two bytes"
    prefill = "byte products, decode's contract" if native_cpu.integer_q4nx_gemm(isa) else "the dequantized bf16 weights"
    return f"Q4NX on {isa}: decode's activations {width} wide; prefill on {prefill}"


def report(session, result) -> str:
    prof, dev = session.profiler, session.device
    dev_calls = sum(s.calls for s in prof.groups.values())
    dev_s = sum(s.total_s for s in prof.groups.values())
    host_s = sum(s.run_s for s in prof.host.values())
    lines = [
        f"== profile: {session.resolved.name} on {dev.name} ==",
        isa_line(),
        threads.governor().describe(),
        prof.table(),
        f"device calls: {dev_calls} in {dev_s * 1e3:.1f} ms; host ops {host_s * 1e3:.1f} ms",
        f"prompt {result.prompt_tokens} tokens -> bucket {session.model.bucket_for(min(result.prompt_tokens, session.model.buckets[-1]))}; "
        f"TTFT {result.ttft_s * 1e3:.1f} ms; decode {len(result.tokens)} tokens, "
        f"{result.decode_tokens_per_s:.2f} tok/s ({1e3 / result.decode_tokens_per_s if result.decode_tokens_per_s else 0:.1f} ms/token)",
        f"BO traffic: {dev.counters.bytes_to_device / 1e6:.1f} MB to device, "
        f"{dev.counters.bytes_from_device / 1e6:.1f} MB from device; resident "
        + ", ".join(f"{k} {v / 1e6:.0f} MB" for k, v in session.kc.resident_bytes().items()),
    ]
    ahead = stream_ahead_line() if dev.kind == "sim" else None
    if ahead:
        lines.insert(2, ahead)
    if dev.kind == "sim" and session.model.quant == q4nx.NAME and not dev.npu_numerics:
        lines.insert(2, q4nx_line(native_cpu.isa()))
    if dev.kind == "interp":
        lines.append(npu_estimate(session, result))
    return "\n".join(lines)


def npu_estimate(session, result) -> str:
    """The cost model's NPU2 time for every group this run called (the interpreter runs the modules
    the NPU would get, so this is where their estimate belongs), and for the whole generation.
    A fused session gets the fused decode's: its last token, and the design from 1K to 128K of
    context beside the published fused decodes (`npu_runtime.cost.fused_report`)."""
    from npu_runtime.cost.hardware import FITTED
    from npu_runtime.cost.model import estimate_phases, format_group

    m = session.model
    if getattr(m, "resident", False):
        from npu_runtime.cost.fused_report import session_report

        text = session_report(session.config, m.quant, m.layer_wide, m.capacity, result.prompt_tokens,
                              result.prompt_tokens + len(result.tokens))
        return "== NPU2 estimate (cost model, not a measurement) ==\n" + text
    est = estimate_phases(session.config, FITTED, result.prompt_tokens, session.model.quant, session.model.layer_wide)
    lines = ["== NPU2 estimate (cost model, not a measurement) =="]
    lines += [format_group(e) for kind, e in est.groups.items() if kind in session.profiler.groups]
    lines.append(f"estimated on NPU2: TTFT {est.ttft_s * 1e3:.1f} ms at this prompt's bucket, "
                 f"decode {est.decode_tokens_per_s:.1f} tok/s")
    return "\n".join(lines)
