"""`bash -n` checks of `cluster.setup`, the user's own shell in a Slurm run's sbatch script.

Separate from the script's rendering (script.py) because it runs bash in a subprocess and reads its
complaints back: the rendering stays pure text, and this one place owns the subprocess and its deadline.
"""

from __future__ import annotations

import re
import shutil
import subprocess

BASH_CHECK_TIMEOUT_S = 10


def setup_syntax_problems(setup: list[str], script: str) -> list[str]:
    if not setup:
        return []
    hint = "each entry is shell run before srun, e.g. 'module load cuda'; fix its quotes, brackets or here-document"
    alone = bash_syntax_error("\n".join(setup) + "\n")
    if alone is not None:
        line, message = alone
        # bash counts lines of the block; with one line per entry that is the entry's index + 1.
        where = "cluster.setup"
        if line is not None and all("\n" not in entry for entry in setup) and 1 <= line <= len(setup):
            where = f"cluster.setup[{line - 1}]={setup[line - 1]!r}"
        return [f"{where}: bash -n: {message}; {hint}"]
    if re.search(r"(?<!\\)(\\\\)*\\$", setup[-1]):
        return [f"cluster.setup[{len(setup) - 1}]={setup[-1]!r}: ends with a line continuation, which would join it to "
                f"trainctl's next line; remove the trailing backslash"]
    whole = bash_syntax_error(script)
    if whole is not None:
        return [f"cluster.setup: the sbatch script with it does not pass bash -n: {whole[1]}; {hint}"]
    return []


def bash_syntax_error(text: str) -> tuple[int | None, str] | None:
    """(line, message) of bash's first complaint about `text` under `bash -n`, warnings included; None if clean.

    A warning such as an unterminated here-document leaves bash's exit code 0 but swallows the rest
    of the script, so anything on stderr counts. Without bash on PATH nothing can be checked.
    """
    bash = shutil.which("bash")
    if bash is None:
        return None
    try:
        done = subprocess.run([bash, "-n"], input=text, capture_output=True, text=True, timeout=BASH_CHECK_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode == 0 and not done.stderr.strip():
        return None
    first = done.stderr.strip().splitlines()[0] if done.stderr.strip() else f"exit code {done.returncode}"
    match = re.match(r"^(?:\S*bash: )?(?:line (\d+): )?(.*)$", first)
    return (int(match.group(1)) if match.group(1) else None), match.group(2)
