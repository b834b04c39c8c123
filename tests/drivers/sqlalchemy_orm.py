"""SQLAlchemy 1.4 on psycopg2: ORM inserts (executemany) in a transaction, a SAVEPOINT rolled
back, a server-side cursor (stream_results: DECLARE ... CURSOR and FETCH in batches), SQL
PREPARE/EXECUTE/DEALLOCATE on a pooled connection, and COPY FROM STDIN through the raw DBAPI
connection.

Usage: python3 sqlalchemy_orm.py CONNINFO TABLE   (TABLE has columns id int, note text)
Prints one line per observation; tests/suite/drivers.rs compares them with a direct connection.
"""
import io
import sys

import psycopg2
from sqlalchemy import Column, Integer, Text, create_engine, func, select, text
from sqlalchemy.orm import Session, declarative_base

if len(sys.argv) != 3:
    sys.exit("usage: sqlalchemy_orm.py CONNINFO TABLE")
conninfo, table = sys.argv[1:]
engine = create_engine(
    "postgresql+psycopg2://", creator=lambda: psycopg2.connect(conninfo), future=True
)
Base = declarative_base()


class Item(Base):
    __tablename__ = table
    id = Column(Integer, primary_key=True, autoincrement=False)
    note = Column(Text, nullable=False)


def totals(session):
    count, total = session.execute(select(func.count(), func.sum(Item.id))).one()
    return f"rows {count} sum {total}"


with Session(engine, future=True) as session:
    with session.begin():
        session.add_all([Item(id=i, note=f"orm {i}") for i in range(1, 51)])
    print("after executemany", totals(session))
    session.commit()
    with session.begin():
        session.add(Item(id=1000, note="kept"))
        savepoint = session.begin_nested()
        session.add(Item(id=1001, note="rolled back"))
        session.flush()
        savepoint.rollback()
    print("after savepoint rollback", totals(session))
    session.commit()

with engine.connect() as conn:
    streamed = conn.execution_options(stream_results=True, max_row_buffer=7).execute(
        text(f'SELECT id FROM "{table}" ORDER BY id')
    )
    first = streamed.fetchone().id
    # (future-style execution_options applies to this connection from now on: the query below
    # is streamed through a cursor of its own, which it leaves out.)
    declared = (
        "SELECT count(*) FROM pg_cursors WHERE starts_with(statement, 'DECLARE')"
        " AND position('pg_cursors' in statement) = 0"
    )
    cursors = conn.exec_driver_sql(declared).scalar()
    print(f"server-side cursors while streaming {cursors}")
    ids = [first] + [row.id for row in streamed]
    print(f"streamed {len(ids)} first {ids[0]} last {ids[-1]}")

with engine.connect() as conn:
    conn.exec_driver_sql("PREPARE plus_one(int) AS SELECT $1 + 1")
    print("EXECUTE plus_one(41)", conn.exec_driver_sql("EXECUTE plus_one(41)").scalar())
    listed = conn.exec_driver_sql("SELECT name, from_sql FROM pg_prepared_statements").all()
    print("prepared", [tuple(row) for row in listed])
    conn.exec_driver_sql("DEALLOCATE plus_one")
    conn.commit()

raw = engine.raw_connection()
try:
    data = io.StringIO("".join(f"{i}\tcopy {i}\n" for i in range(2000, 2300)))
    cursor = raw.cursor()
    cursor.copy_expert(f'COPY "{table}" (id, note) FROM STDIN', data)
    print("copied", cursor.rowcount)
    raw.commit()
finally:
    raw.close()

with Session(engine, future=True) as session:
    print("at the end", totals(session))
engine.dispose()
