"""A child-process script that holds an exclusive lock on a SQLite file for a while (argv: path, seconds)."""

LOCK_HOLDER = """
import sqlite3, sys, time
con = sqlite3.connect(sys.argv[1], isolation_level=None)
con.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
con.execute("COMMIT")
"""
