"""router/: picks the worker (or, later, the workflow) for each request from the admissible pool.

Imports policies for types only. The learned router replaces CheapestRouter as the default once a
trained model is loaded; CheapestRouter stays as the fallback.
"""

from router.rules import CheapestRouter, RouteDecision, RouteRequest, estimate_cost

__all__ = ["CheapestRouter", "RouteDecision", "RouteRequest", "estimate_cost"]
