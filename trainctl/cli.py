"""The `trainctl` command line: one small function per command, rendered with rich.

Launcher side of the wall: nothing here (or below it) imports torch or wandb, so
every command except a real launch answers in well under a second on a login node.
"""

from __future__ import annotations

import json
import math
import shlex
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.syntax import Syntax
from rich.table import Column, Table

from trainctl.config import compose as composer
from trainctl.config import sources
from trainctl.config.schema import GROUPS, RunConfig, option_of, to_yaml
from trainctl.config.validate import resolve
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

OVERRIDES = typer.Argument(
    None, help="Hydra overrides, e.g. recipe=tiny_cpu optim.lr=1e-4 model=llama2_7b", show_default=False
)


CONFIG_DIRS = typer.Option(
    None, "--config-dir", show_default=False,
    help=f"A folder of your own options (DIR/recipes/*.yaml, DIR/model/*.yaml, ...); repeatable; "
    f"searched before ${sources.ENV_VAR}'s folders and the shipped configs.")


def _search(config_dirs: list[Path] | None) -> sources.SearchPath:
    """The config folders to compose from; a user option hiding a shipped one is said on stderr."""
    sp = sources.search_path([str(d) for d in config_dirs or []])
    for winner, _hidden in sources.shadowed(sp):
        err.print(f"note: {winner.group} {winner.name} from {winner.path} shadows the shipped one",
                  highlight=False, soft_wrap=True, markup=False)
    return sp


def _resolved(overrides: list[str] | None, config_dirs: list[Path] | None = None) -> RunConfig:
    from trainctl.launch.sweep import is_sweep

    if swept := is_sweep(list(overrides or [])):
        raise UserError([f"{item}: several values (a sweep); `trainctl launch -m ...` runs one run per point"
                         for item in swept])
    return resolve(composer.compose(list(overrides or []), _search(config_dirs)))


@app.command()
def recipes(config_dirs: list[Path] = CONFIG_DIRS) -> None:
    """List the recipes, one line each, with where each comes from.  Example: trainctl recipes"""
    sp = _search(config_dirs)
    rows = [(name, composer.recipe_description(name, sp), sources.describe_origin(opt))
            for name, opt in sources.options("recipe", sp).items()]
    if not out.is_terminal:  # for grep and scripts: whole values, tab-separated, never cut
        sys.stdout.write("".join("\t".join(row) + "\n" for row in rows))
        return
    table = Table("recipe", "description", "from", box=None, header_style="bold")
    for row in rows:
        table.add_row(*map(escape, row))
    out.print(table)


@config_app.command("groups")
def config_groups(config_dirs: list[Path] = CONFIG_DIRS) -> None:
    """Every config group and its options (user options with their file).  Example: trainctl config groups"""
    sp = _search(config_dirs)
    table = Table("group", "options", "default", "from your folders", box=None, header_style="bold")
    defaults = composer.compose_dictconfig([], sp)
    for group in (*GROUPS, "recipe"):
        found = sources.options(group, sp)
        default = option_of(group, defaults[group]) if group in GROUPS else "(none)"
        mine = ", ".join(f"{name} ({opt.path})" for name, opt in found.items() if not opt.shipped)
        table.add_row(group, escape(", ".join(found)), default, escape(mine or "-"))
    out.print(table)


@config_app.command("show")
def config_show(overrides: list[str] = OVERRIDES, config_dirs: list[Path] = CONFIG_DIRS) -> None:
    """Print the resolved config as YAML.  Example: trainctl config show recipe=llama7b_fsdp optim.lr=1e-4"""
    cfg = _resolved(overrides, config_dirs)
    text = to_yaml(cfg)
    if out.is_terminal:
        out.print(Syntax(text, "yaml", background_color="default"))
    else:
        sys.stdout.write(text)


@app.command()
def plan(
    overrides: list[str] = OVERRIDES,
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON."),
    compare: str = typer.Option(
        None, "--compare", show_default=False,
        help="Side-by-side memory and step time along one axis: sharding, checkpointing, tp, micro_batch."),
    config_dirs: list[Path] = CONFIG_DIRS,
) -> None:
    # One help line for typer, written as two literals to keep the source under 120 columns.
    ("Show the run plan: topology, batch math, FLOPs, memory per rank with a verdict, throughput.  "
     "Example: trainctl plan recipe=llama7b_fsdp cluster.nodes=2 --compare sharding")
    from trainctl.launch.command import plan_record
    from trainctl.plan import build

    cfg = _resolved(overrides, config_dirs)
    if compare is not None:
        _plan_compare(cfg, compare.replace("-", "_"), as_json)
        return
    # The plan with the command that would launch it, as the run directory's plan.json will hold it.
    data = plan_record(build(cfg), cfg)
    if as_json:
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
        return
    from trainctl.render import render_plan

    render_plan(out, data)


def _plan_compare(cfg: RunConfig, axis: str, as_json: bool) -> None:
    from trainctl.plan.compare import compare
    from trainctl.plan.variants import AXES

    if axis not in AXES:
        raise UserError([f"--compare {axis}: not an axis; use one of: {', '.join(AXES)}"])
    rows = compare(cfg, axis)
    if as_json:
        sys.stdout.write(json.dumps({"axis": axis, "rows": rows}, indent=2) + "\n")
        return
    from trainctl.render import compare_table

    out.print(compare_table(axis, rows))


def _env_runs_dir() -> Path:
    """$TRAINCTL_RUNS_DIR, else runs/: an empty or blank variable counts as unset (as the config reads it)."""
    import os

    return Path(os.environ.get("TRAINCTL_RUNS_DIR", "").strip() or "runs")


RUNS_DIR = typer.Option(None, "--runs-dir", show_default=False, callback=lambda v: v or _env_runs_dir(),
                        help="Where the runs are (the config's runs_dir; default: $TRAINCTL_RUNS_DIR, else runs).")
AS_JSON = typer.Option(False, "--json", help="Print JSON (for scripts).")
RUN = typer.Argument(..., help="A run directory, or a run name under --runs-dir.", show_default=False)


def _step(state) -> str:
    if state.step is None:
        return "-"
    return f"{state.step}/{state.steps}" if state.steps else str(state.step)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _run_record(st, f, eta: float | None = None) -> dict:
    """One run for --json: its state and its figures (None where not known)."""
    return {"name": st.name, "path": str(Path(st.path).resolve()), "launcher": st.launcher, "job_id": st.job_id,
            "state": st.state, "active": st.active, "detail": st.detail, "step": st.step, "steps": st.steps,
            **f.as_dict(), **({"eta_s": eta} if eta is not None else {})}


RUN_COLUMNS = ("run", "launcher", "job", "state", "step", "loss", "eval", "tok/s")


def _run_cells(st, f) -> list[str]:
    return [st.name, st.launcher or "-", st.job_id or "-", st.state, _step(st), _fmt(f.loss, ".4g"),
            _fmt(f.val_loss, ".4g"), _fmt(f.tokens_per_s, ".0f")]


def _runs_dir_of(runs_dir: Path | None, overrides: list[str] | None, config_dirs: list[Path] | None) -> Path:
    """--runs-dir, else the runs_dir of the config the overrides compose (recipe=..., runs_dir=...), else
    $TRAINCTL_RUNS_DIR, else runs/."""
    if runs_dir is not None:
        return runs_dir
    if overrides or config_dirs:
        return Path(composer.compose(list(overrides or []), _search(config_dirs)).runs_dir.strip() or "runs")
    return _env_runs_dir()


@app.command("runs")
def list_runs(
    overrides: list[str] = typer.Argument(None, help="Overrides whose config says where the runs are, e.g. "
                                          "recipe=NAME or runs_dir=/scratch/runs.", show_default=False),
    runs_dir: Path = typer.Option(None, "--runs-dir", show_default=False,
                                  help="Where the runs are (default: the config's runs_dir: $TRAINCTL_RUNS_DIR, "
                                  "else runs)."),
    as_json: bool = AS_JSON,
    sweep_name: str = typer.Option(None, "--sweep", help="A sweep's points with their overrides, best first.",
                                   show_default=False),
    config_dirs: list[Path] = CONFIG_DIRS,
) -> None:
    """List runs with their state, progress and latest losses (Slurm runs from squeue/sacct).  Example: trainctl runs"""
    from trainctl.launch import runs
    from trainctl.launch.figures import figures

    runs_dir = _runs_dir_of(runs_dir, overrides, config_dirs)
    if sweep_name is not None:
        _list_sweep(runs_dir, sweep_name, as_json)
        return

    states = runs.run_states(runs.list_runs(runs_dir))
    measured = [figures(st.path) for st in states]
    if as_json:
        records = [_run_record(st, f) for st, f in zip(states, measured, strict=True)]
        sys.stdout.write(json.dumps(_finite_json(records), indent=2) + "\n")
        return
    # Measured figures next to the plan's, once some run has them: "38.2% (plan 40%)", "61.2 GiB (plan 60.3)".
    shown = any(f.mfu is not None or f.peak_bytes is not None for f in measured)
    rows = [[*_run_cells(st, f), *((f.mfu_text(), f.peak_text()) if shown else ()), st.detail]
            for st, f in zip(states, measured, strict=True)]
    header = [*RUN_COLUMNS, *(("mfu", "peak") if shown else ()), "detail"]
    if not out.is_terminal:  # for grep, cut and awk: whole values, tab-separated, never cut
        sys.stdout.write("".join("\t".join(row) + "\n" for row in [header, *rows]))
        return
    table = Table(*(Column(h, no_wrap=h != "detail") for h in header), box=None, header_style="bold")
    for row in rows:
        table.add_row(*map(escape, row))
    out.print(table)


def _list_sweep(runs_dir: Path, name: str, as_json: bool) -> None:
    """A sweep's points ranked by one metric (the final eval loss when every finished point has one, else the train
    loss), finished points first; unfinished ones last, marked, with their state."""
    from trainctl.launch import runs, sweep

    record = sweep.read(runs_dir, name)
    dirs = sweep.point_run_dirs(record)
    states = {str(d): st.state for d, st in zip(dirs, runs.run_states(dirs), strict=True)}
    metric, rows = sweep.ranked(record, states)
    if as_json:
        sys.stdout.write(json.dumps(_finite_json(rows), indent=2) + "\n")
        return
    ranked_by = "eval loss" if metric == "val_loss" else "train loss"
    header = ["rank", "run", "state", "train loss", "eval loss", "swept"]
    cells = [[str(i + 1) if r["finished"] else "-", r["run"], r["state"] + ("" if r["finished"] else " (unfinished)"),
              _fmt(r["train_loss"], ".4f"), _fmt(r["val_loss"], ".4f"), " ".join(r["swept"])]
             for i, r in enumerate(rows)]
    if not out.is_terminal:
        sys.stdout.write("".join("\t".join(row) + "\n" for row in [header, *cells]))
        return
    out.print(f"sweep {name}: ranked by final {ranked_by}; unfinished points last", markup=False, highlight=False)
    table = Table(*header, box=None, header_style="bold")
    for row in cells:
        table.add_row(*map(escape, row))
    out.print(table)


def _finite_json(value):
    """Strict JSON for scripts: NaN and infinities (a diverged loss) become null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite_json(v) for v in value]
    return value


@app.command()
def status(run: str = RUN, runs_dir: Path = RUNS_DIR, as_json: bool = AS_JSON) -> None:
    """Show one run's state, progress, losses, speed and ETA.  Example: trainctl status tiny_cpu-20250101-120000"""
    from trainctl.launch import runs
    from trainctl.launch.figures import figures, sparkline

    run_dir = runs.find_run(run, runs_dir)
    st = runs.run_state(run_dir)
    f = figures(run_dir)
    eta = f.eta_s(st.step, st.steps) if st.active else None
    if as_json:
        record = {**_run_record(st, f, eta), "log": str(runs.log_path(run_dir, None))}
        sys.stdout.write(json.dumps(_finite_json(record), indent=2) + "\n")
        return
    peak = f.peak_text() + (f", by {f.peak_source}" if f.peak_source else "")
    rows = [("run", str(run_dir)), ("launcher", st.launcher or "- (not launched)"), ("job", st.job_id),
            ("state", st.state), ("detail", st.detail), ("step", _step(st)),
            ("loss", f"{_fmt(f.loss, '.4f')}  {sparkline(f.losses)}".strip() if f.loss is not None else ""),
            ("eval", _fmt(f.val_loss, ".4f") if f.val_loss is not None else ""),
            ("speed", f"{f.tokens_per_s:,.0f} tokens/s" if f.tokens_per_s is not None else ""),
            ("eta", _duration(eta) if eta is not None else ""),
            ("mfu", f.mfu_text()), ("peak", peak), ("log", str(runs.log_path(run_dir, None)))]
    for key, value in rows:
        if value:
            out.print(f"{key:9}{value}", highlight=False, soft_wrap=True, markup=False)


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


@app.command()
def plot(
    run: list[str] = typer.Argument(None, help="Run directories or names under --runs-dir.", show_default=False),
    sweep_name: str = typer.Option(None, "--sweep", help="Every point of a sweep, overlaid.", show_default=False),
    out_file: Path = typer.Option(None, "--out", help="The PNG to write (default: RUN/plot.png, or plot.png for "
                                  "several runs).", show_default=False),
    runs_dir: Path = RUNS_DIR,
) -> None:
    """Plot train/eval loss, learning rate, tokens/s and grad norm, runs overlaid.  Example: trainctl plot a b"""
    from trainctl.launch import runs
    from trainctl.launch.plot import plot as draw
    from trainctl.launch.plot import target_path

    run_dirs = [runs.find_run(r, runs_dir) for r in run or []]
    labels = [d.name for d in run_dirs]
    if sweep_name is not None:
        from trainctl.launch import sweep

        record = sweep.read(runs_dir, sweep_name)
        run_dirs += sweep.point_run_dirs(record)
        # A sweep's curves are told apart by what the sweep varies.
        labels += [f"{p['run_dir'].rsplit('/', 1)[-1]}: {' '.join(varied)}" for p, varied in
                   zip(record["points"], sweep.swept([p.get("overrides", []) for p in record["points"]]), strict=True)]
    if not run_dirs:
        raise UserError(["plot: name runs (trainctl plot RUN [RUN...]) or a sweep (--sweep NAME)"])
    default = sweep.sweep_dir(runs_dir, sweep_name) / "plot.png" if sweep_name else (
        run_dirs[0] / "plot.png" if len(run_dirs) == 1 else Path("plot.png"))
    target = target_path(out_file or default)  # checked before matplotlib is imported or anything drawn
    out.print(f"wrote {draw(run_dirs, target, labels)}", markup=False, highlight=False, soft_wrap=True)


@app.command()
def logs(
    run: str = RUN,
    follow: bool = typer.Option(
        False, "--follow", "-f", help="Keep printing until the run ends (Ctrl-C stops following, not the run)."),
    rank: int = typer.Option(
        None, "--rank", show_default=False,
        help="A rank's own log (RUN/logs/rankN.log); default: the workers' output of the newest attempt."),
    runs_dir: Path = RUNS_DIR,
) -> None:
    """Print a run's log.  Example: trainctl logs tiny_cpu-20250101-120000 --follow"""
    from trainctl.core import rundir as layout
    from trainctl.launch import runs

    run_dir = runs.find_run(run, runs_dir)
    if rank is not None and rank < 0:
        raise UserError([f"--rank {rank}: ranks count from 0"])
    state = runs.run_state(run_dir)
    path = runs.log_path(run_dir, rank)
    if not follow or not state.active:
        # A run that is not active will write no log: say what there is instead of waiting or printing nothing.
        f = layout.open_regular(path)
        if f is None:
            raise UserError([_no_log(path, rank, state.state, run_dir)])
        with f:
            while chunk := f.read(runs.FOLLOW_CHUNK):
                sys.stdout.buffer.write(chunk)
        return
    try:
        found = runs.follow(lambda: runs.log_path(run_dir, rank), lambda: runs.run_state(run_dir).active,
                            sys.stdout.buffer)
    except KeyboardInterrupt:
        return
    if not found:
        raise UserError([_no_log(path, rank, runs.run_state(run_dir).state, run_dir)])


def _no_log(path: Path, rank: int | None, state: str, run_dir: Path) -> str:
    if path.exists() and not path.is_file():
        return f"{path} is not a regular file (something else was put there); it is not read"
    if rank is not None:
        ranks = sorted(p.name for p in (run_dir / "logs").glob("rank*.log"))
        have = f"; logs there: {', '.join(ranks)}" if ranks else ""
        return f"--rank {rank}: {path} does not exist (run state {state}){have}"
    return f"{path} does not exist (run state {state}); a run writes it once its workers start"


@app.command()
def cancel(run: str = RUN, runs_dir: Path = RUNS_DIR) -> None:
    """Stop a running or pending run (scancel on Slurm).  Example: trainctl cancel tiny_cpu-20250101-120000"""
    from trainctl.launch import backends, runs

    st = runs.cancel(runs.find_run(run, runs_dir))
    what = backends.named(st.launcher).job_label(st.job_id)
    out.print(f"cancelled {what} of run {st.name} (it was {st.state})")


def _launch_problems(cfg: RunConfig, run_plan, dry_run: bool, force: bool, workdir: Path | None = None) -> list[str]:
    """Everything that stops a launch of this config, one line each.

    A dry run is checked the same way (it writes what a launch would start), except that sbatch need not be
    on this machine: the script may be submitted from another one.
    """
    from trainctl.core.support import unsupported
    from trainctl.launch import backends
    from trainctl.launch.preflight import launch_problems
    from trainctl.plan import refusal

    problems = unsupported(cfg.sharding, cfg.precision)
    too_big = refusal(run_plan)
    if too_big and not force:
        problems.append(too_big)
    if not dry_run:
        problems += backends.for_cluster(cfg.cluster).submit_problems(cfg)
    # cluster.setup syntax, W&B credentials, token files
    return problems + launch_problems(cfg, workdir=workdir)


def _start_command(cfg: RunConfig, script: Path) -> str:
    """How to start what a dry run wrote (sbatch for a Slurm script, bash for a local one)."""
    from trainctl.launch import backends

    return shlex.join(backends.for_cluster(cfg.cluster).start_command(script))


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
    config_dirs: list[Path] = CONFIG_DIRS,
) -> None:
    """Write a run directory and start the workers.  Example: trainctl launch recipe=tiny_cpu train.steps=50"""
    from trainctl.launch import rundir
    from trainctl.plan import build

    if multirun:
        _launch_sweep(list(overrides or []), config_dirs, dry_run, force, name)
        return
    cfg = _resolved(overrides, config_dirs)
    run_plan = build(cfg)
    if problems := _launch_problems(cfg, run_plan, dry_run, force):
        raise UserError(problems)
    run_dir = rundir.create(cfg, run_plan, runs_dir=Path(cfg.runs_dir), name=name or cfg.name or None,
                            overrides=list(overrides or []))
    for warning in run_plan.warnings:
        err.print(f"[yellow]warning:[/] {escape(warning)}", highlight=False)
    out.print(f"run directory: [bold]{escape(str(run_dir))}[/]", highlight=False, soft_wrap=True)
    if dry_run:
        out.print(f"dry run: start it with [bold]{escape(_start_command(cfg, run_dir / 'launch.sh'))}[/]",
                  highlight=False, soft_wrap=True)
        return
    _start(run_dir, cfg, new=True)


def _launch_sweep(overrides: list[str], config_dirs: list[Path] | None, dry_run: bool, force: bool,
                  name: str) -> None:
    """Every point checked first (nothing starts if one is bad), then the run directories, then the runs."""
    from trainctl.launch import backends, rundir, sweep
    from trainctl.plan import build

    sp = _search(config_dirs)

    def build_point(point: list[str]):
        cfg = resolve(composer.compose(point, sp))
        run_plan = build(cfg)
        return cfg, run_plan, _launch_problems(cfg, run_plan, dry_run, force)

    points = sweep.check_points(sweep.expand(overrides, lambda group: list(sources.options(group, sp))), build_point)
    if problems := sweep.duplicate_problems(points):
        raise UserError(problems)
    launchers = {p.cfg.cluster.launcher for p in points}
    if len(launchers) > 1:
        raise UserError([f"-m: the points use different launchers ({', '.join(sorted(launchers))}); sweep one"])
    backend = backends.for_cluster(points[0].cfg.cluster)
    if problems := backend.sweep_problems([p.cfg for p in points]):
        raise UserError(problems)
    sweep_name = name or sweep.default_name(points[0].cfg)
    folder = sweep.create(points, sweep_name, overrides, lambda p, run_name: rundir.create(
        p.cfg, p.plan, runs_dir=Path(p.cfg.runs_dir), name=run_name, overrides=p.overrides))
    run_dirs = sweep.point_run_dirs(sweep.read(folder.parent.parent, sweep_name))
    out.print(f"sweep {sweep_name}: {len(points)} points in {folder}", markup=False, highlight=False, soft_wrap=True)
    for varied, run_dir in zip(sweep.swept([p.overrides for p in points]), run_dirs, strict=True):
        out.print(f"  {run_dir.name}: {' '.join(varied)}", markup=False, highlight=False, soft_wrap=True)
    if dry_run:
        script = backend.write_sweep(points[0].cfg, sweep_name, folder, run_dirs)
        if script is not None:
            out.print(f"dry run: submit the job array with {_start_command(points[0].cfg, script)}", markup=False,
                      highlight=False, soft_wrap=True)
        return
    launched = backend.start_sweep(points[0].cfg, sweep_name, folder, run_dirs)
    if launched is not None:
        out.print(launched.message, markup=False, highlight=False, soft_wrap=True)
        return
    raise typer.Exit(_run_points_locally(points, run_dirs, sweep_name))


def _run_points_locally(points, run_dirs: list[Path], sweep_name: str) -> int:
    """One point after another; a Ctrl-C (its checkpoint saved) ends the sweep. The first failure's code."""
    from trainctl.core import rundir as layout
    from trainctl.launch import backends

    codes = []
    for point, run_dir in zip(points, run_dirs, strict=True):
        out.print(f"sweep {sweep_name}: point {point.index + 1}/{len(points)}: {' '.join(point.overrides)}",
                  markup=False, highlight=False, soft_wrap=True)
        cfg = point.cfg
        codes.append(backends.for_cluster(cfg.cluster).start(run_dir, cfg, new=False).exit_code or 0)
        if layout.stop_record(run_dir):
            err.print(f"sweep {sweep_name} stopped at point {point.index}; resume its runs with `trainctl resume`",
                      markup=False, highlight=False, soft_wrap=True)
            break
    out.print(f"sweep {sweep_name}: {sum(c == 0 for c in codes)} of {len(points)} points completed; "
              f"rank them with: trainctl runs --sweep {sweep_name}", markup=False, highlight=False, soft_wrap=True)
    return next((c for c in codes if c), 0)


def _start(run_dir: Path, cfg: RunConfig, new: bool, held=None) -> None:
    """Start the run through its backend: a run that ran here exits with its code, a queued one says how to follow.

    `new`: this command wrote the run directory (a backend that refuses to start it removes it).
    """
    from trainctl.launch import backends

    launched = backends.for_cluster(cfg.cluster).start(run_dir, cfg, new=new, held=held)
    if launched.message:
        out.print(launched.message, markup=False, highlight=False, soft_wrap=True)
    if launched.exit_code is not None:
        raise typer.Exit(launched.exit_code)


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
    from trainctl.launch import backends, runs
    from trainctl.launch import resume as resumer
    from trainctl.launch.command import plan_record
    from trainctl.launch.rundir import script_workdir
    from trainctl.plan import build

    run_dir = runs.find_run(run, runs_dir)
    _check_idle(run_dir)
    res = resumer.check(run_dir, list(overrides or []))
    cfg, workdir = res.resolved, script_workdir(run_dir)
    run_plan = build(cfg)
    if cfg.checkpoint.resume == "never":
        raise UserError([f"run {run_dir.name} has checkpoint.resume=never: it would start over; "
                         "launch a new run instead"])
    if problems := _launch_problems(cfg, run_plan, dry_run=False, force=force, workdir=workdir):
        raise UserError(problems)
    for note in res.notes:
        out.print(note, markup=False, highlight=False, soft_wrap=True)
    for warning in res.warnings:
        err.print(f"[yellow]warning:[/] {escape(warning)}", highlight=False, soft_wrap=True)
    # Locally, the lock first: a second resume started at the same moment is refused before it writes anything.
    held = backends.for_cluster(cfg.cluster).lock_before_start(run_dir)
    try:
        record = plan_record(run_plan, res.cfg, run_dir)
        record.update(workdir=str(workdir or Path.cwd()), notes=[*record["notes"], *res.notes],
                      warnings=[*record["warnings"], *res.warnings])
        resumer.apply(res, record)
        _rewrite_script(run_dir, res.cfg, workdir)
    except BaseException:
        if held is not None:
            held.release()  # nothing was launched: the next resume must not find the run locked
        raise
    # Named, not verified here: hashing a large checkpoint on a login node would take long, and the workers
    # verify it anyway (sharing the work), falling back to an older one when it is damaged.
    where = f"step-{res.step:08d}" if res.step is not None else "the start (no checkpoint yet)"
    out.print(f"resuming {escape(str(run_dir))} from {escape(where)}", highlight=False, soft_wrap=True)
    _start(run_dir, cfg, new=False, held=held)


def _check_idle(run_dir: Path) -> None:
    """A UserError when the run is active, or its state cannot be known now (before anything is written)."""
    from trainctl.launch import runs

    state = runs.run_state(run_dir)
    if state.active:
        raise UserError([f"run {state.name} is still {state.state} ({state.detail}); "
                         f"wait for it, or `trainctl cancel {state.name}` first"])
    if state.detail.startswith("Slurm controller unreachable"):
        raise UserError([f"run {state.name}: {state.detail}; its job may still be running, "
                         "so try again when Slurm answers"])


def _rewrite_script(run_dir: Path, cfg: RunConfig, workdir: Path | None) -> None:
    """The script for where the run is now (it may have been copied or moved), launched from where it was."""
    from trainctl.launch import rundir

    rundir.write_script(run_dir, cfg, run_dir, workdir or Path.cwd())


EXPORT_DTYPES = ("fp32", "bf16", "fp16")  # models/export.EXPORT_DTYPES' keys (that module imports torch)


@app.command()
def export(
    run: str = RUN,
    checkpoint: str = typer.Option(
        None, "--checkpoint", help="Checkpoint directory or name under RUN/checkpoints; it must verify "
        "(default: the newest that verifies).", show_default=False),
    out_dir: str = typer.Option(
        None, "--out", help="Output folder (default: RUN/export/step-NNNNNNNN).", show_default=False),
    max_shard_size: str = typer.Option(
        None, "--max-shard-size", help="Bytes per file before sharding (e.g. 5000000000, 5GB).", show_default=False),
    dtype: str = typer.Option(
        None, "--dtype", help="Cast the weights: fp32, bf16 or fp16 (default: as saved).", show_default=False),
    verify: bool = typer.Option(
        False, "--verify", help="Load the export with transformers and compare every tensor and the logits with "
        "trainctl's model before calling it done (exit 1 and nothing written if they differ)."),
    merged: bool = typer.Option(False, "--merged", help="A LoRA run: full weights with the adapters folded in."),
    adapter: bool = typer.Option(
        False, "--adapter", help="A LoRA run: a PEFT adapter folder (adapter_config.json, adapter_model.safetensors)."),
    runs_dir: Path = RUNS_DIR,
) -> None:
    """Write a verified checkpoint's model as safetensors.  Example: trainctl export tiny_cpu-20250101-120000"""
    import subprocess

    from trainctl.launch import runs

    if out_dir is not None and not out_dir.strip():
        raise UserError(["--out '': empty; name a new folder, e.g. --out exports/mymodel"])
    if dtype is not None and dtype not in EXPORT_DTYPES:
        raise UserError([f"--dtype {dtype}: not an export dtype; use one of {', '.join(EXPORT_DTYPES)} "
                         "(quantized formats are not written)"])
    if merged and adapter:
        raise UserError(["--merged and --adapter: pick one (full weights, or a PEFT adapter folder)"])
    run_dir = runs.find_run(run, runs_dir)
    # The exporter imports torch: a child process keeps this side of the wall torch-free. It prints its own
    # one-line errors (exit 2) and warnings; its exit code is this command's.
    args = [sys.executable, "-m", "trainctl.models.export", str(run_dir)]
    for flag, value in (("--checkpoint", checkpoint), ("--out", out_dir), ("--max-shard-size", max_shard_size),
                        ("--dtype", dtype)):
        if value is not None:
            args += [flag, str(value)]
    args += ["--verify"] if verify else []
    args += ["--merged"] if merged else ["--adapter"] if adapter else []
    raise typer.Exit(subprocess.run(args).returncode)


def _worker_module(module: str, run_dir: Path, options: dict[str, object], flags: dict[str, bool]) -> None:
    """Run `python -m MODULE RUN_DIR --option value... --flag...` (it imports torch: the CLI stays torch-free); it
    prints its own output and one-line errors (exit 2); its exit code is the command's."""
    import subprocess

    args = [sys.executable, "-m", module, str(run_dir)]
    for flag, value in options.items():
        args += [flag, str(value)] if value is not None else []
    args += [flag for flag, on in flags.items() if on]
    raise typer.Exit(subprocess.run(args).returncode)


def _regular_file(key: str, path: str) -> None:
    """A named input that is not a regular file (a FIFO would block the reader forever) is refused here."""
    import os
    import stat

    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise UserError([f"{key} {path}: {exc.strerror or exc}; pass a text file, one prompt per line"]) from None
    if not stat.S_ISREG(mode):
        raise UserError([f"{key} {path}: not a regular file; pass a text file, one prompt per line"])


@app.command()
def generate(
    run: str = RUN,
    prompt: str = typer.Option(None, "--prompt", help="The text to continue.", show_default=False),
    prompts: str = typer.Option(None, "--prompts", help="A text file, one prompt per line (prints JSON lines).",
                                show_default=False),
    prompt_ids: str = typer.Option(None, "--prompt-ids", help="Token ids instead of text (e.g. 1,2,3): for runs "
                                   "without a tokenizer (synthetic data).", show_default=False),
    checkpoint: str = typer.Option(None, "--checkpoint", help="Checkpoint directory or name under RUN/checkpoints "
                                   "(default: the newest that verifies).", show_default=False),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", help="Most tokens to add to each prompt."),
    temperature: float = typer.Option(0.0, "--temperature", help="0: greedy; above: sample."),
    top_p: float = typer.Option(1.0, "--top-p", help="Sample from the smallest set of tokens this likely."),
    seed: int = typer.Option(0, "--seed", help="Seeds the sampling: the same seed gives the same text."),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt as a user message in the run's chat template."),
    device: str = typer.Option(None, "--device", help="cpu or cuda (default: the GPU if there is one).",
                               show_default=False),
    runs_dir: Path = RUNS_DIR,
) -> None:
    """Continue a prompt with a run's checkpoint, on one device.  Example: trainctl generate RUN --prompt 'def '"""
    from trainctl.launch import runs

    given = [key for key, value in (("--prompt", prompt), ("--prompts", prompts), ("--prompt-ids", prompt_ids))
             if value is not None]
    if len(given) != 1:
        raise UserError([f"{' and '.join(given) or 'no prompt'}: give exactly one of --prompt TEXT, "
                         "--prompts FILE or --prompt-ids 1,2,3"])
    run_dir = runs.find_run(run, runs_dir)
    if prompts is not None:
        _regular_file("--prompts", prompts)
    options = {"--prompt": prompt, "--prompts": prompts, "--prompt-ids": prompt_ids, "--checkpoint": checkpoint,
               "--max-new-tokens": max_new_tokens, "--temperature": temperature, "--top-p": top_p, "--seed": seed,
               "--device": device}
    _worker_module("trainctl.models.generate", run_dir, options, {"--chat": chat})


@app.command("eval")
def eval_command(
    run: str = RUN,
    data: str = typer.Option(..., "--data", help="A prepared dataset (trainctl data prepare) with a val split.",
                             show_default=False),
    checkpoint: str = typer.Option(None, "--checkpoint", help="Checkpoint directory or name under RUN/checkpoints "
                                   "(default: the newest that verifies).", show_default=False),
    batches: int = typer.Option(None, "--batches", help="Val batches of the run's micro_batch x seq_len (default: "
                                "train.eval_batches x the run's data-parallel ranks).", show_default=False),
    as_json: bool = AS_JSON,
    device: str = typer.Option(None, "--device", help="cpu or cuda (default: the GPU if there is one).",
                               show_default=False),
    runs_dir: Path = RUNS_DIR,
) -> None:
    """Loss and perplexity of a checkpoint over a dataset's val split.  Example: trainctl eval RUN --data tok"""
    from trainctl.launch import runs

    if batches is not None and batches < 1:
        raise UserError([f"--batches {batches}: must be at least 1"])
    run_dir = runs.find_run(run, runs_dir)
    options = {"--data": data, "--checkpoint": checkpoint, "--batches": batches, "--device": device}
    _worker_module("trainctl.train.evaluate", run_dir, options, {"--json": as_json})


@data_app.command("prepare")
def data_prepare(
    inputs: list[str] = typer.Argument(..., help="Text files, folders or glob patterns (.txt .md .jsonl .parquet).",
                                       show_default=False),
    out_dir: str = typer.Option(..., "--out", help="The dataset folder to create.", show_default=False),
    tokenizer: str = typer.Option("bytes", "--tokenizer",
                                  help="bytes, or a Hugging Face tokenizer.json (or its model folder)."),
    train_tokenizer: bool = typer.Option(False, "--train-tokenizer", help="Train a byte-level BPE on the inputs."),
    vocab_size: int = typer.Option(None, "--vocab-size", help="With --train-tokenizer.", show_default=False),
    eos_token: str = typer.Option(None, "--eos-token", help="The end-of-document token (default: found).",
                                  show_default=False),
    text_field: str = typer.Option("text", "--text-field", help="The text field of .jsonl / .parquet records."),
    val_fraction: float = typer.Option(0.01, "--val-fraction", help="Share of text held out for eval."),
    shard_tokens: int = typer.Option(1 << 28, "--shard-tokens", help="Tokens per shard file."),
    workers: int = typer.Option(None, "--workers", help="Processes (default: one per core).", show_default=False),
    data_format: str = typer.Option("text", "--format", help="text, chat (a messages list per record) or "
                                    "instruction (prompt and completion): chat and instruction keep a loss mask."),
    messages_field: str = typer.Option("messages", "--messages-field", help="--format chat: the records' field."),
    prompt_field: str = typer.Option("prompt", "--prompt-field", help="--format instruction: the prompt field."),
    completion_field: str = typer.Option("completion", "--completion-field",
                                         help="--format instruction: the completion field (what the loss counts)."),
    chat_template: str = typer.Option(None, "--chat-template", show_default=False,
                                      help="chatml, llama3 or a .jinja file (default: the tokenizer's own)."),
    max_doc_tokens: int = typer.Option(None, "--max-doc-tokens", show_default=False,
                                       help="Longest chat / instruction document (e.g. train.seq_len + 1)."),
    overlong: str = typer.Option("refuse", "--overlong", help="A longer document: refuse, or truncate it."),
) -> None:
    """Tokenize text into a token dataset (data.datasets=[DIR]).  Example: trainctl data prepare docs/ --out tok"""
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    from trainctl.data.chat import RecordOptions
    from trainctl.data.prepare import DatasetError, prepare

    records = RecordOptions(data_format, messages_field, prompt_field, completion_field, None, max_doc_tokens,
                            overlong)

    columns = ("[progress.description]{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
               TimeRemainingColumn())
    try:
        with Progress(*columns, console=err, transient=True, disable=not err.is_terminal) as bar:
            task = bar.add_task("tokenizing", total=None)
            meta = prepare(inputs, out_dir, tokenizer=tokenizer, train_tokenizer=train_tokenizer,
                           vocab_size=vocab_size, eos_token=eos_token, text_field=text_field,
                           val_fraction=val_fraction, shard_tokens=shard_tokens, workers=workers,
                           progress=lambda done, total: bar.update(task, completed=done, total=total),
                           records=records, chat_template=chat_template)
    except DatasetError as exc:
        raise UserError([str(exc)]) from None
    except KeyboardInterrupt:
        err.print(f"interrupted: run the same command again to continue where it stopped ({out_dir})",
                  markup=False, highlight=False)
        raise typer.Exit(130) from None
    train, val = meta.splits["train"], meta.splits["val"]
    counted = f", {train.loss_tokens:,} of them in the loss" if train.loss_tokens is not None else ""
    out.print(f"{meta.root}: {train.tokens:,} train tokens{counted} ({train.documents:,} documents, "
              f"{len(train.shards)} shards), {val.tokens:,} val tokens; {meta.tokenizer.kind} tokenizer, vocabulary "
              f"{meta.tokenizer.vocab_size:,}, {meta.token_dtype}", markup=False, highlight=False, soft_wrap=True)
    # Evaluation reads the val split: plan and launch refuse an empty one unless eval is off.
    note = "" if val.tokens else "\nno val split: train with train.eval_every=0, or prepare with --val-fraction 0.01"
    out.print(f"train on it with: data=memmap data.datasets=[{meta.root}]{note}", markup=False, highlight=False,
              soft_wrap=True)


def _report(problems: list[str]) -> None:
    for line in problems:
        err.print(f"[red]error:[/] {escape(line)}", highlight=False, soft_wrap=True)  # user text: no markup


def _cwd_problem() -> str | None:
    """Every command resolves relative paths (runs/, data, configs) against the working directory; a deleted one
    would fail deep inside Hydra or a launch. One line instead."""
    import os

    try:
        os.getcwd()
    except OSError as exc:
        return (f"the working directory cannot be read ({exc.strerror or exc}; deleted?); "
                "cd to an existing directory and run the command again")
    return None


def main() -> None:
    """Console-script entry: user errors print one line each and exit 2, never a traceback."""
    from trainctl.plan import PlanError

    if problem := _cwd_problem():
        _report([problem])
        sys.exit(2)
    try:
        app()
    except UserError as exc:  # config, launch and export errors all derive from it
        _report(exc.problems)
        sys.exit(2)
    except PlanError as exc:  # until PlanError subclasses UserError (asked of plan/plan.py's owner)
        _report([str(exc)])
        sys.exit(2)


if __name__ == "__main__":
    main()
