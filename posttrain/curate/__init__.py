"""The front half of the data flywheel: curation, rejection sampling, feedback ingestion.

- ``pipeline``: ``posttrain curate``, which runs the stages over sharded input and writes kept/dropped
  records, the funnel and the manifest (``stages`` plans and runs segments; ``executor`` runs shards
  in-process, in a process pool or on Ray Data).
- Stages: ``normalize``, ``filters``, ``dedup`` (exact, near-duplicate via ``minhash``, semantic via
  ``embed``), ``verify``, ``judge``, ``intent``, ``difficulty``.
- ``sample``: ``posttrain sample``, best-of-n rejection sampling scored by ``scorers``.
- ``feedback``: ``posttrain feedback``, which merges edge cases into SFT and preference sets.
- ``funnel``: the counts and the manifest (lineage). ``corpus``: a planted near-duplicate corpus for
  the tests and the benchmark. ``config``: the typed recipes.
"""
