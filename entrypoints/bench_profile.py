"""`tokenmill bench throughput --profile`: which decode program ran the model (or why it ran eagerly),
the kernels each op kind reached, and each path's share of the forward time."""
from __future__ import annotations

from typing import Any, Optional


def start_profile(engine: Any) -> Optional[Any]:
    """The in-process model runner, now recording its steps; None (said) when the model runs in workers."""
    runner = getattr(engine.executor, "runner", None)       # in-process only (tp = pp = 1)
    if runner is None:
        print("--profile: the model runs in worker processes (tensor/pipeline parallelism); no step profile")
        return None
    from tokenmill.core.model_runner import StepProfile
    runner.profile = StepProfile()
    return runner


def profile_lines(profile: dict[str, Any]) -> list[str]:
    """`--profile`'s text: the decode program, the kernels per op kind, the time per path."""
    fast = profile["fast_path"]
    lines = [f"decode program {fast['decode_program']}: "
             + ("runs the model" if fast["took_the_model"] else f"the model runs eagerly ({fast['eager_reason']})"),
             f"attention {fast['attention_backend']} (native decode entry: "
             f"{'yes' if fast['native_decode_attention'] else 'no'})",
             "layer kernels: " + (", ".join(f"{k} {v}" for k, v in fast["layer_kernels"].items()) or "none (torch)")]
    for method, kernels in fast["quantization_kernels"].items():
        lines.append(f"quantization method {method}: " + (", ".join(kernels) or "torch path"))
    lines.append("forward time by path (all workloads, timed and warm-up runs):")
    for row in profile["steps"]:
        share = (f", {row['share_of_decode_time']:.0%} of decode-step time" if row["decode_only"] else "")
        lines.append(f"  {row['path']:<14} {'decode-only' if row['decode_only'] else 'with prompts':<12} "
                     f"{row['steps']:>6} steps {row['tokens']:>8} tokens {row['seconds']:8.2f} s "
                     f"({row['share_of_forward_time']:.0%} of forward time{share})")
    return lines
