"""posttrain: post-training for causal language models.

The data flywheel as one loop: curate -> SFT with a curriculum -> rejection sampling ->
preference alignment (DPO family) -> evaluation with confidence intervals -> feedback.
"""

__version__ = "0.1.0"
