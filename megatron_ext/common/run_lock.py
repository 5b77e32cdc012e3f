"""One run, one writer: an exclusive lease on a run's checkpoint directory (no torch, Megatron).

``DIR/megatron_ext_run.lock`` names its holder and is published whole with ``link(2)``, kept
fresh by a heartbeat thread, and taken over when stale: unlike ``flock``, it holds across the
nodes of any shared filesystem, NFS included. docs/launching.md "One run, one writer".
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from megatron_ext.common.errors import MegatronExtError
from megatron_ext.common.files import RUN_LOCK_FILE

TOKEN_ENV = "MEGATRON_EXT_RUN_LOCK_TOKEN"
HEARTBEAT_S = 10.0
STALE_AFTER_S = 60.0  # six missed heartbeats


class RunLockHeld(MegatronExtError):
    """Another live writer holds the run directory; the message names it and what to do."""


@dataclass(frozen=True)
class Holder:
    role: str  # training | supervisor | skiplist ... (what holds the run)
    host: str
    pid: int
    pid_start: str  # the pid's start time in clock ticks since boot (/proc/PID/stat field 22)
    job_id: str
    start_time: float
    token: str

    def describe(self) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.start_time))
        job = f", job {self.job_id}" if self.job_id else ""
        return f"{self.role} pid {self.pid} on {self.host}{job}, started {started}"


def _pid_start(pid: int) -> str | None:
    """The kernel start time of ``pid`` (None: no such process here, or a zombie: dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] in ("Z", "X") else fields[19]


def job_id() -> str:
    return os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID", "")


def read_holder(path: Path) -> Holder | None:
    """The holder a lock file names; None when there is no lock."""
    try:
        return Holder(**json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as exc:
        raise RunLockHeld(
            f"the run lock {path} is unreadable ({exc}); if no job uses {path.parent}, "
            "remove it or pass --force"
        ) from None


def _fs_now(directory: Path) -> float:
    """The filesystem's clock (on NFS, the server's): the mtime of a file written now."""
    probe = directory / f".{RUN_LOCK_FILE}.clock.{socket.gethostname()}.{os.getpid()}"
    probe.write_bytes(b"")
    try:
        return probe.stat().st_mtime
    finally:
        probe.unlink(missing_ok=True)


def liveness(holder: Holder, path: Path) -> tuple[bool, str]:
    """Whether ``holder`` (of the lock file ``path``) is alive, and why we think so."""
    if holder.host == socket.gethostname():
        if _pid_start(holder.pid) == holder.pid_start:
            return True, f"pid {holder.pid} runs on this host"
        return False, f"pid {holder.pid} no longer runs on this host"
    try:
        age = _fs_now(path.parent) - path.stat().st_mtime
    except FileNotFoundError:
        return False, "its lock is gone"
    if age <= STALE_AFTER_S:
        return True, f"its heartbeat is {max(age, 0):.0f} s old"
    return False, f"no heartbeat for {age:.0f} s (stale after {STALE_AFTER_S:.0f} s)"


def _publish(path: Path, holder: Holder) -> bool:
    """Create ``path`` holding ``holder`` atomically; False when it already exists."""
    temporary = path.with_name(f".{path.name}.{holder.token}")
    temporary.write_text(json.dumps(asdict(holder)) + "\n")
    try:
        os.link(temporary, path)
        return True
    except FileExistsError:
        return False
    except OSError:  # NFS: the link may have been made and its reply lost
        return temporary.stat().st_nlink == 2
    finally:
        temporary.unlink(missing_ok=True)


def _take_over(path: Path, stale: Holder, why: str) -> None:
    """Move a dead holder's lock aside (a contender that moved a newer lock puts it back)."""
    aside = path.with_name(f".{path.name}.stale.{secrets.token_hex(4)}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return  # another contender took it over first; try again
    moved = read_holder(aside)
    if moved is not None and moved.token != stale.token:
        with contextlib.suppress(OSError):
            os.link(aside, path)  # a live lease published meanwhile: put it back
    else:
        print(f"megatron-ext: taking over the run lock of {stale.describe()}: {why}", flush=True)
    aside.unlink(missing_ok=True)


def _refusal(directory: Path, what: str, holder: Holder, why: str, kind: str) -> RunLockHeld:
    return RunLockHeld(
        f"{what} refused: {directory} is held by {holder.describe()} ({kind}; {why}). One run "
        f"directory has one writer: stop that job first (or wait for it to end); if it is "
        "known to be dead (its node is gone), pass --force to take the lock over"
    )


class Lease:
    """A held (or inherited) run lock, with its heartbeat thread."""

    def __init__(self, path: Path, holder: Holder, inherited_from: Holder | None) -> None:
        self.path, self.holder, self.inherited_from = path, holder, inherited_from
        self.child = path.with_name(path.name + ".child")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def own_file(self) -> Path:
        return self.child if self.inherited_from else self.path

    def beat(self) -> str | None:
        """Renew the heartbeat; a sentence when the lease is lost (taken over, or its
        supervisor died)."""
        current = read_holder(self.own_file)
        if current is None or current.token != self.holder.token:
            taker = f" by {current.describe()}" if current else ""
            return f"the run lock {self.own_file} was taken over{taker}"
        os.utime(self.own_file)
        if self.inherited_from is not None:
            parent = read_holder(self.path)
            if parent is None or parent.token != self.inherited_from.token:
                return f"the {self.inherited_from.describe()} released or lost {self.path}"
            alive, why = liveness(parent, self.path)
            if not alive:
                return f"the {parent.describe()} that holds {self.path} is dead: {why}"
        return None

    def watch(self, on_lost: Callable[[str], None], interval: float = HEARTBEAT_S) -> None:
        """Heartbeat in a daemon thread; ``on_lost(message)`` once if the lease is lost."""

        def run() -> None:
            while not self._stop.wait(interval):
                try:
                    lost = self.beat()
                except OSError as exc:  # a full disk or a gone mount: warn, keep trying
                    print(f"megatron-ext: WARNING: run lock heartbeat: {exc}", file=sys.stderr)
                    continue
                if lost:
                    on_lost(lost)
                    return

        self._thread = threading.Thread(target=run, name="megatron-ext-run-lock", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stop the heartbeat and remove our file if it is still ours."""
        self._stop.set()
        with contextlib.suppress(RunLockHeld, OSError):
            current = read_holder(self.own_file)
            if current is not None and current.token == self.holder.token:
                self.own_file.unlink()


def acquire(directory: str | os.PathLike[str], role: str, what: str, force: bool = False) -> Lease:
    """Hold ``directory`` for ``role``, or inherit the lease whose token is in :data:`TOKEN_ENV`;
    :class:`RunLockHeld` (naming the holder and ``what`` was refused) while another holds it."""
    folder, pid = Path(directory), os.getpid()
    folder.mkdir(parents=True, exist_ok=True)
    path, start = folder / RUN_LOCK_FILE, _pid_start(pid) or ""
    holder = Holder(
        role, socket.gethostname(), pid, start, job_id(), time.time(), secrets.token_hex(8)
    )
    child = path.with_name(path.name + ".child")
    for _ in range(5):
        current = read_holder(path)
        if current is not None and current.token == os.environ.get(TOKEN_ENV):
            _refuse_live_child(child, what, force)
            if role != "training":
                return _Borrowed(path, holder, current)
            child.unlink(missing_ok=True)
            if not _publish(child, holder):
                continue
            return Lease(path, holder, current)
        if current is None:
            if _publish(path, holder):
                return Lease(path, holder, None)
            continue
        alive, why = liveness(current, path)
        if alive and not force:
            raise _refusal(folder, what, current, why, "alive")
        _refuse_live_child(child, what, force)
        _take_over(path, current, "forced (--force)" if alive else why)
    raise RunLockHeld(f"{what} refused: could not take the run lock {path} (contended)")


def _refuse_live_child(child: Path, what: str, force: bool) -> None:
    """A training whose supervisor died may still be running (saving, shutting down)."""
    holder = read_holder(child)
    if holder is None:
        return
    alive, why = liveness(holder, child)
    if alive and not force:
        raise _refusal(child.parent, what, holder, why, "a training still running")
    child.unlink(missing_ok=True)


class _Borrowed(Lease):
    """A tool (``skiplist --apply``) run by the lease's holder itself: nothing to renew."""

    def beat(self) -> str | None:
        return None

    def release(self) -> None:
        self._stop.set()


@contextlib.contextmanager
def held(directory: str | os.PathLike[str], role: str, what: str, force: bool) -> Iterator[Lease]:
    """The lease for the duration of a ``with`` block (tools that change the directory)."""
    lease = acquire(directory, role, what, force)
    try:
        yield lease
    finally:
        lease.release()
