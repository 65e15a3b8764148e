"""SandboxFusion's `POST /run_code` on the real server (loopback, real kernels), sent the way verl sends it.

The reference for what a run must return is the interpreter itself: each program also runs as `python main.py`
in a subprocess here, and the route must give the same stdout, stderr and exit status.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

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


def test_a_sandbox_failure_is_a_sandbox_error_never_a_result(server: Server):
    reply = run_code(server.url, "import ctypes\nctypes.string_at(0)\n")  # kills the kernel
    assert reply["status"] == "SandboxError" and "KernelDied" in reply["message"]
    assert reply["run_result"]["status"] == "Error" and reply["run_result"]["return_code"] is None
    assert run_code(server.url, "print('fresh')")["run_result"]["stdout"] == "fresh\n"


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
        ({"fetch_files": ["out.txt"]}, "fetch_files", "not supported"),
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


def test_token_required_when_configured():
    srv = Server("--pool-size", "1", env={"SANDBOX_TOKEN": "s3cret"}).start()
    try:
        for token in (None, "wrong"):
            refused = post(srv.url, verl_payload("print(1)"), token=token)
            assert refused.status_code == 401 and "token" in refused.json()["detail"]
        accepted = post(srv.url, verl_payload("print(1)"), token="s3cret")
        assert accepted.status_code == 200 and accepted.json()["run_result"]["stdout"] == "1\n"
    finally:
        srv.stop()


def test_openapi_describes_run_code(server: Server):
    spec = httpx.get(f"{server.url}/openapi.json").json()
    assert {"200", "413", "422", "429"} <= set(spec["paths"]["/run_code"]["post"]["responses"])
    assert {"RunCodeRequest", "RunCodeResponse", "CommandRunResult"} <= set(spec["components"]["schemas"])
