"""The run folder: writing it (store.py), the record formats and their JSON Schemas
(records.py, schemas/), the totals of summary.json (summary.py) and the training exports
(export.py).

May import: chat.
"""
