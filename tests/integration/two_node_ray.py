"""A two-node Ray cluster on this machine for the tests: a head and a worker raylet, each with its
own object store, run by an interpreter that cannot import the checkout.

The nodes are `ray.cluster_utils.Cluster` nodes started by a launcher process (this file, run as a
script) under a *node Python*: a venv made for the test (`--without-pip`, seconds) whose only
site-packages entry is a `.pth` line naming the test venv's site-packages. A path added by a
`.pth` line is not scanned for `.pth` files itself, so the editable install's import hook never
loads there: `import batchgen_data` fails on the nodes unless the job ships the package
(`runtime_env={"py_modules": [...]}`), as on a real cluster. The launcher runs from an empty
temp folder with PYTHONPATH cleared; Ray starts every worker with the launcher's interpreter.

The launcher is driven over its stdin/stdout, one JSON line each way (`start`, `kill-worker`,
`add-worker`, `stop`), and runs in a session of its own, so tearing it down ends the raylets,
their workers and Ray's helpers by process group, never by name. Every call has a deadline.

Resources: each node has `num_cpus` logical CPUs and one unit of `ENGINE` (an engine actor asks
for one, so two actors land one per node), and a small object store. Ray's node health check
runs every 0.5 s (4 misses: dead), so a killed node is noticed in ~2 s instead of Ray's ~15 s.
"""
from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ENGINE = "batchgen_test_engine"  # custom resource: one unit per node


class TwoNodeRay:
    """Driver side: starts the launcher, kills and re-adds the worker node, tears it all down."""

    def __init__(self, work: Path, num_cpus: float = 2, object_store_mb: int = 200,
                 env: dict[str, str] | None = None, timeout_s: float = 120.0) -> None:
        self.work = work
        self.timeout_s = timeout_s
        python = node_python(work / "nodepy")
        cwd = work / "cwd"
        cwd.mkdir(parents=True, exist_ok=True)
        script = cwd / "launcher.py"
        shutil.copy(__file__, script)
        child_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        # a node that stops answering counts as dead after ~2 s, not Ray's default ~15 s
        # (3 s x 5 health checks): the kill tests then wait for the replacement, not for this
        child_env.update({"RAY_health_check_period_ms": "500", "RAY_health_check_timeout_ms": "500",
                          "RAY_health_check_failure_threshold": "4"})
        # Ray records "the cluster a plain ray.init() joins" under its temp root (/tmp/ray by
        # default): kept in here, no other Ray user of this machine finds this cluster
        child_env["RAY_TMPDIR"] = str(work)
        child_env.update(env or {})
        self.proc = subprocess.Popen(
            [python, str(script)], cwd=cwd, env=child_env, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=open(work / "launcher.log", "w"), text=True,
            start_new_session=True)
        self.python = python
        try:
            info = self.ask({"cmd": "start", "num_cpus": num_cpus,
                             "object_store_mb": object_store_mb,
                             "temp_dir": str(work / "ray")})
        except BaseException:
            self.stop()
            raise
        self.address: str = info["address"]
        self.head: str = info["head"]
        self.worker: str = info["worker"]

    def ask(self, msg: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"cluster launcher: no answer to {msg['cmd']} "
                                   f"({self.log_tail()})")
            ready, _, _ = select.select([self.proc.stdout], [], [], left)
            if not ready:
                continue
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"cluster launcher exited ({self.log_tail()})")
            if line.startswith("{"):
                reply = json.loads(line)
                if "error" in reply:
                    raise RuntimeError(f"cluster launcher: {reply['error']}")
                return reply

    def kill_worker(self) -> dict[str, Any]:
        """SIGKILL the worker node's raylet and every process under it (its actors and tasks)
        at once; returns when they are gone."""
        return self.ask({"cmd": "kill-worker"})

    def add_worker(self) -> str:
        """A new worker node (a replacement, as an autoscaler would start); its node id."""
        self.worker = self.ask({"cmd": "add-worker"})["worker"]
        return self.worker

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.ask({"cmd": "stop"}, timeout_s=30)
            except Exception:  # noqa: BLE001 - the process group goes below anyway
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)

    def log_tail(self) -> str:
        try:
            return (self.work / "launcher.log").read_text()[-2000:]
        except OSError:
            return ""


def node_python(where: Path) -> str:
    """A venv at `where` that sees this interpreter's site-packages through a `.pth` line only
    (so not the `.pth` files in it: no editable hook); the path of its python."""
    base = getattr(sys, "_base_executable", sys.executable)
    if not (where / "bin" / "python").exists():
        subprocess.run([base, "-m", "venv", "--without-pip", str(where)], check=True,
                       timeout=120, capture_output=True)
    site = next((where / "lib").glob("python*/site-packages"))
    ours = [p for p in sys.path if p.endswith("site-packages") and Path(p, "ray").is_dir()]
    (site / "test_venv.pth").write_text("\n".join(ours) + "\n")
    return str(where / "bin" / "python")


# ---- the launcher (this file run as a script, by the node python) ------------------------
def _launcher() -> None:
    import psutil
    import ray
    from ray.cluster_utils import Cluster

    cluster = None
    worker = None
    added = 0
    args: dict[str, Any] = {}

    def node_args(name: str) -> dict[str, Any]:
        # a temp dir per node: nodes sharing one would share `runtime_resources`, and a node
        # starting (or a dead one's cleanup) would delete the other's unpacked py_modules
        return dict(num_cpus=args["num_cpus"], resources={ENGINE: 1},
                    object_store_memory=args["object_store_mb"] << 20,
                    include_dashboard=False, temp_dir=f"{args['temp_dir']}/{name}")

    def reply(**kw: Any) -> None:
        print(json.dumps(kw), flush=True)

    for line in sys.stdin:
        msg = json.loads(line)
        try:
            if msg["cmd"] == "start":
                args = msg
                cluster = Cluster(initialize_head=True, head_node_args=node_args("head"))
                worker = cluster.add_node(**node_args("worker-0"))
                cluster.wait_for_nodes()
                reply(address=cluster.address, head=cluster.head_node.node_id,
                      worker=worker.node_id)
            elif msg["cmd"] == "kill-worker":
                assert cluster is not None and worker is not None
                raylet = worker.all_processes[ray._private.ray_constants.PROCESS_TYPE_RAYLET][0]
                procs = psutil.Process(raylet.process.pid).children(recursive=True)
                t0 = time.monotonic()
                for p in [psutil.Process(raylet.process.pid), *procs]:
                    try:
                        p.send_signal(signal.SIGKILL)
                    except psutil.NoSuchProcess:
                        pass
                psutil.wait_procs(procs, timeout=10)
                cluster.remove_node(worker, allow_graceful=False)
                gone = worker.node_id
                worker = None
                reply(killed=gone, pids=len(procs) + 1, kill_s=round(time.monotonic() - t0, 3))
            elif msg["cmd"] == "add-worker":
                assert cluster is not None and worker is None
                added += 1
                worker = cluster.add_node(**node_args(f"worker-{added}"))
                reply(worker=worker.node_id)
            elif msg["cmd"] == "stop":
                if cluster is not None:
                    cluster.shutdown()
                reply(stopped=True)
                return
        except Exception as e:  # noqa: BLE001 - reported to the driver, which fails the test
            reply(error=repr(e))


if __name__ == "__main__":
    _launcher()
