"""ppojax.rollout."""
