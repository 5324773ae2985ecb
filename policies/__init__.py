"""policies/: the worker catalog, the policy file and engine, data-class detection (the safety boundary).

Imports neither gateway nor router. Public surface below; other packages import only this.
"""

from policies.admission import EMBEDDED_POLICY_VERSION, Admission, Exclusion, admit
from policies.catalog import (
    DEFAULT_CATALOG_PATH,
    Architecture,
    Catalog,
    CatalogError,
    Kind,
    LocalServer,
    Tier,
    Worker,
    load_catalog,
    parse_catalog,
)
from policies.catalog_check import catalog_problems, check_against_catalog
from policies.catalog_file import CatalogFile
from policies.cost import BilledRate, estimate_tokens, predicted_cost
from policies.engine import Classification, PolicyEngine, PolicyRequest, PolicyRequestError, Spend
from policies.loader import DEFAULT_POLICY_PATH, AuditLog, PolicyNotWritable, PolicySource, compile_policy
from policies.schema import Policy, PolicyError, Rule, parse_policy

__all__ = [
    "DEFAULT_CATALOG_PATH",
    "DEFAULT_POLICY_PATH",
    "AuditLog",
    "BilledRate",
    "Classification",
    "Policy",
    "PolicyEngine",
    "PolicyError",
    "PolicyNotWritable",
    "PolicyRequest",
    "PolicyRequestError",
    "PolicySource",
    "Rule",
    "Spend",
    "catalog_problems",
    "check_against_catalog",
    "compile_policy",
    "estimate_tokens",
    "parse_policy",
    "predicted_cost",
    "EMBEDDED_POLICY_VERSION",
    "Admission",
    "Architecture",
    "Catalog",
    "CatalogError",
    "CatalogFile",
    "Exclusion",
    "Kind",
    "LocalServer",
    "Tier",
    "Worker",
    "admit",
    "load_catalog",
    "parse_catalog",
]
