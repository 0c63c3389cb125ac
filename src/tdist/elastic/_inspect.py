"""Looking into a running job from outside: ``tdist status`` and ``tdist dump``.

Theory of operation. ``tdist run`` registers the job it runs on this host: a small JSON file
``<tmp>/tdist-jobs-<uid>/<launcher pid>.json`` (the run's directory, the attempt, every
worker's rank, pid and directory), rewritten at each attempt and removed at the end. Each
worker (``TDIST_STATUS_DIR``, set by the launcher to its rank's directory) keeps, once it has
imported tdist (``worker_side``):

- ``status.json``, rewritten every second by a daemon thread: the time (its heartbeat), the
  operation its process groups are in and since when (from the flight recorder, where one
  runs), and the steps it reported (``report_progress``);
- every thread's Python stack, appended to ``stacks.txt`` when asked, and its flight record
  (``tdist.flight_recorder``) dumped: asked by a file in its directory (``stacks.request``,
  ``record.request``) and a byte written to its named pipe ``.wake`` there, which wakes the
  status thread at once (it also looks for the files each second); it removes a request once
  it has answered it. The main thread may be inside a long call of C code, where no Python
  signal handler runs, and the program may have handlers of its own for the user signals (a
  scheduler's "save and requeue" hook on ``SIGUSR1`` or ``SIGUSR2``): tdist's launcher never
  signals a worker to look into it. (``kill -USR2`` and ``kill -USR1`` by hand ask for the
  same, where the program has no handler of its own.) The status thread writes the stacks from
  ``sys._current_frames()``, holding the interpreter's lock: ``faulthandler``'s dump of every
  thread, from the signal handler itself, walks the other threads' frames while they run,
  and crashed the worker it looked into (a segmentation fault in ``dump_traceback``, about
  one dump in a thousand with four busy threads).

``tdist status`` reads those files and ``/proc`` (state, CPU, memory) into a per-rank table,
redrawn every second; ``tdist dump`` asks every worker and gathers the stacks and flight
records into one folder. Both see the jobs of this host.

A job of several nodes is also seen whole from anywhere that reaches its store: every node's
launcher publishes its rows each second in the job's store (the rendezvous store, or node 0's
job store), under ``tdist.status/<run id>/<host>:<launcher pid>`` (``publish_status``), and
``tdist status --rdzv-endpoint HOST:PORT`` (with the job's secret) reads every node's rows into
one table (``watch_job``). A node's rows older than ``STALE`` seconds are not shown (its
launcher stopped publishing: gone, or stopped). ``tdist dump --rdzv-endpoint`` puts a request
in the store (``DUMP_KEY/<run id>/request``); each launcher, at its next publication, gathers its
workers' stacks and flight records (``gather_dump``, in a thread of its own) and puts the files
in the store under the request's token (``answer_dump``), and the command writes every node's
files into one folder (``collect_dump``).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import select
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

from .._core._process import pid_alive, proc_stat

__all__ = [
    "RECORD_REQUEST",
    "STACKS_REQUEST",
    "STALE",
    "answer_dump",
    "answers",
    "collect_dump",
    "dump_request",
    "expire_status",
    "find_job",
    "gather_dump",
    "job_rows",
    "jobs",
    "metrics_key",
    "node_metrics",
    "publish_metrics",
    "publish_status",
    "register_job",
    "report_progress",
    "status_rows",
    "status_table",
    "unregister_job",
    "watch_job",
    "worker_side",
    "write_stacks",
]

STATUS_DIR_ENV = "TDIST_STATUS_DIR"
_STATUS_EVERY = 1.0  # seconds between two writes of a worker's status.json
STALE = 10.0  # seconds after which a node's published rows (and metrics' workers) are not shown

STATUS_KEY = "tdist.status"
METRICS_KEY = "tdist.metrics"
DUMP_KEY = "tdist.dump"


def _registry() -> str:
    return os.path.join(tempfile.gettempdir(), f"tdist-jobs-{os.getuid()}")


# -- the launcher's side -------------------------------------------------------------------------
def register_job(record: dict[str, Any]) -> str:
    """Write (or rewrite) this launcher's entry in the registry of running jobs; its path."""
    directory = _registry()
    os.makedirs(directory, mode=0o700, exist_ok=True)
    path = os.path.join(directory, f"{os.getpid()}.json")
    tmp = f"{path}.{threading.get_ident()}.tmp"
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, path)
    return path


def unregister_job() -> None:
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(_registry(), f"{os.getpid()}.json"))


def jobs() -> list[dict[str, Any]]:
    """The jobs ``tdist run`` runs on this host now (entries of dead launchers are dropped)."""
    found = []
    with contextlib.suppress(OSError):
        for name in sorted(os.listdir(_registry())):
            if not name.endswith(".json"):
                continue
            path = os.path.join(_registry(), name)
            try:
                with open(path) as f:
                    record = json.load(f)
            except (OSError, ValueError):
                continue
            if pid_alive(int(record.get("pid", 0))):
                found.append(record)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(path)
    return found


def find_job(pid: int | None) -> dict[str, Any]:
    """The job of launcher ``pid``, or the only one running here.

    Raises:
        LookupError: none, or several and no ``pid`` (the message lists them).
    """
    running = jobs()
    if pid is not None:
        for record in running:
            if record["pid"] == pid:
                return record
        raise LookupError(f"no tdist run job with launcher pid {pid} on this host")
    if not running:
        raise LookupError("no tdist run job is running on this host (as this user)")
    if len(running) > 1:
        listed = ", ".join(f"{r['pid']} ({r.get('run_id', '?')}: {r.get('entrypoint', '')})" for r in running)
        raise LookupError(f"several jobs run on this host; pick one with --pid: {listed}")
    return running[0]


# -- the worker's side ---------------------------------------------------------------------------
_progress: list[tuple[int, float]] = []  # the last two reports: (step, time)
_progress_lock = threading.Lock()
_started = False


def report_progress(step: int) -> None:
    """Tell ``tdist status`` that this worker finished training step ``step`` (it shows the
    steps per second). Cheap: a tuple kept in memory; nothing is written here."""
    with _progress_lock:
        _progress[:] = [*_progress[-1:], (int(step), time.monotonic())]


def _steps() -> tuple[int | None, float | None]:
    with _progress_lock:
        p = list(_progress)
    if not p:
        return None, None
    if len(p) < 2 or p[1][1] <= p[0][1]:
        return p[-1][0], None
    # the rate of the last two reports, until the next one is later than that rate says: then
    # over the time since the last (a rank that stops making progress is seen to slow down)
    span = max(p[1][1] - p[0][1], time.monotonic() - p[1][1])
    return p[1][0], (p[1][0] - p[0][0]) / span


# a dump of the stacks is asked for: ``SIGUSR2``'s handler writes a byte to this pipe, which
# wakes the status thread (the file ``STACKS_REQUEST`` asks too, seen at its next look)
_stacks_pipe: tuple[int, int] | None = None
STACKS_REQUEST = "stacks.request"
RECORD_REQUEST = "record.request"
# the named pipe in a worker's directory: a byte wakes its status thread (hidden, and removed by
# the launcher at the end: ``cat logs/*`` on a pipe nobody writes to waits for good)
WAKE = ".wake"


def _on_stacks_signal(signum: int, frame: object) -> None:
    # (no lock here, not even an Event's: the handler runs between two bytecodes of the main
    # thread, which may hold that very lock in this handler's earlier run, when two signals
    # come close together; a byte to a non-blocking pipe takes none)
    if _stacks_pipe is not None:
        with contextlib.suppress(OSError):  # (full: a wake-up is pending anyway)
            os.write(_stacks_pipe[1], b"\0")


def write_stacks(path: str) -> None:
    """Append every thread's Python stack but the caller's to ``path``, most recent call
    first, in ``faulthandler``'s form (and each thread's name)."""
    me = threading.get_ident()
    names = {t.ident: t.name for t in threading.enumerate()}
    frames = sys._current_frames()  # (Python objects, taken under the interpreter's lock: safe)
    main = threading.main_thread().ident
    lines = []
    for ident in sorted(frames, key=lambda i: (i != main, i)):
        if ident == me:
            continue
        lines.append(f'Thread 0x{ident:016x} "{names.get(ident, "?")}" (most recent call first):')
        f: Any = frames[ident]
        while f is not None:
            lines.append(f'  File "{f.f_code.co_filename}", line {f.f_lineno} in {f.f_code.co_name}')
            f = f.f_back
        lines.append("")
    del frames
    with open(path, "a") as out:
        out.write("\n".join(lines) + "\n")


def _wake_pipe(directory: str) -> int | None:
    """This worker's named pipe ``.wake``, open for reading (and writing, so that it never
    reads as closed: no writer between two requests is no end), or None where none can be
    made."""
    path = os.path.join(directory, WAKE)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # (a restarted worker's predecessor's)
    try:
        os.mkfifo(path, 0o600)
        return os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None


def remove_wake_pipes(run_dir: str) -> None:
    """The workers' named pipes under a run's directory (at the run's end: its logs are kept,
    and read with ``cat`` and ``grep``, which a pipe without a writer holds for good)."""
    for root, _dirs, files in os.walk(run_dir):
        if WAKE in files:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(root, WAKE))


def _status(directory: str) -> None:
    path = os.path.join(directory, "status.json")
    stacks = os.path.join(directory, "stacks.txt")
    request = os.path.join(directory, STACKS_REQUEST)
    record_request = os.path.join(directory, RECORD_REQUEST)
    wake = select.poll()
    pipes = [fd for fd in (_wake_pipe(directory), _stacks_pipe[0] if _stacks_pipe is not None else None) if fd is not None]
    for fd in pipes:
        wake.register(fd, select.POLLIN)
    while True:
        asked = False
        for fd in pipes:
            with contextlib.suppress(OSError):  # (BlockingIOError: nothing written)
                asked = bool(os.read(fd, 4096)) or asked
        if asked or os.path.exists(request):
            with contextlib.suppress(Exception):
                write_stacks(stacks)
            with contextlib.suppress(OSError):
                os.unlink(request)  # (answered: what the asker waits for)
        if os.path.exists(record_request):
            recorder = sys.modules.get("tdist.c10d._flight_recorder")  # (where the program has groups)
            if recorder is not None:
                with contextlib.suppress(Exception):
                    recorder.write_dumps()
            with contextlib.suppress(OSError):
                os.unlink(record_request)
        step, rate = _steps()
        op = None
        recorder = sys.modules.get("tdist.c10d._flight_recorder")  # (where the program has groups)
        if recorder is not None:
            with contextlib.suppress(Exception):
                op = recorder.current_op()
        record = {"pid": os.getpid(), "host": socket.gethostname(), "time": time.time(), "op": op,
                  "step": step, "steps_per_s": rate}
        with contextlib.suppress(OSError):
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(record, f)
            os.replace(tmp, path)
        if not pipes:
            time.sleep(_STATUS_EVERY)
        else:
            with contextlib.suppress(OSError):
                wake.poll(_STATUS_EVERY * 1000)


def worker_side() -> None:
    """In a worker of ``tdist run`` (``TDIST_STATUS_DIR`` set): the status thread and the
    stacks-on-``SIGUSR2`` handler; once per process, never raises."""
    global _started
    directory = os.environ.pop(STATUS_DIR_ENV, None)  # (the worker's own: not its children's)
    if _started or not directory or not os.path.isdir(directory):
        return
    _started = True
    with contextlib.suppress(Exception):
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGUSR2) in (
            signal.SIG_DFL, None,
        ):
            global _stacks_pipe
            r, w = os.pipe()
            os.set_blocking(r, False)
            os.set_blocking(w, False)
            _stacks_pipe = (r, w)
            signal.signal(signal.SIGUSR2, _on_stacks_signal)
            # (a system call that the signal interrupts is restarted, as under faulthandler's
            # handler before: C code that does not expect EINTR sees nothing)
            signal.siginterrupt(signal.SIGUSR2, False)
    threading.Thread(target=_status, args=(directory,), name="tdist-status", daemon=True).start()


# -- the inspector's side ------------------------------------------------------------------------
def _proc(pid: int) -> dict[str, Any]:
    """State, CPU seconds and resident memory of ``pid`` from ``/proc``."""
    out: dict[str, Any] = {"state": "gone", "cpu_s": None, "rss_mb": None}
    fields = proc_stat(pid) or []
    try:
        ticks = os.sysconf("SC_CLK_TCK")
        out["state"] = {"R": "running", "S": "sleeping", "D": "disk", "T": "stopped", "t": "stopped",
                        "Z": "exited"}.get(fields[0], fields[0])
        out["cpu_s"] = (int(fields[11]) + int(fields[12])) / ticks
        out["rss_mb"] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, IndexError, ValueError):
        pass
    return out


def status_rows(job: dict[str, Any], previous: dict[int, tuple[float, float]] | None = None) -> list[dict[str, Any]]:
    """One row per worker of ``job``: rank, pid, host, state, the operation it is in and for how
    long, steps and steps/s, CPU % (since ``previous``: rank -> (cpu seconds, time)), memory,
    and the age of its last heartbeat (its status file)."""
    rows = []
    now = time.time()
    for w in job.get("workers", []):
        info = _proc(int(w["pid"]))
        status: dict[str, Any] = {}
        with contextlib.suppress(OSError, ValueError):
            with open(os.path.join(w["dir"], "status.json")) as f:
                status = json.load(f)
        cpu = None
        if previous is not None and info["cpu_s"] is not None and w["rank"] in previous:
            cpu_s, at = previous[w["rank"]]
            if now > at:
                cpu = 100.0 * (info["cpu_s"] - cpu_s) / (now - at)
        if previous is not None and info["cpu_s"] is not None:
            previous[w["rank"]] = (info["cpu_s"], now)
        op = status.get("op")
        rows.append({
            "rank": w["rank"], "pid": w["pid"], "host": status.get("host", socket.gethostname()),
            "state": info["state"],
            "op": None if not op else op.get("name"),
            "op_for_s": None if not op or op.get("since") is None else max(0.0, now - float(op["since"])),
            "step": status.get("step"), "steps_per_s": status.get("steps_per_s"),
            "cpu_pct": cpu, "rss_mb": info["rss_mb"],
            "heartbeat_s": None if "time" not in status else max(0.0, now - float(status["time"])),
        })
    return rows


def _cell(value: Any, fmt: str = "{}") -> str:
    return "-" if value is None else fmt.format(value)


def status_table(job: dict[str, Any], rows: Sequence[dict[str, Any]], head: str | None = None) -> str:
    """The rows as a text table under a line naming the job (or ``head``)."""
    if head is None:
        head = (f"job {job.get('run_id', '?')}: {job.get('entrypoint', '')} | launcher pid {job['pid']} | "
                f"node {job.get('node_rank', 0)} | attempt {job.get('attempt', 0)} | {job.get('run_dir', '')}"
                + (f" | metrics {job['metrics']}" if job.get("metrics") else ""))
    cols = ["rank", "pid", "host", "state", "operation", "in it", "step", "steps/s", "cpu", "mem", "heartbeat"]
    lines = [[
        str(r["rank"]), str(r["pid"]), r["host"], r["state"], _cell(r["op"]), _cell(r["op_for_s"], "{:.1f}s"),
        _cell(r["step"]), _cell(r["steps_per_s"], "{:.2f}"), _cell(r["cpu_pct"], "{:.0f}%"),
        _cell(r["rss_mb"], "{:.0f} MB"), _cell(r["heartbeat_s"], "{:.1f} s ago"),
    ] for r in rows]
    widths = [max(len(c), *(len(line[i]) for line in lines)) if lines else len(c) for i, c in enumerate(cols)]
    text = [head, "  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))]
    text += ["  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)) for line in lines]
    return "\n".join(text)


def watch(job_pid: int | None, once: bool, interval: float, out: Any = None) -> int:
    """``tdist status``: the table, redrawn every ``interval`` seconds until the job ends (or
    once). Returns an exit status."""
    out = out or sys.stdout
    try:
        job = find_job(job_pid)
    except LookupError as exc:
        print(f"tdist status: {exc}", file=sys.stderr)
        return 1
    previous: dict[int, tuple[float, float]] = {}
    status_rows(job, previous)  # (a first sample of the CPU times: the first table has CPU %)
    time.sleep(min(interval, 0.5))
    tty = out.isatty() and not once
    shown = 0
    while True:
        rows = status_rows(job, previous)
        table = status_table(job, rows)
        if tty and shown:
            out.write(f"\x1b[{shown}F\x1b[J")  # (back to the table's first line, erase below)
        out.write(table + "\n")
        out.flush()
        shown = table.count("\n") + 1
        if once or not pid_alive(int(job["pid"])):
            return 0
        time.sleep(interval)
        with contextlib.suppress(LookupError):
            job = find_job(int(job["pid"]))


# -- a job of several nodes, through its store ---------------------------------------------------
def status_key(run_id: str) -> str:
    """This launcher's key in the job's store (see the module)."""
    return f"{STATUS_KEY}/{run_id}/{socket.gethostname()}:{os.getpid()}"


def publish_status(store: Any, job: dict[str, Any], previous: dict[int, tuple[float, float]]) -> None:
    """Put this node's rows of ``job`` (its registry record) in the job's ``store``."""
    rows = status_rows(job, previous)
    record = {"time": time.time(), "host": socket.gethostname(), "launcher": os.getpid(), "run_id": job.get("run_id"),
              "node_rank": job.get("node_rank", 0), "attempt": job.get("attempt", 0),
              "entrypoint": job.get("entrypoint", ""), "rows": rows}
    store.set(status_key(str(job.get("run_id"))), json.dumps(record).encode())


def metrics_key(run_id: str) -> str:
    """This launcher's key for its part of the job's metrics (``--metrics-port``)."""
    return f"{METRICS_KEY}/{run_id}/{socket.gethostname()}:{os.getpid()}"


def publish_metrics(store: Any, run_id: str, part: dict[str, Any]) -> None:
    """Put this node's part of the job's metrics (``MetricsServer.snapshot``) in ``store``."""
    store.set(metrics_key(run_id), json.dumps({"time": time.time(), **part}).encode())


def node_metrics(store: Any, run_id: str) -> list[dict[str, Any]]:
    """Every other node's last part of the job's metrics, from ``store``, fresh or not (a node
    that left keeps its counts in the job's; its ``time`` says how old it is). The keys are
    never deleted (a launcher's last publication stays), so every key listed can be read at
    once."""
    prefix, mine = f"{METRICS_KEY}/{run_id}/", metrics_key(run_id)
    keys = [k for k in store.list_keys() if k.startswith(prefix) and k != mine]
    parts = []
    for raw in (store.multi_get(keys) if keys else []):
        try:
            part = json.loads(raw)
            float(part["time"])
        except (ValueError, KeyError, TypeError):
            continue
        parts.append(part)
    return parts


def expire_status(store: Any, run_id: str) -> None:
    """Take this node's rows out of ``tdist status``: its record is overwritten as stale, not
    deleted (a reader lists the keys, then reads them all in one request, which would wait
    for a key deleted in between)."""
    store.set(status_key(run_id), json.dumps({"time": 0.0, "rows": []}).encode())


def job_rows(store: Any, run_id: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(every node's fresh record, all their rows by rank) from the job's ``store``."""
    prefix = f"{STATUS_KEY}/{run_id}/"
    keys = [k for k in store.list_keys() if k.startswith(prefix)]
    now = time.time()
    nodes, rows = [], []
    for raw in (store.multi_get(keys) if keys else []):
        try:
            record = json.loads(raw)
            age = max(0.0, now - float(record["time"]))
        except (ValueError, KeyError, TypeError):
            continue
        if age > STALE:
            continue
        nodes.append(record)
        for row in record.get("rows", []):
            for k in ("op_for_s", "heartbeat_s"):  # (as of now, not as of the publication)
                if row.get(k) is not None:
                    row[k] = float(row[k]) + age
            rows.append(row)
    nodes.sort(key=lambda r: int(r.get("node_rank", 0)))
    rows.sort(key=lambda r: int(r.get("rank", 0)))
    return nodes, rows


def watch_job(store: Any, run_id: str, endpoint: str, once: bool, interval: float, out: Any = None) -> int:
    """``tdist status --rdzv-endpoint``: every node's rows of job ``run_id``, read from its
    store, redrawn every ``interval`` seconds until no node publishes (or once)."""
    out = out or sys.stdout
    tty = out.isatty() and not once
    shown = 0
    seen = False
    while True:
        nodes, rows = job_rows(store, run_id)
        if not nodes:
            if not seen:
                print(f"tdist status: no node of job {run_id!r} publishes its status in the store at {endpoint} "
                      "(a job started by tdist run with more than one node, or an elastic range; --rdzv-id "
                      "names the job)", file=sys.stderr)
                return 1
            return 0
        seen = True
        first = nodes[0]
        head = (f"job {run_id}: {first.get('entrypoint', '')} | {len(nodes)} node{'s' if len(nodes) != 1 else ''} "
                f"({', '.join(str(n.get('host')) for n in nodes)}) | attempt {first.get('attempt', 0)} | via {endpoint}")
        table = status_table({}, rows, head=head)
        if tty and shown:
            out.write(f"\x1b[{shown}F\x1b[J")
        out.write(table + "\n")
        out.flush()
        shown = table.count("\n") + 1
        if once:
            return 0
        time.sleep(interval)


def dump_request(store: Any, run_id: str) -> str | None:
    """The token of the job's pending dump request, if any (a launcher looks each second)."""
    key = f"{DUMP_KEY}/{run_id}/request"
    if not store.check([key]):
        return None
    return bytes(store.get(key)).decode()


def answer_dump(store: Any, job: dict[str, Any], token: str, timeout: float) -> None:
    """A launcher's answer to dump request ``token``: its workers' stacks and flight records,
    gathered here, as keys of the job's store (then ``.../done``: their names)."""
    run_id = str(job.get("run_id"))
    base = f"{DUMP_KEY}/{run_id}/{token}/{socket.gethostname()}:{os.getpid()}"
    names: list[str] = []
    with tempfile.TemporaryDirectory(prefix="tdist_dump_") as tmp:
        for path in gather_dump(job, tmp, timeout):
            name = os.path.basename(path)
            with open(path, "rb") as f:
                store.set(f"{base}/{name}", f.read())
            names.append(name)
    store.set(f"{base}/done", json.dumps(names).encode())


def collect_dump(store: Any, run_id: str, dest: str, timeout: float) -> tuple[list[str], int]:
    """``tdist dump --rdzv-endpoint``: ask every launcher of job ``run_id`` for its workers'
    stacks and flight records and write them into ``dest``; (the files, the nodes that
    answered). Waits for the nodes that publish their status (at most ``timeout`` + 5 s)."""
    nodes, _ = job_rows(store, run_id)
    if not nodes:
        raise LookupError(f"no node of job {run_id!r} publishes its status in this store")
    token = secrets.token_hex(8)
    request = f"{DUMP_KEY}/{run_id}/request"
    store.set(request, token.encode())
    expected = {f"{n['host']}:{n['launcher']}" for n in nodes}
    base = f"{DUMP_KEY}/{run_id}/{token}/"
    deadline = time.monotonic() + timeout + 5.0  # (a launcher looks once a second, then gathers)
    done: dict[str, list[str]] = {}
    try:
        while time.monotonic() < deadline and set(done) < expected:
            for node in expected - set(done):
                key = f"{base}{node}/done"
                if store.check([key]):
                    done[node] = json.loads(store.get(key))
            time.sleep(0.1)
    finally:
        with contextlib.suppress(Exception):
            store.delete_key(request)
    os.makedirs(dest, exist_ok=True)
    files: list[str] = []
    for node, names in sorted(done.items()):
        for name in names:
            key = f"{base}{node}/{name}"
            target = os.path.join(dest, name)
            with open(target, "wb") as f:
                f.write(bytes(store.get(key)))
            files.append(target)
            with contextlib.suppress(Exception):
                store.delete_key(key)
        with contextlib.suppress(Exception):
            store.delete_key(f"{base}{node}/done")
    return files, len(done)


def answers(worker: dict[str, Any]) -> bool:
    """Whether a worker of a job's record answers requests to look into it: its status
    thread runs (it imported tdist), with its named pipe ``wake``."""
    return os.path.exists(os.path.join(worker["dir"], WAKE)) and pid_alive(int(worker["pid"]))


def _ask(worker: dict[str, Any], requests: Sequence[str]) -> None:
    for name in requests:
        with contextlib.suppress(OSError):
            open(os.path.join(worker["dir"], name), "w").close()
    with contextlib.suppress(OSError):  # (ENXIO: nobody reads it any more, the worker is gone)
        fd = os.open(os.path.join(worker["dir"], WAKE), os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            os.write(fd, b"\0")
        finally:
            os.close(fd)


def gather_dump(job: dict[str, Any], dest: str, timeout: float = 10.0) -> list[str]:
    """``tdist dump``: every worker's Python stacks and flight record into ``dest``
    (``stacks_<r>.txt``; ``rank_<r>``, what ``torchfrtrace dest`` reads: it takes every file
    whose name has ``rank_`` in it), asked through its directory (``STACKS_REQUEST``,
    ``RECORD_REQUEST`` and its ``wake`` pipe: no signal). Returns the files gathered."""
    os.makedirs(dest, exist_ok=True)
    workers = [w for w in job.get("workers", []) if answers(w)]
    sizes = {}
    for w in workers:
        path = os.path.join(w["dir"], "stacks.txt")
        sizes[w["rank"]] = os.path.getsize(path) if os.path.exists(path) else 0
    started = time.time()
    for w in workers:
        _ask(w, [STACKS_REQUEST, RECORD_REQUEST] if w.get("flight_record") else [STACKS_REQUEST])
    deadline = time.monotonic() + timeout
    stacks_of = {w["rank"]: os.path.join(w["dir"], "stacks.txt") for w in workers}
    records_of = {w["rank"]: w["flight_record"] for w in workers if w.get("flight_record")}
    pending = [os.path.join(w["dir"], name) for w in workers for name in (STACKS_REQUEST, RECORD_REQUEST)]
    while time.monotonic() < deadline and any(os.path.exists(p) for p in pending):
        time.sleep(0.02)  # (each request is removed once answered)
    stacks = [r for r, p in stacks_of.items() if os.path.exists(p) and os.path.getsize(p) > sizes[r]]
    records = [r for r, p in records_of.items() if os.path.exists(p) and os.path.getmtime(p) >= started - 1]
    gathered: list[str] = []
    for rank in stacks:
        with open(stacks_of[rank], "rb") as src:
            src.seek(sizes[rank])
            data = src.read()
        target = os.path.join(dest, f"stacks_{rank}.txt")
        with open(target, "wb") as dst:
            dst.write(data)
        gathered.append(target)
    for rank in records:
        target = os.path.join(dest, f"rank_{rank}")
        shutil.copyfile(records_of[rank], target)
        gathered.append(target)
    return gathered
