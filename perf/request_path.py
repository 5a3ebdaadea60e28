"""How many of pdserve's modules one request runs through: the measure of how far a reader has
to follow a request (issue 27 asks for 25 or fewer on a streamed, disaggregated chat request).

Workload: ``pdserve up`` (1 prefill, 1 decode worker, the default model) serving ONE streamed
``/v1/chat/completions`` request of 16 tokens, after a warm-up request. Every process of the stack
runs with a profile hook (``sitecustomize`` on ``PYTHONPATH``) that records the source file of
every Python function called while recording is on; SIGUSR2 turns recording on and, the second
time, off and writes the files out (SIGUSR1 is taken: it promotes a standby worker). A module counts when any of its functions ran in any of the
three processes (gateway, prefill, decode) while the request was served. Start-up, model loading
and the warm-up request are not counted.

    python -m perf.request_path                       # this checkout
    python -m perf.request_path --repo /tmp/old --python /tmp/oldvenv/bin/python --cli pdserve.shared.cli
    python -m perf.request_path --out perf/results/request_path.json --label after

The second form measures another checkout (the ``--cli`` module is where its command lived); the
third adds the result, under its label, to a JSON file of such results (a before and an after).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HOOK = """
import os, signal, sys, threading
_out = os.environ["PDSERVE_PATH_OUT"]
_seen = set()
_on = False

def _profile(frame, event, arg):
    if _on and event == "call":
        _seen.add(frame.f_code.co_filename)

def _toggle(signum, frame):
    global _on
    _on = not _on
    if not _on:
        with open(os.path.join(_out, f"{os.getpid()}.txt"), "w") as f:
            f.write("\\n".join(sorted(_seen)))

sys.setprofile(_profile)
threading.setprofile(_profile)
signal.signal(signal.SIGUSR2, _toggle)
"""

FOLDERS = ("gateway", "services", "shared", "kernels")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    found = [int(p) for p in out.stdout.split()]
    return found + [g for c in found for g in children(c)]


def chat(port: int, max_tokens: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as resp:
        model = json.load(resp)["data"][0]["id"]
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Name three colours."}],
        "max_tokens": max_tokens,
        "stream": True,
        "temperature": 0,
    }
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        return sum(1 for line in resp if line.startswith(b"data: {"))


def project_module(path: str, repo: Path) -> str | None:
    try:
        rel = Path(path).resolve().relative_to(repo)
    except ValueError:
        return None
    if rel.parts[0] in FOLDERS or rel.as_posix() == "cli.py":
        return rel.as_posix()
    return None


def measure(
    repo: Path, python: str, cli: str, max_tokens: int, model: str | None = None
) -> dict[str, list[str]]:
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        hook_dir, out_dir = Path(tmp, "hook"), Path(tmp, "out")
        hook_dir.mkdir()
        out_dir.mkdir()
        (hook_dir / "sitecustomize.py").write_text(HOOK)
        env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
        env.update(PYTHONPATH=str(hook_dir), PDSERVE_PATH_OUT=str(out_dir))
        log = Path(tmp, "up.log")
        argv = [python, "-m", cli, "up", "--port", str(port)]
        argv += ["--model", model] if model else []
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                argv,
                cwd=repo,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            deadline = time.monotonic() + 600
            while "pdserve ready at" not in log.read_text(errors="replace"):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"pdserve up did not start:\n{log.read_text()[-3000:]}")
                time.sleep(0.5)
            chat(port, max_tokens)  # warm-up: first-call paths are not the request path
            pids = [p for p in children(proc.pid) if "nats-server" not in _cmdline(p)]
            for pid in pids:
                os.kill(pid, signal.SIGUSR2)
            time.sleep(0.5)
            chunks = chat(port, max_tokens)
            time.sleep(0.5)
            for pid in pids:
                os.kill(pid, signal.SIGUSR2)
            time.sleep(2)
            per_process = {}
            for pid in pids:
                f = out_dir / f"{pid}.txt"
                if f.exists():
                    mods = {project_module(p, repo) for p in f.read_text().split("\n")}
                    per_process[_role(pid)] = sorted(m for m in mods if m)
            per_process["_chunks"] = [str(chunks)]
            return per_process
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _role(pid: int) -> str:
    cmd = _cmdline(pid).split()
    return next((r for r in ("gateway", "prefill", "decode") if r in cmd), f"pid{pid}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1])
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--cli", default="pdserve.cli", help="the module `-m` runs the CLI from")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--model", help="what pdserve up serves (default: its own default)")
    p.add_argument("--out", type=Path, help="a JSON file to add this result to")
    p.add_argument("--label", default="this checkout", help="the result's name in --out")
    ns = p.parse_args()
    found = measure(ns.repo.resolve(), ns.python, ns.cli, ns.max_tokens, ns.model)
    chunks = found.pop("_chunks")[0]
    union = sorted({m for mods in found.values() for m in mods})
    for role, mods in sorted(found.items()):
        print(f"{role}: {len(mods)} modules")
        for m in mods:
            print(f"  {m}")
    print(f"one streamed disaggregated chat request ({chunks} chunks): {len(union)} modules")
    if ns.out:
        results = json.loads(ns.out.read_text()) if ns.out.exists() else {}
        results[ns.label] = {
            "commit": _commit(ns.repo),
            "modules": len(union),
            "per_process": {role: len(mods) for role, mods in sorted(found.items())},
            "union": union,
        }
        ns.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


def _commit(repo: Path) -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True)
    return out.stdout.decode().strip()


if __name__ == "__main__":
    sys.exit(main())
