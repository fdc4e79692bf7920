"""Evaluation: items and suites, verifiers, the code sandbox, statistics with confidence intervals,
and run-to-run comparison.

Entry points: ``posttrain.eval.harness.evaluate`` and ``posttrain.eval.stats.compare_results`` in code,
``posttrain eval`` / ``posttrain eval compare`` on the command line.
"""
