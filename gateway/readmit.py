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
import logging

from starlette.requests import Request

from gateway.errors import APIError
from policies import Admission, Spend, Worker
from router.compose.base import Admissible

log = logging.getLogger("polyroute.gateway")


def still_admits(state, request: Request, ex) -> Admissible:
    """Whether the policy in force still admits a worker for this request, asked before each step of
    its workflow and each attempt of fast mode: None, or why not. Made once per request (the
    Exchange's `admissible`; its workflow's Run shares it), so a policy version is evaluated at most
    once for the request. A workflow runs for seconds (a plan's rounds, a cascade's levels) and the
    policy file is hot-reloaded meanwhile; a worker the operator has excluded since the request was
    admitted is not called by a later step (a policy decision is never undone downstream, the newer
    one included). Nothing is done or computed while the version admitted is in force (every request
    asks); after a reload the request is evaluated as it was at admission (its texts, recalled memory,
    data class tag), off the event loop. Its budget was held when the workflow started, so the
    tenant's spend does not exclude anyone here. A policy that refuses the request altogether, or
    cannot be evaluated, admits nobody: fail closed. A worker left out is logged when first found so
    (`still_admitted` asks no more about it)."""
    admitted = ex.admission.policy_version
    verdicts: dict[str, Admission | str] = {}  # per policy version: its Admission, or why it admits nobody

    async def check(worker: Worker) -> str | None:
        engine = state.policy.engine
        if engine is not None and engine.version == admitted:
            return None
        why = await _why_not(worker, engine)
        if why is not None:
            log.info("request %s: %s left out: %s", ex.request_id, worker.name, why)
        return why

    async def _why_not(worker: Worker, engine) -> str | None:
        if engine is None:  # never after a valid policy was loaded; fail closed all the same
            return "no valid policy is loaded"
        if engine.version not in verdicts:
            verdicts[engine.version] = await _verdict(state, request, ex, engine)
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


async def _verdict(state, request: Request, ex, engine) -> Admission | str:
    """The request evaluated under ``engine`` as at admission (off the event loop): its Admission,
    or why that policy refuses it altogether."""
    from gateway.completions import admission_for

    extra = ((ex.memory.injected_text(),) if ex.memory is not None else ()) + ex.wire.policy_texts()
    try:
        return await asyncio.to_thread(
            admission_for, state, request, ex.tenant, ex.chat, engine, Spend(), extra
        )
    except APIError as err:
        return f"policy {engine.version} refuses this request: {err.message}"
