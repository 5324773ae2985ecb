"""`polyroute router calibrate`: the command around polyroute/calibrate.py (what it does and why is there).

Reads the settings a gateway would (POLYROUTE_*, REDIS_URL), prints the plan and its estimated cost,
then (unless --dry-run) runs it with a progress bar showing the spend, and fits what was graded.
Exit codes: 0 done (or stopped at the cap: rerun to resume), 1 some calls failed (rerun retries
them), 2 bad input or a state the run cannot start from, 130 stopped by Ctrl-C and 143 by SIGTERM
(the calls in flight are recorded as stopped; rerun to resume). A run killed outright (SIGKILL)
records nothing more, but each paid call it had in flight left an intent in the ledger, which the
next run books as stopped at its hold and counts against its cap (polyroute/calibrate.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

console = Console(stderr=True)


def _usd(value: Decimal) -> str:
    return f"${value:.4f}" if value < 1 else f"${value:.2f}"


def _fail(message: str, code: int = 2) -> typer.Exit:
    """One line on stderr, markup-free: it quotes paths, options and errors, whose brackets ("[draft]",
    "[/x]", a pattern's "[a-z]") rich would read as markup, dropping them or raising MarkupError."""
    console.print(message, style="red", markup=False, soft_wrap=True)
    return typer.Exit(code)


def _records(settings) -> list[dict]:
    """The ledger a gateway with these settings writes (file or Redis); empty when there is none yet."""
    from gateway.ledger_export import ledger_records

    try:
        return list(ledger_records(Path(settings.data_dir), settings.redis_url))
    except FileNotFoundError:
        return []
    except Exception as exc:
        if type(exc).__module__.startswith("redis"):
            raise _fail(f"cannot read the ledger from Redis: {exc}") from None
        raise


def _spent(spent: Decimal, cap: Decimal) -> str:
    """The progress bar's spend: red and said when the run has passed its cap."""
    if spent > cap:
        return f"[bold red]{_usd(spent)} (over the cap)[/]"
    return _usd(spent)


def _excluded(plan) -> str:
    """Markup-escaped: the rules' ids and reasons are the policy author's text."""
    return "; ".join(
        escape(f"{worker}: {n} pairs by rule {rule} ({plan.reasons[rule]})")
        for worker, rules in plan.excluded.items()
        for rule, n in rules.items()
    )


def _lost(plan, dry_run: bool) -> str:
    """The one line on calls earlier runs left in flight (killed before recording their outcome)."""
    n = len(plan.lost)
    workers = escape(", ".join(sorted({call.worker for call in plan.lost})))
    calls, were, them, holds = (
        ("calls", "were", "them", "their holds") if n > 1 else ("call", "was", "it", "its hold")
    )
    booked = "a real run books them" if dry_run else "booked"
    return (
        f"[yellow]{n} {calls} to {workers} {were} in flight when an earlier run was killed[/] (no outcome in "
        f"the ledger; the provider may bill {them}): {booked} as stopped (status 499) at {holds}, "
        f"{_usd(plan.lost_usd)}, counted against this run's cap"
    )


def _print_plan(plan, cap: Decimal, seed: int, dry_run: bool = False) -> Decimal:
    from polyroute.calibrate import estimate

    kinds: dict[str, int] = {}
    for probe in plan.probes:
        kinds[probe.type] = kinds.get(probe.type, 0) + 1
    source = escape(f"{plan.probe_set.path} ({plan.probe_set.version}, seed {seed})")
    console.print(
        f"{len(plan.probes)} probes from {source}: " + ", ".join(f"{n} {kind}" for kind, n in kinds.items())
    )
    for name, reason in plan.unavailable.items():
        console.print(f"[yellow]skipping {escape(name)}[/]: {escape(reason)}")
    if plan.done:
        console.print(f"resuming: {plan.done} (worker, probe) pairs were graded by an earlier run")
    if plan.excluded:
        console.print(f"[yellow]excluded by the policy, not sent[/]: {_excluded(plan)}")
    if plan.lost:
        console.print(_lost(plan, dry_run))
    table = Table("worker", "calls", "estimated", "at most (max_tokens)", title="estimated cost")
    expected_total = worst_total = Decimal(0)
    for row in estimate(plan):
        table.add_row(row.worker, str(row.pairs), _usd(row.expected_usd), _usd(row.worst_usd))
        expected_total += row.expected_usd
        worst_total += row.worst_usd
    table.add_row("total", str(len(plan.pending)), _usd(expected_total), _usd(worst_total), style="bold")
    console.print(table)
    console.print(
        f"cost cap {_usd(cap)}" + (": the run may stop there (rerun to resume)" if worst_total > cap else "")
    )
    return expected_total


async def _stoppable(run, stopped: list[str]):
    """`run`, cancelled by SIGTERM as asyncio.run cancels it on Ctrl-C: each call in flight is then
    recorded as stopped and the ledger written out. SIGTERM is what `timeout`, systemd and Kubernetes
    send; its default ends the process at once, and the calls in flight, sent and maybe billed, were
    lost. A second SIGTERM ends the process at once."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None

    def stop() -> None:
        stopped.append("SIGTERM")
        loop.remove_signal_handler(signal.SIGTERM)
        task.cancel()

    with contextlib.suppress(NotImplementedError):  # no such handlers on Windows' event loop
        loop.add_signal_handler(signal.SIGTERM, stop)
    try:
        return await run
    finally:
        with contextlib.suppress(NotImplementedError):
            loop.remove_signal_handler(signal.SIGTERM)


def _quiet_logs() -> None:
    """Warnings above the progress bar; a failed call is counted in the summary, not logged each time."""
    from rich.logging import RichHandler

    logging.basicConfig(
        level=logging.WARNING,
        format="%(name)s: %(message)s",
        handlers=[RichHandler(console=console, show_path=False)],
    )
    logging.getLogger("polyroute.upstream").setLevel(logging.ERROR)


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _print_result(result, plan) -> None:
    """The run's table and notes. Table cells are rich markup: the policy's reasons and the workers'
    error texts ("[Errno 111] …", a provider's "[/…]") are escaped."""
    table = Table("worker", "graded", "mean score", "errors", "skipped by policy", "spent")
    for worker in plan.workers:
        tally = result.tallies[worker.name]
        skipped = ", ".join(f"{n} ({rule}: {tally.reasons[rule]})" for rule, n in tally.skipped.items())
        skipped = ", ".join(
            filter(
                None, [skipped, *(f"{n} ({rule})" for rule, n in plan.excluded.get(worker.name, {}).items())]
            )
        )
        table.add_row(
            worker.name,
            str(tally.graded),
            f"{tally.mean:.2f}" if tally.mean is not None else "-",
            f"{tally.errors}" + (f" (last: {escape(_short(tally.last_error))})" if tally.last_error else ""),
            escape(skipped) or "-",
            _usd(tally.spent),
        )
    console.print(table)
    for name, tally in result.tallies.items():
        if tally.no_usage:
            console.print(
                f"[yellow]{name} reported no token usage for {tally.no_usage} answers[/]: each is booked at "
                f"its hold, the most it could cost ({_usd(tally.booked)} in all); the provider's bill may differ"
            )
    for name, reason in result.unavailable.items():
        console.print(f"[yellow]{name} was not called[/]: {escape(reason)}")
    for name, tally in result.tallies.items():
        if tally.gave_up:
            console.print(
                f"[yellow]gave up on {name} after {tally.failing} failed calls in a row[/]; its other probes "
                "are left for a rerun"
            )


def calibrate_command(
    workers: Annotated[
        str | None, typer.Option(help="comma-separated worker names [default: every available worker]")
    ] = None,
    probes: Annotated[int, typer.Option(min=1, help="probes per worker, stratified over answer types")] = 200,
    max_cost_usd: Annotated[
        str, typer.Option(help="stop before a call would take this run's spend over this (USD)")
    ] = "2.00",
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="print the plan and its estimated cost; send nothing")
    ] = False,
    seed: Annotated[int, typer.Option(help="which probes (the same seed resumes the same set)")] = 0,
    concurrency: Annotated[int, typer.Option(min=1, max=32, help="calls in flight at once")] = 4,
    tenant: Annotated[
        str, typer.Option(help="the tenant the policy is evaluated for and the ledger records")
    ] = "calibration",
    probe_file: Annotated[
        Path | None, typer.Option(help="a probe file (JSON lines) [default: the shipped set]")
    ] = None,
    # the help of cli.py's WorkersFile and RouterDir (cli.py imports this module, so not from there):
    # Settings.from_env reads these variables when the options are not given, as `serve` does
    workers_file: Annotated[
        Path | None,
        typer.Option(
            help="worker catalog YAML [env POLYROUTE_WORKERS_FILE, default: embedded], as `serve` reads it"
        ),
    ] = None,
    router_dir: Annotated[
        Path | None, typer.Option(help="model store [env POLYROUTE_ROUTER_DIR] [default: <data dir>/router]")
    ] = None,
    data_dir: Annotated[
        Path | None,
        typer.Option("--data-dir", help="state directory [env POLYROUTE_DATA_DIR, default .polyroute]"),
    ] = None,
) -> None:
    """Measure workers on labelled probes through the gateway's worker path, grade them into the ledger
    (source: calibration), fit their vectors and put the new router in force. A rerun resumes. Reads
    the settings a gateway would (POLYROUTE_* env vars, REDIS_URL): its policy, ledger and workers."""
    from gateway import Settings
    from gateway.keys import check_tenant
    from policies import CatalogError, load_catalog
    from polyroute.calibrate import (
        CalibrationError,
        fit_workers,
        make_plan,
        parse_worker_names,
        planning_policy,
        run_calibration,
    )
    from router.probes import ProbeError, load_probes

    try:  # a tenant no key can carry: the policy and the ledger would be read and written for nobody
        check_tenant(tenant)
    except ValueError as exc:
        raise _fail(f"--tenant: {exc}") from None
    try:
        cap = Decimal(max_cost_usd)
    except InvalidOperation:
        raise _fail(f"--max-cost-usd must be a number of dollars, got {max_cost_usd!r}") from None
    if not cap.is_finite():
        raise _fail(f"--max-cost-usd must be a finite number of dollars, got {max_cost_usd}")
    if cap <= 0:
        raise _fail(f"--max-cost-usd must be more than 0, got {max_cost_usd}")
    data_dir = data_dir or Path(os.environ.get("POLYROUTE_DATA_DIR") or ".polyroute")
    try:
        settings = Settings.from_env(data_dir=data_dir, workers_file=workers_file, router_dir=router_dir)
        catalog = load_catalog(settings.workers_file)
        probe_set = load_probes(probe_file)
        plan = make_plan(
            catalog,
            probe_set,
            probes,
            seed,
            parse_worker_names(workers),
            _records(settings),
            settings.local_workers,
            planning_policy(settings, catalog),
            tenant,
        )
    except (CatalogError, ProbeError, CalibrationError, ValueError) as exc:
        raise _fail(str(exc)) from None
    if not plan.workers:
        raise _fail("no worker can be called: " + "; ".join(f"{n}: {r}" for n, r in plan.unavailable.items()))
    _print_plan(plan, cap, seed, dry_run)
    if dry_run:
        console.print("dry run: nothing was sent")
        return
    root = Path(settings.router_dir or Path(settings.data_dir) / "router")
    _quiet_logs()
    result = None
    if plan.pending or plan.lost:  # a run books the calls earlier runs lost, even with nothing to send
        with Progress(
            TextColumn("[bold]calibrating[/]"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("spent {task.fields[spent]} of {task.fields[cap]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=console,
        ) as bar:
            task = bar.add_task("calibrate", total=len(plan.pending), spent=_usd(Decimal(0)), cap=_usd(cap))

            def progress(pair, outcome, spent) -> None:
                bar.update(task, advance=1, spent=_spent(spent, cap))

            stopped: list[str] = []
            try:
                result = asyncio.run(
                    _stoppable(
                        run_calibration(
                            settings, catalog, plan, cap, tenant, concurrency, progress, bar.console.print
                        ),
                        stopped,
                    )
                )
            except CalibrationError as exc:
                raise _fail(str(exc)) from None
            except (KeyboardInterrupt, asyncio.CancelledError):
                by = "SIGTERM" if stopped else "Ctrl-C"
                bar.stop()
                console.print(
                    f"[yellow]stopped by {by}[/]: the graded answers are in the ledger; each call left in "
                    "flight is recorded as stopped (status 499, with the most it may cost) and an answer "
                    "being graded as paid but not graded; run the same command again to resume"
                )
                raise typer.Exit(143 if stopped else 130) from None
        _print_result(result, plan)
        if result.capped:
            console.print(
                f"[yellow]stopped at the cost cap[/] ({_usd(result.spent)} spent of {_usd(cap)}): "
                f"{result.left} calls left; run the same command again to resume"
            )
            if result.blocked is not None and result.blocked[1] > cap:
                worker, hold = result.blocked
                console.print(
                    f"[yellow]a call to {worker} may cost up to {_usd(hold)} alone, more than the cap: "
                    "raise --max-cost-usd to go on[/]"
                )
        else:
            left = f"; {result.left} calls left for a rerun" if result.left else ""
            console.print(f"done: {_usd(result.spent)} spent{left}")
        if result.over_cap:
            why = (
                "answers were billed more than their holds allowed for (see the spent column: a "
                "provider that bills more tokens than predicted, or more output than max_tokens)"
            )
            if result.spent - result.lost_usd <= cap:
                why = (
                    "the calls earlier runs left in flight, booked at their holds "
                    f"({_usd(result.lost_usd)}), passed it"
                )
            over = f"this run spent {_usd(result.spent)}, more than its cap of {_usd(cap)}"
            console.print(f"[bold red]warning: {over}[/]: {why}")
    else:
        excluded = f", {plan.excluded_pairs} excluded by the policy" if plan.excluded else ""
        console.print(f"nothing to send: {plan.done} (worker, probe) pairs are graded{excluded}")
        if settings.router_prior:  # the calls above built the gateway's state, which installs it
            from router.shipped import try_install_shipped_prior

            prior_error = try_install_shipped_prior(root)
            if prior_error:
                console.print(f"[yellow]{escape(prior_error)}[/]")
    with console.status("fitting the workers' vectors …"):
        fit = fit_workers(root, _records(settings), probe_set, [w.name for w in plan.workers])
    colour = {"fitted": "green", "unchanged": "green", "no_labels": "yellow", "no_router": "yellow"}
    console.print(f"[{colour.get(fit.status, 'red')}]{escape(fit.message)}[/]")
    if (result is not None and result.errors) or fit.status == "failed":
        raise typer.Exit(1)
