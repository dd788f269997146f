"""What becomes of a job whose gang has stopped, by why it stopped (a pure function).

An outcome is "kind: reason". cancelled -> cancelled; refused (the engine cannot run it as asked)
-> failed at once; preempted or lost (a worker gone) -> requeued, up to max_preemptions;
failed -> retried up to max_retries, then failed with the replica's reason.
"""

from __future__ import annotations

from dataclasses import dataclass

from keel.cluster.spec import JobSpec


@dataclass(frozen=True)
class Resolution:
    state: str  # "pending" (requeued) or a final state
    reason: str
    failures: int
    preemptions: int


def resolve(outcome: str, spec: JobSpec, failures: int, preemptions: int) -> Resolution:
    kind, _, reason = outcome.partition(": ")
    if kind == "cancelled":
        return Resolution("cancelled", reason, failures, preemptions)
    if kind == "refused":
        return Resolution("failed", reason, failures, preemptions)
    if kind in ("preempted", "lost"):
        count = preemptions + 1
        if count > spec.max_preemptions:
            why = f"{kind} {count} times (max_preemptions {spec.max_preemptions}): {reason}"
            return Resolution("failed", why, failures, count)
        return Resolution("pending", f"requeued after being {kind}: {reason}", failures, count)
    count = failures + 1
    if count > spec.max_retries:
        return Resolution("failed", reason, count, preemptions)
    return Resolution(
        "pending", f"retry {count} of {spec.max_retries} after: {reason}", count, preemptions
    )


def gang_outcome(tasks: list[dict], cancel_requested: bool) -> str:
    """Why a running gang must stop now ("" = it need not): the first broken replica, or a
    cancel request."""
    for task in tasks:
        if task["state"] in ("failed", "lost", "cancelled"):
            kind = "lost" if task["state"] in ("lost", "cancelled") else "failed"
            return f"{kind}: replica {task['replica']}: {task['reason'] or task['state']}"
    return "cancelled: on request" if cancel_requested else ""
