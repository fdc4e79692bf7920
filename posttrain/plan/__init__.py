"""Scale on paper: memory per GPU, communication, step time, checkpoint interval and goodput of a run.

Pure functions, each with its formula and source in the docstring (docs/plan.md gathers them with the
validation against measured numbers). ``posttrain plan`` (posttrain/commands/plan.py) prints and writes them.
"""
