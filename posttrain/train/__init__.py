"""The training engine: one loop shared by SFT, pretraining, DPO and reward modelling; algorithms plug in a step source and a loss."""
