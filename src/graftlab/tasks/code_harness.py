"""Runs one candidate program against its tests. This file is a script, never imported by graftlab.

`graftlab.tasks.code` starts it for each graded completion as `python -I code_harness.py MEMORY CPU`, in
a fresh temporary directory. The script reads a JSON payload `{"code", "tests", "token"}` from stdin.
It then caps its own address space at MEMORY bytes and its CPU time at CPU seconds, and runs every test
in order, each against a fresh execution of the code. Its verdict is one JSON line on the original
stdout: `{"token", "passed", "detail"}`. File descriptors 1 and 2 are pointed at /dev/null first, so
nothing the program writes can be mistaken for the verdict, and its output cannot fill the parent's
memory. It imports only the standard library, so `-I` (no user site, no script directory on sys.path)
leaves nothing of graftlab in view.

The test forms are the ones `graftlab.tasks.code` documents (`code`, `stdin`/`stdout`, `fn`/`args`/
`expected`). This is not a sandbox: the program can still open files and sockets and start processes.
"""

import contextlib
import io
import json
import os
import resource
import sys

STDIN_FILE = os.path.abspath("stdin.txt")  # in the run's temporary directory, whatever the program's chdir


def _limit(memory: int, cpu: int) -> None:
    """Cap the address space, CPU time, core dumps and file size before any candidate code runs."""
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 20, 256 << 20))


def _set_stdin(text: str) -> None:
    """Make `text` the program's standard input, for `input()`, `sys.stdin` and `open(0)` alike."""
    with open(STDIN_FILE, "w", encoding="utf-8") as f:
        f.write(text)
    fd = os.open(STDIN_FILE, os.O_RDONLY)
    if fd != 0:  # 0 itself when the last program closed its stdin (an `open(0)` it let go)
        os.dup2(fd, 0)
        os.close(fd)
    sys.stdin = open(0, encoding="utf-8", closefd=False)  # fd 0 stays open: the program may read it too


def _jsonable(value):
    """`value` as plain JSON data (tuples become lists), or TypeError for anything else, so that no custom
    object can pass by overriding `==`."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    raise TypeError(f"returned a {type(value).__name__}, not JSON data")


def _squash(text: str) -> str:
    """Standard output as upstream compares it: newlines read as spaces, ends stripped."""
    return text.strip().replace("\r", "").replace("\n", " ")


def _function(namespace: dict, name: str):
    """The function a functional test calls: a top-level `name`, else the method of a `Solution` class
    (LeetCode style)."""
    if callable(namespace.get(name)):
        return namespace[name]
    solution = namespace.get("Solution")
    if isinstance(solution, type) and callable(getattr(solution, name, None)):
        return getattr(solution(), name)
    raise NameError(f"the program defines no function {name!r}")


def _run(code: str, test: dict) -> str | None:
    """Run one test against a fresh execution of `code`: None when it passes, else what went wrong."""
    is_program = "stdin" in test
    _set_stdin(test.get("stdin", ""))
    namespace = {"__name__": "__main__" if is_program else "solution", "__builtins__": __builtins__}
    captured = io.BytesIO()  # behind a text layer, so that `sys.stdout.buffer.write` works too
    out = io.TextIOWrapper(captured, encoding="utf-8", write_through=True)
    with contextlib.redirect_stdout(out):
        try:
            exec(compile(code, "solution.py", "exec"), namespace)
        except SystemExit as e:
            # A program may end itself with exit(); anything else exiting is a failure.
            if not is_program or e.code not in (None, 0):
                return f"exited with {e.code!r}"
        if "code" in test:
            exec(compile(test["code"], "tests.py", "exec"), namespace)
            return None
        if "fn" in test:
            result = _function(namespace, test["fn"])(*test["args"])
    if is_program:
        out.flush()
        got = _squash(captured.getvalue().decode("utf-8", "replace"))
        return None if got == _squash(test["stdout"]) else f"printed {got[:200]!r}"
    same = json.dumps(_jsonable(result), sort_keys=True) == json.dumps(test["expected"], sort_keys=True)
    return None if same else f"returned {result!r}"[:200]


def main() -> None:
    payload = json.loads(sys.stdin.read())
    verdict = os.fdopen(os.dup(1), "w", encoding="utf-8")
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    _limit(int(sys.argv[1]), int(sys.argv[2]))
    detail = ""
    for i, test in enumerate(payload["tests"], 1):
        try:
            failure = _run(payload["code"], test)
        except BaseException as e:  # the program's own errors, SystemExit and KeyboardInterrupt included
            failure = f"{type(e).__name__}: {e}"[:300]
        if failure is not None:
            detail = f"test {i} of {len(payload['tests'])}: {failure}"
            break
    verdict.write(json.dumps({"token": payload["token"], "passed": not detail, "detail": detail}) + "\n")
    verdict.flush()
    # Leave at once: the program's threads or atexit hooks must not decide the exit or hold it up.
    os._exit(0)


if __name__ == "__main__":
    main()
