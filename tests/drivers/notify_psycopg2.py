"""psycopg2's LISTEN/NOTIFY through pgsluice in transaction mode (tests/suite/notify.rs).

Usage: notify_psycopg2.py CONNINFO

One autocommit connection LISTENs and waits with select() and conn.poll(), as psycopg2's
documentation shows; a second connection sends the NOTIFY and reports the pid of the
backend that sent it. Prints one line per notification: channel, payload, and whether the pid
matches the sender's.
"""

import select
import sys
import time

import psycopg2
import psycopg2.extensions

conninfo = sys.argv[1]
listener = psycopg2.connect(conninfo)
listener.set_isolation_level(psycopg2.extensions.ISOLATION_LEVEL_AUTOCOMMIT)
cur = listener.cursor()
cur.execute('LISTEN "Psy Channel"')
cur.execute("LISTEN plain")
print("listening", flush=True)

sender = psycopg2.connect(conninfo)
sender.autocommit = True
scur = sender.cursor()
scur.execute(
    "SELECT pg_backend_pid(), pg_notify('Psy Channel', 'first'), pg_notify('plain', 'second')"
)
sender_pid = scur.fetchone()[0]

got = []
deadline = time.time() + 10
while len(got) < 2 and time.time() < deadline:
    if select.select([listener], [], [], 1) == ([], [], []):
        continue
    listener.poll()
    while listener.notifies:
        got.append(listener.notifies.pop(0))
for n in got:
    print(n.channel, n.payload, "pid-matches" if n.pid == sender_pid else "pid-differs")

cur.execute("UNLISTEN *")
scur.execute("NOTIFY plain, 'after unlisten'")
time.sleep(0.5)
listener.poll()
print("after unlisten", len(listener.notifies))
