"""The fault suite (issue 14): hostile input, crashes, lost services, the disk, hostile
clients, secrets at rest, slots held for free, job TTLs, and the money invariant under
load (``load.py`` drives it, ``ledger.py`` reads the books from the database,
``served.py`` wraps a ``bourse serve`` process)."""
