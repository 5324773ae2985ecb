"""router/: picks the worker for each request from the admissible pool.

The learned router (per-worker quality models over query features, quality − λ·cost) is used
when a trained model is in force; the rule-based CheapestRouter serves otherwise and is the
fallback when a model cannot be loaded. Imports policies for types only; heavy ML imports are
deferred to training and to the first prediction.

What runs per request lives here at the top level; how we measure it (data loaders, splits, metrics,
the evaluation harness, plots) lives in router/offline/, which nothing here imports.
"""

from router.artifacts import (
    RouterArtifact,
    RouterLoadError,
    activate_version,
    is_version_name,
    list_versions,
    load_current,
    load_version,
    read_pointer,
    rollback,
    save_artifact,
)
from router.decide import Choice, Estimate, choose
from router.learned import LearnedRouter
from router.rules import CheapestRouter, Propensity, RouteDecision, RouteRequest, estimate_cost
from router.training import feature_builder_for, train_artifact

__all__ = [
    "CheapestRouter",
    "Choice",
    "Estimate",
    "LearnedRouter",
    "Propensity",
    "RouteDecision",
    "RouteRequest",
    "RouterArtifact",
    "RouterLoadError",
    "activate_version",
    "choose",
    "estimate_cost",
    "feature_builder_for",
    "is_version_name",
    "list_versions",
    "load_current",
    "load_version",
    "read_pointer",
    "rollback",
    "save_artifact",
    "train_artifact",
]
