"""The in-engine sandbox as the openrlhf backend's executor makes it (runtime.make_client, sandbox.url empty), run
by test_non_root.py as a uid that is not root and owns THREADS other threads. Prints one JSON report."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading

from stare_agent.config import SandboxConfig
from stare_agent.runtime import check_sandbox, make_client

THREADS = 100


async def main(run_folder: str) -> dict:
    client = make_client(SandboxConfig(pool_size=1, max_kernels=4))
    try:
        await asyncio.wait_for(client.start(), 120)
    except Exception as exc:  # the refusal, when the host offers no user namespace
        return {"started": False, "error": f"{type(exc).__name__}: {exc}"}
    try:
        report = {"started": True, "isolation": (await client.health())["isolation"]}
        calls = {
            "answer": "print(6 * 7)",
            "threads": "import threading; e = threading.Event(); ts = [threading.Thread(target=e.wait) for _ in "
            "range(8)]; [t.start() for t in ts]; e.set(); [t.join() for t in ts]; print('threads ok')",
            "run_folder": f"open({os.path.join(run_folder, 'policy.txt')!r}, 'w').write('x'); print('WROTE')",
            "scratch": "open('mine.txt', 'w').write('x'); print(open('mine.txt').read())",
            "siblings": "import os; print(os.listdir('..') == [os.path.basename(os.getcwd())])",
            "signal": f"import os\ntry:\n    os.kill({os.getpid()}, 0); print('SEEN')\nexcept OSError as e:\n"
            "    print(type(e).__name__)",
            "capabilities": "print([l.split()[1] for l in open('/proc/self/status') if l.startswith('CapEff')][0])",
            "remount": "import subprocess; print(subprocess.run(['mount', '-o', 'remount,rw', '/'], "
            "capture_output=True).returncode)",
        }
        session = await client.create_session()
        for name, code in calls.items():
            result = await client.execute(code, session, timeout_s=60)
            error = str(result.error)[-300:]
            report[name] = {"status": result.status, "stdout": result.stdout.strip(), "error": error}
        return report
    finally:
        await client.close()


if __name__ == "__main__":
    hold = threading.Event()
    held = [threading.Thread(target=hold.wait, daemon=True) for _ in range(THREADS)]
    for thread in held:
        thread.start()
    try:
        check_sandbox(SandboxConfig(), 0, "")  # what each engine runs at its start
        checked = "ok"
    except Exception as exc:
        checked = f"{type(exc).__name__}: {exc}"
    out = asyncio.run(main(sys.argv[1]))
    out["check_sandbox"] = checked
    out["uid"], out["threads_held"] = os.getuid(), threading.active_count() - 1
    hold.set()
    print(json.dumps(out))
