"""Study storages in one file on this host: Optuna's journal (``.journal``) and SQLite (``.db``).

[Note: journal lock after kill -9] Optuna's journal locks are lock *files*, created on
acquire and deleted on release; a worker killed with ``kill -9`` while appending leaves its
lock file behind, and the next worker waits out a 30 s grace period before it dares remove
it, so a resumed study runs slowly. Here the lock is ``flock`` on ``PATH.flock``: the kernel
drops it when its process dies, so a dead worker holds nothing. Holding the lock also makes
it safe to cut a half-written last line (a worker killed in the middle of its append), which
Optuna would otherwise glue to the next append and then refuse to read.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time

from wrapopt.errors import WrapoptError

try:
    import fcntl
except ImportError:  # Windows: Optuna's own lock files
    fcntl = None

__all__ = ["journal_storage", "sqlite_storage", "corrupt_storage_error", "check_storage_file", "not_a_study_error"]


def _flock_lock_class():
    from optuna.storages.journal._file import BaseJournalFileLock  # not re-exported (Optuna 4-5)

    class FlockLock(BaseJournalFileLock):
        """The journal's append lock as ``flock``: See [Note: journal lock after kill -9]."""

        def __init__(self, path: str) -> None:
            self._path = path + ".flock"
            self._fd: int | None = None

        def acquire(self) -> bool:
            fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
            self._fd = fd
            return True

        def release(self) -> None:
            fd, self._fd = self._fd, None
            if fd is not None:
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)

    return FlockLock


def _cut_torn_tail(path: str, lock) -> None:
    """Drop a half-written last line (its writer died mid-append), under the append lock."""
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return
    lock.acquire()
    try:
        with open(path, "rb+") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - 1))
            if f.read(1) == b"\n":
                return
            keep = 0
            step = 1 << 16
            end = size
            while end > 0 and not keep:
                start = max(0, end - step)
                f.seek(start)
                chunk = f.read(end - start)
                i = chunk.rfind(b"\n")
                if i >= 0:
                    keep = start + i + 1
                end = start
            f.truncate(keep)
    finally:
        lock.release()


# [Note: a storage file is checked first] Optuna opens a journal file by replaying its lines and
# skips a last line it cannot parse (it takes it for one being written), then appends the study it
# creates: given a text file, it would append, and only the next read would call the file damaged.
# A SQLite file that is something else is refused by SQLite, but wrapopt would first cut the "torn"
# tail of a journal. So before anything is written, a file that is not empty must look like what
# its suffix says: a journal's first and last whole lines are JSON objects with Optuna's
# ``op_code`` (lines in between are checked by Optuna's replay, which raises on a bad line that has
# one after it); a SQLite file starts with SQLite's 16-byte header. An empty file is a new study.
_SQLITE_HEADER = b"SQLite format 3\x00"
_HEAD_BYTES = 1 << 20  # a journal's first line is a study's creation: far shorter than this


def _journal_record(line: bytes) -> bool:
    try:
        record = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return False
    return isinstance(record, dict) and isinstance(record.get("op_code"), int)


def _last_whole_line(f, size: int) -> bytes:
    """The last line that ends in a newline (a torn tail after it is not a line yet)."""
    f.seek(max(0, size - _HEAD_BYTES))
    tail = f.read()
    end = tail.rfind(b"\n")
    return tail[tail.rfind(b"\n", 0, end) + 1:end] if end >= 0 else b""


def check_storage_file(path: str, kind: str) -> None:
    """Refuse ``path`` before anything is written to it unless it is empty, absent, or looks like
    a ``kind`` ("journal" or "sqlite") file: See [Note: a storage file is checked first]."""
    if not os.path.lexists(path):
        return
    if not os.path.isfile(path):
        raise not_a_study_error(path, kind, "it is not a regular file")
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return
        f.seek(0)
        if kind == "sqlite":
            if f.read(len(_SQLITE_HEADER)) != _SQLITE_HEADER:
                raise not_a_study_error(path, kind, "it does not start with SQLite's header")
            return
        head = f.readline(_HEAD_BYTES)
        if not _journal_record(head):
            raise not_a_study_error(path, kind, "its first line is not one of Optuna's JSON records")
        if head.endswith(b"\n") and not _journal_record(_last_whole_line(f, size)):
            raise not_a_study_error(path, kind, "its last line is not one of Optuna's JSON records")


def not_a_study_error(path: str, kind: str, why: str) -> WrapoptError:
    """One line: the file is not a study of ``kind``, was left untouched, and what to do."""
    what = "Optuna journal" if kind == "journal" else "SQLite database"
    return WrapoptError(f"--storage {path}: this file is not an {what} ({why}); it was left untouched: pass a "
                        f"new file name for a new study, or, if it is a damaged study, move it aside "
                        f"(mv {path} {path}.bad)")


def journal_storage(path: str):
    """Optuna's journal file storage at ``path``, locked with ``flock`` where the OS has it."""
    import optuna

    check_storage_file(path, "journal")  # See [Note: a storage file is checked first]
    journal = optuna.storages.journal
    lock = _flock_lock_class()(path) if fcntl is not None else journal.JournalFileOpenLock(path)
    _cut_torn_tail(path, lock)
    try:
        return optuna.storages.JournalStorage(journal.JournalFileBackend(path, lock_obj=lock))
    except (ValueError, KeyError, TypeError, IndexError) as e:  # a line not JSON, or JSON Optuna cannot replay
        raise corrupt_storage_error(path, e) from None


# What SQLite says of a file it cannot read as a database (as opposed to a busy or racing one).
_DAMAGED = ("file is not a database", "malformed", "disk image")
_CREATE_TRIES = 4


def sqlite_storage(url: str, path: str):
    """An ``RDBStorage`` on the SQLite file ``path`` that several workers of one host share."""
    import optuna

    check_storage_file(path, "sqlite")  # See [Note: a storage file is checked first]

    def connect():
        # Several workers on one file wait for its lock instead of failing.
        conn = sqlite3.connect(path, timeout=120, check_same_thread=False, isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        return conn

    for attempt in range(_CREATE_TRIES):
        try:
            storage = optuna.storages.RDBStorage(url, engine_kwargs={"creator": connect})
            break
        except Exception as e:
            causes = [c for c in (e, getattr(e, "orig", None), e.__cause__, e.__context__) if c is not None]
            if any(isinstance(c, sqlite3.DatabaseError) and any(w in str(c) for w in _DAMAGED) for c in causes):
                raise corrupt_storage_error(path, e) from None  # "file is not a database", a torn page
            # Two workers starting on a new file both create its tables: the second one's insert of
            # Optuna's schema version collides (IntegrityError) or finds the file locked; a second
            # look sees the tables made.
            if attempt + 1 < _CREATE_TRIES and any(
                    isinstance(c, (sqlite3.IntegrityError, sqlite3.OperationalError)) for c in causes):
                time.sleep(0.5 * (attempt + 1))
                continue
            raise
    from sqlalchemy import event

    @event.listens_for(storage.engine, "begin")
    def _begin(conn) -> None:
        # SQLite's default deferred transactions let two workers both read a
        # waiting trial and both claim it; taking the write lock up front
        # makes Optuna's read-check-update atomic.
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    return storage


def corrupt_storage_error(path: str, err: BaseException) -> WrapoptError:
    """One line naming the storage file, what is wrong and what to do."""
    why = (str(err).splitlines() or [type(err).__name__])[0][:200]
    return WrapoptError(f"--storage {path}: the study file is damaged and cannot be read ({why}); its trials are "
                        f"lost to wrapopt: move it aside (mv {path} {path}.bad) and run the search again, or pass "
                        "another --storage")
