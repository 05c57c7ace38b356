"""Which kernel policy a run uses, and the run-log lines that say which kernels ran.

On CUDA the default is "fused": the first layer that would fall back to a PyTorch reference
raises `KernelFallbackError` (the original recipe's first lesson, verify the kernel each layer runs: the run that silently fell back to dense
attention). The user may ask for "reference" or "auto" explicitly. On the CPU the references
are the only choice.
"""

from __future__ import annotations

from genolong.model import ops


def choose_policy(device_type: str, requested: str | None = None) -> str:
    if requested is not None:
        if requested not in ops.POLICIES:
            raise ValueError(f"kernel policy must be one of {ops.POLICIES}, got {requested!r}")
        return requested
    return "fused" if device_type == "cuda" else "reference"


def setup(device_type: str, requested: str | None = None) -> str:
    """Load the fused kernels, set the policy, clear the audit; returns the policy in force."""
    from genolong.kernels import load

    load()
    policy = choose_policy(device_type, requested)
    ops.use(policy)
    ops.reset_audit()
    return policy


def log_lines() -> list[str]:
    """One line per op: which implementation ran in how many layers (from the ops audit)."""
    lines = [f"kernel policy: {ops.current_policy()}"]
    for op, counts in sorted(ops.audit_summary().items()):
        lines.append(f"kernels {op}: " + ", ".join(f"{impl} x{n}" for impl, n in sorted(counts.items())))
    return lines
