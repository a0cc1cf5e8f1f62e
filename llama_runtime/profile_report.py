"""The `make profile` breakdown: where a generation's time went, per device call and host op."""
from __future__ import annotations

from cpu_kernels import native_cpu


def isa_line() -> str:
    """The CPU kernels' ISA class: the simulated device's kernels and, on any device, the host
    ops; a profile taken on one class says little about another."""
    return f"CPU kernels: {native_cpu.isa()} (of {', '.join(native_cpu.supported_isas() + [native_cpu.TORCH])}; {native_cpu.ENV_ISA} picks)"


def stream_ahead_line() -> str | None:
    """How far ahead the decode GEMVs read their weights, which their tuner moves with the
    host's memory (cpu_kernels/native/stream_ahead.h); None without the native kernels."""
    ahead, moves = native_cpu.stream_ahead(), native_cpu.stream_ahead_moves()
    if not ahead:
        return None
    how = (f"pinned by {native_cpu.ENV_AHEAD}" if native_cpu.pinned_ahead()
           else f"tuned while decoding over {', '.join(f'{b / 1024:g}' for b in native_cpu.stream_ahead_ladder())} KiB")
    return "decode GEMVs prefetch " + ", ".join(f"{fmt} {b / 1024:g} KiB ahead ({moves[fmt]} moves)"
                                                 for fmt, b in ahead.items()) + f"; {how}"


def report(session, result) -> str:
    prof, dev = session.profiler, session.device
    dev_calls = sum(s.calls for s in prof.groups.values())
    dev_s = sum(s.total_s for s in prof.groups.values())
    host_s = sum(s.run_s for s in prof.host.values())
    lines = [
        f"== profile: {session.resolved.name} on {dev.name} ==",
        isa_line(),
        prof.table(),
        f"device calls: {dev_calls} in {dev_s * 1e3:.1f} ms; host ops {host_s * 1e3:.1f} ms",
        f"prompt {result.prompt_tokens} tokens -> bucket {session.model.bucket_for(min(result.prompt_tokens, session.model.buckets[-1]))}; "
        f"TTFT {result.ttft_s * 1e3:.1f} ms; decode {len(result.tokens)} tokens, "
        f"{result.decode_tokens_per_s:.2f} tok/s ({1e3 / result.decode_tokens_per_s if result.decode_tokens_per_s else 0:.1f} ms/token)",
        f"BO traffic: {dev.counters.bytes_to_device / 1e6:.1f} MB to device, "
        f"{dev.counters.bytes_from_device / 1e6:.1f} MB from device; resident "
        + ", ".join(f"{k} {v / 1e6:.0f} MB" for k, v in session.kc.resident_bytes().items()),
    ]
    if dev.kind == "sim" and stream_ahead_line():
        lines.insert(2, stream_ahead_line())
    if dev.kind == "interp":
        lines.append(npu_estimate(session, result))
    return "\n".join(lines)


def npu_estimate(session, result) -> str:
    """The cost model's NPU2 time for every group this run called (the interpreter runs the modules
    the NPU would get, so this is where their estimate belongs), and for the whole generation."""
    from npu_runtime.cost.hardware import FITTED
    from npu_runtime.cost.model import estimate_phases, format_group

    est = estimate_phases(session.config, FITTED, result.prompt_tokens, session.model.quant)
    lines = ["== NPU2 estimate (cost model, not a measurement) =="]
    lines += [format_group(e) for kind, e in est.groups.items() if kind in session.profiler.groups]
    lines.append(f"estimated on NPU2: TTFT {est.ttft_s * 1e3:.1f} ms at this prompt's bucket, "
                 f"decode {est.decode_tokens_per_s:.1f} tok/s")
    return "\n".join(lines)
