"""SandboxFusion's `POST /run_code` on the real server (loopback, real kernels), sent the way verl sends it.

The reference for what a run must return is the interpreter itself: each program also runs as `python main.py`
in a subprocess here, and the route must give the same stdout, stderr and exit status.
"""

from __future__ import annotations

import base64
import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from stare_sandbox import sandboxfusion
from stare_sandbox.schemas import RunResult

from .test_service import Server, served_then_clean


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One server for the module, like test_service's: stopping it leaves no kernel and no scratch dir."""
    yield from served_then_clean(tmp_path_factory)


def verl_payload(code: str, stdin: str | None = None, timeout: int = 30, language: str = "python") -> dict:
    """The body verl's sandbox_fusion utils build (call_sandbox_api): every field, stdin null when there is none."""
    return {
        "compile_timeout": timeout,
        "run_timeout": timeout,
        "code": code,
        "stdin": stdin,
        "memory_limit_MB": 1024,
        "language": language,
        "files": {},
        "fetch_files": [],
    }


def post(url: str, body: dict, token: str | None = None) -> httpx.Response:
    """POST a JSON text body with verl's headers (it sends `data=json.dumps(payload)`, not a client's json=)."""
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return httpx.post(f"{url}/run_code", content=json.dumps(body), headers=headers, timeout=60)


def run_code(url: str, code: str, stdin: str | None = None, **fields: object) -> dict:
    response = post(url, {**verl_payload(code, stdin), **fields})
    assert response.status_code == 200, response.text
    return response.json()


def python_main(code: str, stdin: str | None, folder: Path) -> tuple[str, str, int]:
    """What `python main.py` prints and returns for `code`, with the script's folder cut from its tracebacks."""
    script = folder / "main.py"
    script.write_text(code)
    done = subprocess.run(
        [sys.executable, "-I", "main.py"], cwd=folder, input=stdin or "", capture_output=True, text=True, timeout=60
    )
    return done.stdout, done.stderr.replace(str(script), "main.py"), done.returncode


PROGRAMS = {
    "hello": ("print('hello')", None),
    "error_in_function": ("def f():\n    return 1 / 0\n\nprint('before')\nf()\n", None),
    "syntax_error": ("def f(:\n    pass\n", None),
    "sys_exit_code": ("import sys\nprint('bye')\nsys.exit(3)\n", None),
    "exit_code_wraps": ("raise SystemExit(258)", None),
    "sys_exit_message": ("import sys\nsys.exit('fatal: no input')\n", None),
    "exit_builtin": ("print('a')\nexit()\nprint('not reached')\n", None),
    "main_guard": ("def main():\n    print(__name__)\n\nif __name__ == '__main__':\n    main()\n", None),
    "stdin_lines": (
        "import sys\nn = int(input())\nprint(sum(map(int, input().split())) * n)\nprint(repr(sys.stdin.read()))\n",
        "2\n1 2 3\nrest\nof it\n",
    ),
    "stdin_buffer": ("import sys\ndata = sys.stdin.buffer.read().split()\nprint(sum(map(int, data)))\n", "4 5\n6\n"),
    "input_prompt": ("name = input('name? ')\nprint('hi', name)\n", "ann"),
    "input_at_eof": ("input()\n", None),
    "chained_error": ("try:\n    input()\nexcept EOFError as e:\n    raise ValueError('no input') from e\n", None),
    "stderr_write": ("import sys\nsys.stderr.write('warn\\n')\nprint('out')\n", None),
    # standard input is file descriptor 0, as in a plain process
    "open_0": ("data = open(0).read().split()\nprint(sum(map(int, data)))\n", "1 2\n3\n"),
    "os_read_0": ("import os\nprint(os.read(0, 100))\n", "abc"),
    "child_reads_stdin": (
        "import subprocess, sys\n"
        "child = [sys.executable, '-c', 'import sys; print(sys.stdin.read().upper())']\n"
        "print(subprocess.run(child, capture_output=True, text=True).stdout, end='')\n",
        "hello\n",
    ),
    "stdout_buffer": ("import sys\nsys.stdout.buffer.write('\u00e9\\n'.encode())\nprint('after')\n", None),
    "argv_and_globals": ("import sys\nprint(sys.argv, [k for k in globals() if not k.startswith('__')])\n", None),
    # the ends a plain process can have: os._exit after flushed output, a signal, a crash
    "os_exit_zero": ("import os\nprint('hi', flush=True)\nos._exit(0)\nprint('not reached')\n", None),
    "os_exit_status": ("import os, sys\nsys.stdout.write('x\\n')\nsys.stdout.flush()\nos._exit(7)\n", None),
    "killed_by_signal": ("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n", None),
    "segfault": ("import ctypes\nctypes.string_at(0)\n", None),
}


@pytest.mark.parametrize("name", PROGRAMS)
def test_runs_like_python_main_py(server: Server, tmp_path: Path, name: str):
    code, stdin = PROGRAMS[name]
    stdout, stderr, return_code = python_main(code, stdin, tmp_path)
    reply = run_code(server.url, code, stdin)
    run = reply["run_result"]
    assert (run["stdout"], run["stderr"], run["return_code"]) == (stdout, stderr, return_code)
    assert run["status"] == "Finished" and run["execution_time"] >= 0
    assert reply["status"] == ("Success" if return_code == 0 else "Failed")
    assert (reply["compile_result"], reply["files"], reply["message"]) == (None, {}, "")


def test_the_traceback_is_the_interpreters(server: Server):
    """The differential test above, pinned: a reader sees what a model trained on /run_code sees."""
    run = run_code(server.url, "def f():\n    return 1 / 0\n\nf()\n")["run_result"]
    assert run["return_code"] == 1
    assert run["stderr"] == (
        "Traceback (most recent call last):\n"
        '  File "main.py", line 4, in <module>\n'
        "    f()\n"
        '  File "main.py", line 2, in f\n'
        "    return 1 / 0\n"
        "           ~~^~~\n"
        "ZeroDivisionError: division by zero\n"
    )


def test_time_limit(server: Server):
    reply = run_code(server.url, "print('started', flush=True)\nwhile True:\n    pass\n", run_timeout=1)
    assert reply["status"] == "Failed"
    run = reply["run_result"]
    assert (run["status"], run["return_code"], run["stdout"]) == ("TimeLimitExceeded", None, "started\n")
    after = run_code(server.url, "print('next')")  # the sandbox goes on
    assert after["run_result"]["stdout"] == "next\n"


def test_run_timeout_above_the_maximum_is_capped_and_says_so(server: Server):
    reply = run_code(server.url, "print(1)", run_timeout=500)
    assert reply["status"] == "Success" and "120 s" in reply["message"]  # the server's max_timeout_s


def test_after_the_kernel_dies_under_a_program_the_next_run_gets_a_fresh_one(server: Server):
    reply = run_code(server.url, "import ctypes\nctypes.string_at(0)\n")  # kills the kernel
    assert (reply["status"], reply["run_result"]["status"], reply["run_result"]["return_code"]) == (
        "Failed",
        "Finished",
        -signal.SIGSEGV,
    )
    assert run_code(server.url, "print('fresh')")["run_result"]["stdout"] == "fresh\n"


def test_a_sandbox_failure_is_a_sandbox_error_never_a_result():
    """A RunResult the sandbox failed (no kernel process ended under the code) is SandboxFusion's SandboxError."""
    failed = RunResult(status="sandbox_error", error={"name": "SandboxClosed", "message": "shut down"}, duration_ms=3)
    reply = sandboxfusion.response(failed)
    assert (reply.status, reply.run_result.status, reply.run_result.return_code) == ("SandboxError", "Error", None)
    assert reply.message == "SandboxClosed: shut down"
    died = failed.model_copy()
    died._exit_status = -9  # what Kernel.execute sets when the kernel's process ended under the code
    assert sandboxfusion.response(died).run_result.return_code == -9


def test_runs_share_nothing(server: Server):
    assert run_code(server.url, "x = 5\nopen('left.txt', 'w').write('x')")["status"] == "Success"
    reply = run_code(server.url, "import os\nprint(os.path.exists('left.txt'))\nprint(x)\n")
    assert reply["run_result"]["stdout"] == "False\n" and "NameError" in reply["run_result"]["stderr"]


def test_files_are_written_before_the_run(server: Server):
    files = {"data/in.txt": base64.b64encode(b"3 4\n").decode(), "skipped.txt": None}
    code = "import os\nprint(sum(map(int, open('data/in.txt').read().split())), os.path.exists('skipped.txt'))\n"
    reply = run_code(server.url, code, files=files)
    assert reply["status"] == "Success" and reply["run_result"]["stdout"] == "7 False\n"


@pytest.mark.parametrize(
    ("fields", "field", "says"),
    [
        ({"language": "cpp"}, "language", "'python' or 'python3'"),
        ({"language": "nodejs"}, "language", "'python' or 'python3'"),
        ({"files": {"../up.txt": ""}}, "files", "relative path"),
        ({"files": {"/etc/x": ""}}, "files", "relative path"),
        ({"files": {"a.txt": "not base64!"}}, "files", "not valid base64"),
        ({"fetch_files": [""]}, "fetch_files", "not a file path"),
        ({"run_timeout": 0}, "run_timeout", "greater than 0"),
    ],
)
def test_requests_this_sandbox_cannot_honour_get_422_naming_the_field(server: Server, fields, field, says):
    response = post(server.url, {**verl_payload("print(1)"), **fields})
    assert response.status_code == 422
    (error,) = response.json()["detail"]
    assert error["loc"][:2] == ["body", field] and says in error["msg"]


def test_python3_is_python_and_unknown_fields_are_ignored(server: Server):
    reply = run_code(server.url, "print(2)", language="python3", some_newer_field=True)
    assert reply["run_result"]["stdout"] == "2\n"


def test_code_and_files_size_limits(server: Server):
    big = post(server.url, verl_payload("#" * 200_000))
    assert big.status_code == 413 and "200000 characters; the limit is 100000" in big.json()["detail"]
    files = {"big.bin": base64.b64encode(b"0" * 150_000).decode()}
    big_files = post(server.url, {**verl_payload("print(1)"), "files": files})
    assert big_files.status_code == 413 and "files have 200000 base64 characters" in big_files.json()["detail"]


def test_token_required_when_configured_and_the_output_cap_is_the_servers_to_set():
    srv = Server("--pool-size", "1", "--run-code-output-limit-bytes", "1000", env={"SANDBOX_TOKEN": "s3cret"}).start()
    try:
        for token in (None, "wrong"):
            refused = post(srv.url, verl_payload("print(1)"), token=token)
            assert refused.status_code == 401 and "token" in refused.json()["detail"]
        accepted = post(srv.url, verl_payload("print(1)"), token="s3cret")
        assert accepted.status_code == 200 and accepted.json()["run_result"]["stdout"] == "1\n"
        cut = post(srv.url, verl_payload("print('x' * 5000)"), token="s3cret").json()["run_result"]
        assert cut["stdout"] == "x" * 1000
    finally:
        srv.stop()


def test_openapi_describes_run_code(server: Server):
    spec = httpx.get(f"{server.url}/openapi.json").json()
    assert {"200", "413", "422", "429"} <= set(spec["paths"]["/run_code"]["post"]["responses"])
    assert {"RunCodeRequest", "RunCodeResponse", "CommandRunResult"} <= set(spec["components"]["schemas"])


# SandboxFusion parity: the official client (sandbox-fusion on PyPI) and verl's payload against the real server


def official(url: str, code: str, **fields: object):
    """A run through SandboxFusion's own client: its request model, its defaults, its parsing of our response."""
    from sandbox_fusion import RunCodeRequest, run_code

    return run_code(RunCodeRequest(code=code, language="python", **fields), endpoint=url, max_attempts=1)


def test_the_official_client_runs_code_with_stdin_files_and_fetch_files(server: Server):
    from sandbox_fusion import RunStatus

    code = (
        "import os\n"
        "n = int(open(0).read())\n"
        "open('out.txt', 'w').write(str(n * 2))\n"
        "os.makedirs('d', exist_ok=True)\n"
        "open('d/copy.bin', 'wb').write(open('in.bin', 'rb').read()[::-1])\n"
        "print('done')\n"
    )
    files = {"in.bin": base64.b64encode(b"\x00\x01\xff").decode()}
    fetch = ["out.txt", "missing.txt", "d/copy.bin", "d"]  # a missing file and a directory are left out
    reply = official(server.url, code, stdin="21", files=files, fetch_files=fetch)
    assert reply.status == RunStatus.Success and reply.run_result.stdout == "done\n"
    assert {path: base64.b64decode(data) for path, data in reply.files.items()} == {
        "out.txt": b"42",
        "d/copy.bin": b"\xff\x01\x00",
    }


def test_files_are_fetched_after_a_time_limit_too(server: Server):
    code = "open('partial.txt', 'w').write('so far')\nwhile True:\n    pass\n"
    reply = run_code(server.url, code, run_timeout=1, fetch_files=["partial.txt"])
    assert reply["run_result"]["status"] == "TimeLimitExceeded"
    assert reply["files"] == {"partial.txt": base64.b64encode(b"so far").decode()}


def test_the_official_client_sees_a_crash_as_the_programs_failure(server: Server):
    from sandbox_fusion import RunStatus

    # SandboxFusion's client retries a SandboxError: a crash must be the program's own result, as it is there
    reply = official(server.url, "import os\nprint('bye', flush=True)\nos._exit(3)\n")
    assert reply.status == RunStatus.Failed and reply.run_result.return_code == 3
    assert reply.run_result.stdout == "bye\n"


def test_memory_limit_mb_is_enforced_per_call_as_sandboxfusion_does(server: Server):
    grab = "x = bytearray(300 * 2**20)\nprint('allocated')\n"
    refused = run_code(server.url, grab, memory_limit_MB=64)  # verl's payload shape, a smaller limit
    run = refused["run_result"]
    assert (refused["status"], run["status"], run["return_code"], run["stdout"]) == ("Failed", "Finished", 1, "")
    assert run["stderr"].endswith("MemoryError\n"), run["stderr"]
    assert run_code(server.url, grab)["run_result"]["stdout"] == "allocated\n"  # verl's default 1024 MB
    unlimited = run_code(server.url, grab, memory_limit_MB=-1)  # SandboxFusion's default: no per-call limit
    assert unlimited["status"] == "Success"
    # the limit is the run's growth, not the warm interpreter's size: numpy and a thread still work under it
    small = run_code(server.url, "import threading, numpy as np\nt = threading.Thread(target=print, args=(1,))\n"
                     "t.start(); t.join()\nprint(np.ones(1000).sum())\n", memory_limit_MB=64)  # fmt: skip
    assert small["run_result"]["stdout"] == "1\n1000.0\n", small


def test_each_stream_keeps_its_first_mebibyte(server: Server):
    code = "import sys\nsys.stdout.write('a' * 1_500_000)\nsys.stderr.write('\\u00e9' * 600_000)\n"
    run = run_code(server.url, code)["run_result"]
    assert run["stdout"] == "a" * 2**20
    assert run["stderr"] == "\u00e9" * (2**20 // 2)  # 2-byte characters: the first MiB is 524,288 of them
