"""Runs the tagged blocks of one document in order: `python tests/docs_runner.py BLOCKS.json`,
where BLOCKS.json is the list `tests/test_docs_run.py` wrote (doc, line, lang, code, timeout).

Python blocks share one namespace (a later block uses an earlier one's names, as a reader does)
and are compiled under the document's name with their own line numbers, so a traceback points
into the document; each shell block runs in `bash -e -o pipefail`. The first block that fails or
runs past its time ends the run with exit 1 and a last line "FAILED doc:line: why".
"""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import traceback


class BlockTimeout(Exception):
    pass


def run_python(block: dict, namespace: dict) -> str | None:
    """Runs a python block in `namespace`; the failure, or None."""

    def alarm(signum, frame):
        raise BlockTimeout(f"ran past {block['timeout']} s")

    code = compile("\n" * block["line"] + block["code"], block["doc"], "exec")  # the doc's line numbers
    signal.signal(signal.SIGALRM, alarm)
    signal.alarm(block["timeout"])
    try:
        exec(code, namespace)
    except BlockTimeout as e:
        return str(e)
    except BaseException as e:  # SystemExit included: a snippet that exits has failed
        traceback.print_exc()
        return f"{type(e).__name__}: {e}"
    finally:
        signal.alarm(0)
    return None


# on the first failing command: its line in the document and its text, for the FAILED line
TRAP = """trap 'echo "$(( {line} + LINENO - 1 )) $BASH_COMMAND" > {where}' ERR\n"""


def run_shell(block: dict) -> str | None:
    """Runs a shell block; the failure (with the document line of the failing command), or None."""
    with tempfile.NamedTemporaryFile("r", suffix=".line") as where:
        trap = TRAP.format(line=block["line"], where=shlex.quote(where.name))
        try:
            done = subprocess.run(
                ["bash", "-e", "-o", "pipefail", "-c", trap + block["code"]], timeout=block["timeout"]
            )
        except subprocess.TimeoutExpired:
            return f"ran past {block['timeout']} s"
        failed = where.read().strip()
    if done.returncode == 0:
        return None
    line, _, command = failed.partition(" ")
    return (
        f"exit status {done.returncode} at line {line}: {command}"
        if failed
        else f"exit status {done.returncode}"
    )


def main(path: str) -> int:
    with open(path) as f:
        blocks = json.load(f)
    namespace: dict = {"__name__": "__main__"}
    for block in blocks:
        where = f"{block['doc']}:{block['line']}"
        print(f"--- {where} ({block['lang']})", flush=True)
        t = time.perf_counter()
        why = run_python(block, namespace) if block["lang"] == "python" else run_shell(block)
        sys.stdout.flush()
        sys.stderr.flush()
        print(f"--- {where}: {time.perf_counter() - t:.1f} s", flush=True)
        if why is not None:
            print(f"FAILED {where}: {why}", flush=True)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
