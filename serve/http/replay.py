"""Exact replay: the token ids the model sampled for an assistant turn, found again when the
client sends that turn back in its next request.

The engine reuses its cache only for a prompt that starts with the very token ids it holds. A
turn sent back as text and encoded again can come out as other ids than were sampled (a BPE
tokenizer has one canonical split of a text; the model may have sampled another), and a turn
whose layout strayed from the canonical one (extra blank lines inside a DSML block, JSON
written without spaces) renders to other text altogether. So, for every finished generation,
the server records the reply's sampled ids, keyed two ways:

* by its text: the exact sampled text, which is also what the official encoding renders for the
  returned message whenever the model kept the canonical layout;
* by the ids of its tool calls (``call_…``, ``toolu_…``): each maps to the turn, with a
  signature of what the turn says (reasoning, content, each call's name and arguments), so a
  returned turn that says the same thing takes the sampled text and ids even when its rendering
  would differ.

Prompt building (``serve.http.chat``) encodes the conversation part by part and asks this store for
each assistant body: a hit contributes the recorded ids, so the new prompt starts with exactly
the tokens of the previous prompt plus the reply, and the cache is reused to the last token.

Bounds: in memory, the most recently used `max_records` turns holding at most `max_tokens`
ids. With a directory (the server's ``--kv-disk-dir``), every record is also written to
``DIR/replay.sqlite3`` (one SQLite transaction each, so a crash keeps the file consistent),
trimmed to the most recently used turns within `max_disk_records` and `max_disk_bytes`, and read
back on a memory miss: replay survives a restart, as the disk KV snapshots do. Disk writes run
on a thread of their own, never on the caller's (the server's event loop). The server opens the
file only once it holds the KV directory's lock, and counts it in the disk budget. A file that
is busy ("database is locked": another process) is retried, then left alone (records stay in
memory); only a damaged one is moved aside. A store error never fails a request: it is logged
and the prompt is encoded as text.

Tenants (the server's API keys, when it has several): a record is found only by requests of the
tenant that made it (`tenant` scopes every key), so a tokenization one client planted (with
`logit_bias` or a grammar) never shapes another client's prompt.
"""
from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import queue
import sqlite3
import threading
import time
from dataclasses import dataclass
from typing import Iterable

from serve.kvstore.snapshot import REPLAY_FILE

log = logging.getLogger("ds4.serve.replay")

OPEN_ATTEMPTS = 5   # a busy file (another process holds it) is retried this many times, a second apart


@dataclass(frozen=True)
class Turn:
    text: str                 # the reply as sampled (without the final EOS)
    ids: tuple[int, ...]      # its token ids as sampled
    signature: str            # what it says: see `signature`


def signature(reasoning: str | None, content: str, calls: Iterable[tuple[str, dict]], with_reasoning: bool) -> str:
    """A canonical summary of an assistant turn: reasoning (where the prompt keeps it), content
    and calls, with surrounding whitespace and argument key order ignored."""
    return json.dumps([with_reasoning, (reasoning or "").strip() if with_reasoning else None, content.strip(),
                       [[name, args] for name, args in calls]], sort_keys=True, ensure_ascii=False)


def _key(text: str, tenant: str | None = None) -> str:
    scoped = text if tenant is None else f"{tenant}\0{text}"
    return hashlib.sha256(scoped.encode("utf-8")).hexdigest()


def _call_key(call_id: str, tenant: str | None) -> str:
    return call_id if tenant is None else f"{tenant}\0{call_id}"


def _busy(e: sqlite3.OperationalError) -> bool:
    return "locked" in str(e) or "busy" in str(e)


class ReplayStore:
    def __init__(self, directory: str | None = None, *, max_records: int = 4096, max_tokens: int = 2_000_000,
                 max_disk_records: int = 20_000, max_disk_bytes: int = 64 * 2**20):
        self.max_records, self.max_tokens, self.max_disk_records = max_records, max_tokens, max_disk_records
        self.max_disk_bytes = max_disk_bytes
        self._turns: collections.OrderedDict[str, Turn] = collections.OrderedDict()
        self._calls: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()                 # the records in memory
        self._db_lock = threading.Lock()              # the connection (the writer thread's and readers')
        self._db: sqlite3.Connection | None = None
        self._writes = 0
        self._pending: queue.Queue = queue.Queue()   # disk writes, for the writer thread
        self._writer: threading.Thread | None = None
        if directory is not None:
            self.open_directory(directory)

    # ------------------------------------------------------------------ disk
    def open_directory(self, directory: str) -> None:
        """Keep the records in `directory` too (read back, written from now on)."""
        path = os.path.join(directory, REPLAY_FILE)
        for attempt in range(OPEN_ATTEMPTS):
            try:
                self._open(path)
                return
            except sqlite3.OperationalError as e:  # busy or locked: not damage
                if attempt + 1 == OPEN_ATTEMPTS:
                    log.warning("replay: %s stays busy (%s): replay records stay in memory only", path, e)
                    return
                time.sleep(1.0)

    def _open(self, path: str) -> None:
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            self._db = self._connect(path)
        except sqlite3.OperationalError as e:
            if _busy(e):
                raise
            self._damaged(path, e)
        except sqlite3.DatabaseError as e:
            self._damaged(path, e)
        except OSError as e:
            log.warning("replay: cannot open %s (%s): replay records stay in memory only", path, e)

    def _damaged(self, path: str, e: Exception) -> None:
        """A damaged file: keep it aside, start a new one."""
        log.warning("replay: %s is unreadable (%s); moved aside, starting empty", path, e)
        try:
            os.replace(path, path + f".damaged-{int(time.time())}")
            self._db = self._connect(path)
        except (OSError, sqlite3.Error) as e2:
            log.warning("replay: cannot open %s (%s): replay records stay in memory only", path, e2)

    @staticmethod
    def _connect(path: str) -> sqlite3.Connection:
        db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=2.0)
        try:
            db.execute("PRAGMA quick_check").fetchall()  # raises DatabaseError on a damaged file
        except sqlite3.Error:
            db.close()
            raise
        db.execute("CREATE TABLE IF NOT EXISTS turns (key TEXT PRIMARY KEY, text TEXT NOT NULL, ids TEXT NOT NULL,"
                   " signature TEXT NOT NULL, used REAL NOT NULL)")
        db.execute("CREATE TABLE IF NOT EXISTS calls (call_id TEXT PRIMARY KEY, key TEXT NOT NULL)")
        db.execute("CREATE INDEX IF NOT EXISTS turns_used ON turns (used)")
        return db

    def _disk(self, what: str, fn):
        try:
            with self._db_lock:
                return None if self._db is None else fn(self._db)
        except sqlite3.Error as e:
            log.warning("replay: %s failed: %s", what, e)
            return None

    def flush(self) -> None:
        """Wait until every record handed to the disk writer is written."""
        self._pending.join()

    def close(self) -> None:
        self.flush()
        with self._db_lock:
            if self._db is not None:
                self._db.close()
                self._db = None

    def _write_behind(self, write) -> None:
        """Run `write(db)` on the writer thread (started on first use)."""
        if self._db is None:
            return
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_loop, name="ds4-replay-writer", daemon=True)
            self._writer.start()
        self._pending.put(write)

    def _write_loop(self) -> None:
        while True:
            write = self._pending.get()
            try:
                self._disk("write", write)
            finally:
                self._pending.task_done()

    # ------------------------------------------------------------------ memory
    def _remember(self, key: str, turn: Turn) -> None:
        old = self._turns.pop(key, None)
        if old is not None:
            self._tokens -= len(old.ids)
        self._turns[key] = turn
        self._tokens += len(turn.ids)
        while self._turns and (len(self._turns) > self.max_records or self._tokens > self.max_tokens):
            _, dropped = self._turns.popitem(last=False)
            self._tokens -= len(dropped.ids)
        while len(self._calls) > 8 * self.max_records:
            self._calls.popitem(last=False)

    def _get(self, key: str, tenant: str | None) -> Turn | None:
        turn = self._turns.get(key)
        if turn is not None:
            self._turns.move_to_end(key)
            return turn
        row = self._disk("read", lambda db: db.execute(
            "SELECT text, ids, signature FROM turns WHERE key = ?", (key,)).fetchone())
        if row is None:
            return None
        try:
            turn = Turn(row[0], tuple(int(i) for i in json.loads(row[1])), row[2])
        except (ValueError, TypeError) as e:
            log.warning("replay: a damaged record was ignored: %s", e)
            return None
        if _key(turn.text, tenant) != key:
            return None
        used = time.time()
        self._write_behind(lambda db: db.execute("UPDATE turns SET used = ? WHERE key = ?", (used, key)))
        self._remember(key, turn)
        return turn

    # ------------------------------------------------------------------ API
    def record(self, text: str, ids: Iterable[int], signature: str, call_ids: Iterable[str] = (),
               tenant: str | None = None) -> None:
        """Remember a finished reply: its sampled text and ids, what it says, its calls' ids."""
        turn = Turn(text, tuple(int(i) for i in ids), signature)
        key = _key(text, tenant)
        call_ids = [_call_key(c, tenant) for c in call_ids]
        with self._lock:
            self._remember(key, turn)
            for call_id in call_ids:
                self._calls[call_id] = key
                self._calls.move_to_end(call_id)

            def write(db):
                db.execute("BEGIN")
                try:
                    db.execute("INSERT OR REPLACE INTO turns VALUES (?, ?, ?, ?, ?)",
                               (key, text, json.dumps(turn.ids), signature, time.time()))
                    db.executemany("INSERT OR REPLACE INTO calls VALUES (?, ?)", [(c, key) for c in call_ids])
                    db.execute("COMMIT")
                except BaseException:
                    db.execute("ROLLBACK")
                    raise
                self._writes += 1
                if self._writes % 64 == 0:
                    self._trim(db)

            self._write_behind(write)

    def _trim(self, db: sqlite3.Connection) -> None:
        """Keep the most recently used turns within `max_disk_records` and `max_disk_bytes`."""
        rows = db.execute("SELECT key, length(text) + length(ids) + length(signature) FROM turns "
                          "ORDER BY used DESC").fetchall()
        total, keep = 0, 0
        for _, size in rows:
            if keep == self.max_disk_records or total + size > self.max_disk_bytes:
                break
            total, keep = total + size, keep + 1
        if keep == len(rows):
            return
        db.execute("BEGIN")
        db.executemany("DELETE FROM turns WHERE key = ?", [(key,) for key, _ in rows[keep:]])
        db.execute("DELETE FROM calls WHERE key NOT IN (SELECT key FROM turns)")
        db.execute("COMMIT")

    def by_text(self, text: str, tenant: str | None = None) -> Turn | None:
        with self._lock:
            return self._get(_key(text, tenant), tenant)

    def by_calls(self, call_ids: Iterable[str], sig: str, tenant: str | None = None) -> Turn | None:
        """The turn these call ids were issued in, if it says what `sig` says."""
        with self._lock:
            keys = set()
            for call_id in (_call_key(c, tenant) for c in call_ids):
                key = self._calls.get(call_id)
                if key is None:
                    row = self._disk("read", lambda db: db.execute(
                        "SELECT key FROM calls WHERE call_id = ?", (call_id,)).fetchone())
                    key = row[0] if row else None
                if key is None:
                    return None
                keys.add(key)
            if len(keys) != 1:
                return None
            turn = self._get(keys.pop(), tenant)
            return turn if turn is not None and turn.signature == sig else None

    def __len__(self) -> int:
        return len(self._turns)
