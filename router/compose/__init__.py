"""Composition ("Ultra" mode): workflows of several workers, and when they pay.

One interface (`Workflow.run(Run) -> Outcome`), one small module per workflow: cascade,
ensemble + fuse, builder/verifier, debate. Every step goes through `Run.call`, which keeps the
workflow inside the admissible pool and under the request's cost ceiling, and records the trace.
The answer-aware plan (`router.compose.planned.Planned`) is imported from its module: it needs
router/evidence.py, which itself imports this package's acceptance checks.
"""

from router.compose.acceptance import AcceptanceModel, acceptance_threshold, answer_features, final_answer
from router.compose.base import (
    Answer,
    CeilingReached,
    DeadlineReached,
    Outcome,
    Run,
    Step,
    StepFailed,
    Workflow,
)
from router.compose.builder import BuilderVerifier, run_tests
from router.compose.cascade import Cascade
from router.compose.choose import (
    PREFIX,
    WORKFLOWS,
    CascadePrediction,
    predict_cascade,
    requested_workflow,
    should_cascade,
)
from router.compose.debate import Debate
from router.compose.ensemble import Ensemble
from router.compose.verifiers import ConsistencyVerifier, JudgeVerifier, ModelVerifier, Verifier

__all__ = [
    "PREFIX",
    "WORKFLOWS",
    "AcceptanceModel",
    "Answer",
    "BuilderVerifier",
    "Cascade",
    "CascadePrediction",
    "CeilingReached",
    "DeadlineReached",
    "ConsistencyVerifier",
    "Debate",
    "Ensemble",
    "JudgeVerifier",
    "ModelVerifier",
    "Outcome",
    "Run",
    "Step",
    "StepFailed",
    "Verifier",
    "Workflow",
    "acceptance_threshold",
    "answer_features",
    "final_answer",
    "predict_cascade",
    "requested_workflow",
    "run_tests",
    "should_cascade",
]
