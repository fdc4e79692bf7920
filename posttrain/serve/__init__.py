"""The feedback service: capture edge cases, annotate pairs of responses with reasons, export the votes.

``posttrain serve feedback`` starts it (``posttrain.serve.app``); ``posttrain serve user add`` and
``posttrain serve import`` manage users and bulk-load edge cases; ``posttrain feedback export`` turns the
vote log into preference pairs, SFT examples and ``posttrain feedback`` records (``posttrain.serve.export``).
The storage layer (``posttrain.serve.db``) is shared by SQLite and PostgreSQL. Nothing in the training path
imports this package; the web framework (FastAPI, uvicorn) is imported only by ``app`` and ``pages``.
See docs/feedback.md for the data model, the roles and the export rules.
"""
