"""Whether the policy in force still admits a worker for a request admitted under an earlier one.

A request's pool is decided once, at admission, by the policy version then in force; but a workflow
runs for seconds (a plan's rounds, a cascade's levels) and fast mode falls back from worker to
worker, while the policy file is hot-reloaded. A worker the operator excluded since the request was
admitted must not be called by a later step or attempt: a policy decision is never undone
downstream, the newer one's included. Used by gateway/compose.py (before each workflow step, as
router.compose.base.Run.admissible) and gateway/completions.py (before each fast-mode attempt).
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request

from gateway.errors import APIError
from policies import Spend, Worker
from router.compose.base import Admissible


def still_admits(state, request: Request, ex) -> Admissible:
    """Whether the policy in force still admits a worker for this request, asked before each step of
    its workflow: None, or why not. A workflow runs for seconds (a plan's rounds, a cascade's levels)
    and the policy file is hot-reloaded meanwhile; a worker the operator has excluded since the
    request was admitted is not called by a later step (a policy decision is never undone downstream,
    the newer one included). Nothing to do while the version admitted is in force; after a reload the
    request is evaluated once per new version as it was at admission (its texts, recalled memory, data
    class tag), off the event loop. Its budget was held when the workflow started, so the tenant's
    spend does not exclude anyone here. A policy that refuses the request altogether, or cannot be
    evaluated, admits nobody: fail closed."""
    from gateway.completions import admission_for

    admitted = ex.admission.policy_version
    extra = ((ex.memory.injected_text(),) if ex.memory is not None else ()) + ex.wire.policy_texts()
    verdicts: dict[str, Any] = {}  # per policy version: its Admission, or why it admits nobody

    async def check(worker: Worker) -> str | None:
        engine = state.policy.engine
        if engine is None:  # never after a valid policy was loaded; fail closed all the same
            return "no valid policy is loaded"
        if engine.version == admitted:
            return None
        if engine.version not in verdicts:
            try:
                verdicts[engine.version] = await asyncio.to_thread(
                    admission_for, state, request, ex.tenant, ex.chat, engine, Spend(), extra
                )
            except APIError as err:
                verdicts[engine.version] = f"policy {engine.version} refuses this request: {err.message}"
        verdict = verdicts[engine.version]
        if isinstance(verdict, str):
            return verdict
        if any(w.name == worker.name for w in verdict.pool):
            return None
        why = next(
            (f"{e.rule}: {e.reason}" for e in verdict.excluded if e.worker == worker.name), "not admitted"
        )
        return f"excluded by policy {engine.version}, in force since the request was admitted ({why})"

    return check
