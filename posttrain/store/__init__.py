"""The run store: one URL per run (a local path or ``s3://bucket/prefix``) for everything a run writes.

A run always works in a directory on local disk — its checkpoints are written there by DCP at local-disk
speed, its logs appended there. With a local ``output_dir`` that directory *is* the store. With a remote
one (``s3://``, ``gs://``, any fsspec URL) the local directory is a mirror (``store.local_dir``, default
under ``$XDG_CACHE_HOME/posttrain/runs/``) and the remote store is the truth:

- at start, the run's small files come down and the newest checkpoint with a valid manifest is fetched
  (``posttrain.store.run_store``); a fresh machine with nothing on its disk resumes the same way;
- each checkpoint goes up in the background (``posttrain.store.uploader``): every rank uploads the shards it
  wrote, rank 0 writes the checksummed manifest **last**, once every rank's shards are there with the
  right sizes; only then are older checkpoints pruned. A reader ignores a step without a valid manifest,
  so an upload that fails halfway never replaces the previous checkpoint;
- logs (``metrics.jsonl``, ``alerts.jsonl``, …) go up after each committed checkpoint, and the export and
  ``finished.json`` (last) when the run ends.
"""

from posttrain.store.run_store import RunStore, StoreUnavailable

__all__ = ["RunStore", "StoreUnavailable"]
