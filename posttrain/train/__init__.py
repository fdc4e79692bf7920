"""The training engine: one loop shared by SFT, DPO, reward modelling and GRPO."""
