"""Rewards: rule-based scorers (``scorers``), the user-function manager (``rule``), the reward model
(``model``)."""
