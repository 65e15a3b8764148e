"""SandboxFusion's `POST /run_code`, Python only, on a stateless kernel.

docs/sandbox.md, "SandboxFusion-compatible route", gives the field mapping and what is not supported.

The request's code runs the way `python main.py` runs it: as __main__, stdin from the request, exit()/sys.exit
ending it with their status, an uncaught error printed to stderr as the interpreter prints it. A driver does
that inside the kernel; a non-zero exit status comes back as the one error the driver raises.
"""

from __future__ import annotations

from stare_sandbox.schemas import CommandRunResult, ErrorInfo, RunCodeRequest, RunCodeResponse, RunResult

EXIT_ERROR = "_RunCodeExit"
"""The one error the driver raises, with the exit status as its message."""
DRIVER = f"""\
def _run_code(source, stdin_text, files):
    import base64, builtins, io, linecache, os, sys, traceback, types

    class {EXIT_ERROR}(Exception):
        pass

    def _input(prompt=""):
        sys.stdout.write(str(prompt))
        sys.stdout.flush()
        line = sys.stdin.readline()
        if not line:
            raise EOFError("EOF when reading a line")
        return line[:-1] if line.endswith("\\n") else line

    def _exit(code=None):
        raise SystemExit(code)

    for path, content in files.items():
        if content is not None:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            with open(path, "wb") as f:
                f.write(base64.b64decode(content))
    namespace, filename, status = globals(), "main.py", 0
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)  # source lines in tracebacks
    saved = sys.stdin, sys.stdout, sys.stderr, builtins.input, namespace.get("exit"), namespace.get("quit")
    data = stdin_text.encode("utf-8", "surrogatepass")
    sys.stdin = io.TextIOWrapper(io.BytesIO(data), encoding="utf-8", errors="surrogatepass", newline="\\n")
    builtins.input, namespace["exit"], namespace["quit"] = _input, _exit, _exit  # the kernel's own refuse stdin
    try:
        exec(compile(source, filename, "exec", dont_inherit=True), namespace)
    except SystemExit as exc:
        if isinstance(exc.code, int):
            status = exc.code & 0xFF
        elif exc.code is not None:
            print(exc.code, file=saved[2])
            status = 1
    except Exception as exc:
        pending, seen = [exc], set()
        while pending:  # drop this driver's frames from the error and the errors chained to it
            error = pending.pop()
            if error is not None and id(error) not in seen:
                seen.add(id(error))
                frames, kept = error.__traceback__, []
                while frames is not None:
                    if frames.tb_frame.f_code.co_filename != _input.__code__.co_filename:
                        kept.append(frames)
                    frames = frames.tb_next
                frames = None
                for tb in reversed(kept):
                    frames = types.TracebackType(frames, tb.tb_frame, tb.tb_lasti, tb.tb_lineno)
                error.__traceback__ = frames
                pending += [error.__cause__, error.__context__]
        traceback.print_exception(exc, file=saved[2])
        status = 1
    finally:
        sys.stdin, sys.stdout, sys.stderr, builtins.input, namespace["exit"], namespace["quit"] = saved
        linecache.cache.pop(filename, None)
    if status:
        raise {EXIT_ERROR}(status)
"""


def response(result: RunResult) -> RunCodeResponse:
    """Our RunResult of the driven program as SandboxFusion's response."""
    run_result = CommandRunResult(
        status="Finished", execution_time=result.duration_ms / 1000, stdout=result.stdout, stderr=result.stderr
    )
    if result.status == "sandbox_error":
        error = result.error.name + ": " + result.error.message if result.error else "the sandbox failed"
        run_result.status, run_result.stderr = "Error", (result.stderr + "\n" + error).lstrip("\n")
        return RunCodeResponse(status="SandboxError", message=error, run_result=run_result)
    if result.status == "timeout":
        run_result.status = "TimeLimitExceeded"
    elif result.status == "ok":
        run_result.return_code = 0
    elif result.error is not None and result.error.name == EXIT_ERROR:
        run_result.return_code = int(result.error.message)
    else:  # raised past the driver (KeyboardInterrupt, a MemoryError while printing a traceback): its last line
        run_result.return_code = 1
        error = result.error or ErrorInfo(name=result.status, message="")
        run_result.stderr = result.stderr + (f"{error.name}: {error.message}" if error.message else error.name) + "\n"
    message = ""
    if result.timeout_capped:
        message = f"run_timeout is above this server's maximum; the code ran under {result.timeout_s:g} s"
    status = "Success" if run_result.return_code == 0 else "Failed"
    return RunCodeResponse(status=status, message=message, run_result=run_result)


def program(body: RunCodeRequest) -> str:
    """The code a stateless kernel runs for one request: the driver, then its call on the request's fields."""
    return f"{DRIVER}\n_run_code({body.code!r}, {body.stdin or ''!r}, {body.files!r})\n"
