"""Does a policy fit the worker catalog it will run against?

The policy file is validated on its own (policies/schema.py); the names it borrows from the catalog —
a tenant's judge, an embeddings alias's worker, the models a rule is scoped to — can only be checked
against a catalog. A typo there would not fail loudly later: a judge outside the catalog fails every
grade, an alias to a missing worker 404s every request, and a rule scoped to a model nobody can send
silently never applies. So the check runs wherever a policy is put in force — at startup, on a file
reload, on PUT /admin/policies — and in `polyroute policies validate`, with the same result.
"""

from __future__ import annotations

from collections.abc import Collection

from policies.catalog import Catalog, Kind
from policies.schema import AUTO_MODEL, WORKFLOW_PREFIX, Policy, PolicyError


def catalog_problems(policy: Policy, catalog: Catalog, workflows: Collection[str] | None = None) -> list[str]:
    """Every name the policy takes from the catalog that the catalog does not have, each with its place.

    `workflows`: the workflow names `compose:<name>` may take (router/compose WORKFLOWS; policies/ does
    not import the router). None accepts any `compose:` name."""
    problems: list[str] = []
    for tenant, config in policy.tenants.items():
        if config.judge is not None:
            if (why := _not_a(catalog, config.judge.worker, Kind.chat)) is not None:
                problems.append(f"tenants.{tenant}.judge.worker: {why} (a judge is a chat worker)")
    for alias, target in policy.embedding_aliases.items():
        if (why := _not_a(catalog, target.worker, Kind.embedding)) is not None:
            problems.append(
                f"embedding_aliases.{alias}.worker: {why} (an embeddings alias names an embedding worker)"
            )
    requestable = _requestable(policy, catalog)
    for i, rule in enumerate(policy.rules):
        for j, model in enumerate(rule.when.models):
            if model in requestable or _is_workflow(model, workflows):
                continue
            problems.append(
                f"rules.{i}.when.models.{j}: {model!r} is not a model a request can name "
                f"(auto, compose:<workflow>, an alias of this policy, or a worker of the catalog)"
            )
    return problems


def check_against_catalog(
    policy: Policy, catalog: Catalog, source: str = "policy", workflows: Collection[str] | None = None
) -> None:
    """Raise PolicyError naming every problem of catalog_problems; the message starts with `source`."""
    problems = catalog_problems(policy, catalog, workflows)
    if problems:
        raise PolicyError(f"{source}: policy does not fit the worker catalog: {'; '.join(problems)}")


def _not_a(catalog: Catalog, name: str, kind: Kind) -> str | None:
    """Why `name` is not a `kind` worker of the catalog, or None when it is."""
    worker = catalog.get(name, kind=None)
    if worker is None:
        return f"{name!r} is not in the catalog"
    if worker.kind != kind:
        return f"{name!r} is {_a(worker.kind)} worker, not {_a(kind)} worker"
    return None


def _a(kind: Kind) -> str:
    return f"{'an' if kind.value[0] in 'aeiou' else 'a'} {kind.value}"


def _requestable(policy: Policy, catalog: Catalog) -> set[str]:
    """The names a rule's `when.models` can match: the engine compares the model a request named —
    auto, a chat alias or a chat worker, and on /v1/embeddings an embedding worker or an embeddings
    alias (so embedding names are as legitimate here as chat ones)."""
    return {AUTO_MODEL, *policy.aliases, *policy.embedding_aliases, *(w.name for w in catalog.workers)}


def _is_workflow(model: str, workflows: Collection[str] | None) -> bool:
    """`compose:<workflow>` is accepted as the rest of the gateway accepts it (a known workflow);
    POST /admin/policies/explain matches it as written."""
    if not model.startswith(WORKFLOW_PREFIX):
        return False
    return workflows is None or model[len(WORKFLOW_PREFIX) :] in workflows
