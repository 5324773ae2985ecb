"""policies/: the worker catalog and the admission of workers per request (the safety boundary).

Imports neither gateway nor router. Public surface below; other packages import only this.
"""

from policies.admission import EMBEDDED_POLICY_VERSION, Admission, Exclusion, admit
from policies.catalog import (
    DEFAULT_CATALOG_PATH,
    Architecture,
    Catalog,
    CatalogError,
    LocalServer,
    Tier,
    Worker,
    load_catalog,
    parse_catalog,
)

__all__ = [
    "DEFAULT_CATALOG_PATH",
    "EMBEDDED_POLICY_VERSION",
    "Admission",
    "Architecture",
    "Catalog",
    "CatalogError",
    "Exclusion",
    "LocalServer",
    "Tier",
    "Worker",
    "admit",
    "load_catalog",
    "parse_catalog",
]
