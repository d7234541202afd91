"""The supervised stages: SFT, reward-model training and preference pairs, on what they
share (common)."""
