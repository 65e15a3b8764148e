"""SandboxFusion's `POST /run_code`, Python only, on a stateless kernel.

docs/sandbox.md, "SandboxFusion-compatible route", gives the field mapping and every difference that remains.

The request's code runs the way `python main.py` runs it: as __main__ in a namespace of its own, with
`sys.argv == ["main.py"]`, the request's stdin on file descriptor 0 (so `input()`, `sys.stdin`, `open(0)` and
child processes all read it), exit()/sys.exit/os._exit ending it with their status, and an uncaught error printed
to stderr as the interpreter prints it. A driver does that inside the kernel; a non-zero exit status comes back as
the one error the driver raises. Around the program the driver also applies the request's `memory_limit_MB` and,
after it, reads the files named in `fetch_files` and hands them back in a display message of its own type.
"""

from __future__ import annotations

import signal

from stare_sandbox.schemas import CommandRunResult, ErrorInfo, RunCodeRequest, RunCodeResponse, RunResult

EXIT_ERROR = "_RunCodeExit"
"""The one error the driver raises, with the exit status as its message."""
FETCH_MIME = "application/x-stare-sandbox-files+json"
"""The display type the driver hands the fetched files back in ({path: base64}); Kernel.execute collects it."""
OUTPUT_LIMIT_BYTES = 1 << 20
"""SandboxFusion's cap on each stream of a run: the first 1 MiB (ServerSettings.run_code_output_limit_bytes)."""

DRIVER = """\
def _run_code(source, stdin_text, files, fetch_files, memory_mb):
    import base64, builtins, codecs, io, linecache, os, resource, sys, traceback, types

    class EXIT_ERROR(Exception):
        pass

    class _ProcessExit(BaseException):  # os._exit(n) in the program: the run ends with status n
        pass

    kernel_pid, real_os_exit = os.getpid(), os._exit

    def _os_exit(status):
        if os.getpid() != kernel_pid:  # a process the program forked exits for real
            real_os_exit(status)
        raise _ProcessExit(status)

    def _input(prompt=""):
        sys.stdout.write(str(prompt))
        sys.stdout.flush()
        line = sys.stdin.readline()
        if not line:
            raise EOFError("EOF when reading a line")
        return line[:-1] if line.endswith("\\n") else line

    def _exit(code=None):
        raise SystemExit(code)

    class _Bytes(io.RawIOBase):  # sys.stdout.buffer: bytes decoded onto the kernel's text stream
        def __init__(self, stream):
            self.stream, self.decoder = stream, codecs.getincrementaldecoder("utf-8")("replace")

        def writable(self):
            return True

        def write(self, data):
            self.stream.write(self.decoder.decode(bytes(data)))
            return len(data)

        def fileno(self):
            return self.stream.fileno()

        def close(self):
            self.stream.write(self.decoder.decode(b"", final=True))
            super().close()

    def _text(stream):
        return io.TextIOWrapper(_Bytes(stream), encoding="utf-8", errors="surrogateescape", write_through=True)

    for path, content in files.items():
        if content is not None:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            with open(path, "wb") as f:
                f.write(base64.b64decode(content))
    filename, status = "main.py", 0
    namespace = {"__name__": "__main__", "__file__": filename, "__builtins__": builtins}
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)  # source lines in tracebacks
    saved = sys.stdin, sys.stdout, sys.stderr, builtins.input, sys.argv, os._exit
    data = stdin_text.encode("utf-8", "surrogatepass")
    fd = os.memfd_create("stdin")  # fd 0 holds the request's stdin for the run, as a pipe would
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    try:
        saved_fd0 = os.dup(0)
    except OSError:
        saved_fd0 = None
    os.dup2(fd, 0)
    os.close(fd)
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "rb", closefd=False), encoding="utf-8", errors="surrogatepass",
                                 newline="\\n")
    sys.stdout, sys.stderr = _text(saved[1]), _text(saved[2])
    builtins.input, sys.argv, os._exit = _input, [filename], _os_exit  # the kernel's own input refuses stdin
    # IPython hides exit and quit while it executes and adds get_ipython: a plain interpreter's builtins instead
    missing, kernel_builtins = object(), {}
    for name, value in (("exit", _exit), ("quit", _exit), ("get_ipython", None)):
        kernel_builtins[name] = builtins.__dict__.pop(name, missing)
        if value is not None:
            builtins.__dict__[name] = value
    limit = resource.getrlimit(resource.RLIMIT_AS)
    try:
        try:
            if memory_mb > 0:  # the run may grow this process's address space by memory_mb MiB
                with open("/proc/self/status") as f:
                    size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
                soft = size + memory_mb * 2**20
                if limit[1] != resource.RLIM_INFINITY:
                    soft = min(soft, limit[1])
                if limit[0] == resource.RLIM_INFINITY or soft < limit[0]:
                    resource.setrlimit(resource.RLIMIT_AS, (soft, limit[1]))
            exec(compile(source, filename, "exec", dont_inherit=True), namespace)
        finally:
            resource.setrlimit(resource.RLIMIT_AS, limit)
    except SystemExit as exc:
        if isinstance(exc.code, int):
            status = exc.code & 0xFF
        elif exc.code is not None:
            print(exc.code, file=sys.stderr)
            status = 1
    except _ProcessExit as exc:
        status = int(exc.args[0]) & 0xFF
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
        traceback.print_exception(exc, file=sys.stderr)
        status = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.close()
            except Exception:
                pass
        sys.stdin, sys.stdout, sys.stderr, builtins.input, sys.argv, os._exit = saved
        for name, value in kernel_builtins.items():
            builtins.__dict__.pop(name, None)
            if value is not missing:
                builtins.__dict__[name] = value
        if saved_fd0 is None:
            os.close(0)
        else:
            os.dup2(saved_fd0, 0)
            os.close(saved_fd0)
        linecache.cache.pop(filename, None)
        if fetch_files:
            from IPython.display import publish_display_data

            fetched = {}
            for path in fetch_files:
                try:
                    if os.path.isfile(path):
                        with open(path, "rb") as f:
                            fetched[path] = base64.b64encode(f.read()).decode("ascii")
                except OSError:
                    pass
            publish_display_data({"FETCH_MIME": fetched})
    if status:
        raise EXIT_ERROR(status)
""".replace("EXIT_ERROR", EXIT_ERROR).replace("FETCH_MIME", FETCH_MIME)


def response(result: RunResult) -> RunCodeResponse:
    """Our RunResult of the driven program as SandboxFusion's response."""
    run_result = CommandRunResult(
        status="Finished", execution_time=result.duration_ms / 1000, stdout=result.stdout, stderr=result.stderr
    )
    files = result._files
    if result.status == "sandbox_error" and result._exit_status is not None:
        # the kernel's process ended while the program ran (a crash, a signal): a plain process would have
        # ended the same way, and SandboxFusion reports its exit status as the run's
        run_result.return_code = result._exit_status
    elif result.status == "sandbox_error":
        error = result.error.name + ": " + result.error.message if result.error else "the sandbox failed"
        run_result.status, run_result.stderr = "Error", (result.stderr + "\n" + error).lstrip("\n")
        return RunCodeResponse(status="SandboxError", message=error, run_result=run_result, files=files)
    elif result.status == "timeout":
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
    return RunCodeResponse(status=status, message=message, run_result=run_result, files=files)


def program(body: RunCodeRequest) -> str:
    """The code a stateless kernel runs for one request: the driver, then its call on the request's fields."""
    call = (body.code, body.stdin or "", body.files, body.fetch_files, max(body.memory_limit_MB, 0))
    return f"{DRIVER}\n_run_code{call!r}\n"


def signal_status(code: int) -> int:
    """A process's exit status as Python's subprocess gives it (-N for signal N) from a wait status already
    converted by os.waitstatus_to_exitcode, or from the namespace init's `128 + N` (stare_sandbox.launch)."""
    if code > 128 and code - 128 in {s.value for s in signal.Signals}:
        return -(code - 128)
    return code
