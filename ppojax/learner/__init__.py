"""ppojax.learner."""
