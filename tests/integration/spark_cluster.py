"""A real Spark standalone cluster on this machine, for tests/integration/test_spark_cluster.py.

`start_cluster(work)` starts, with the classes pyspark ships (`spark-class`):
  * a Master on `spark://127.0.0.1:PORT` and one Worker with 2 cores, every port chosen free;
  * a driver process (`spark_cluster_driver.py`: one JVM holds one SparkContext, and the test
    session has its `local[2]` one already) whose application gets two executors of 1 core and
    768 MiB each.
The executors get the project the way a cluster does, from a wheel and not from the checkout:
the wheel is built from a copy of the sources, installed with `pip --target`, zipped and shipped
with `spark.archives` (`#bgsite`, on the workers' `PYTHONPATH`), and the executors' Python is a
venv of its own that sees the test venv's packages (torch, pyspark, ...) but neither the
checkout nor its editable install. The Worker runs from a temp folder with no `PYTHONPATH`, so
each executor and its Python workers start in `<work>/app-*/<executor id>/`.

Everything runs in new process groups owned by the fixture: `Cluster.stop()` ends the driver,
then the Worker's group (its executors and their Python workers) and the Master's, by id, and
every wait is bounded.
"""
from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wheel_site import build_wheel, install_wheel

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("spark_cluster_driver.py")
EXECUTORS = 2
EXECUTOR_MEMORY = "768m"
# short-lived JVMs on 2 cores: the C1 compiler only and the serial GC start and idle cheaper
JAVA_OPTS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).parent


def build_wheel_site(work: Path) -> tuple[Path, Path]:
    """The wheel built from a copy of the sources, installed into `work/site` (no deps: the
    cluster's Python has them) and zipped as `work/batchgen_site.zip`. Returns (wheel, zip)."""
    wheel = build_wheel(work)
    site = install_wheel(wheel, work / "site")
    archive = shutil.make_archive(str(work / "batchgen_site"), "zip", site)
    return wheel, Path(archive)


def executor_python(work: Path) -> Path:
    """A venv whose site-packages point at this venv's (a plain path line in a .pth: the test
    venv's own .pth files, the editable install's hook among them, are not run)."""
    venv = work / "executor-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=60, capture_output=True)
    import sysconfig

    purelib = Path(sysconfig.get_paths()["purelib"])
    ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
    (venv / "lib" / ver / "site-packages" / "test-venv.pth").write_text(f"{purelib}\n")
    return venv / "bin" / "python"


@dataclass
class Service:
    """A process the fixture started, in a process group of its own."""

    name: str
    proc: subprocess.Popen
    log: Path
    handle: Any = None  # the log file, open for the process's stderr

    def stop(self, grace_s: float = 10.0) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        # whatever of the group is left: executors, their Python workers
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        if self.handle is not None:
            self.handle.close()

    def tail(self, n: int = 3000) -> str:
        try:
            return f"--- {self.name} ({self.log}) ---\n" + self.log.read_text()[-n:]
        except OSError:
            return ""


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it if the test process dies without a teardown (a
    killed pytest); its executors then stop when they lose their Worker or driver."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _start(name: str, cmd: list[str], work: Path, env: dict[str, str],
           stdin: Any = subprocess.DEVNULL, stdout: Any = None) -> Service:
    log = work / f"{name}.log"
    handle = open(log, "w")
    proc = subprocess.Popen(cmd, cwd=work, env=env, stdin=stdin,
                            stdout=handle if stdout is None else stdout, stderr=handle,
                            start_new_session=True, text=True, preexec_fn=_die_with_parent)
    return Service(name, proc, log, handle)


def _wait(what: str, check: Any, deadline: float, services: list[Service]) -> None:
    while not check():
        for s in services:
            if s.proc.poll() is not None:
                raise RuntimeError(f"{s.name} exited ({s.proc.returncode}) while waiting for "
                                   f"{what}\n{s.tail()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}\n" +
                               "\n".join(s.tail() for s in services))
        time.sleep(0.25)


def _bound_ports(log: Path) -> dict[str, int]:
    try:
        text = log.read_text()
    except OSError:
        return {}
    return {m[1]: int(m[2]) for m in
            re.finditer(r"Successfully started service '([^']+)' on port (\d+)", text)}


def _master_state(ui_port: int) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{ui_port}/json/", timeout=2) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return None


@dataclass
class Cluster:
    work: Path
    master_url: str
    master_ui: int
    wheel: Path
    archive: Path
    executor_python: Path
    model_cache: Path
    services: list[Service] = field(default_factory=list)
    driver: "Driver | None" = None
    started_in_s: float = 0.0

    def state(self) -> dict[str, Any] | None:
        return _master_state(self.master_ui)

    def executor_jvms(self) -> list[int]:
        """Pids of this cluster's live executor JVMs (children of the Worker's JVM)."""
        return [p for p in _descendants(self.services[1].proc.pid)
                if "CoarseGrainedExecutorBackend" in _cmdline(p)]

    def logs(self) -> str:
        out = [s.tail() for s in self.services]
        for err in sorted(self.work.glob("spark-work/app-*/*/stderr")):
            out.append(f"--- {err} ---\n" + err.read_text()[-3000:])
        return "\n".join(out)

    def stop(self) -> list[int]:
        """Stop everything; returns the pids still alive afterwards (none, unless a process
        left its group)."""
        pids = {p: _started(p) for s in self.services
                for p in (s.proc.pid, *_descendants(s.proc.pid))}
        if self.driver is not None:  # EOF on stdin: the driver stops its SparkContext
            self.driver.close()
        for s in reversed(self.services):  # driver, then Worker (with executors), then Master
            s.stop()
        # still there, and the same process (its start time too: a pid can be reused)
        left = [p for p, started in pids.items() if _alive(p) and _started(p) == started]
        for pid in left:  # ours: started under one of the services
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return left


def start_cluster(work: Path, timeout_s: float = 150.0) -> Cluster:
    """Master, Worker and driver up, both executors registered; on any failure whatever was
    started is stopped before the error propagates."""
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    home = spark_home()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SPARK_HOME")}
    env.update(SPARK_HOME=str(home), SPARK_LOCAL_IP="127.0.0.1", SPARK_DAEMON_MEMORY="256m",
               SPARK_DAEMON_JAVA_OPTS=JAVA_OPTS, SPARK_NO_DAEMONIZE="1",
               SPARK_MASTER_OPTS="-Dspark.master.rest.enabled=false")  # no fixed port 6066
    spark_class = str(home / "bin" / "spark-class")
    services: list[Service] = []
    cluster: Cluster | None = None
    try:
        master = _start("master", [spark_class, "org.apache.spark.deploy.master.Master",
                                   "--host", "127.0.0.1", "--port", str(free_port()),
                                   "--webui-port", str(free_port())], work, env)
        services.append(master)
        wheel, archive = build_wheel_site(work / "wheel")  # while the Master's JVM starts
        python = executor_python(work)
        # the ports it bound (Spark moves on to the next port if one was taken meanwhile)
        ports: dict[str, int] = {}
        _wait("the master", lambda: ports.update(_bound_ports(master.log)) or
              {"sparkMaster", "MasterUI"} <= set(ports), deadline, services)
        master_url, ui = f"spark://127.0.0.1:{ports['sparkMaster']}", ports["MasterUI"]
        _wait("the master's state", lambda: _master_state(ui) is not None, deadline, services)
        worker_dir = work / "spark-work"
        worker_dir.mkdir()
        services.append(_start("worker", [
            spark_class, "org.apache.spark.deploy.worker.Worker", master_url,
            "--host", "127.0.0.1", "--port", str(free_port()), "--webui-port", str(free_port()),
            "--cores", str(EXECUTORS), "--memory", "2g", "--work-dir", str(worker_dir)],
            work, env))
        cache = work / "node-model-cache"
        cluster = Cluster(work, master_url, ui, wheel, archive, python, cache, services)
        # the driver's JVM starts while the Worker registers; its app waits for the Worker
        cluster.driver = Driver.start(cluster, env, deadline)
        _wait("the worker", lambda: (cluster.state() or {}).get("aliveworkers") == 1,
              deadline, services)
        cluster.driver.wait_ready(deadline)
        cluster.started_in_s = time.monotonic() - t0
        return cluster
    except BaseException:
        for s in reversed(services):
            s.stop()
        raise


def driver_conf(cluster: Cluster) -> dict[str, str]:
    return {
        "spark.ui.enabled": "false",
        "spark.driver.host": "127.0.0.1",
        "spark.driver.bindAddress": "127.0.0.1",
        "spark.driver.memory": "1g",
        "spark.driver.extraJavaOptions": JAVA_OPTS,
        "spark.executor.extraJavaOptions": JAVA_OPTS,
        "spark.executor.cores": "1",
        "spark.executor.memory": EXECUTOR_MEMORY,
        "spark.cores.max": str(EXECUTORS),
        "spark.sql.shuffle.partitions": "2",
        "spark.default.parallelism": "2",
        "spark.python.worker.reuse": "true",
        "spark.pyspark.python": str(cluster.executor_python),
        "spark.pyspark.driver.python": sys.executable,
        # the wheel, installed and zipped, unpacked into each executor's folder as ./bgsite
        "spark.archives": f"{cluster.archive}#bgsite",
        "spark.executorEnv.PYTHONPATH": "bgsite",
        "spark.executorEnv.BATCHGEN_MODEL_CACHE_DIR": str(cluster.model_cache),
        "spark.executorEnv.HF_HUB_OFFLINE": "1",
        "spark.executorEnv.TOKENIZERS_PARALLELISM": "false",
        # an executor killed on purpose: find out at once, and do not exclude the node
        "spark.excludeOnFailure.enabled": "false",
        "spark.task.maxFailures": "4",
    }


class Driver:
    """The driver process and its request/answer protocol (spark_cluster_driver.py)."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.lines: "queue.Queue[str | None]" = queue.Queue()
        self.lock = threading.Lock()
        self.broken = ""
        threading.Thread(target=self._read, daemon=True).start()

    @classmethod
    def start(cls, cluster: Cluster, env: dict[str, str], deadline: float) -> "Driver":
        config = {"master": cluster.master_url, "conf": driver_conf(cluster),
                  "executors": EXECUTORS, "executor_wait_s": max(10, deadline - time.monotonic())}
        denv = {**env, "PYSPARK_PYTHON": str(cluster.executor_python),
                "PYSPARK_DRIVER_PYTHON": sys.executable}
        service = _start("driver", [sys.executable, str(DRIVER), json.dumps(config)],
                         cluster.work, denv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        cluster.services.append(service)
        return cls(service)

    def _read(self) -> None:
        assert self.service.proc.stdout is not None
        for line in self.service.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def _next(self, deadline: float, prefix: str) -> str:
        while True:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"the driver did not answer in time\n{self.service.tail()}")
            if line is None:
                raise RuntimeError(f"the driver exited ({self.service.proc.poll()})\n"
                                   f"{self.service.tail()}")
            if line.startswith(prefix):
                return line[len(prefix):]

    def wait_ready(self, deadline: float) -> None:
        self._next(deadline, "READY")

    def send(self, job: str, **kwargs: Any) -> None:
        assert self.service.proc.stdin is not None
        self.service.proc.stdin.write(json.dumps({"job": job, "kwargs": kwargs}) + "\n")
        self.service.proc.stdin.flush()

    def result(self, timeout_s: float = 120.0) -> Any:
        if self.broken:  # an earlier answer never came: what is queued would be out of step
            raise RuntimeError(f"the driver is out of step: {self.broken}")
        try:
            line = self._next(time.monotonic() + timeout_s, "RESULT ")
        except (TimeoutError, RuntimeError) as err:
            self.broken = str(err).splitlines()[0]
            raise
        answer = json.loads(line)
        if not answer["ok"]:
            raise RuntimeError(f"{answer['error']}\n{answer['traceback']}")
        return answer["value"]

    def close(self, timeout_s: float = 10.0) -> None:
        with contextlib.suppress(OSError, ValueError):
            assert self.service.proc.stdin is not None
            self.service.proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.service.proc.wait(timeout_s)

    def call(self, job: str, timeout_s: float = 120.0, **kwargs: Any) -> Any:
        with self.lock:
            self.send(job, **kwargs)
            return self.result(timeout_s)


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        ppid = int(text.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(stat.parent.name))
    return kids


def _descendants(pid: int) -> list[int]:
    kids, out, todo = _children(), [], [pid]
    while todo:
        for child in kids.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _started(pid: int) -> str:
    """The process's start time (clock ticks after boot), "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def ancestor_executor(pid: int) -> int | None:
    """The executor JVM above a Python worker pid (its daemon's parent), if any."""
    while pid > 1:
        if "CoarseGrainedExecutorBackend" in _cmdline(pid):
            return pid
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            return None
    return None


def kill_executor(jvm: int) -> list[int]:
    """SIGKILL an executor JVM and every process under it (its Python daemon and workers), as
    when a node or container is lost. Returns the pids killed."""
    victims = [jvm, *_descendants(jvm)]
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return victims
