"""RL: rewards, and (from the lead) the GRPO recipe."""
