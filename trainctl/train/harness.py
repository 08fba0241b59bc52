"""`trainctl eval --tasks NAMES`: lm-evaluation-harness's tasks on a run's checkpoint, in this process.

The harness (`pip install 'trainctl[eval]'`, the `lm_eval` package) asks a language model three things; `RunLM`
answers them with the run's own model and tokenizer (models/run_tokens.py), one sequence at a time on one device:
- loglikelihood(context, continuation): the summed log-probability of the continuation's tokens after the
  context's, and whether greedy decoding would have produced them;
- loglikelihood_rolling(text): the whole text's log-probability, in windows of the model's context that do not
  overlap (each window sees the previous window's last token), the first token after the end-of-text id;
- generate_until(context, {until, max_gen_toks}): greedy text up to the first stop string.
The results (the harness's metrics per task) are written to RUN/lm_eval.json, where `runs` and `status` read them.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import math
import os
import sys
from pathlib import Path

import torch

from trainctl.core import checkpoints
from trainctl.core import rundir as layout
from trainctl.core.errors import UserError
from trainctl.core.tool_options import EvalOptions
from trainctl.models.generate import Sampling, generate_ids
from trainctl.models.run_tokens import RunTokens, run_tokens

HARNESS_MISSING = ("--tasks: lm-evaluation-harness is not installed in this Python; install it with "
                   "pip install 'trainctl[eval]' (or pip install lm-eval)")


def _harness():
    """The lm_eval package, or a one-line refusal naming what to install."""
    if importlib.util.find_spec("lm_eval") is None:
        raise UserError([HARNESS_MISSING])
    import lm_eval
    from lm_eval.api.model import LM
    from lm_eval.tasks import TaskManager

    return lm_eval, LM, TaskManager


def run_lm_class(base: type) -> type:
    """The harness's LM subclass over a run's model (built on the harness's own base class, imported late)."""

    class RunLM(base):
        def __init__(self, model: torch.nn.Module, device: torch.device, tokens: RunTokens):
            super().__init__()
            self.model, self.on, self.tokens = model, device, tokens
            self.max_len = int(model.cfg.max_seq_len)
            self.prefix = tokens.eos_ids[0] if tokens.eos_ids else 0  # what an empty context is conditioned on

        @torch.no_grad()
        def _logprobs(self, ids: list[int]) -> torch.Tensor:
            """Log-probabilities [len(ids) - 1, vocab] of each next token after ids[:-1] (fp32)."""
            logits = self.model(torch.tensor([ids[:-1]], dtype=torch.long, device=self.on))
            return torch.log_softmax(logits[0].float(), dim=-1)

        def _score(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
            ids = (context + continuation)[-(self.max_len + 1):]  # the context's start gives way, never the answer
            logprobs = self._logprobs(ids)[-len(continuation):]
            wanted = torch.tensor(continuation, device=logprobs.device)
            total = float(logprobs.gather(1, wanted[:, None]).sum())
            return total, bool((logprobs.argmax(dim=-1) == wanted).all())

        def loglikelihood(self, requests) -> list[tuple[float, bool]]:
            out = []
            for request in requests:
                context, continuation = request.args
                ids = self.tokens.encode(context) or [self.prefix]
                wanted = self.tokens.encode(continuation)
                out.append(self._score(ids, wanted) if wanted else (0.0, True))
            return out

        def loglikelihood_rolling(self, requests) -> list[float]:
            out = []
            for request in requests:
                ids = self.tokens.encode(request.args[0])
                total, last = 0.0, self.prefix
                for start in range(0, len(ids), self.max_len):
                    window = ids[start:start + self.max_len]
                    total += self._score([last], window)[0]
                    last = window[-1]
                out.append(total)
            return out

        def generate_until(self, requests) -> list[str]:
            out = []
            for request in requests:
                context, kwargs = request.args
                until = [u for u in (kwargs.get("until") or []) if u]
                steps = int(kwargs.get("max_gen_toks", 256))
                ids = (self.tokens.encode(context) or [self.prefix])[-max(1, self.max_len - steps):]
                stop = (lambda new, until=until: any(u in self.tokens.decode(new) for u in until)) if until else None
                new = generate_ids(self.model, ids, Sampling(steps, 0.0, 1.0, 0), self.tokens.eos_ids,
                                   device=self.on, stop=stop)
                text = self.tokens.decode([i for i in new if i not in self.tokens.eos_ids])
                for u in until:
                    text = text.split(u)[0]
                out.append(text)
            return out

    return RunLM


def metrics(results: dict) -> dict[str, dict[str, float]]:
    """task -> {metric: value} from the harness's `results` (its "acc,none" keys without the filter's "none"), the
    task's own metric first."""
    out = {}
    for task, values in results.get("results", {}).items():
        shown = {}
        for key, value in values.items():
            # Metrics are "name,filter" keys; the rest (alias, sample_len) describe the task, not its score.
            if "," in key and isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
                metric, _, filtered = key.partition(",")
                shown[metric if filtered in ("", "none") else key] = value
        out[task] = shown
    return out


@contextlib.contextmanager
def git_hash_from_files():
    """lm-eval records the working folder's commit by running `git describe`, whose stderr it leaves on the
    terminal: outside a checkout (where an eval usually runs) that printed "fatal: not a git repository" in the
    eval's output. Its own fallback reads the commit from the .git folder's files, with no process and no output:
    the same record, and a real error of the eval still says itself."""
    from lm_eval import evaluator

    original = getattr(evaluator, "get_git_commit_hash", None)
    from_files = getattr(sys.modules.get(getattr(original, "__module__", "")), "get_commit_from_path", None)
    if original is None or from_files is None:  # a harness that looks the commit up some other way: leave it be
        yield
        return
    evaluator.get_git_commit_hash = lambda: from_files(os.getcwd())
    try:
        yield
    finally:
        evaluator.get_git_commit_hash = original


@functools.cache
def _manager(include: str | None):
    """The harness's task index (it reads every task YAML it ships: seconds), built once a process per folder."""
    return _harness()[2](include_path=include)


def checked_tasks(run_dir: Path, options: EvalOptions) -> tuple[object, list[str], RunTokens]:
    """(the harness's task manager, the task names, the run's tokenizer) once every name is a task the harness
    knows; else one line (before any model is loaded)."""
    tokens = run_tokens(run_dir)
    if tokens.kind == "none":
        raise UserError([f"--tasks: {run_dir} trained on synthetic data and has no tokenizer: the tasks' text "
                         "cannot be encoded"])
    return checked_with(options, tokens)


def checked_with(options: EvalOptions, tokens: RunTokens) -> tuple[object, list[str], RunTokens]:
    """checked_tasks for a given tokenizer."""
    include = Path(options.include_path).expanduser() if options.include_path is not None else None
    if include is not None and not include.is_dir():
        raise UserError([f"--include-path {options.include_path}: no such folder; name a folder of task YAMLs"])
    manager = _manager(str(include) if include else None)
    names = [t.strip() for t in options.tasks.split(",") if t.strip()]
    if unknown := [n for n in names if n not in manager.all_tasks]:
        where = f" (nor in {options.include_path})" if include else ""
        raise UserError([f"--tasks {','.join(unknown)}: not a task lm-evaluation-harness knows{where}; "
                         "list them with: lm-eval ls tasks"])
    return manager, names, tokens


def run_tasks(run_dir: Path, options: EvalOptions, checked: tuple, model: torch.nn.Module, device: torch.device,
              checkpoint: Path) -> tuple[dict, str]:
    """Run the checked tasks on the run's model; (task -> metrics, the JSON file written in the run directory)."""
    lm_eval, base, _ = _harness()
    manager, names, tokens = checked
    with git_hash_from_files():
        results = lm_eval.simple_evaluate(model=run_lm_class(base)(model, device, tokens), tasks=names,
                                          task_manager=manager, limit=options.limit, log_samples=False)
    found = metrics(results or {})
    record = {"step": checkpoints.step_of(checkpoint), "checkpoint": str(checkpoint), "limit": options.limit,
              "tasks": found}
    layout.write_json_atomic(run_dir / layout.LM_EVAL, record)
    return found, str(run_dir / layout.LM_EVAL)
