"""asyncpg's LISTEN/NOTIFY through pgsluice in transaction mode, at scale (tests/suite/notify.rs).

Usage: notify_asyncpg.py CONNINFO [CLIENTS]

CONNINFO is the libpq keyword string the other driver scripts take (host=… port=… user=…
password=… dbname=… connect_timeout=…). CLIENTS (default 200) asyncpg connections each call
`add_listener` on one or two of four channels, and all on the channel `fence`. Then:

  1. prints `listening CLIENTS` and waits for a line on stdin (the test counts the server
     connections meanwhile);
  2. round 1: a separate asyncpg connection through the proxy sends three notifications per
     channel with `SELECT pg_backend_pid(), pg_notify($1, $2)` and records the pid of the
     backend that sent each one; then one on `fence`. Once every client has its fence, each
     client's notifications must be exactly those of its channels, in order, with the
     sender's pid;
  3. every client runs ordinary queries (a parameterized query, a simple-protocol statement
     and a transaction) on the pooled backends, all at once, and gets the right answers;
  4. some clients `remove_listener` (UNLISTEN) a channel; round 2 as round 1: those clients
     must get nothing more on that channel, not even on the wire (the fence comes after it on
     the same connection, so its arrival proves the absence without waiting on a clock);
  5. queries again, then all connections close.

Prints one line per step and a closing `ok …` line; exits 1 with the mismatches on any.
"""

import asyncio
import sys
import time

import asyncpg

CHANNELS = ["alpha", "beta", "Gamma Ray", "delta"]
FENCE = "fence"
PER_CHANNEL = 3
# Each step's deadline: a notification or a query that has not arrived by then is a failure.
STEP_TIMEOUT = 15.0
# Connections opened at once (logins are the expensive part).
CONNECT_CONCURRENCY = 20


def parse_conninfo(conninfo):
    kw = dict(part.split("=", 1) for part in conninfo.split())
    return {
        "host": kw["host"],
        "port": int(kw["port"]),
        "user": kw["user"],
        "password": kw.get("password"),
        "database": kw["dbname"],
        "timeout": float(kw.get("connect_timeout", 10)),
    }


class WireConnection(asyncpg.Connection):
    """asyncpg's connection, also recording every NotificationResponse that arrives on the wire:
    asyncpg itself drops one for a channel without a callback, so a notification the proxy
    still sends after UNLISTEN would go unseen by the callbacks alone."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.wire = []

    def _process_notification(self, pid, channel, payload):
        self.wire.append((channel, pid, payload))
        super()._process_notification(pid, channel, payload)


class Listener:
    """One listening connection and what it received, per channel."""

    def __init__(self, index, conn, channels):
        self.index = index
        self.conn = conn
        self.channels = set(channels)
        self.got = {}
        self.fences = set()
        self.fence_event = asyncio.Event()
        self.wanted_fence = None

    def on_notification(self, conn, pid, channel, payload):
        if channel == FENCE:
            self.fences.add(payload)
            if payload == self.wanted_fence:
                self.fence_event.set()
            return
        self.got.setdefault(channel, []).append((pid, payload))


def channels_of(i):
    first = CHANNELS[i % len(CHANNELS)]
    # Every fifth client also listens on the next channel.
    if i % 5 == 0:
        return [first, CHANNELS[(i + 1) % len(CHANNELS)]]
    return [first]


async def open_listener(i, params, gate):
    async with gate:
        conn = await asyncpg.connect(connection_class=WireConnection, **params)
        listener = Listener(i, conn, channels_of(i))
        for ch in sorted(listener.channels) + [FENCE]:
            await conn.add_listener(ch, listener.on_notification)
        return listener


async def send_round(notifier, tag, listeners, sent):
    """Sends PER_CHANNEL notifications per channel, then the fence; waits for every fence."""
    for ch in CHANNELS:
        for k in range(PER_CHANNEL):
            payload = f"{tag} {ch} {k}"
            pid, _ = await notifier.fetchrow(
                "SELECT pg_backend_pid(), pg_notify($1, $2)::text", ch, payload
            )
            sent.setdefault(ch, []).append((pid, payload))
    fence = f"{tag} done"
    for lst in listeners:
        lst.wanted_fence = fence
        lst.fence_event.clear()
        if fence in lst.fences:
            lst.fence_event.set()
    await notifier.execute(f"NOTIFY {FENCE}, '{fence}'")
    waits = [asyncio.wait_for(lst.fence_event.wait(), STEP_TIMEOUT) for lst in listeners]
    results = await asyncio.gather(*waits, return_exceptions=True)
    late = [
        lst.index for lst, r in zip(listeners, results) if isinstance(r, BaseException)
    ]
    return late


def check(listeners, expected_for, what):
    """Each listener's notifications against what its channels were sent."""
    mismatches = []
    total = 0
    for lst in listeners:
        want = expected_for(lst)
        got = {ch: v for ch, v in lst.got.items() if v}
        total += sum(len(v) for v in got.values())
        if got != want:
            mismatches.append(
                f"{what}: client {lst.index} {sorted(lst.channels)}: got {got}, want {want}"
            )
        wire = {}
        for ch, pid, payload in lst.conn.wire:
            if ch != FENCE:
                wire.setdefault(ch, []).append((pid, payload))
        if wire != want:
            mismatches.append(
                f"{what}: client {lst.index}: on the wire {wire}, want {want}"
            )
    return total, mismatches


async def run_queries(listeners, tag):
    async def one(lst):
        c = lst.conn
        v = await c.fetchval("SELECT $1::int + 1", lst.index)
        if v != lst.index + 1:
            return f"{tag}: client {lst.index}: SELECT $1 + 1 gave {v}"
        status = await c.execute("SELECT 1")
        if status != "SELECT 1":
            return f"{tag}: client {lst.index}: simple SELECT 1 gave {status}"
        async with c.transaction():
            a = await c.fetchval("SELECT txid_current()")
            b = await c.fetchval("SELECT txid_current()")
        if a != b:
            return f"{tag}: client {lst.index}: one transaction saw txids {a} and {b}"
        return None

    results = await asyncio.wait_for(
        asyncio.gather(*(one(lst) for lst in listeners), return_exceptions=True),
        STEP_TIMEOUT,
    )
    return [f"{tag}: {r!r}" if isinstance(r, BaseException) else r for r in results if r]


async def main():
    params = parse_conninfo(sys.argv[1])
    clients = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    failures = []
    started = time.monotonic()

    gate = asyncio.Semaphore(CONNECT_CONCURRENCY)
    listeners = await asyncio.wait_for(
        asyncio.gather(*(open_listener(i, params, gate) for i in range(clients))),
        60,
    )
    print(f"listening {clients}", flush=True)
    print(
        f"connected and listened in {time.monotonic() - started:.1f} s",
        file=sys.stderr,
        flush=True,
    )
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)

    notifier = await asyncpg.connect(**params)

    # Round 1: every client hears exactly its channels.
    sent = {}
    late = await send_round(notifier, "r1", listeners, sent)
    if late:
        failures.append(f"round 1: no fence within {STEP_TIMEOUT} s for clients {late}")
    total1, bad = check(
        listeners, lambda lst: {ch: sent[ch] for ch in lst.channels}, "round 1"
    )
    failures += bad
    print(f"round 1 notifications {total1}", flush=True)

    failures += await run_queries(listeners, "queries 1")
    print("queries 1 done", flush=True)

    # Every fourth client UNLISTENs its first channel (a two-channel client keeps the other).
    removed = {}
    for lst in listeners[::4]:
        ch = channels_of(lst.index)[0]
        await lst.conn.remove_listener(ch, lst.on_notification)
        removed[lst.index] = ch
    for lst in listeners:
        lst.got = {}
        lst.conn.wire = []
    print(f"unlistened {len(removed)}", flush=True)

    # Round 2: the unlistened channel is silent, the others go on.
    sent = {}
    late = await send_round(notifier, "r2", listeners, sent)
    if late:
        failures.append(f"round 2: no fence within {STEP_TIMEOUT} s for clients {late}")
    total2, bad = check(
        listeners,
        lambda lst: {
            ch: sent[ch] for ch in lst.channels if removed.get(lst.index) != ch
        },
        "round 2",
    )
    failures += bad
    print(f"round 2 notifications {total2}", flush=True)

    failures += await run_queries(listeners, "queries 2")
    print("queries 2 done", flush=True)

    await notifier.close()
    await asyncio.gather(*(lst.conn.close() for lst in listeners))

    if failures:
        for f in failures[:20]:
            print("MISMATCH", f, flush=True)
        print(f"FAILED {len(failures)} mismatches", flush=True)
        sys.exit(1)
    print(f"ok in {time.monotonic() - started:.1f} s", flush=True)


asyncio.run(main())
