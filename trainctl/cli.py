"""The `trainctl` command line: each command parses its arguments, calls `trainctl.api` and renders the value.

Launcher side of the wall: nothing here (or below it) imports torch or wandb, so every command except a real
launch answers in well under a second on a login node. Rich rendering lives in trainctl/render.py.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.syntax import Syntax

from trainctl import api, cli_tools
from trainctl.cli_tools import RUN, RUNS_DIR
from trainctl.config import sources
from trainctl.core import rundir
from trainctl.core.errors import UserError

app = typer.Typer(
    help="Compose, plan and launch Llama training runs. "
    "Overrides use Hydra's grammar: key=value, group=option, +key=value, ~key.",
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion for bash, zsh, fish
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    rich_markup_mode=None,  # help text is shown as written: `key=[a,b]` stays, no markup or emoji
)


def _print_version(value: bool) -> None:
    if value:
        import trainctl

        sys.stdout.write(f"trainctl {trainctl.__version__}\n")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", "-V", callback=_print_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    """Compose, plan and launch Llama training runs."""
config_app = typer.Typer(help="Inspect config groups and the resolved config.", no_args_is_help=True)
app.add_typer(config_app, name="config")
data_app = typer.Typer(help="Turn your own text into a token dataset.", no_args_is_help=True)
app.add_typer(data_app, name="data")

out = Console(emoji=False)  # user text stays as written: no :name: emoji codes
err = Console(stderr=True, emoji=False)


def _say(console: Console, text: str) -> None:
    """One line of plain text (no markup, no highlighting, never wrapped inside a word)."""
    console.print(text, markup=False, highlight=False, soft_wrap=True)


def _opt(default, *flags: str, help: str, **kw):  # noqa: A002 -- typer's own keyword
    """A typer option; one without a default shows none."""
    return typer.Option(default, *flags, help=help, show_default=default is not None and default is not ..., **kw)


OVERRIDES = typer.Argument(
    None, help="Hydra overrides, e.g. recipe=tiny_cpu optim.lr=1e-4 model=llama2_7b", show_default=False
)
CONFIG_DIRS = _opt(None, "--config-dir", help=f"A folder of your own options (DIR/recipes/*.yaml, DIR/model/*.yaml, "
                   f"...); repeatable; searched before ${sources.ENV_VAR}'s folders and the shipped configs.")
AS_JSON = typer.Option(False, "--json", help="Print JSON (for scripts).")


def _search(config_dirs: list[Path] | None) -> sources.SearchPath:
    """The config folders to compose from; a user option hiding a shipped one is said on stderr."""
    sp = api.search(config_dirs)
    for note in api.shadow_notes(sp):
        _say(err, note)
    return sp


@app.command()
def recipes(config_dirs: list[Path] = CONFIG_DIRS) -> None:
    """List the recipes, one line each, with where each comes from.  Example: trainctl recipes"""
    from trainctl.render import table_or_lines

    table_or_lines(out, None, [list(row) for row in api.recipes(_search(config_dirs))], "recipe", "description", "from")


@config_app.command("groups")
def config_groups(config_dirs: list[Path] = CONFIG_DIRS) -> None:
    """Every config group and its options (user options with their file).  Example: trainctl config groups"""
    from trainctl.render import plain_table

    out.print(plain_table(("group", "options", "default", "from your folders"), api.groups(_search(config_dirs))))


@config_app.command("show")
def config_show(overrides: list[str] = OVERRIDES, config_dirs: list[Path] = CONFIG_DIRS) -> None:
    """Print the resolved config as YAML.  Example: trainctl config show recipe=llama7b_fsdp optim.lr=1e-4"""
    from trainctl.config.load import to_yaml

    text = to_yaml(api.resolved(overrides, _search(config_dirs)))
    out.print(Syntax(text, "yaml", background_color="default")) if out.is_terminal else sys.stdout.write(text)


@app.command()
def plan(overrides: list[str] = OVERRIDES,
         as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON."),
         compare: str = _opt(None, "--compare", help="Side-by-side memory and step time along one axis: sharding, "
                             "checkpointing, tp, micro_batch, optim, ep."),
         config_dirs: list[Path] = CONFIG_DIRS) -> None:
    # One help line for typer, written as two literals to keep the source under 120 columns.
    ("Show the run plan: topology, batch math, FLOPs, memory per rank with a verdict, throughput.  "
     "Example: trainctl plan recipe=llama7b_fsdp cluster.nodes=2 --compare sharding")
    from trainctl import render

    cfg = api.resolved(overrides, _search(config_dirs))
    if compare is not None:
        axis = compare.replace("-", "_")
        rows = api.compare(cfg, axis)
        sys.stdout.write(json.dumps({"axis": axis, "rows": rows}, indent=2) + "\n") if as_json else out.print(
            render.compare_table(axis, rows))
        return
    data = api.plan_record(cfg)
    sys.stdout.write(json.dumps(data, indent=2) + "\n") if as_json else render.render_plan(out, data)


@app.command("runs")
def list_runs(
    overrides: list[str] = typer.Argument(None, help="Overrides whose config says where the runs are, e.g. "
                                          "recipe=NAME or runs_dir=/scratch/runs.", show_default=False),
    runs_dir: Path = _opt(None, "--runs-dir", help="Where the runs are (default: the config's runs_dir: "
                          "$TRAINCTL_RUNS_DIR, else runs)."),
    as_json: bool = AS_JSON,
    sweep_name: str = _opt(None, "--sweep", help="A sweep's points with their overrides, best first."),
    config_dirs: list[Path] = CONFIG_DIRS,
) -> None:
    """List runs with their state, progress and latest losses (Slurm runs from squeue/sacct).  Example: trainctl runs"""
    from trainctl import render

    configs = _search(config_dirs) if runs_dir is None and (overrides or config_dirs) else None
    runs_dir = api.runs_dir_of(runs_dir, overrides, configs)
    if sweep_name is not None:
        ranking = api.sweep_runs(sweep_name, runs_dir)
        render.print_json(ranking.rows) if as_json else render.sweep_table(out, ranking)
        return
    infos = api.runs(runs_dir)
    render.print_json([i.to_dict() for i in infos]) if as_json else render.runs_table(out, infos)


@app.command()
def status(run: str = RUN, runs_dir: Path = RUNS_DIR, as_json: bool = AS_JSON) -> None:
    """Show one run's state, progress, losses, speed and ETA.  Example: trainctl status tiny_cpu-20250101-120000"""
    from trainctl import render

    info = api.status(run, runs_dir)
    render.print_json(info.to_dict()) if as_json else render.status_panel(out, info)


@app.command()
def plot(run: list[str] = typer.Argument(None, help="Run directories or names under --runs-dir.", show_default=False),
         sweep_name: str = _opt(None, "--sweep", help="Every point of a sweep, overlaid."),
         out_file: Path = _opt(None, "--out", help="The PNG to write (default: RUN/plot.png, or plot.png for "
                               "several runs)."),
         runs_dir: Path = RUNS_DIR) -> None:
    """Plot train/eval loss, learning rate, tokens/s and grad norm, runs overlaid.  Example: trainctl plot a b"""
    _say(out, f"wrote {api.plot(run or [], sweep_name=sweep_name, out_file=out_file, runs_dir=runs_dir)}")


@app.command()
def logs(run: str = RUN, follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing until the run "
                                                     "ends (Ctrl-C stops following, not the run)."),
         rank: int = _opt(None, "--rank", help="A rank's own log (RUN/logs/rankN.log); default: the workers' output "
                          "of the newest attempt."),
         runs_dir: Path = RUNS_DIR) -> None:
    """Print a run's log.  Example: trainctl logs tiny_cpu-20250101-120000 --follow"""
    try:
        api.logs(run, sys.stdout.buffer, rank=rank, follow=follow, runs_dir=runs_dir)
    except KeyboardInterrupt:
        return


@app.command()
def cancel(run: str = RUN, runs_dir: Path = RUNS_DIR) -> None:
    """Stop a running or pending run (scancel on Slurm).  Example: trainctl cancel tiny_cpu-20250101-120000"""
    done = api.cancel(run, runs_dir)
    out.print(f"cancelled {done.what} of run {done.state.name} (it was {done.state.state})")


def _warn(lines: list[str]) -> None:
    for warning in lines:
        err.print(f"[yellow]warning:[/] {escape(warning)}", highlight=False, soft_wrap=True)


@app.command()
def launch(
    overrides: list[str] = OVERRIDES,
    dry_run: bool = typer.Option(False, "--dry-run", help="Write the run directory and stop; start nothing."),
    name: str = typer.Option("", "--name", help="Run directory name (default: recipe or model, then a timestamp); "
                             "with -m, the sweep's name."),
    force: bool = typer.Option(
        False, "--force", help="Launch even when the plan says a rank's memory does not fit its device."),
    multirun: bool = typer.Option(
        False, "-m", "--multirun", help="A sweep: one run per point of Hydra's sweep grammar (a=1,2 range() "
        "choice()); locally one after another, on Slurm one job array."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="The full plan (as `trainctl plan` prints it) "
                                 "instead of its short summary."),
    config_dirs: list[Path] = CONFIG_DIRS,
) -> None:
    """Write a run directory and start the workers.  Example: trainctl launch recipe=tiny_cpu train.steps=50"""
    from trainctl import render

    if multirun:
        _launch_sweep(list(overrides or []), _search(config_dirs), dry_run, force, name)
        return
    prepared = api.prepare_launch(overrides, _search(config_dirs), dry_run=dry_run, force=force, name=name)
    plan = {k: v for k, v in prepared.plan.to_dict().items() if k != "warnings"}  # warnings: once, on stderr
    render.render_plan(out, plan) if verbose else render.plan_summary(out, plan)
    _warn(prepared.warnings)
    out.print(f"run directory: [bold]{escape(str(prepared.run_dir))}[/]", highlight=False, soft_wrap=True)
    if dry_run:
        out.print(f"dry run: start it with [bold]{escape(prepared.start_command)}[/]", highlight=False, soft_wrap=True)
        return
    _start(prepared)


def _launch_sweep(overrides: list[str], sp, dry_run: bool, force: bool, name: str) -> None:
    prepared = api.prepare_sweep(overrides, sp, dry_run=dry_run, force=force, name=name)
    _say(out, f"sweep {prepared.name}: {len(prepared.points)} points in {prepared.folder}")
    for varied, run_dir in zip(prepared.varied, prepared.run_dirs, strict=True):
        _say(out, f"  {run_dir.name}: {' '.join(varied)}")
    if dry_run:
        if prepared.start_command:
            _say(out, f"dry run: submit the job array with {prepared.start_command}")
        return
    result = api.start_sweep(prepared, console=True, on_point=lambda point, total: _say(
        out, f"sweep {prepared.name}: point {point.index + 1}/{total}: {' '.join(point.overrides)}"))
    if result.message:
        _say(out, result.message)
        return
    if result.stopped_at is not None:
        _say(err, f"sweep {prepared.name} stopped at point {result.stopped_at}; resume its runs with `trainctl resume`")
    _say(out, f"sweep {prepared.name}: {sum(c == 0 for c in result.exit_codes)} of {len(prepared.points)} points "
         f"completed; rank them with: trainctl runs --sweep {prepared.name}")
    raise typer.Exit(result.exit_code)


def _start(prepared: api.Prepared) -> None:
    """A run that ran here exits with its code, a queued one says how to follow it."""
    handle = api.start(prepared, console=True)
    if handle.message:
        _say(out, handle.message)
    if handle.exit_code == 0:
        _say(out, _next_steps(prepared.run_dir))
    if handle.exit_code is not None:
        raise typer.Exit(handle.exit_code)


def _next_steps(run_dir: Path) -> str:
    """What to run after a finished run: by name when `status` finds it by name from here, else by its path."""
    default = Path(os.environ.get("TRAINCTL_RUNS_DIR", "").strip() or "runs").resolve()
    ref = run_dir.name if run_dir.parent.resolve() == default else _shown(run_dir)
    board = run_dir / rundir.TENSORBOARD
    tail = f" / tensorboard --logdir {shlex.quote(_shown(board))}" if board.is_dir() else ""
    return f"next: trainctl status {shlex.quote(ref)} / trainctl plot {shlex.quote(ref)}{tail}"


def _shown(path: Path) -> str:
    """A path relative to here when it is below here (shorter to read and to copy)."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


@app.command()
def resume(
    run: str = RUN,
    overrides: list[str] = typer.Argument(None, help="Keys to change, checked like a launch, e.g. train.steps=2000 "
                                          "(extends a finished run) or optim.lr=1e-4.", show_default=False),
    force: bool = typer.Option(False, "--force", help="Resume even when the plan says a rank's memory does not fit."),
    runs_dir: Path = RUNS_DIR,
) -> None:
    # One help line for typer, written as two literals to keep the source under 120 columns.
    ("Relaunch a run from its newest valid checkpoint, with its own config or changed keys.  "
     "Example: trainctl resume tiny_cpu-20250101-120000 train.steps=200")
    prepared = api.prepare_resume(run, overrides, force=force, runs_dir=runs_dir)
    for note in prepared.notes:
        _say(out, note)
    _warn(prepared.warnings)
    # Named, not verified here: hashing a large checkpoint on a login node would take long, and the workers
    # verify it anyway (sharing the work), falling back to an older one when it is damaged.
    step = prepared.resumes_from
    where = f"step-{step:08d}" if step is not None else "the start (no checkpoint yet)"
    out.print(f"resuming {escape(str(prepared.run_dir))} from {escape(where)}", highlight=False, soft_wrap=True)
    _start(prepared)


cli_tools.register(app, data_app)  # export, generate, eval, data prepare


def _report(problems: list[str]) -> None:
    for line in problems:
        err.print(f"[red]error:[/] {escape(line)}", highlight=False, soft_wrap=True)  # user text: no markup


def main() -> None:
    """Console-script entry: user errors print one line each and exit 2, never a traceback."""
    if problem := api.cwd_problem():
        _report([problem])
        sys.exit(2)
    try:
        app()
    except UserError as exc:  # config, plan, launch, dataset and export errors all derive from it
        _report(exc.problems)
        sys.exit(2)
    except api.ToolFailed as exc:  # e.g. export --verify found a difference: not the user's mistake
        _report([str(exc)])
        sys.exit(1)


if __name__ == "__main__":
    main()
